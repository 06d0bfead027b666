"""The engine's instruction-count benchmark: each arm runs as bench_engine runs it (the
checkpointer arms changing only the engine's checkpoint_every), and, under valgrind (slow),
the table and its information line."""

from __future__ import annotations

import re
import shutil

import pytest

from agentlog.engine import SessionEngine
from agentlog.tools.bench import bench_engine_instructions as bench


@pytest.mark.parametrize("arm", bench.ARMS)
def test_each_arm_runs_and_leaves_the_engine_as_it_found_it(arm, monkeypatch):
    seen: list[int | None] = []
    opened = SessionEngine.__dict__["open"]

    async def spying(cls, log, **options):
        seen.append(options.get("checkpoint_every"))
        return await opened.__func__(cls, log, **options)

    monkeypatch.setattr(SessionEngine, "open", classmethod(spying))
    spy = SessionEngine.__dict__["open"]
    bench.run_arm(arm, 8)
    assert SessionEngine.__dict__["open"] is spy  # restored: the arm's change does not outlive it
    want = {"raw": [], "engine": [None], "engine_no_snapshots": [10**12], "engine_no_checkpointer": [0]}[arm]
    assert seen == want


def test_an_unknown_arm_is_refused_by_name():
    with pytest.raises(ValueError, match="arm: expected one of raw, engine, .* found 'fast'"):
        bench.run_arm("fast", 8)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_the_table_counts_each_arm_and_ends_with_its_information_line(capsys):
    # Tiny sizes: the table's shape, not its figures (at 4 against 8 sessions the noise can even make one negative).
    assert bench.main(["--small", "4", "--large", "8", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    for arm in bench.ARMS:
        assert re.search(rf"^{arm} +-?[\d,]+ +-?[\d.]+x$", out, re.M), out
    assert re.search(r"^information: engine_vs_raw_append in instructions -?[\d.]+x", out.rstrip().splitlines()[-1]), out
