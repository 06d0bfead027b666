"""Benchmark: the learner step with packing vs padding, and the loss vs a plain reference.

Samples look like agent rollouts: prompt lengths around 100 tokens and
response lengths drawn log-normal (median ~150 tokens, a long tail clipped at
1,500), in groups of 8 with binary rewards. In one run it measures:

* tokens/s of a full ``Learner.step`` (batching, forward, backward, optimiser)
  on the built-in GPT with packing vs with padding (same samples, same
  micro-batch budget), and the padding waste of each layout;
* ``learner.loss.total_loss`` (forward + backward) against a straightforward
  reference implementation of the same loss and diagnostics (clip fraction,
  approximate KL, ...) written below, on the same tensors, with default
  settings and with every extra on;
* the same for a Hugging Face ``LlamaForCausalLM`` (4 layers, width 256,
  built from a config in code) behind ``HFCausalLM``: Learner-step tokens/s
  packed (block-diagonal 4-D masks, position ids restarting per sample) vs
  padded, and the learner's whole loss path on one micro-batch
  (``token_log_probs`` with entropy + ``total_loss``, forward + backward)
  against a plain masked cross-entropy forward + backward of the same model
  on the same batch (needs ``transformers``; skipped with a note without it).

Timings are CPU seconds of this process (``time.process_time``), by default
on one torch thread, and the fastest of interleaved repeats: on a shared
machine other tenants stretch wall time arbitrarily (and make OpenMP threads
spin), but barely change the CPU time a computation needs. Throughput is
therefore tokens per CPU second.

Usage: ``python tools/bench/bench_learner.py [--quick] [--samples N] [--threads T]``; every size
has its own option (``--help``), for a smoke run far below ``--quick``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import structlog
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentlog.learner.config import LearnerConfig  # noqa: E402
from agentlog.learner.learner import Learner  # noqa: E402
from agentlog.learner.loss import LossInputs, total_loss  # noqa: E402
from agentlog.learner.model import GPT, GPTConfig  # noqa: E402
from agentlog.reducers.samples import COMPLETED, Sample  # noqa: E402
from agentlog.tools.bench.goals import goal_line, meets  # noqa: E402

VOCAB = 512
MAX_LEN = 1664


def rollout_samples(n: int, rng: np.random.Generator) -> list[Sample]:
    """Agent-like samples: log-normal response lengths with a long tail."""
    out = []
    for i in range(n):
        p = int(np.clip(rng.normal(100, 30), 16, 160))
        r = int(np.clip(rng.lognormal(np.log(150), 0.9), 8, 1500))
        mask = np.ones(r, dtype=np.uint8)
        # tool output inside the response: context, not trained
        if r > 40:
            a = int(rng.integers(10, r - 20))
            mask[a : a + int(rng.integers(5, 20))] = 0
        out.append(Sample(
            group_id=f"g{i // 8}", session_id=f"s{i}", sample_index=i % 8,
            tokens=rng.integers(0, VOCAB, p + r).astype("<i4").tobytes(), response_length=r,
            loss_mask=mask.tobytes(), rollout_log_probs=(-rng.random(r) * 4).astype("<f4").tobytes(),
            reward=float(rng.integers(0, 2)), status=COMPLETED,
        ))
    return out


def reference_loss(lp, old, adv, mask, rollout=None, ref=None, entropy=None, *, eps_lo=0.2, eps_hi=0.28,
                   dual=None, tis=None, kl_coef=0.0, ent_coef=0.0):
    """The same loss and diagnostics written the obvious way (token mean, cleanrl-style
    masked means), without row removal, validation or micro-batch denominators."""
    n = mask.sum().clamp(min=1)

    def mean(x):
        return (x * mask).sum() / n

    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    a = adv.unsqueeze(-1)
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(1 - eps_lo, 1 + eps_hi)
    loss_tok = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": mean((clipped > unclipped).float()).detach()}
    if dual is not None:
        metrics["dual_clip_frac"] = mean(((a < 0) & (-a * dual < loss_tok)).float()).detach()
        loss_tok = torch.where(a < 0, torch.minimum(loss_tok, -a * dual), loss_tok)
    if tis is not None:
        w = torch.exp(old - rollout)
        metrics["tis_clip_frac"] = mean((w > tis).float())
        loss_tok = loss_tok * w.clamp(max=tis)
    loss = mean(loss_tok)
    if ref is not None:
        x = lp - ref
        kl = mean(torch.exp(-x) - 1 + x)
        metrics["kl"] = kl.detach()
        loss = loss + kl_coef * kl
    if entropy is not None:
        ent = mean(entropy)
        metrics["entropy"] = ent.detach()
        loss = loss - ent_coef * ent
    metrics["approx_kl"] = mean((ratio - 1) - log_ratio).detach()
    return loss, metrics


def timed(fn) -> float:
    """CPU seconds the call took (all torch threads together)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def bench_step(samples, repeats: int, d_model: int, n_layer: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=4, d_model=d_model, max_seq_len=MAX_LEN))
    state = {k: v.clone() for k, v in base.state_dict().items()}
    learners = {}
    for name, packing in (("packing", True), ("padding", False)):
        m = GPT(base.config)
        m.load_state_dict(state)
        learners[name] = Learner(m, LearnerConfig(packing=packing, max_tokens_per_batch=16384, lr=1e-5))
    times = {name: [] for name in learners}
    metrics = {}
    for name, lrn in learners.items():  # warm-up
        metrics[name] = lrn.step(samples)
    for _ in tqdm(range(repeats), desc="learner step", leave=False):
        for name, lrn in learners.items():
            times[name].append(timed(lambda: metrics.__setitem__(name, lrn.step(samples))))
    out = {}
    for name in learners:
        t = min(times[name])
        out[name] = {
            "step_s": t,
            "tokens_per_s": metrics[name]["perf/tokens"] / t,
            "waste": metrics[name]["perf/padding_waste"],
            "padded": metrics[name]["perf/padded_tokens"],
            "tokens": metrics[name]["perf/tokens"],
        }
    return out


