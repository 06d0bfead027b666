"""The demo's teacher (demo-only): a bigger built-in GPT that already solves the task.

`agentlog demo --distill` distils a teacher into the student: the teacher
scores the student's own turns, and the learner pushes the student toward
it. No weights are ever downloaded, so the teacher is built in code: the
built-in GPT made bigger (:class:`TeacherRecipe`: width 128, 3 blocks,
against the student's 64 and 2) and trained with the demo's supervised
warm-up (:func:`agentlog.loop.demo.warmup.supervised_warmup`) on *correct*
demonstrations (``warmup_wrong_rate = 0``, so it learns the copy, not only
the protocol) until its solve rate, measured with the task's own tool and
verifier at the rollout temperature, reaches ``target_solve_rate``.

It is deterministic from the seed and the recipe (same data, same init,
same threads), and it is built once per run: :func:`ensure_teacher` writes
``<run>/teacher/policy.pt`` (a weights file that
:class:`agentlog.loop.teacher.TorchTeacher` ``.from_checkpoint`` reads) and
``<run>/teacher/teacher.json`` (recipe, seed, digest, solve rate, build
time) atomically, so every loop process loads the very same weights.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from agentlog._logging import get_logger
from agentlog.engine.tasks import Task
from agentlog.events.fs import write_dir_atomically
from agentlog.learner.learner import read_policy, save_state
from agentlog.learner.model import GPT

from ..config import ConfigError, LoopConfig
from ..teacher import state_dict_digest
from . import DEMO_DISTILL_COEF, DEMO_TOPK, DEMO_TOPK_COEF, TEACHER_NAME

log = get_logger("agentlog.loop.demo.teacher_model")

#: The run folder's teacher directory, its weights file and its description.
TEACHER_DIR = "teacher"
TEACHER_FILE = "policy.pt"
TEACHER_META = "teacher.json"
#: Format tag of teacher.json.
META_FORMAT = "agentlog.demo_teacher.v1"
#: Seed offset of the episodes the solve rate is measured on (never the training data's).
EVAL_SEED = 1_000_003


@dataclass(frozen=True)
class TeacherRecipe:
    """How the demo's teacher is built: its shape and its supervised training."""

    d_model: int = 128
    """Width (the student's default is 64)."""
    n_layer: int = 3
    """Transformer blocks (the student's default is 2)."""
    n_head: int = 4
    """Attention heads."""
    batch: int = 64
    """Demonstrations per training step."""
    lr: float = 3e-3
    """AdamW learning rate (linear warm-up over 20 steps, then constant)."""
    max_steps: int = 400
    """Most training steps; the build fails if the target is not reached by then."""
    check_every: int = 20
    """Steps between solve-rate measurements (training stops at the first that reaches the target)."""
    target_solve_rate: float = 0.97
    """Solve rate at which training stops (measured on eval_episodes)."""
    min_solve_rate: float = 0.95
    """Below this after max_steps, the build raises instead of handing back a teacher that does not solve the task."""
    eval_episodes: int = 512
    """Episodes of each solve-rate measurement (fresh ones, never trained on)."""
    temperature: float = 1.0
    """Sampling temperature of the solve-rate measurement (the rollout temperature)."""
    threads: int = 1
    """torch threads while building (fixed: the float results, hence the digest, depend on it). One:
    at this size a second thread gains nothing, and on a busy 2-core machine it made each step 8x slower."""

    def loop_config(self, task: str, seed: int) -> LoopConfig:
        """The LoopConfig whose model shape and warm-up fields give this recipe."""
        return LoopConfig(
            task=task, seed=seed, d_model=self.d_model, n_layer=self.n_layer, n_head=self.n_head,
            warmup_steps=self.max_steps, warmup_batch=self.batch, warmup_wrong_rate=0.0,
            warmup_threads=self.threads, learner={"lr": self.lr, "warmup_steps": 20, "grad_clip": 1.0},
        )


