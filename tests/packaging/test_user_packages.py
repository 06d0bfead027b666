"""`agentlog demo` run from inside a user's project that has its own ``tools``
and ``events`` packages.

Agent projects often have a ``tools/`` package. ``python -m`` puts the current
directory first on ``sys.path`` (before $PYTHONPATH and site-packages), and the
demo starts its worker and learner with ``python -m agentlog.loop...`` in the
caller's directory, so any bare ``import tools`` or ``import events`` in our
code, in the command or in those subprocesses, would pick up the user's
package. Here the user's packages record every import in a marker file; the
demo must finish, never import them, leave their files byte for byte as they
were, and they must still import from that directory afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from short_demo import SHORT_DEMO_ARGS

#: The user's packages: importing one appends a line to $USER_PKG_MARKER (when set),
#: and provides nothing our code could use.
USER_PACKAGE_SOURCE = '''"""The user's own {name} package (not agentlog's)."""
import os
import sys

OWNER = "user-project"
_marker = os.environ.get("USER_PKG_MARKER")
if _marker:
    with open(_marker, "a") as f:
        f.write(f"{name} imported by pid {{os.getpid()}}: {{sys.argv!r}}\\n")
'''

USER_PACKAGES = ("tools", "events")


def make_user_project(project: Path) -> dict[str, bytes]:
    """Write the user's ``tools`` and ``events`` packages into ``project``; {relative path: bytes}."""
    for name in USER_PACKAGES:
        pkg = project / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(USER_PACKAGE_SOURCE.format(name=name))
        (pkg / "helpers.py").write_text(f"WHO = {name!r}\n")
    return snapshot(project)


def snapshot(project: Path) -> dict[str, bytes]:
    """Every file under the user's package folders: {relative path: bytes}."""
    return {
        p.relative_to(project).as_posix(): p.read_bytes()
        for name in USER_PACKAGES for p in sorted((project / name).rglob("*")) if p.is_file()
    }


def test_demo_in_a_project_with_its_own_tools_and_events(tmp_path):
    project = tmp_path / "project"
    before = make_user_project(project)
    marker = tmp_path / "user_packages_imported.log"
    # As a user runs the console script: `python -m` with the project as cwd
    # (so the project is sys.path[0]). Our package comes from the install, or
    # from $PYTHONPATH in a development checkout; either way it is behind the cwd.
    env = {**os.environ, "USER_PKG_MARKER": str(marker), "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "agentlog.tools.cli", *SHORT_DEMO_ARGS, "--out", "runs/demo"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    run_dir = project / "runs" / "demo"
    stderr_logs = "".join(
        f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((run_dir / "logs").glob("*.stderr"))
    ) if (run_dir / "logs").is_dir() else ""
    assert res.returncode == 0, (
        f"agentlog demo in {project} exited {res.returncode}\nstdout:\n{res.stdout[-3000:]}\n"
        f"stderr:\n{res.stderr[-3000:]}{stderr_logs}"
    )
    assert not marker.exists(), (
        "agentlog (the command or its worker/learner subprocesses) imported the user's own packages:\n"
        + marker.read_text()
    )
    assert (run_dir / "learner").is_dir() and (run_dir / "rollout").is_dir(), f"no run written under {run_dir}"

    assert snapshot(project) == before, f"the user's packages under {project} changed"

    probe = subprocess.run(
        [sys.executable, "-c", "import tools, events, tools.helpers, events.helpers; "
         "print(tools.OWNER, events.OWNER, tools.helpers.WHO, events.helpers.WHO)"],
        cwd=project, env={**env, "USER_PKG_MARKER": ""}, capture_output=True, text=True, timeout=60, check=False,
    )
    assert probe.returncode == 0, f"the user's packages no longer import from {project}:\n{probe.stderr}"
    assert probe.stdout.split() == ["user-project", "user-project", "tools", "events"], probe.stdout
