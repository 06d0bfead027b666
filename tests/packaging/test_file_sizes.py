"""No library module is over 600 lines (docs/design.md, "Who owns what": a
module owns a concept). A file that grows past it holds more than one concept: split it by
concept, as events/log/writer.py, gateway/server.py and learner/model.py were."""

from __future__ import annotations

from packaging_helpers import ROOT, tracked_files

MAX_LINES = 600

#: Known offenders, each to be split by concept, then removed from this list
#: (an entry whose file has shrunk fails too, so the list only ever shrinks).
#: The number is the file's size when it was listed: it may not grow.
KNOWN_OVER: dict[str, int] = {
}


def _library_sizes() -> dict[str, int]:
    sizes = {}
    for rel in tracked_files(ROOT, "*.py"):
        if rel.parts[0] in ("tests", "docs") or rel.parts[0].startswith("."):
            continue
        sizes[rel.as_posix()] = len((ROOT / rel).read_text(encoding="utf-8").splitlines())
    return sizes


def test_no_library_file_is_over_600_lines():
    sizes = _library_sizes()
    over = {p: n for p, n in sizes.items() if n > MAX_LINES and p not in KNOWN_OVER}
    assert not over, (
        f"library files over {MAX_LINES} lines (split each by concept): "
        + ", ".join(f"{p} ({n})" for p, n in sorted(over.items(), key=lambda x: -x[1]))
    )
    grown = {p: (sizes[p], n) for p, n in KNOWN_OVER.items() if p in sizes and sizes[p] > n}
    assert not grown, "known oversized files that grew (split them instead): " + ", ".join(
        f"{p} ({now} lines, listed at {was})" for p, (now, was) in grown.items()
    )
    shrunk = [p for p in KNOWN_OVER if sizes.get(p, 0) <= MAX_LINES]
    assert not shrunk, f"now at most {MAX_LINES} lines (or gone): remove from KNOWN_OVER: {', '.join(shrunk)}"
