"""Fixtures and hooks for the whole suite.

* The ``required`` marker: an end-to-end check that CI must actually run
  (the report in headless Chromium, the real agent CLIs). Locally such a
  test skips with its reason when its tool is missing; under ``CI=true``
  (what CI services set; ``.ci/run`` sets it too) that skip FAILS the run
  instead, so CI never goes green on a check it did not make.
* Weights & Biases is off for the session (``WANDB_MODE=disabled``, no
  ``WANDB_PROJECT``).
* ``short_demo_run``: one short ``agentlog demo`` run per test session, for
  the tests that need a real run folder (the demo smoke test, the README's
  examples).
* The longest files are collected first: ``make test`` hands whole files to
  its workers (``--dist loadfile``) in collection order, so a long file that
  starts last makes the whole run wait for it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: Values of $CI that mean "this is a CI run" (GitHub, GitLab and most others set "true").
CI_TRUE = ("true", "1", "yes")


def running_in_ci() -> bool:
    """Whether $CI says this is a CI run."""
    return os.environ.get("CI", "").strip().lower() in CI_TRUE


def _skip_reason(report: pytest.TestReport) -> str:
    """The reason of a skipped report (its longrepr is (file, line, "Skipped: why"))."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


#: The files that take longest (``--durations=0`` on the 2-core VM, 2026-12-07: 30 to 167 s each), longest first.
#: Only an order: a file missing here, or one that got faster, costs time, never a result.
LONGEST_FIRST = (
    "tests/loop/test_ray_rollouts.py", "tests/tools/test_readme_examples.py", "tests/loop/test_jetstream_loop.py",
    "tests/loop/test_multi_worker_run.py", "tests/test_readme_python.py", "tests/tools/test_cli_errors.py",
    "tests/loop/test_refill_loop.py", "tests/tools/test_cli_paths.py", "tests/loop/test_example_repo_fix.py",
    "tests/tools/test_cli_tail_report.py", "tests/engine/test_many_sessions.py", "tests/loop/test_custom_task_dir.py",
    "tests/loop/test_resume_worker.py", "tests/loop/test_demo_teacher.py", "tests/loop/test_claude_code_loop.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collect the files of :data:`LONGEST_FIRST` first, in that order, each file's tests in their own order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else "", len(rank)))


def pytest_configure(config: pytest.Config) -> None:
    """Keep the suite off Weights & Biases: a CI environment with
    $WANDB_PROJECT set would otherwise reach wandb from the loop tests
    (the learner's metric sinks read it). Take Ctrl-C as Python does when
    the suite was started with SIGINT ignored (:func:`_deliver_ctrl_c`)."""
    os.environ.pop("WANDB_PROJECT", None)
    os.environ["WANDB_MODE"] = "disabled"
    _deliver_ctrl_c()


def _deliver_ctrl_c() -> None:
    """A suite started in the background by a shell without job control
    (``make test &`` in a script) starts with SIGINT ignored, and every
    command it starts inherits that: the tests that stop ``tail``, ``serve``
    or a run with Ctrl-C would see it ignored and fail as hangs. Python's own
    handler instead, in this process and so, reset to the default by exec, in
    each command it starts (xdist's workers included: the controller runs this
    before it starts them)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _structlog_as_the_test_found_it():
    """Each test starts with structlog unconfigured, as an application that
    has not set up logging: a command run in-process (``cli.main``) configures
    structlog for the rest of the process, and a later test of the library's
    quiet default, or of ``capture_logs``, would otherwise see that setup."""
    import structlog

    yield
    structlog.reset_defaults()


def _one_torch_thread() -> None:
    """Torch in this process on one thread, where the test modules imported it (no import here):
    `make test` runs three xdist workers on two cores, and torch's default of one thread per core
    makes the workers' threads spin against each other (a learner step measured 20-30x
    slower with two). Small models gain nothing from more; a test about thread counts sets its own."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_for_module_fixtures() -> None:
    """Before the first module-scoped fixture (a run trained in this process) is made."""
    _one_torch_thread()


@pytest.fixture(autouse=True)
def _one_torch_thread_for_each_test() -> None:
    """Again before each test: a test may import torch itself, or leave another thread count."""
    _one_torch_thread()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under CI=true, a skip of a test marked ``required`` becomes a failure that carries the skip's reason."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("required") and running_in_ci():
        report.outcome = "failed"
        report.longrepr = (
            f"required test skipped under CI={os.environ.get('CI')}: {_skip_reason(report)}\n"
            "(a test marked `required` must run in CI: install what it needs, see .ci/run)"
        )
    return report


from short_demo import SHORT_DEMO_ARGS  # noqa: E402  (tests/ is on sys.path: it has no __init__.py)


@pytest.fixture(scope="session")
def short_demo_run(tmp_path_factory) -> tuple[Path, str]:
    """(cwd, stdout): a short `agentlog demo --out runs/demo` run (2 RL steps of 4 groups x 4,
    5 warm-up steps, faults on, report written) made once per session in ``cwd``. Read-only."""
    import contextlib
    import io

    from agentlog.tools.cli import main as cli_main

    cwd = tmp_path_factory.mktemp("demo")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main([*SHORT_DEMO_ARGS, "--out", str(cwd / "runs" / "demo")])
    assert rc == 0, out.getvalue()
    return cwd, out.getvalue()

# The JetStream fixtures (tests/nats_helpers.py), for every test: a 3-node
# loopback cluster per module, and one server for the JetStreamLog tests.
from nats_helpers import nats_cluster, nats_cluster_module, nats_server  # noqa: E402, F401
