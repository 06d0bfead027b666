"""`agentlog demo`: the online training loop on embedded defaults.

A rollout worker and a learner run as two processes coupled only through
logs: the worker drives lookup-task sessions through the SessionEngine into
the rollout log (with faults injected), the learner tails it, trains the
built-in GPT with GRPO after a short supervised warm-up, and publishes each
policy version in its learner log. Everything lands in ``runs/<run-id>/``.
"""

from __future__ import annotations

import argparse

from agentlog.tools.cli import EXIT_USAGE, CliError
from agentlog.tools.cli_loop import add_config_flags, add_output_flags, config_from_args, config_reference, execute
from agentlog.loop.config import ConfigError, LoopConfig
from agentlog.loop.demo import DEMO_DISTILL_COEF, DEMO_TOPK, DEMO_TOPK_COEF

EPILOG = """\
what it does: a supervised warm-up (300 steps on demonstrations whose answers
are 85% wrong: it teaches the lookup protocol, not the copy; reward starts
<= 0.3), then GRPO (32 prompts x 8 samples per step, eps 0.2/0.28, lr 1e-3
with warm-up, grad-clip 1.0) until --steps policy versions. The run folder
holds both logs, checkpoints, reward.png, report.html and structlog JSON; at
the end the rollout log is reconstructed offline and its per-step sample
digests are compared with those the learner recorded online.

--distill: on-policy distillation. Before the loop starts, a bigger built-in
GPT (128 wide, 3 blocks) is trained in code on correct demonstrations until it
solves the lookup task (>= 97% at temperature 1, a few seconds) and saved in
<run>/teacher/ with its weights digest. The worker scores every turn of each
finished session with it (teacher_scored events, in the rollout log, with its
top-{topk} tokens), and the learner adds -lambda x (rollout log-prob - teacher
log-prob) per token to the GRPO advantage (distill_coef, default {coef}) and a
top-K forward KL to the teacher x {topk_coef} (distill_topk_coef).
"""


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser(
        "demo",
        help="run the online training demo (rollouts + learner coupled through logs)",
        description=__doc__.split("\n\n")[0],
        epilog=lambda: EPILOG.format(coef=DEMO_DISTILL_COEF, topk=DEMO_TOPK, topk_coef=DEMO_TOPK_COEF) + "\n" + config_reference(LoopConfig()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p, defaults=LoopConfig())
    add_output_flags(p)
    g = p.add_argument_group("on-policy distillation")
    g.add_argument("--distill", action="store_true",
                   help="a bigger built-in GPT that solves the task teaches the student (built into <run>/teacher)")
    g.add_argument("--distill-coef", type=float, default=None, metavar="LAMBDA",
                   help=f"distill_coef lambda with --distill (default {DEMO_DISTILL_COEF})")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run the demo with defaults (its injected timeouts are infrastructure aborts) plus the flags given."""
    from agentlog.loop.demo.faults import demo_groups

    cfg = config_from_args(args, LoopConfig.from_dict({"groups": demo_groups()}))
    if not args.distill:
        if args.distill_coef is not None:
            raise CliError("--distill-coef: only with --distill", EXIT_USAGE)
        return execute(cfg, args, title="demo")
    coef = DEMO_DISTILL_COEF if args.distill_coef is None else args.distill_coef
    if not coef > 0:
        raise CliError(f"--distill-coef: expected a number > 0, found {coef}", EXIT_USAGE)

    def prepare(cfg: LoopConfig, run_dir) -> LoopConfig:
        from agentlog.engine.tasks import TaskError
        from agentlog.loop.demo.teacher_model import demo_teacher_config

        try:
            return demo_teacher_config(cfg, run_dir, coef)
        except (ConfigError, TaskError, RuntimeError) as exc:
            raise CliError(f"--distill: {exc}", EXIT_USAGE) from None

    return execute(cfg, args, title="demo", prepare=prepare)
