"""docs/design.md keeps one picture, and it shows every layer.

The picture (the one code block under "## Layers") draws the layers and the
data flow session → events → log → reducers → samples → learner. A layer
folder added to the repository (tests/packaging/test_layers.py finds them on
disk) must appear in it, and in the ownership table beside it.
"""

from __future__ import annotations

import re

from packaging_helpers import ROOT, layer_folders

DESIGN = ROOT / "docs" / "design.md"


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def pictures(text: str) -> list[str]:
    """The fenced code blocks of ``text``."""
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)


def test_design_md_has_one_picture_and_it_shows_every_layer_and_the_data_flow():
    text = DESIGN.read_text(encoding="utf-8")
    blocks = pictures(text)
    assert len(blocks) == 1, f"docs/design.md: expected one picture (code block), found {len(blocks)}"
    picture = blocks[0]
    assert picture in _section(text, "Layers"), "docs/design.md: the picture belongs in the section 'Layers'"
    missing = [layer for layer in layer_folders(ROOT) if f"{layer}/" not in picture]
    assert not missing, f"docs/design.md's picture does not show layer folder(s) {missing}"
    for step in ("SessionEngine", "append events", "read / follow", "samples", "LoopLearner", "policy_updated"):
        assert step in picture, f"docs/design.md's picture lost the data-flow step {step!r}"


def test_every_layer_has_a_row_in_the_ownership_table():
    table = _section(DESIGN.read_text(encoding="utf-8"), "Layers").split("### Who owns what", 1)[1]
    missing = [layer for layer in layer_folders(ROOT) if f"`{layer}/" not in table]
    assert not missing, f"docs/design.md 'Who owns what' names no module of layer(s) {missing}"


def test_the_picture_check_counts_code_blocks():
    assert len(pictures("a\n```\nx\n```\nb\n```python\ny\n```\n")) == 2
