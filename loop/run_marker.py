"""The run folder's ``INCOMPLETE`` marker: a run that has not ended well says so.

:func:`agentlog.loop.run.run_loop` writes it when the loop starts, rewrites it
with the reason when the loop is interrupted (Ctrl-C) or fails, and removes it
once the loop ends normally; a killed driver leaves the "running" line. Runs
are not resumed: the marker tells the reading commands (and a later ``--out``)
that the logs end where the run stopped. A module of its own, without torch,
so that the reading commands can ask.
"""

from __future__ import annotations

import time
from pathlib import Path

from agentlog.events.fs import atomic_file

#: A file in the run folder while the loop has not ended well: written when the loop starts,
#: rewritten with the reason when it is interrupted or fails, removed once it ends normally.
INCOMPLETE_MARKER = "INCOMPLETE"


def mark_incomplete(run_dir: Path, why: str) -> None:
    """Write ``<run_dir>/INCOMPLETE`` saying why the run is not complete (one line), durably."""
    with atomic_file(Path(run_dir) / INCOMPLETE_MARKER, "w", encoding="utf-8") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {why}\n")


def incomplete_reason(run_dir: Path) -> str | None:
    """Why the run in ``run_dir`` is incomplete (its INCOMPLETE marker's line), or None when it is not marked."""
    try:
        text = (Path(run_dir) / INCOMPLETE_MARKER).read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:  # a directory or an unreadable file in its place: marked all the same
        return f"(its {INCOMPLETE_MARKER} marker cannot be read: {exc.strerror or exc})"
    return text.splitlines()[0] if text else "(marker without a reason)"