def hf_llama(layers: int = 4, width: int = 256):
    """A random LlamaForCausalLM of the given size behind HFCausalLM (eager-free SDPA attention)."""
    import transformers

    from agentlog.learner.hf_model import HFCausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=int(width * 8 / 3) // 64 * 64,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=2048, tie_word_embeddings=False)
    return HFCausalLM(transformers.LlamaForCausalLM(cfg))


def bench_hf_step(samples, repeats: int, layers: int, width: int) -> dict[str, dict[str, float]]:
    """Learner.step tokens per CPU second on the HF Llama, packed vs padded."""
    import copy

    base = hf_llama(layers, width)
    learners = {name: Learner(copy.deepcopy(base), LearnerConfig(packing=packing, max_tokens_per_batch=8192, lr=1e-5))
                for name, packing in (("packing", True), ("padding", False))}
    times = {name: [] for name in learners}
    metrics = {name: lrn.step(samples) for name, lrn in learners.items()}  # warm-up
    for _ in tqdm(range(repeats), desc="HF learner step", leave=False):
        for name, lrn in learners.items():
            times[name].append(timed(lambda: metrics.__setitem__(name, lrn.step(samples))))
    return {name: {"step_s": min(times[name]), "tokens_per_s": metrics[name]["perf/tokens"] / min(times[name]),
                   "waste": metrics[name]["perf/padding_waste"], "padded": metrics[name]["perf/padded_tokens"],
                   "tokens": metrics[name]["perf/tokens"]} for name in learners}


def bench_hf_loss(samples, repeats: int, layers: int, width: int) -> tuple[float, float]:
    """(ours, reference) CPU seconds of one packed micro-batch's forward + backward on the HF Llama:
    the learner's token_log_probs (with entropy) + total_loss vs a plain masked cross-entropy."""
    import torch.nn.functional as F

    from agentlog.learner.batching import make_batches
    from agentlog.learner.model import token_log_probs

    model = hf_llama(layers, width)
    adv = np.random.default_rng(2).standard_normal(len(samples)).astype(np.float32)
    (batch,) = make_batches(samples, adv, packing=True, max_tokens_per_batch=1 << 30)
    config = LearnerConfig()

    def ours():
        model.zero_grad(set_to_none=True)
        lp, ent = token_log_probs(model, batch, with_entropy=True)
        inputs = LossInputs(lp, lp.detach(), batch.advantages, batch.loss_mask, entropy=ent.detach(),
                            rollout_log_probs=batch.rollout_log_probs)
        loss, _ = total_loss(inputs, config)
        loss.backward()

    def plain():
        model.zero_grad(set_to_none=True)
        logits = model(batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask)
        picked = logits.reshape(-1, logits.shape[-1])[batch.predict_index].float()
        w = batch.loss_mask.reshape(-1)[batch.slots]
        loss = (F.cross_entropy(picked, batch.targets, reduction="none") * w).sum() / w.sum().clamp(min=1)
        loss.backward()

    ours(), plain()  # warm-up
    t_ours, t_ref = [], []
    for _ in tqdm(range(repeats), desc="HF loss", leave=False):
        t_ours.append(timed(ours))
        t_ref.append(timed(plain))
    return min(t_ours), min(t_ref)