def rollout_solve_rate(model: torch.nn.Module, task: Task, *, episodes: int, seed: int,
                       temperature: float = 1.0) -> float:
    """Fraction of ``episodes`` fresh episodes (drawn from ``seed``) that ``model``
    solves when it samples every turn at ``temperature``, with the task's own
    tool between turns and its verifier at the end (``Verdict.success``).
    All episodes advance together, one batched ``sample`` per turn."""
    if episodes < 1:
        raise ValueError(f"rollout_solve_rate: expected episodes >= 1, found {episodes!r}")
    rng = random.Random(seed)
    eps = [task.new_episode(rng) for _ in range(episodes)]
    contexts: list[list[int]] = [list(e.prompt_ids) for e in eps]
    outputs: list[list[Sequence[int]]] = [[] for _ in eps]
    live = list(range(episodes))
    generator = torch.Generator().manual_seed(seed)
    for turn in range(task.max_turns):
        if not live:
            break
        gen = model.sample([contexts[i] for i in live], task.max_new_tokens, temperature=temperature,
                           stop_ids=(task.eos_id,), generator=generator)
        still = []
        for i, out in zip(live, gen.tokens):
            out = [int(t) for t in out]
            outputs[i].append(out)
            contexts[i] += out
            tool = task.tool_step(eps[i], turn, out)
            if tool is not None:
                contexts[i] += list(tool.ids)
                still.append(i)
        live = still
    solved = sum(bool(task.verify(e, outs).success) for e, outs in zip(eps, outputs))
    return solved / episodes


