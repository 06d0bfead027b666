"""The model interface, a small built-in GPT, and per-token log-probs.

Interface: any ``torch.nn.Module`` that maps token ids ``(B, T)`` to logits
``(B, T, V)``. Padded batches call ``model(input_ids)`` only (right padding
plus causal attention needs nothing else). Packed batches also pass
``position_ids`` ``(B, T)`` and ``attention_mask`` ``(B, T, T)`` (bool, True
where a query may attend to a key: block-diagonal and causal), so a model
must accept those keywords to be trained with packing. A model whose class
sets ``packs_by_position_ids = True`` gets ``position_ids`` alone and keeps
attention within each run of positions that starts at 0 (as flash-attention's
variable-length kernels do); the built-in GPT does, and so never pays for a
dense T x T mask.

The built-in `GPT` serves the tests and the demo. It ties its input and
output embeddings by default: in the lookup task of the demo untied runs
collapsed or stalled. `GPT.sample` generates batches with a KV cache and
returns the sampled tokens together with their log-probs. By default
(``GPT.batch_invariant``) sampling and the training forward share one
numeric path (:mod:`agentlog.learner.batch_invariant`), so the learner
reproduces the recorded log-probs bit for bit at the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from agentlog.learner import batch_invariant

if TYPE_CHECKING:
    from agentlog.learner.batching import Batch


@dataclass
class GPTConfig:
    """Shape of the built-in GPT."""

    vocab_size: int = 64
    """Number of token ids."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    d_model: int = 64
    """Width of the residual stream (divisible by n_head)."""
    max_seq_len: int = 256
    """Longest sequence (positions) the model can see."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}: expected an integer >= 1, got {getattr(self, name)}")


class _KVCache:
    """Preallocated keys and values per layer, written in place while decoding."""

    def __init__(self, n_layer: int, batch: int, n_head: int, length: int, head_dim: int, like: torch.Tensor):
        shape = (batch, n_head, length, head_dim)
        self.k = [like.new_zeros(shape) for _ in range(n_layer)]
        self.v = [like.new_zeros(shape) for _ in range(n_layer)]
        self.length = 0  # positions filled so far


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, mask, cache: _KVCache | None, layer: int, plan: "_VarlenPlan | None" = None):
        B, T, D = x.shape
        H = self.n_head
        if plan is not None:
            return self.proj(plan.attend(self.qkv(x), H))
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            start = cache.length
            cache.k[layer][:, :, start : start + T] = k
            cache.v[layer][:, :, start : start + T] = v
            k = cache.k[layer][:, :, : start + T]
            v = cache.v[layer][:, :, : start + T]
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class _VarlenPlan:
    """Causal attention within each packed sample only, at the cost of the samples' own lengths.

    A dense block-diagonal mask makes every packed row pay T^2 attention and
    forbids skipping masked blocks. Instead the segments (runs of positions
    starting at 0) are sorted by length and cut into buckets of similar
    length; each bucket is gathered into a right-padded batch and attended
    with plain causal attention, and one gather puts the outputs back.
    """

    def __init__(self, position_ids: torch.Tensor, ratio: float = 0.7) -> None:
        B, T = position_ids.shape
        device = position_ids.device
        is_start = (position_ids == 0).clone()
        is_start[:, 0] = True  # every row starts a segment
        starts = torch.nonzero(is_start.reshape(-1)).flatten()
        # One segment per row is plain causal attention: nothing to plan.
        self.trivial = len(starts) == B
        self.buckets: list[torch.Tensor] = []
        if self.trivial:
            return
        ends = torch.cat([starts[1:], torch.tensor([B * T], device=device)])
        ends = torch.minimum(ends, (starts // T + 1) * T)  # a segment never runs over a row end
        lengths = ends - starts
        order = torch.argsort(lengths, descending=True, stable=True)
        starts_l, lengths_l = starts[order].tolist(), lengths[order].tolist()
        where = torch.empty(B * T, dtype=torch.long, device=device)
        base = 0
        for i, j in batch_invariant.length_buckets(lengths_l, ratio):
            top = lengths_l[i]
            st = torch.tensor(starts_l[i:j], device=device)
            ln = torch.tensor(lengths_l[i:j], device=device)
            ar = torch.arange(top, device=device)
            valid = ar[None, :] < ln[:, None]
            idx = st[:, None] + ar[None, :]
            # Padding slots read position 0; under the causal mask no real query sees them.
            self.buckets.append(torch.where(valid, idx, torch.zeros_like(idx)))
            slots = base + torch.arange((j - i) * top, device=device).view(j - i, top)
            where[idx[valid]] = slots[valid]
            base += (j - i) * top
        self.where = where

    def attend(self, qkv: torch.Tensor, n_head: int) -> torch.Tensor:
        """Attention output (B, T, D) for the fused projections ``qkv`` (B, T, 3D)."""
        B, T, D3 = qkv.shape
        D = D3 // 3
        flat = qkv.reshape(B * T, D3)
        outs = []
        for idx in self.buckets:
            n, L = idx.shape
            q, k, v = (t.view(n, L, n_head, D // n_head).transpose(1, 2) for t in flat[idx].split(D, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            outs.append(y.transpose(1, 2).reshape(n * L, D))
        return torch.cat(outs)[self.where].view(B, T, D)


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x, mask, cache, layer, plan=None):
        x = x + self.attn(self.ln1(x), mask, cache, layer, plan)
        return x + self.mlp(self.ln2(x))


def sample_rows(who: str, prompts, temperature: float, max_new_tokens: int, vocab_size: int, max_len: int,
                max_len_name: str) -> list[list[int]]:
    """The prompts of a ``sample`` call as lists of ints, after checking the call's
    arguments: temperature > 0, max_new_tokens >= 1, every prompt non-empty with
    ids in ``[0, vocab_size)``, and the longest prompt + max_new_tokens within
    ``max_len`` (named ``max_len_name`` in the error). Errors name ``who``."""
    if not temperature > 0:
        raise ValueError(f"{who}: temperature must be > 0, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"{who}: max_new_tokens must be >= 1, got {max_new_tokens}")
    rows = [list(map(int, p)) for p in (prompts.tolist() if torch.is_tensor(prompts) else prompts)]
    for i, p in enumerate(rows):
        if not p:
            raise ValueError(f"{who}: prompt {i} is empty; it needs at least one token")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{who}: prompt {i} has token ids {bad[:5]} outside [0, {vocab_size})")
    longest = max((len(p) for p in rows), default=0)
    if rows and longest + max_new_tokens > max_len:
        raise ValueError(f"{who}: longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds {max_len_name}={max_len}")
    return rows


@dataclass
class Generation:
    """What `GPT.sample` returns, one entry per prompt."""

    tokens: list[np.ndarray] = field(default_factory=list)
    """Generated token ids (int32), stop token included."""
    log_probs: list[np.ndarray] = field(default_factory=list)
    """Log-prob (float32) of each generated token under the sampling distribution."""
    finish_reasons: list[str] = field(default_factory=list)
    """"stop" if a stop id was generated, "abort" if ``between_steps`` stopped
    the batch while the row was still generating, else "length"."""


def decode(
    logits: torch.Tensor,
    step_logits: "Callable[[torch.Tensor, int], torch.Tensor]",
    max_new_tokens: int,
    temperature: float,
    stop_ids: Sequence[int],
    generator: torch.Generator | None,
    between_steps: "Callable[[int], bool] | None" = None,
) -> Generation:
    """The decode loop of `GPT.sample` and `HFCausalLM.sample`.

    ``logits`` ``(B, V)``: the last prompt position's; ``step_logits(tok,
    step)`` feeds the tokens ``tok`` ``(B,)`` sampled at ``step`` through the
    model's cache and returns the logits of the next position. Each row stops
    after one of ``stop_ids`` (included) or ``max_new_tokens``; log-probs are
    those of ``log_softmax(logits / temperature)``.

    The draw happens where ``generator`` lives (the callers keep a CPU
    generator, seeded per worker, whatever the model's device): torch
    refuses a CPU generator for a CUDA draw, and drawing on one device keeps
    a seed's samples the same on CPU and GPU. Everything else stays on the
    model's device.

    ``between_steps(n)``, when given, runs at each token boundary (``n``
    tokens generated, before the next position is computed): it may change
    the model's weights in place (the cache keeps what earlier weights
    computed: continue in place), and returning True stops the batch there,
    the rows still generating finishing ``"abort"`` (to be resubmitted)."""
    device = logits.device
    B = logits.shape[0]
    draw_on = generator.device if generator is not None else device
    out_tok = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)
    out_lp = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    n_out = torch.zeros(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stopped = torch.zeros(B, dtype=torch.bool, device=device)
    stop = torch.tensor(sorted({int(s) for s in stop_ids}), dtype=torch.long, device=device)
    interrupted = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        tok = torch.multinomial(logp.exp().to(draw_on), 1, generator=generator).squeeze(1).to(device)
        live = ~done
        out_tok[live, step] = tok[live]
        out_lp[live, step] = logp.gather(1, tok[:, None]).squeeze(1)[live]
        n_out += live.long()
        if len(stop):
            hit = live & torch.isin(tok, stop)
            stopped |= hit
            done |= hit
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if between_steps is not None and between_steps(step + 1):
            interrupted = ~done
            break
        logits = step_logits(tok, step)
    gen = Generation()
    for i in range(B):
        n = int(n_out[i])
        gen.tokens.append(out_tok[i, :n].to(torch.int32).cpu().numpy())
        gen.log_probs.append(out_lp[i, :n].cpu().numpy())
        gen.finish_reasons.append("stop" if bool(stopped[i]) else "abort" if bool(interrupted[i]) else "length")
    return gen


class GPT(nn.Module):
    """A small pre-LayerNorm decoder-only transformer with learned positions."""

    #: Packed batches may be passed as position_ids alone: attention then stays
    #: within each run of positions that starts at 0 (the flash-attention
    #: "varlen" convention), computed at the cost of the samples' own lengths.
    packs_by_position_ids = True
    #: Sample and score through the batch-invariant kernels (:mod:`.batch_invariant`): a token's
    #: log-prob is then the same bit for bit in `sample` and in a training forward. False: torch's
    #: attention and one product per linear layer (faster; used by the demo's supervised warm-up).
    batch_invariant = True

    def __init__(self, config: GPTConfig | None = None, **overrides) -> None:
        super().__init__()
        if config is None:
            config = GPTConfig(**overrides)
        elif overrides:
            raise ValueError("GPT: pass either a GPTConfig or keyword overrides, not both")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # GPT-2's scaled init of the residual projections keeps the stream stable.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], config: dict | None = None) -> "GPT":
        """A GPT holding ``state``. Its shape is read from the tensors' shapes,
        and ``config`` (``GPTConfig`` fields as a dict) overrides it: the head
        count cannot be read from the weights and is otherwise the default
        (``GPTConfig.n_head``)."""
        try:
            vocab, width = state["tok_emb.weight"].shape
            n_layer = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
            shape = {
                "vocab_size": int(vocab), "d_model": int(width), "n_layer": n_layer,
                "max_seq_len": int(state["pos_emb.weight"].shape[0]),
                "mlp_ratio": int(state["blocks.0.mlp.0.weight"].shape[0]) // int(width),
                "tie_embeddings": "lm_head.weight" not in state or torch.equal(state["lm_head.weight"], state["tok_emb.weight"]),
            }
        except (KeyError, ValueError, IndexError, AttributeError) as exc:
            raise ValueError(f"GPT.from_state_dict: not the built-in GPT's weights (no {exc} of the expected shape)") from None
        model = cls(GPTConfig(**{**shape, **(config or {})}))
        model.load_state_dict(state)
        return model

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, T, V)`` for token ids ``(B, T)``.

        ``position_ids`` (B, T) restart at 0 for every packed sample;
        ``attention_mask`` (B, T, T) bool, True where query t may attend to
        key s. With position_ids and no mask, attention is causal within each
        run of positions starting at 0; with neither, plainly causal.
        With ``batch_invariant`` (and no mask) the batch-invariant path computes them.
        """
        if self.batch_invariant and attention_mask is None:
            return batch_invariant.logits(self, input_ids, position_ids)
        plan = None
        if position_ids is not None and attention_mask is None:
            plan = _VarlenPlan(position_ids)
            if plan.trivial:
                plan = None
        return self._run(input_ids, position_ids, attention_mask, None, plan)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings (ValueError for a position past ``max_seq_len``):
        the input of both numeric paths."""
        if positions.numel() and int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(f"GPT: position {int(positions.max())} is beyond max_seq_len={self.config.max_seq_len}")
        return self.tok_emb(ids) + self.pos_emb(positions)

    def _run(self, input_ids, position_ids, attention_mask, cache, plan=None):
        B, T = input_ids.shape
        if position_ids is None:
            offset = 0 if cache is None else cache.length
            position_ids = torch.arange(offset, offset + T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids, position_ids)
        for i, block in enumerate(self.blocks):
            x = block(x, attention_mask, cache, i, plan)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[Sequence[int]] | torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        stop_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        between_steps: Callable[[int], bool] | None = None,
    ) -> Generation:
        """Sample continuations of a batch of prompts (any lengths), with a KV cache.

        Each sequence stops after it emits one of ``stop_ids`` (included in
        its tokens) or after ``max_new_tokens``; ``between_steps``: see
        :func:`decode` (a weight update at a token boundary). Log-probs are those of the
        sampling distribution, ``log_softmax(logits / temperature)``: record
        the temperature with the turn (``sampling={"temperature": ...}``) so
        its samples carry it and the learner divides by the same value.
        """
        rows = sample_rows("GPT.sample", prompts, temperature, max_new_tokens, self.config.vocab_size,
                           self.config.max_seq_len, "max_seq_len")
        if not rows:
            return Generation()
        was_training = self.training
        try:
            return self._sample(rows, max_new_tokens, temperature, stop_ids, generator, between_steps)
        finally:
            self.train(was_training)

    def _sample(self, rows: list[list[int]], max_new_tokens: int, temperature: float, stop_ids: Sequence[int],
                generator: torch.Generator | None, between_steps: Callable[[int], bool] | None) -> Generation:
        """:meth:`sample` of checked rows, in eval mode (the caller restores the mode)."""
        self.eval()
        if self.batch_invariant:
            return batch_invariant.sample(self, rows, max_new_tokens, temperature, stop_ids, generator, between_steps)
        lengths = torch.tensor([len(p) for p in rows])
        B, P = len(rows), int(lengths.max())
        total = P + max_new_tokens
        device = self.tok_emb.weight.device
        # Left-pad so every sequence's next token sits in the same column.
        ids = torch.zeros(B, P, dtype=torch.long)
        real = torch.zeros(B, total, dtype=torch.bool)  # which cache columns hold real tokens
        for i, p in enumerate(rows):
            ids[i, P - len(p) :] = torch.tensor(p)
            real[i, P - len(p) : P] = True
        ids, real, lengths = ids.to(device), real.to(device), lengths.to(device)
        pos = (torch.arange(P, device=device) - (P - lengths).unsqueeze(1)).clamp(min=0)
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        # A padding query attends to itself so no softmax row is empty (NaN).
        eye = torch.eye(P, dtype=torch.bool, device=device)
        mask = (causal & real[:, None, :P]) | eye
        cache = _KVCache(self.config.n_layer, B, self.config.n_head, total,
                         self.config.d_model // self.config.n_head, self.tok_emb.weight)
        logits = self._run(ids, pos, mask, cache)[:, -1]
        cache.length = P

        next_pos = lengths.clone()

        def step_logits(tok: torch.Tensor, step: int) -> torch.Tensor:
            real[:, P + step] = True
            logits = self._run(tok[:, None], next_pos[:, None], real[:, None, : P + step + 1], cache)[:, -1]
            cache.length += 1
            next_pos.add_(1)
            return logits

        return decode(logits, step_logits, max_new_tokens, temperature, stop_ids, generator, between_steps)


def token_log_probs(
    model: nn.Module, batch: "Batch", temperature: float | None = None, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(N, L)`` of each sample's response tokens, and optionally their entropy.

    Works on padded and packed batches alike: the logits of the positions that
    predict response tokens are gathered into one row per sample, so the
    result is laid out as the loss expects whatever the packing.

    Log-probs and entropy are those of the sampling distribution,
    ``log_softmax(logits / T)``, with ``T`` each sample's own temperature
    (``batch.temperatures``); a number for ``temperature`` overrides it for
    every sample.
    """
    stats = token_stats(model, batch, temperature, with_entropy=with_entropy)
    return stats.log_probs, stats.entropy


