"""No file of the repository refers to an issue by number ("issue 13",
"Issue #7", "issue-25", "(#12)", "the hardening issue"): the tracker those
numbers point into is not part of the repository, so a reader cannot follow
them. A comment or doc says why in its own words instead.

Citations of a named public repository's pull requests ("slime PR #2124")
stay: they name where a rule came from and can be looked up.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging_helpers import ROOT, tracked_files

#: Each pattern, with what it catches. Built from pieces so that this file
#: does not match itself.
_ISSUE = "iss" + "ue"
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("numbered issue", re.compile(rf"\b{_ISSUE}s?[ -]?#?\d+", re.I)),
    ("numbered issue (#N)", re.compile(r"\(#\d+\)")),
    # A bare "#12 " outside a named repository's PR citation; CSS colours
    # ("#222;") and hex digests are not followed by a space or closing mark.
    ("bare #N", re.compile(r"(?<!PR )(?<![\w&#])#\d{1,5}(?=[ ),.:]|$)", re.M)),
    ("an issue named by its kind", re.compile(rf"\bthe (?:hardening|redesign|review) {_ISSUE}\b", re.I)),
    ("the issue as an authority", re.compile(rf"\b(?:the|this|that) {_ISSUE} (?:says|asks|allows|wants|requires)\b", re.I)),
)

#: Suffixes never read as text.
BINARY_SUFFIXES = {".png", ".jpg", ".gif", ".pt", ".safetensors", ".msgpack", ".parquet", ".so", ".bin", ".gz"}


def issue_references(root: Path) -> list[str]:
    """'file:line: kind: text' for every reference to a numbered issue in the
    text files git tracks under ``root`` (this test's own file excepted)."""
    me = Path(__file__).resolve()
    found = []
    for rel in tracked_files(root):
        path = root / rel
        if path.resolve() == me or rel.suffix in BINARY_SUFFIXES or rel.parts[0] in ("tests",) and "fixtures" in rel.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file without a known suffix
        for lineno, line in enumerate(text.splitlines(), 1):
            for kind, pattern in PATTERNS:
                if pattern.search(line):
                    found.append(f"{rel.as_posix()}:{lineno}: {kind}: {line.strip()[:120]}")
                    break
    return found


def test_no_file_refers_to_an_issue_by_number():
    found = issue_references(ROOT)
    assert not found, (
        f"{len(found)} reference(s) to issues of a tracker that is not in the repository; say why in words "
        "(e.g. 'before the write-time schema check was added'):\n" + "\n".join(found)
    )


def test_the_check_finds_each_kind(tmp_path):
    """The patterns catch what they are for and leave colours, PR citations and ordinary words alone."""
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    lines = {
        f"since {_ISSUE} 13": True,
        f"{_ISSUE.capitalize()} #7: the demo": True,
        f"see {_ISSUE}-25": True,
        "the split (#12)": True,
        "fixed in #12 and": True,
        f"as the hardening {_ISSUE} said": True,
        f"The {_ISSUE} allows scores": True,
        "color: #222;": False,
        "from slime PR #2124 added": False,
        f"the key the gateway {_ISSUE}s at open": False,
        "digest sha256:ab12": False,
    }
    for i, line in enumerate(lines):
        (tmp_path / f"f{i}.md").write_text(line + "\n")
    found = issue_references(tmp_path)
    flagged = {int(f.split(":")[0][1:-3]) for f in found}
    assert flagged == {i for i, (_, bad) in enumerate(lines.items()) if bad}, found
