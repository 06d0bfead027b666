"""`agentlog demo`: the online training loop on embedded defaults.

A rollout worker and a learner run as two processes coupled only through
logs: the worker drives lookup-task sessions through the SessionEngine into
the rollout log (with faults injected), the learner tails it, trains the
built-in GPT with GRPO after a short supervised warm-up, and publishes each
policy version in its learner log. Everything lands in ``runs/<run-id>/``.
"""

from __future__ import annotations

import argparse

from agentlog.tools.cli_loop import add_config_flags, add_output_flags, config_from_args, execute
from agentlog.loop.config import LoopConfig

EPILOG = """\
what it does: a supervised warm-up (300 steps on demonstrations whose answers
are 85% wrong: it teaches the lookup protocol, not the copy; reward starts
<= 0.3), then GRPO (32 prompts x 8 samples per step, eps 0.2/0.28, lr 1e-3
with warm-up, grad-clip 1.0) until --steps policy versions. The run folder
holds both logs, checkpoints, reward.png, report.html and structlog JSON; at
the end the rollout log is reconstructed offline and its per-step sample
digests are compared with those the learner recorded online.
"""


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser(
        "demo",
        help="run the online training demo (rollouts + learner coupled through logs)",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p, defaults=LoopConfig())
    add_output_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Run the demo with defaults plus the flags given."""
    return execute(config_from_args(args, LoopConfig()), args, title="demo")
