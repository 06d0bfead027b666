"""Readers never report an empty log when acknowledged records are missing:
with the only segment emptied, cut to its header or deleted, every lock-free
reader (read_log, follow_log, verify_log and the CLI on top of them) checks
the DURABLE watermark as recovery does and names the missing LSN range."""

from __future__ import annotations

import asyncio
import os

import pytest

from agentlog.events import LogCorruption, follow_log, read_log, verify_log
from agentlog.events.log.format import SEG_HDR_SIZE
from log_helpers import seg_path, write_small_log
from agentlog.tools.cli import main

DAMAGE = ["emptied", "cut_to_header", "deleted"]


def _damaged(tmp_path, how: str):
    d = tmp_path / "log"
    write_small_log(d, 12)
    seg = seg_path(d)
    if how == "emptied":
        os.truncate(seg, 0)
    elif how == "cut_to_header":
        os.truncate(seg, SEG_HDR_SIZE)
    else:
        seg.unlink()
    return d, seg


@pytest.mark.parametrize("how", DAMAGE)
def test_read_log_raises_naming_the_missing_range(tmp_path, how):
    d, seg = _damaged(tmp_path, how)
    with pytest.raises(LogCorruption, match=r"lsn 0\.\.11 were acknowledged; they are missing") as info:
        list(read_log(d))
    assert (seg.name if how != "deleted" else "no segment files exist") in str(info.value)
    # Records not claimed by the watermark are not demanded.
    assert list(read_log(d, durable_only=False)) == []
    assert list(read_log(d, 12)) == []


@pytest.mark.parametrize("how", DAMAGE)
def test_follow_log_raises_instead_of_waiting_forever(tmp_path, how):
    d, _seg = _damaged(tmp_path, how)

    async def first():
        async for env in follow_log(d, poll_s=0.01):
            return env

    with pytest.raises(LogCorruption, match=r"lsn 0\.\.11 were acknowledged; they are missing"):
        asyncio.run(asyncio.wait_for(first(), 5))


@pytest.mark.parametrize("how", DAMAGE)
def test_verify_reports_corrupt(tmp_path, how):
    d, seg = _damaged(tmp_path, how)
    rep = verify_log(d)
    assert rep.status == "corrupt" and not rep.ok
    if how == "emptied":  # its header is gone too, and the watermark says it held records
        assert seg.name in rep.problem and "header" in rep.problem
    else:
        assert "lsn 0..11" in rep.problem and "missing" in rep.problem


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("cmd", [["replay"], ["stats"], ["reconstruct", "-o", "{TMP}/out.jsonl"]], ids=lambda c: c[0])
def test_cli_readers_exit_1_with_one_line(tmp_path, capsys, how, cmd):
    d, _seg = _damaged(tmp_path, how)
    capsys.readouterr()
    args = [cmd[0], str(d), *(a.replace("{TMP}", str(tmp_path)) for a in cmd[1:])]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 1, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentlog: error: "), err
    assert "lsn 0..11 were acknowledged; they are missing" in lines[0]
