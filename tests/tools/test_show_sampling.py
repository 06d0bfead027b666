"""`agentlog show` names why a row sampled with truncation is not trained."""

from __future__ import annotations

import asyncio

from cli_helpers import agentlog


async def _write(path) -> None:
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    eng = await SessionEngine.open(FileLog.open(path, fsync="batch"), drain_s=0.1)
    h = await eng.open_session("cut-0", group_id="g", group_size=1)
    await h.start()
    await h.record_turn(messages=[{"role": "user", "content": "q"}], prompt_ids=[1, 2], output_ids=[3, 4],
                        output_log_probs=[-0.5, -0.5], sampling={"temperature": 1.0, "top_p": 0.9})
    await h.finish(reward=1.0)
    await eng.close()


def test_show_gives_the_sampling_reason_of_a_removed_row(tmp_path):
    path = tmp_path / "run.log"
    asyncio.run(_write(path))
    res = agentlog("show", str(path), "cut-0")
    assert res.returncode == 0, res.stderr
    row = [line for line in res.stdout.splitlines() if line.strip().startswith("row 0:")][0]
    assert "remove_sample" in row and "sampled with top_p=0.9" in row, res.stdout
