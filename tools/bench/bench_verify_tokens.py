"""Benchmark: ``verify-tokens`` in process on the tiny Hugging Face model.

The workload is a log of multi-turn chat sessions recorded from the tiny model
(:func:`agentlog.learner.hf_tiny.build_tiny_hf`, built in code): each turn's prompt is
the model's chat template over the conversation so far, its output sampled by the model
(``HFCausalLM.sample``, log-probs recorded), the next user message a tool result. Then,
in one run:

* **ours**: :func:`agentlog.loop.token_check.verify_turns` over the turns read back from
  the log (``collect_turns``: read, delta turns expanded), each turn retokenized through
  the chat template and scored by :class:`agentlog.loop.model_scorer.ModelScorer`, wall time;
* **anchor**: the scoring forward passes alone (``ModelScorer.score_batch`` over the same
  turns, already in memory, sorted by length as ours sorts them): what any re-feed costs at
  the least.

It ends with ``GOAL verify_tokens_turns_per_s_in_process`` (goal >= 200 turns/s), the
anchor's rate and the max log-prob difference printed beside it.

Usage: ``python -m agentlog.tools.bench.bench_verify_tokens [--quick] [--sessions N] [--turns T] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from agentlog.events import FileLog, read_log
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.tools.bench.goals import goal_line, meets

TEMPERATURE = 1.0
NEW_TOKENS = 24


def record_sessions(log_dir: Path, model_dir: Path, sessions: int, turns: int, seed: int) -> int:
    """Write ``sessions`` chat sessions of ``turns`` turns each, sampled from the tiny model;
    returns the number of turns written."""
    from agentlog.gateway.chat import HFChatTemplate
    from agentlog.learner.hf_model import HFCausalLM

    model = HFCausalLM(model_dir).eval()
    template = HFChatTemplate.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    convs = [[{"role": "system", "content": "You are a coding agent."},
              {"role": "user", "content": f"fix the failing test in module_{i}.py"}] for i in range(sessions)]
    bodies: list[list] = [[SessionOpened(group_id=f"g{i // 8}", group_size=8, sample_index=i % 8), SessionStarted()]
                          for i in range(sessions)]
    written = 0
    for t in tqdm(range(turns), desc="record", unit="turn-batch"):
        prompts = [template.encode_prompt(c, []) for c in convs]
        with torch.no_grad():
            out = model.sample(prompts, NEW_TOKENS, temperature=TEMPERATURE, generator=gen)
        for i, conv in enumerate(convs):
            ids, lps = out.tokens[i].tolist(), out.log_probs[i].tolist()
            text = template.decode(ids)
            bodies[i].append(TurnRecorded(
                turn_index=t, messages=list(conv), prompt_ids=prompts[i], output_ids=ids, output_log_probs=lps,
                finish_reason=out.finish_reasons[i] if out.finish_reasons[i] != "abort" else "length",
                response_message={"role": "assistant", "content": text},
                sampling={"temperature": TEMPERATURE, "top_p": 1.0, "top_k": -1},
            ))
            conv.append({"role": "assistant", "content": text})
            conv.append({"role": "user", "content": f"exit code {rng.randrange(3)}: {'ok' if rng.random() < 0.5 else 'FAILED'}"})
            written += 1
    with FileLog.open(log_dir) as log:
        for i, b in enumerate(bodies):
            b.append(SessionFinished(reward=float(i % 2)))
            log.append_batch([(f"s{i:05d}", k, body) for k, body in enumerate(b)])
    return written


def main(argv: list[str] | None = None) -> int:
    """Record, verify, time; print the GOAL line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller log (a smoke run; the GOAL line still prints)")
    p.add_argument("--sessions", type=int, default=None)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None,
                   help="write the tiny model and the log under this directory, kept (default: a temporary one, removed)")
    args = p.parse_args(argv)
    sessions = args.sessions or (16 if args.quick else 128)
    from agentlog.learner.hf_tiny import build_tiny_hf
    from agentlog.loop.model_scorer import ModelScorer, run_template
    from agentlog.loop.token_check import collect_turns, verify_turns
    from agentlog.learner.hf_model import HFCausalLM

    with contextlib.ExitStack() as cleanup:
        root = args.dir if args.dir is not None else Path(cleanup.enter_context(tempfile.TemporaryDirectory()))
        model_dir = build_tiny_hf(root / "model")
        written = record_sessions(root / "log", model_dir, sessions, args.turns, args.seed)
        scorer = ModelScorer(HFCausalLM(model_dir), run_template(None, None, str(model_dir)))

        t0 = time.perf_counter()
        turns = collect_turns(read_log(root / "log"))
        report = asyncio.run(verify_turns(turns, lambda _v: scorer, engine="in-process"))
        ours = time.perf_counter() - t0
        assert report.turns_checked == written, (report.turns_checked, written)

        items = sorted(((t.prompt, t.output, t.temperature) for t in turns), key=lambda it: len(it[0]) + len(it[1]))
        async def forwards() -> None:
            # In a worker thread, as verify_turns runs them: measured here, the same forwards
            # take 2.5x as long on the main thread (torch's intra-op threads).
            for lo in range(0, len(items), 64):
                await asyncio.to_thread(scorer.score_batch, items[lo : lo + 64])

        t0 = time.perf_counter()
        asyncio.run(forwards())
        anchor = time.perf_counter() - t0

    tokens = sum(len(t.output) for t in turns)
    context = sum(len(t.prompt) for t in turns) / len(turns)
    print(f"{written} turns ({sessions} sessions x {args.turns}), {tokens:,} output tokens, mean prompt {context:.0f} tokens")
    print(f"  verify-tokens (read, expand, retokenize, score, compare): {ours:.2f} s = {written / ours:,.0f} turns/s")
    print(f"  anchor, the scoring forward passes alone:                 {anchor:.2f} s = {written / anchor:,.0f} turns/s")
    print(f"  max |log-prob diff| {report.lp_max_abs_diff:.3g} (tolerance {report.tolerance:g}); retokenized "
          f"{report.retok_checked}, differ {report.retok_mismatched}; verdict {'OK' if report.ok else 'MISMATCH'}")
    print(f"  ours / anchor: {anchor / ours:.2f}x the forwards' rate")
    rate = written / ours
    print(goal_line("verify_tokens_turns_per_s_in_process", f"{rate:,.0f} turns/s", ">=", "200", meets(rate, ">=", 200)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