def bench_loss(n: int, length: int, repeats: int) -> dict[str, tuple[float, float]]:
    g = torch.Generator().manual_seed(1)
    lp0 = -torch.rand(n, length, generator=g) * 3
    old = lp0 + torch.randn(n, length, generator=g) * 0.1
    rollout = old + torch.randn(n, length, generator=g) * 0.1
    ref = old + torch.randn(n, length, generator=g) * 0.1
    ent0 = torch.rand(n, length, generator=g)
    lens = torch.clamp(torch.exp(torch.randn(n, generator=g) * 0.9) * length / 4, 1, length).long()
    mask = (torch.arange(length)[None, :] < lens[:, None]).float()
    adv = torch.randn(n, generator=g)

    cases = {  # (our inputs, our config, the reference's arguments)
        "default": (dict(), LearnerConfig(), dict()),
        "all extras": (
            dict(rollout_log_probs=rollout, ref_log_probs=ref),
            LearnerConfig(dual_clip=3.0, tis_cap=2.0, kl_coef=0.01, kl_type="k3", entropy_coef=0.001),
            dict(dual=3.0, tis=2.0, kl_coef=0.01, ent_coef=0.001, rollout=rollout, ref=ref),
        ),
    }
    results = {}
    for case, (ours_kw, config, ref_kw) in cases.items():
        extras = case != "default"
        lp = lp0.clone().requires_grad_(True)
        ent = ent0.clone().requires_grad_(True)

        def ours():
            loss, _ = total_loss(LossInputs(lp, old, adv, mask, entropy=ent if extras else None, **ours_kw), config)
            loss.backward()
            return loss

        def plain():
            loss, _ = reference_loss(lp, old, adv, mask, entropy=ent if extras else None, **ref_kw)
            loss.backward()
            return loss

        a, b = ours(), plain()
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            raise SystemExit(f"bench_learner: loss mismatch in case {case!r}: ours {a.item()} vs reference {b.item()}")
        t_ours, t_ref = [], []
        for _ in tqdm(range(repeats), desc=f"loss ({case})", leave=False):
            t_ours.append(timed(ours))
            t_ref.append(timed(plain))
        results[case] = (min(t_ours), min(t_ref))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (CI smoke)")
    ap.add_argument("--samples", type=int, default=None, help="samples per learner step (default 64, quick 24)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; CPU time adds up over threads)")
    sizes = ap.add_argument_group("sizes (each defaults to the full run's, or --quick's)")
    sizes.add_argument("--step-repeats", type=int, default=None, help="timed learner steps per layout (default 3, quick 2)")
    sizes.add_argument("--d-model", type=int, default=None, help="width of the built-in GPT (default 128, quick 64)")
    sizes.add_argument("--layers", type=int, default=None, help="blocks of the built-in GPT (default 2)")
    sizes.add_argument("--loss-rows", type=int, default=None, help="rows of the loss benchmark (default 256, quick 64)")
    sizes.add_argument("--loss-length", type=int, default=None, help="tokens per row of the loss benchmark (default 1024, quick 256)")
    sizes.add_argument("--loss-repeats", type=int, default=None, help="timed loss calls per case (default 60, quick 10)")
    sizes.add_argument("--hf-samples", type=int, default=None, help="samples of the HF Learner step (default 32, quick 12)")
    sizes.add_argument("--hf-layers", type=int, default=None, help="layers of the HF Llama (default 4, quick 2)")
    sizes.add_argument("--hf-width", type=int, default=None, help="width of the HF Llama (default 256, quick 128)")
    sizes.add_argument("--hf-loss-repeats", type=int, default=None, help="timed HF loss-path calls (default 5, quick 3)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    def size(given: int | None, quick: int, full: int) -> int:
        """An option's value, else the --quick or the full run's."""
        return given if given is not None else quick if args.quick else full

    n = args.samples or (24 if args.quick else 64)
    step_repeats = size(args.step_repeats, 2, 3)
    loss_repeats = size(args.loss_repeats, 10, 60)
    d_model, n_layer = size(args.d_model, 64, 128), size(args.layers, 2, 2)
    samples = rollout_samples(n, np.random.default_rng(0))
    lengths = np.array([s.response_length for s in samples])

    step = bench_step(samples, step_repeats, d_model, n_layer)
    loss = bench_loss(size(args.loss_rows, 64, 256), size(args.loss_length, 256, 1024), loss_repeats)
    try:
        import transformers  # noqa: F401
    except ImportError:
        hf_step = hf_loss = None
    else:
        hf_layers, hf_width = size(args.hf_layers, 2, 4), size(args.hf_width, 128, 256)
        hf_samples = samples[: size(args.hf_samples, 12, 32)]
        hf_step = bench_hf_step(hf_samples, step_repeats, hf_layers, hf_width)
        hf_loss = bench_hf_loss(hf_samples[:8], size(args.hf_loss_repeats, 3, 5), hf_layers, hf_width)

    print(f"learner step: {n} samples, response length median {int(np.median(lengths))}, "
          f"p90 {int(np.percentile(lengths, 90))}, max {lengths.max()}; GPT d_model {d_model}, {n_layer} layers, "
          f"vocab {VOCAB}; {args.threads} threads")
    print(f"{'layout':<10} {'tokens':>8} {'padded':>8} {'waste':>7} {'CPU s':>8} {'tokens/CPU-s':>13}")
    for name, r in step.items():
        print(f"{name:<10} {int(r['tokens']):>8} {int(r['padded']):>8} {r['waste']:>7.1%} "
              f"{r['step_s']:>8.3f} {r['tokens_per_s']:>13.0f}")
    print()
    print(f"{'policy loss (fwd+bwd)':<24} {'ours CPU ms':>12} {'reference CPU ms':>17} {'ratio':>6}")
    for case, (t_ours, t_ref) in loss.items():
        print(f"{case:<24} {t_ours * 1e3:>12.2f} {t_ref * 1e3:>17.2f} {t_ours / t_ref:>6.2f}")
    print()
    if hf_step is None:
        print("HF Llama: skipped (transformers is not installed: pip install 'agentlog[hf]')")
    else:
        print(f"HF LlamaForCausalLM ({hf_layers} layers, width {hf_width}, SDPA): Learner.step on {len(hf_samples)} samples")
        print(f"{'layout':<10} {'tokens':>8} {'padded':>8} {'waste':>7} {'CPU s':>8} {'tokens/CPU-s':>13}")
        for name, r in hf_step.items():
            print(f"{name:<10} {int(r['tokens']):>8} {int(r['padded']):>8} {r['waste']:>7.1%} "
                  f"{r['step_s']:>8.3f} {r['tokens_per_s']:>13.0f}")
        print(f"one packed micro-batch, fwd+bwd: policy loss path {hf_loss[0] * 1e3:.1f} CPU ms, "
              f"plain cross-entropy {hf_loss[1] * 1e3:.1f} CPU ms")
    print()
    speedup = step["packing"]["tokens_per_s"] / step["padding"]["tokens_per_s"]
    ratio = loss["default"][0] / loss["default"][1]
    print(goal_line("packing_speedup", f"{speedup:.2f}x", ">=", "1.5x", meets(speedup, ">=", 1.5)))
    print(goal_line("loss_vs_reference", f"{ratio:.2f}x", "<=", "1.1x", meets(ratio, "<=", 1.1)))
    if hf_step is not None:
        hf_speedup = hf_step["packing"]["tokens_per_s"] / hf_step["padding"]["tokens_per_s"]
        hf_ratio = hf_loss[0] / hf_loss[1]
        print(goal_line("hf_packing_speedup", f"{hf_speedup:.2f}x", ">=", "1.5x", meets(hf_speedup, ">=", 1.5)))
        print(goal_line("hf_policy_loss_overhead", f"{hf_ratio:.2f}x", "<=", "1.1x", meets(hf_ratio, "<=", 1.1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