def build_teacher(task: Task, *, seed: int, recipe: TeacherRecipe = TeacherRecipe()) -> tuple[GPT, dict[str, Any]]:
    """Build and train the teacher for ``task`` from ``seed``; returns it (in eval mode) and its
    description (recipe, seed, steps, loss, solve rate, seconds, digest). Raises RuntimeError
    when it does not reach ``recipe.min_solve_rate`` within ``recipe.max_steps``."""
    from ..policy import build_model
    from .warmup import supervised_warmup

    cfg = recipe.loop_config(task.name, seed)
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    torch.set_num_threads(recipe.threads)
    try:
        model = build_model(cfg, task)
        if not isinstance(model, GPT):
            raise ConfigError(f"demo teacher: task {task.name!r} builds a {type(model).__name__}, expected the built-in GPT")
        rates: list[float] = []

        def solved(m: torch.nn.Module) -> bool:
            rates.append(rollout_solve_rate(m, task, episodes=recipe.eval_episodes, seed=seed + EVAL_SEED,
                                            temperature=recipe.temperature))
            log.info("teacher.check", solve_rate=rates[-1], checks=len(rates))
            return rates[-1] >= recipe.target_solve_rate

        metrics = supervised_warmup(model, task, cfg, stop=solved, check_every=recipe.check_every)
        if not rates or metrics["warmup/steps"] % recipe.check_every:
            solved(model)  # the last steps ran after the last measurement
    finally:
        torch.set_num_threads(threads)
    model.eval()
    seconds = time.perf_counter() - t0
    if rates[-1] < recipe.min_solve_rate:
        raise RuntimeError(
            f"demo teacher: solve rate {rates[-1]:.3f} on task {task.name!r} after {int(metrics['warmup/steps'])} steps "
            f"(seed {seed}), expected >= {recipe.min_solve_rate}; raise TeacherRecipe.max_steps or lr")
    meta = {
        "format": META_FORMAT, "task": task.name, "seed": seed, "recipe": dataclasses.asdict(recipe),
        "steps": int(metrics["warmup/steps"]), "loss": metrics["warmup/loss"], "solve_rate": rates[-1],
        "solve_rates": rates, "seconds": round(seconds, 3), "digest": state_dict_digest(model),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    log.info("teacher.built", **{k: v for k, v in meta.items() if k not in ("recipe", "solve_rates")})
    return model, meta


def teacher_path(run_dir: str | Path) -> Path:
    """Where a run keeps its teacher's weights (``<run>/teacher/policy.pt``)."""
    return Path(run_dir) / TEACHER_DIR / TEACHER_FILE


def ensure_teacher(run_dir: str | Path, task: Task, *, seed: int, recipe: TeacherRecipe = TeacherRecipe()) -> tuple[Path, dict[str, Any]]:
    """The run's teacher: ``(<run>/teacher/policy.pt, its description)``, built on first use
    (:func:`build_teacher`) and written atomically with ``teacher.json``. A cached teacher is
    reused only if it was built for the same task, seed and recipe and its weights still have
    the recorded digest; a mismatch raises rather than silently rebuilding another teacher
    under a run that already used one."""
    target = Path(run_dir) / TEACHER_DIR
    want = {"format": META_FORMAT, "task": task.name, "seed": seed, "recipe": dataclasses.asdict(recipe)}
    if not (target / TEACHER_META).is_file():
        model, meta = build_teacher(task, seed=seed, recipe=recipe)

        def write(tmp: Path) -> None:
            tmp.mkdir(parents=True)
            save_state({"format": "agentlog.weights.v1", "model": model.state_dict(),
                        "model_config": dataclasses.asdict(model.config)}, tmp / TEACHER_FILE)
            (tmp / TEACHER_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

        write_dir_atomically(target, write, replace=False)
    meta = load_teacher_meta(target)
    found = {k: meta.get(k) for k in want}
    if found != want:
        raise ConfigError(f"{target}: holds a teacher built for {found}, expected {want}; use another run folder")
    state, config = read_policy(target / TEACHER_FILE)
    digest = state_dict_digest(GPT.from_state_dict(state, config))
    if digest != meta["digest"]:
        raise ConfigError(f"{target / TEACHER_FILE}: weights digest {digest}, expected {meta['digest']} (teacher.json); "
                          "the file was changed after it was built")
    return target / TEACHER_FILE, meta


def load_teacher_meta(directory: str | Path) -> dict[str, Any]:
    """The description ``teacher.json`` of a run's teacher directory."""
    path = Path(directory) / TEACHER_META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the teacher's description: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise ConfigError(f"{path}: expected a {META_FORMAT} description, found {str(meta)[:80]!r}")
    return meta


def with_teacher(cfg: LoopConfig, teacher: str | Path, coef: float = DEMO_DISTILL_COEF, *, topk: int = DEMO_TOPK,
                 topk_coef: float = DEMO_TOPK_COEF) -> LoopConfig:
    """``cfg`` distilling the built-in GPT teacher at ``teacher`` (a policy file): a ``[distill]``
    table with that one in-process teacher and ``coef`` as the learner's ``distill_coef``; with
    ``topk`` the teacher also sends its top-K tokens, and ``topk_coef`` weighs the learner's
    top-K forward KL term (``distill_topk_coef``)."""
    values = cfg.to_dict()
    values["distill"] = {**values.get("distill", {}), "teachers": [{"name": TEACHER_NAME, "checkpoint": str(Path(teacher).resolve())}],
                         "coef": coef, "topk": topk}
    if topk_coef:
        values["learner"] = {**values["learner"], "distill_topk_coef": topk_coef}
    return LoopConfig.from_dict(values)


def demo_teacher_config(cfg: LoopConfig, run_dir: str | Path, coef: float = DEMO_DISTILL_COEF) -> LoopConfig:
    """What `agentlog demo --distill` runs: the run's teacher built (or found) in ``<run>/teacher``
    for ``cfg``'s task and seed, and ``cfg`` distilling it with lambda ``coef``."""
    from agentlog.engine.tasks import select_task

    path, meta = ensure_teacher(run_dir, select_task(cfg.task), seed=cfg.seed)
    log.info("teacher.ready", path=str(path), digest=meta["digest"], solve_rate=meta["solve_rate"],
             build_seconds=meta["seconds"])
    return with_teacher(cfg, path, coef)
