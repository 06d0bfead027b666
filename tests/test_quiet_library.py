"""agentlog used as a library prints nothing unless the application configures logging.

Each test runs one script in a fresh interpreter (logging configuration is
process-global): it opens a FileLog, appends and reads, and runs engine
sessions (one finished, one aborted, so the engine logs ``session.aborted``).
Unconfigured, stdout and stderr stay empty; with structlog configured the
events come through structlog; with stdlib logging configured they come
through ``logging`` under the ``agentlog`` logger names.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCENARIO = textwrap.dedent(
    """
    import asyncio, sys, tempfile
    from pathlib import Path

    import agentlog
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog
    from agentlog.events.schema.types import SessionOpened

    async def scenario(path):
        log = FileLog.open(path, fsync="always")
        log.append_batch([("raw", 0, SessionOpened(group_id="g0", group_size=1, sample_index=0))])
        engine = await SessionEngine.open(log)
        h = await engine.open_session("s1", group_id="g1", group_size=2, sample_index=0, prompt_ids=[1, 2])
        await h.start(harness="quiet-test")
        await h.record_turn(prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2])
        await h.finish(reward=1.0)
        h2 = await engine.open_session("s2", group_id="g1", group_size=2, sample_index=1, prompt_ids=[1, 2])
        await h2.start(harness="quiet-test")
        await h2.abort("exception:Boom", error="on purpose")
        await engine.close()
        n = sum(1 for _ in log.read(0))
        log.close()
        assert n >= 8, n
        reopened = FileLog.open(path)
        assert sum(1 for _ in reopened.read(0)) == n
        reopened.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(scenario(Path(tmp) / "log"))
    """
)


def run_script(setup: str) -> subprocess.CompletedProcess:
    """Run ``setup`` then the scenario in a fresh interpreter; fail naming its output if it fails."""
    code = "import sys\n" + textwrap.dedent(setup) + SCENARIO
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the scenario failed (exit {proc.returncode}):\n{proc.stderr}"
    return proc


def test_unconfigured_library_prints_nothing() -> None:
    proc = run_script("")
    assert proc.stdout == "", f"stdout of a script that configured no logging:\n{proc.stdout}"
    assert proc.stderr == "", f"stderr of a script that configured no logging:\n{proc.stderr}"


def test_configured_structlog_receives_the_library_events() -> None:
    proc = run_script(
        """
        import structlog
        structlog.configure(processors=[structlog.processors.add_log_level, structlog.processors.KeyValueRenderer(key_order=["event"])],
                            logger_factory=structlog.PrintLoggerFactory(sys.stdout))
        """
    )
    assert "event='log.segment.created'" in proc.stdout, proc.stdout
    aborted = [line for line in proc.stdout.splitlines() if line.startswith("event='session.aborted'") and "session_id='s2'" in line]
    assert aborted and "level='warning'" in aborted[0] and "reason='exception:Boom'" in aborted[0], proc.stdout
    assert proc.stderr == "", proc.stderr


def test_configured_stdlib_logging_receives_the_library_events_under_agentlog() -> None:
    proc = run_script(
        """
        import logging
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
        """
    )
    lines = proc.stderr.splitlines()
    assert any(line.startswith("DEBUG agentlog.events.log.writer log.segment.created") for line in lines), proc.stderr
    aborted = [line for line in lines if line.startswith("WARNING agentlog.engine session.aborted") and "session_id='s2'" in line]
    assert aborted and "reason='exception:Boom'" in aborted[0], proc.stderr
    assert proc.stdout == "", proc.stdout


def test_stdlib_logging_above_the_events_level_stays_silent() -> None:
    """A handler at WARNING sees the engine's warning and none of the debug/info lines."""
    proc = run_script(
        """
        import logging
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
        """
    )
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith(("WARNING ", "ERROR ")) for line in lines), proc.stderr
    assert not any("log.segment.created" in line or "log.opened" in line for line in lines), proc.stderr
    assert any("session.aborted" in line for line in lines), proc.stderr


@pytest.mark.parametrize("method", ["debug", "info", "warning", "error", "critical"])
def test_a_silent_logger_formats_nothing(method: str) -> None:
    """Unconfigured, an event's fields are never rendered (no str/repr of them)."""
    code = textwrap.dedent(
        f"""
        from agentlog._logging import get_logger

        class Loud:
            def __repr__(self):
                raise AssertionError("rendered while silent")
            __str__ = __repr__

        get_logger("agentlog.test", bound=Loud()).bind(more=Loud()).{method}("test.event", field=Loud())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", (proc.stdout, proc.stderr)


def test_capture_logs_captures_library_events() -> None:
    """structlog.testing.capture_logs configures structlog, so the library's events reach it."""
    from structlog.testing import capture_logs

    from agentlog._logging import get_logger

    with capture_logs() as logs:
        get_logger("agentlog.test", session_id="s9").bind(api="chat").info("gateway.turn_cancelled", reason="test")
    assert logs == [{"event": "gateway.turn_cancelled", "log_level": "info", "session_id": "s9", "api": "chat", "reason": "test"}]


def test_a_logger_name_outside_agentlog_is_refused() -> None:
    from agentlog._logging import get_logger

    with pytest.raises(ValueError, match="expected a name under 'agentlog'"):
        get_logger("engine")
