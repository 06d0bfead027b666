"""The optional compiled accelerators (agentlog._compiled): the file log's frame
codec (agentlog.events.log._framecodec) and the event schema's speedups
(agentlog.events.schema._speedups).

Everything else about the package is in pyproject.toml. Each extension is an
accelerator: when it cannot be built (no C compiler, no Python headers, an
unsupported platform) the build warns and goes on, and its pure-Python path is
used instead. ``pip install`` never fails for want of a compiler.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that turns every failure into a warning."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure leaves the pure-Python path
            self._warn(exc)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - CompileError, LinkError, a missing compiler, ...
            self._warn(exc)

    @staticmethod
    def _warn(exc: BaseException) -> None:
        print(
            f"WARNING: an agentlog accelerator was not built ({type(exc).__name__}: {exc}); "
            "its pure-Python path will be used (slower, same results)",
            file=sys.stderr,
        )


_FLAGS = ["-O3", "-std=c99", "-Wall"] if sys.platform != "win32" else []

setup(
    ext_modules=[
        Extension("agentlog.events.log._framecodec", sources=["events/log/_framecodec.c"], extra_compile_args=_FLAGS, optional=True),
        Extension("agentlog.events.schema._speedups", sources=["events/schema/_speedups.c"], extra_compile_args=_FLAGS, optional=True),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
