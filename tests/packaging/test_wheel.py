"""The built wheel installs one top-level module, ``agentlog``, and all of our code.

pip silently overwrites another distribution's files, and PyPI has
distributions called ``events``, ``tools``, ``learner`` and ``reducers``: a
wheel that put our layer folders at the top of site-packages would break
other projects (and be broken by them). The layer folders are mapped under
``agentlog`` by an explicit ``packages`` list in pyproject.toml, so the second
test makes sure a new folder cannot be forgotten in that list.

The wheel is built from a copy of the files git knows (what a fresh clone
has), so the build writes nothing into the checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from packaging_helpers import ROOT, layer_folders, tracked_files

#: Tracked folders under the layer folders that are deliberately NOT installed:
#: the benchmarks are scripts run from a checkout (``python tools/bench/bench_log.py``).
NOT_INSTALLED = (PurePosixPath("tools/bench"),)


def build_wheel(root: Path, work: Path) -> Path:
    """Build the wheel of the repository at ``root`` (from a copy of its git files) into ``work``; its path."""
    src = work / "src"
    for rel in tracked_files(root):
        dst = src / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dst)
    out = work / "dist"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert res.returncode == 0, f"pip wheel of {src} failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}"
    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {out}, found {[w.name for w in wheels]}"
    return wheels[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from this checkout."""
    return build_wheel(ROOT, tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def wheel_names(wheel) -> list[str]:
    """The paths inside the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def top_level_modules(names: list[str]) -> set[str]:
    """The top-level modules a wheel with these paths installs (first path components, .dist-info and .data aside)."""
    firsts = {PurePosixPath(n).parts[0] for n in names}
    return {f.removesuffix(".py") for f in firsts if not f.endswith((".dist-info", ".data"))}


def expected_installed_files(root: Path) -> set[str]:
    """``agentlog/<path>`` for every git file under a layer folder (and the root ``__init__.py``)
    that the wheel must install: Python modules and package data alike, benchmarks aside."""
    layers = set(layer_folders(root))
    expected = {"agentlog/__init__.py"}
    for rel in tracked_files(root):
        posix = PurePosixPath(rel.as_posix())
        if posix.parts[0] not in layers or "__pycache__" in posix.parts:
            continue
        if any(posix.is_relative_to(skip) for skip in NOT_INSTALLED):
            continue
        expected.add(f"agentlog/{posix}")
    return expected


def test_agentlog_is_the_only_top_level_module(wheel, wheel_names):
    tops = top_level_modules(wheel_names)
    assert tops == {"agentlog"}, f"{wheel.name} installs top-level modules {sorted(tops)}; it must install only 'agentlog'"
    # setuptools also declares them in top_level.txt (other backends may not write it).
    with zipfile.ZipFile(wheel) as zf:
        for name in (n for n in wheel_names if n.endswith(".dist-info/top_level.txt")):
            declared = zf.read(name).decode().split()
            assert declared == ["agentlog"], f"{wheel.name}:{name} declares {declared}; expected ['agentlog']"


def test_every_layer_folder_file_is_in_the_wheel(wheel_names):
    missing = sorted(expected_installed_files(ROOT) - set(wheel_names))
    assert not missing, (
        f"{len(missing)} file(s) of the layer folders are not in the wheel (add their package to "
        f"[tool.setuptools] packages or package-data in pyproject.toml): {missing}"
    )


def test_wheel_installs_no_test_or_benchmark_code(wheel_names):
    stray = sorted(n for n in wheel_names if n.startswith(("agentlog/tests/", "agentlog/tools/bench/", "agentlog/.shim/")))
    assert not stray, f"the wheel carries files that are not part of the library: {stray}"


@pytest.mark.parametrize("loader, stem, folder", [
    ("agentlog.events.log.framecodec", "_framecodec", "agentlog/events/log"),
    ("agentlog.events.schema.speedups", "_speedups", "agentlog/events/schema"),
])
def test_the_wheel_carries_the_compiled_accelerators_where_they_build(wheel_names, loader, stem, folder):
    """setup.py builds events/log/_framecodec.c and events/schema/_speedups.c into the wheel when
    a C compiler is present (this checkout built them: its editable install has them)."""
    import importlib

    module = importlib.import_module(loader)
    if not module.available():
        pytest.skip(f"no compiled {stem} in this checkout (no C compiler at install time?)")
    built = [n for n in wheel_names if PurePosixPath(n).name.startswith(f"{stem}.") and n.endswith((".so", ".pyd"))]
    assert [PurePosixPath(n).parent.as_posix() for n in built] == [folder], wheel_names
