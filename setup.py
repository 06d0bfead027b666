"""The optional compiled frame codec (agentlog.events.log._framecodec).

Everything else about the package is in pyproject.toml. The extension is an
accelerator: when it cannot be built (no C compiler, no Python headers, an
unsupported platform) the build warns and goes on, and the pure-Python codec
(agentlog.events.log.framecodec) is used instead. ``pip install`` never fails
for want of a compiler.
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
            f"WARNING: agentlog's compiled frame codec was not built ({type(exc).__name__}: {exc}); "
            "the pure-Python codec will be used (slower, same results)",
            file=sys.stderr,
        )


setup(
    ext_modules=[
        Extension(
            "agentlog.events.log._framecodec",
            sources=["events/log/_framecodec.c"],
            extra_compile_args=["-O3", "-std=c99", "-Wall"] if sys.platform != "win32" else [],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
