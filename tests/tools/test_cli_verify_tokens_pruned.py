"""verify-tokens over a run none of whose recorded versions still has a checkpoint
checks nothing: that is an error naming the versions, not an OK."""

from __future__ import annotations

import contextlib
import io
import shutil

from agentlog.tools.cli import main as cli_main


def test_a_run_whose_checkpoints_were_all_pruned_is_not_reported_ok(short_demo_run, tmp_path) -> None:
    cwd, _ = short_demo_run
    run = shutil.copytree(cwd / "runs" / "demo", tmp_path / "demo", ignore=shutil.ignore_patterns("LOCK"))
    for p in (run / "checkpoints").iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["verify-tokens", str(run), "-q"])
    assert rc != 0, out.getvalue()
    assert "no policy for version 0" in err.getvalue() and "OK" not in out.getvalue().splitlines()[-1:]
