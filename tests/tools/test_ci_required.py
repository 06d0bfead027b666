"""The `required` marker: under CI=true a skip of a required test fails the run (tests/conftest.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from cli_helpers import ROOT

GENERATED = '''
import pytest

@pytest.mark.required
def test_required_but_missing():
    pytest.skip("frobnicator not installed")

@pytest.mark.required
@pytest.mark.skipif(True, reason="no chromium here")
def test_required_skipif():
    pass

@pytest.mark.required
def test_required_that_runs():
    # Leaves proof that its body ran (a skip would leave none): the outer test reads it.
    import pathlib
    pathlib.Path(__file__).with_name("required-ran.txt").write_text("ran")
    assert pathlib.Path(__file__).with_name("required-ran.txt").read_text() == "ran"

@pytest.mark.required
@pytest.mark.xfail(reason="known", strict=False)
def test_required_xfail():
    assert False

def test_optional_skip():
    pytest.skip("optional tool missing")
'''


def _run_generated(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(ROOT / "tests" / "short_demo.py", tmp_path / "short_demo.py")
    shutil.copy(ROOT / "tests" / "nats_helpers.py", tmp_path / "nats_helpers.py")  # conftest.py registers its fixtures
    shutil.copy(ROOT / "tests" / "nats_cluster.py", tmp_path / "nats_cluster.py")  # nats_helpers.py imports it
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -v -rA --strict-markers -p no:cacheprovider\nmarkers =\n    required: must run in CI\n"
    )
    (tmp_path / "test_generated.py").write_text(GENERATED)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def _outcomes(stdout: str) -> dict[str, str]:
    """test name -> PASSED / FAILED / ERROR / SKIPPED / XFAIL, from the -v lines."""
    return dict(re.findall(r"^test_generated\.py::(\w+) ([A-Z]+)", stdout, re.M))


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_under_ci_a_skipped_required_test_fails_with_the_skip_reason(tmp_path, ci):
    res = _run_generated(tmp_path, ci)
    assert res.returncode == 1, res.stdout
    got = _outcomes(res.stdout)
    # A skip raised in setup (skipif, a fixture's skip) becomes an error of that phase: it fails the run too.
    assert got == {
        "test_required_but_missing": "FAILED",
        "test_required_skipif": "ERROR",
        "test_required_that_runs": "PASSED",
        "test_required_xfail": "XFAIL",
        "test_optional_skip": "SKIPPED",
    }, res.stdout
    assert "required test skipped under CI" in res.stdout and "frobnicator not installed" in res.stdout, res.stdout
    assert "no chromium here" in res.stdout, res.stdout
    assert (tmp_path / "required-ran.txt").read_text() == "ran"  # the required test's body ran


@pytest.mark.parametrize("ci", [None, "false", ""])
def test_outside_ci_a_required_test_skips_quietly(tmp_path, ci):
    res = _run_generated(tmp_path, ci)
    assert res.returncode == 0, res.stdout
    got = _outcomes(res.stdout)
    assert got["test_required_but_missing"] == "SKIPPED" and got["test_required_skipif"] == "SKIPPED", res.stdout
    assert got["test_required_that_runs"] == "PASSED", res.stdout
    assert (tmp_path / "required-ran.txt").read_text() == "ran"


def test_the_end_to_end_checks_are_marked_required():
    """The Chromium report tests and the real agent-CLI tests (the loop's with Claude Code too) carry the (declared) marker."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "required", "-p", "no:cacheprovider",
         "tests/tools/test_cli_tail_report.py", "tests/gateway/test_agent_clis.py", "tests/loop/test_claude_code_loop.py"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr  # --strict-markers: an undeclared marker is an error
    ids = set(re.findall(r"^(tests/\S+::\S+)$", res.stdout, re.M))
    assert ids == {
        "tests/tools/test_cli_tail_report.py::test_report_in_headless_chromium_draws_every_chart_and_the_sessions_table",
        "tests/tools/test_cli_tail_report.py::test_report_of_a_generated_run_stays_small_and_renders_with_the_learner_curves",
        "tests/tools/test_cli_tail_report.py::test_an_abort_reason_is_drawn_as_text_in_the_reports_chart_never_as_a_link",
        "tests/gateway/test_agent_clis.py::test_agent_cli_completes_a_tool_round_trip_and_every_turn_is_recorded[claude-code]",
        "tests/gateway/test_agent_clis.py::test_agent_cli_completes_a_tool_round_trip_and_every_turn_is_recorded[codex]",
        "tests/gateway/test_agent_clis.py::test_claude_code_subagents_become_lineages_spawned_by_their_agent_calls",
        "tests/gateway/test_agent_clis.py::test_a_cli_agent_past_its_budget_leaves_no_process_running[claude-code-Bash]",
        "tests/gateway/test_agent_clis.py::test_a_cli_agent_past_its_budget_leaves_no_process_running[codex-exec_command]",
        "tests/gateway/test_agent_clis.py::test_claude_code_writes_nothing_into_the_users_config_dir_or_tmp",
        "tests/loop/test_claude_code_loop.py::test_claude_code_plays_every_session_of_a_training_step_and_each_model_call_is_a_recorded_turn",
    }, res.stdout


def _stub(bin_dir, name: str, body: str = "") -> None:
    path = bin_dir / name
    path.write_text(f'#!/bin/bash\necho "{name} $*" >> "$STUB_LOG"\n{body}\n')
    path.chmod(0o755)


@pytest.mark.parametrize("have_npm", [False, True])
def test_ci_run_installs_what_the_required_tests_need_each_under_a_time_bound(tmp_path, have_npm):
    """.ci/run on a machine without chromium (and with or without npm), every external command a stub
    that records its arguments: each install runs under `timeout`, the CLIs go to $AGENTLOG_CLI_DIR,
    and `make test` runs with CI=true."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "env"):  # the real ones; nothing else from the host's PATH
        (bin_dir / tool).symlink_to(shutil.which(tool))
    _stub(bin_dir, "timeout")
    _stub(bin_dir, "make", 'echo "make-env CI=$CI AGENTLOG_CLI_DIR=$AGENTLOG_CLI_DIR" >> "$STUB_LOG"')
    if have_npm:
        _stub(bin_dir, "npm")
    log = tmp_path / "calls.log"
    env = {"PATH": str(bin_dir), "STUB_LOG": str(log), "HOME": str(tmp_path / "home")}
    res = subprocess.run([str(bin_dir / "bash"), str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    calls = log.read_text().splitlines()
    apt = [c for c in calls if "apt-get" in c]
    assert apt and all(c.startswith("timeout 900 apt-get") for c in apt), calls
    assert "timeout 900 apt-get install -y -qq chromium" in calls
    assert ("timeout 900 apt-get install -y -qq nodejs npm" in calls) is (not have_npm), calls
    cli_dir = tmp_path / "home" / ".cache" / "agentlog-clis"
    install = f"timeout --kill-after=30 900 tools/gateway_clis.sh {cli_dir}"
    assert (install in calls) is have_npm, calls  # without npm (the stub apt installs nothing) there is nothing to install with
    assert calls[-2:] == ["make test", f"make-env CI=true AGENTLOG_CLI_DIR={cli_dir}"], calls


@pytest.mark.parametrize("lint_fails", [False, True])
def test_ci_run_runs_the_static_checks_before_the_tests_and_fails_on_a_finding(tmp_path, lint_fails):
    """.ci/run runs `make lint` (ruff, mypy) before `make test`; a lint finding (make exits 2)
    fails the run before any test starts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "env"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for tool in ("timeout", "npm", "chromium"):  # present: nothing to install
        _stub(bin_dir, tool)
    _stub(bin_dir, "make", 'if [ "$1" = lint ] && [ -n "$LINT_FAILS" ]; then exit 2; fi')
    log = tmp_path / "calls.log"
    env = {"PATH": str(bin_dir), "STUB_LOG": str(log), "HOME": str(tmp_path / "home")}
    if lint_fails:
        env["LINT_FAILS"] = "1"
    res = subprocess.run([str(bin_dir / "bash"), str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    makes = [c for c in log.read_text().splitlines() if c.startswith("make")]
    if lint_fails:
        assert res.returncode == 2 and makes == ["make lint"], (res.returncode, makes)
    else:
        assert res.returncode == 0 and makes == ["make lint", "make test"], (res.returncode, res.stderr, makes)
