"""`agentlog export` that fails part way (a damaged message on the stream's second log) must not
leave DIR holding log directories that read as a complete run: a reader would take a run with a
partition cut short (or missing) for the whole one."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("nats", reason="the nats:// URLs need the nats extra")

from agentlog.events.log.jetstream import JetStreamLog  # noqa: E402
from agentlog.events.schema.types import SessionOpened  # noqa: E402
from agentlog.tools.cli import main  # noqa: E402


def test_a_failed_export_leaves_no_directory_that_looks_complete(nats_server, tmp_path, capsys):
    for pid in (0, 1):
        log = JetStreamLog.open(nats_server.url, "halfexp", pid)
        log.append_batch([(f"s{pid}", 0, SessionOpened(group_id=f"g{pid}", group_size=1, sample_index=0))])
        log.close()

    async def damage() -> None:
        import nats

        nc = await nats.connect(nats_server.url)
        try:
            await nc.jetstream().publish("halfexp.p0001", b"not a frame at all, but long enough to be read as one")
        finally:
            await nc.close()

    asyncio.run(damage())
    out_dir = tmp_path / "exported"
    code = main(["export", f"{nats_server.url}/halfexp", str(out_dir)])
    _, err = capsys.readouterr()
    assert code == 1 and "halfexp" in err
    # Nothing that a reading command would take for the run (p0000 whole, p0001 cut at its damage).
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert not out_dir.exists() or not any(out_dir.iterdir()), left
    assert left in ([], ["exported"]), left
    # A good export into the same DIR afterwards works (an existing empty DIR too).
    out_dir.mkdir(exist_ok=True)
    assert main(["export", f"{nats_server.url}/halfexp/p0000", str(out_dir)]) == 0
    assert (out_dir).is_dir() and any(out_dir.iterdir())