class TokenStats(NamedTuple):
    """What `token_stats` computes, laid out per sample like the loss expects."""

    log_probs: torch.Tensor
    """(N, L) log-probs of the response tokens."""
    entropy: torch.Tensor | None
    """(N, L) entropy of the sampling distribution at each response token (with_entropy)."""
    top_log_probs: torch.Tensor | None
    """(N, L, K) log-probs of the teacher's top-K ids (``batch.teacher_top_ids``; with_top)."""


def token_stats(
    model: nn.Module, batch: "Batch", temperature: float | None = None, *, with_entropy: bool = False,
    with_top: bool = False,
) -> TokenStats:
    """`token_log_probs`, plus (``with_top``) the policy's log-probs of the
    teacher's top-K token ids at each response position, for the top-K
    distillation term (None when the batch carries no top-K data)."""
    if batch.position_ids is None:
        logits = model(batch.input_ids)
    elif getattr(model, "packs_by_position_ids", False):
        logits = model(batch.input_ids, position_ids=batch.position_ids)
    else:
        logits = model(batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask)
    if logits.dim() != 3 or logits.shape[:2] != batch.input_ids.shape:
        raise ValueError(
            f"token_log_probs: model returned logits of shape {tuple(logits.shape)}, "
            f"expected (B, T, V) with (B, T) = {tuple(batch.input_ids.shape)}"
        )
    V = logits.shape[-1]
    N, L = batch.loss_mask.shape
    # Only real response positions go through the softmax: no padding, no prompt.
    picked = logits.reshape(-1, V)[batch.predict_index].float()
    if temperature is not None:
        if temperature != 1.0:
            picked = picked / temperature
    elif batch.temperatures is not None:
        picked = picked / batch.temperatures.unsqueeze(-1)
    logp_all = torch.log_softmax(picked, dim=-1)
    flat = logp_all.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    log_probs = flat.new_zeros(N * L).scatter(0, batch.slots, flat).view(N, L)
    entropy = None
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)
        entropy = ent.new_zeros(N * L).scatter(0, batch.slots, ent).view(N, L)
    top = None
    if with_top and batch.teacher_top_ids is not None:
        ids = batch.teacher_top_ids
        K = ids.shape[-1]
        bad = (ids < 0) | (ids >= V)
        if bool(bad.any()):
            n, pos, k = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"token_stats: teacher top-K id {int(ids[n, pos, k])} of batch row {n} (sample"
                f" {batch.sample_indices[n]}), response position {pos}, is outside the vocabulary [0, {V})"
            )
        at = logp_all.gather(-1, ids.reshape(N * L, K)[batch.slots])
        top = at.new_zeros(N * L, K).index_copy(0, batch.slots, at).view(N, L, K)
    return TokenStats(log_probs, entropy, top)


def __getattr__(name: str):
    """``HFCausalLM`` and ``quiet_transformers`` live in
    :mod:`agentlog.learner.hf_model`; they are still importable from here,
    loaded on first use (that module imports this one)."""
    if name in ("HFCausalLM", "quiet_transformers"):
        from . import hf_model

        return getattr(hf_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
