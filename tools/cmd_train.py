"""`agentlog train --config FILE`: the online loop with a user's TOML configuration.

The TOML file's top-level keys are LoopConfig fields (``task``, ``steps``,
``seed``, ``groups_per_step``...), its ``[learner]`` table holds
LearnerConfig fields and its ``[faults]`` table FaultConfig fields; see
``agentlog demo --help`` for every knob. Flags given on the command line
override the file. The task is chosen by name from the task registry
(``engine.tasks.register_task``); ``--import MODULE`` (or the config's
``[task] module``) imports a module first, in every process of the loop, so
that it can register its own task. The current directory and the config
file's directory are importable, like under ``python -m``; ``[task] path``
adds more. Installed packages can declare tasks in the ``agentlog.tasks``
entry point group.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agentlog.tools.cli import EXIT_USAGE, CliError
from agentlog.tools.cli_loop import add_config_flags, add_output_flags, config_from_args, config_reference, execute
from agentlog.loop.config import ConfigError, LoopConfig


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser(
        "train",
        help="run the online loop with a TOML config (task, model, learner, faults)",
        description=__doc__.split("\n\n")[0],
        epilog=lambda: __doc__.split("\n\n", 1)[1] + "\n" + config_reference(LoopConfig()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, required=True, metavar="FILE", help="TOML file of LoopConfig fields")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE (it registers a task) in every process of the loop, from the current directory, "
                        "the config's directory or [task] path; repeatable")
    add_config_flags(p, defaults=LoopConfig())
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Load the config, apply flags, run (the task modules are imported by ``execute``'s task check, and
    by the worker and learner processes from ``config.json``)."""
    if args.config.suffix != ".toml":
        raise CliError(f"{args.config}: expected a .toml file", EXIT_USAGE)
    try:
        base = LoopConfig.load(args.config)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    try:
        base.learner_config()  # the file's [learner] table, checked here so that its errors name the file
    except (ConfigError, ValueError) as exc:
        raise CliError(f"{args.config}: [learner] {exc}", EXIT_USAGE) from None
    cfg = config_from_args(args, base, task_modules=args.imports, import_dirs=[args.config.absolute().parent])
    return execute(cfg, args, title="train")
