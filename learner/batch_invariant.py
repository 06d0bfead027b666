"""One numeric path for the built-in GPT's sampling and training: batch-invariant kernels.

A token's log-prob computed while sampling (one new token per row, a KV
cache, as many rows as sessions are waiting) and the same token's log-prob
computed by the learner (whole rows, packed or padded, hundreds of samples
per micro-batch) go through different shapes. CPU kernels choose their
algorithm by shape: a matrix product of 1 to 3 rows (1 to 11 with two
threads, on MKL) accumulates in another order than one of many rows, and
``scaled_dot_product_attention`` blocks queries and keys by the lengths it
is given, so the same query over the same keys gives another rounding in a
longer sequence. Measured before this module: up to 2.6e-6 of absolute
log-prob difference at the same weights (the lookup demo's tokens).

Here every reduction a token's result depends on runs in a shape that does
not depend on the batch, the sequence length or where the token sits
(slime's "true on-policy" mode does the same with batch-invariant GPU
kernels):

* a linear layer's rows are padded to a multiple of :data:`ROW_TILE` and
  multiplied one tile at a time, every product of one shape (:func:`linear`;
  within a product of a given shape a row's result does not depend on the
  other rows, nor on the thread count);
* attention (:func:`attend`) takes :data:`QUERY_TILE` queries at a time
  against blocks of :data:`KEY_BLOCK` keys at their absolute positions,
  every product of one shape; a decoding step's one query is padded to a
  tile for the two products only. The softmax subtracts the row's maximum
  over the keys it sees (exact in any order) and adds the blocks' sums and
  products up in block order, in float64 (:func:`_sum_blocks`): a block a
  query cannot see adds exact zeros, so its result does not depend on how
  many keys follow it;
* layer norms, log-softmax, GELU and exp are row-wise or elementwise
  kernels, invariant already (their inputs stay contiguous: torch computes
  contiguous tails with the same vector code).

Sampling (:func:`sample`) and training (:func:`logits`) both call these, so
the log-probs recorded at rollout are reproduced bit for bit by the
learner's own forward at the same weights and temperature, on the same
machine and torch build, with any thread count
(``tests/learner/test_batch_invariant.py``; ``tools/bench/bench_mismatch.py``).
Verified on CPU (MKL); on a GPU, cuBLAS's choice of kernel by batch count is
not pinned here. The backward pass is torch's own. Small tiles cost long
sequences about 2x the time of torch's fused attention (docs/performance.md).
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence, cast

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from agentlog.learner.model import GPT, Generation, _Block

#: Rows per matrix product of a linear layer.
ROW_TILE = 64
#: Query rows per attention product.
QUERY_TILE = 16
#: Keys per attention product.
KEY_BLOCK = 16


def padded(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)`` for rows ``x`` (M, K): the rows are padded to a multiple of
    :data:`ROW_TILE` and multiplied one tile at a time, every product of the
    same shape, so a row's result depends on that row alone."""
    M, K = x.shape
    tiles = max(1, -(-M // ROW_TILE))
    if M != tiles * ROW_TILE:
        x = torch.cat([x, x.new_zeros(tiles * ROW_TILE - M, K)])
    weight = layer.weight.t().unsqueeze(0).expand(tiles, K, layer.weight.shape[0])
    y = torch.bmm(x.reshape(tiles, ROW_TILE, K), weight).reshape(tiles * ROW_TILE, -1)[:M]
    return y if layer.bias is None else y + layer.bias


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Causal attention, ``(N, Tq, hd)``, batch-invariant.

    ``q`` (N, Tq, hd); ``k``, ``v`` (N, Lk, hd), Lk a multiple of
    :data:`KEY_BLOCK`, key j sitting at position j; ``q_pos`` (N or 1, Tq)
    each query's position: it sees the keys at positions up to its own (key
    0 always, so no row is empty).

    Queries go :data:`QUERY_TILE` at a time (a last tile of fewer, such as a
    decoding step's one query, is padded with zero rows for the two products
    only), against every key block up to the last position asked for. Each
    (tile, block) product has the same shape; the softmax takes the row's
    maximum over every key it sees (exact, whatever the order), and the
    per-block sums and products are added up block after block in order
    (:func:`_sum_blocks`): a block a query cannot see adds exact zeros, so
    nothing depends on how many blocks were computed."""
    N, Tq, hd = q.shape
    tiles = -(-Tq // QUERY_TILE)
    rows = min(Tq, QUERY_TILE)  # rows of each tile the softmax runs on
    if Tq != tiles * QUERY_TILE and tiles > 1:
        raise ValueError(f"batch_invariant.attend: {Tq} queries is neither at most {QUERY_TILE} nor a multiple of it")
    q = _pad_rows(q * (1.0 / math.sqrt(hd)), tiles * QUERY_TILE).reshape(N, tiles, QUERY_TILE, hd)
    pos = q_pos.reshape(q_pos.shape[0], tiles, rows, 1)
    kb = k.reshape(N, -1, KEY_BLOCK, hd)
    vb = v.reshape(N, -1, KEY_BLOCK, hd)
    key_pos = torch.arange(KEY_BLOCK, device=q.device)
    # Up to 8 tiles at a time (the blocks past a chunk's last query are skipped), fewer where
    # the scores of a chunk would pass 2**22 numbers.
    step = max(1, min(8, (1 << 22) // max(1, N * kb.shape[1] * QUERY_TILE * KEY_BLOCK)))
    out = []
    for t0 in range(0, tiles, step):
        Q, P_ = q[:, t0 : t0 + step], pos[:, t0 : t0 + step]
        blocks = int(P_.max()) // KEY_BLOCK + 1
        # (N, tiles, blocks, QUERY_TILE, KEY_BLOCK): one product of the same shape per (tile, block).
        s = torch.matmul(Q[:, :, None], kb[:, None, :blocks].transpose(-1, -2))
        if rows < QUERY_TILE:
            s = s[..., :rows, :].contiguous()
        key_at = key_pos + KEY_BLOCK * torch.arange(blocks, device=q.device)[:, None, None]  # (blocks, 1, KEY_BLOCK)
        s.masked_fill_(key_at > P_[:, :, None], -math.inf)
        # Softmax is shift-invariant: the maximum only keeps exp() in range, no gradient needed.
        m = s.detach().amax(-1, keepdim=True).amax(2, keepdim=True)
        p = s.sub_(m).exp_()
        norm = _sum_blocks(p.sum(-1))  # (N, tiles, rows)
        pv = torch.matmul(_pad_rows(p, QUERY_TILE, dim=3), vb[:, None, :blocks])
        out.append(_sum_blocks(pv[..., :rows, :]) / norm[..., None])  # (N, tiles, rows, hd)
    o = out[0] if len(out) == 1 else torch.cat(out, 1)
    return o.reshape(N, tiles * rows, hd)


def _sum_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over dim 2 (the key blocks) in order, in float64, rounded once: what
    ``cumsum`` computes for its last entry (it accumulates float32 in float64). Under autograd
    the sum is taken block by block instead: the same numbers, without cumsum's backward
    (two flips and a cumsum over the whole tensor)."""
    if not x.requires_grad:
        return x.cumsum(2)[:, :, -1]
    parts = x.double().unbind(2)  # whose backward is one stack, where indexing would make a tensor per block
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    return acc.to(x.dtype)


def _pad_rows(t: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to ``n``."""
    have = t.shape[dim]
    if have == n:
        return t
    shape = list(t.shape)
    shape[dim] = n - have
    return torch.cat([t, t.new_zeros(shape)], dim)


def length_buckets(lengths: Sequence[int], ratio: float) -> list[tuple[int, int]]:
    """Cut ``lengths`` (sorted longest first) into runs ``[i, j)`` of similar length: each run
    holds the lengths at least ``ratio`` times its first (the varlen attention's buckets)."""
    out, i = [], 0
    while i < len(lengths):
        j = i
        while j < len(lengths) and lengths[j] >= ratio * lengths[i]:
            j += 1
        out.append((i, j))
        i = j
    return out


class Segments:
    """Attention over runs of tokens (the samples), laid out flat, one token per row.

    ``pos`` (M,): each token's position; a run starts wherever it is 0, and at
    every ``row``-th token (the rows of a batch, flattened). Within a run, token
    i attends to tokens 0..i. Runs are sorted by length and cut into buckets of similar length
    (as `model._VarlenPlan` does); each bucket is gathered into rows of
    :data:`KEY_BLOCK`-padded keys and queries, attended with :func:`attend`
    and scattered back. A query's result does not depend on its bucket."""

    def __init__(self, pos: torch.Tensor, row: int | None = None, ratio: float = 0.7) -> None:
        device = pos.device
        M = len(pos)
        is_start = pos == 0
        is_start[:: row or max(M, 1)] = True
        starts = torch.nonzero(is_start).flatten()
        ends = torch.cat([starts[1:], torch.tensor([M], device=device)])
        self.starts, self.lengths = starts, ends - starts
        self.rows = M
        #: (segment ids, gather index (n, keys), valid (n, keys), queries) per bucket
        self.buckets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        order = torch.argsort(self.lengths, descending=True, stable=True)
        lengths = self.lengths[order].tolist()
        for i, j in length_buckets(lengths, ratio):
            top = lengths[i]
            ids = order[i:j]
            queries = top if top <= QUERY_TILE else padded(top, QUERY_TILE)
            ar = torch.arange(padded(top, KEY_BLOCK), device=device)
            valid = ar[None, :] < self.lengths[ids][:, None]
            index = torch.where(valid, starts[ids][:, None] + ar[None, :], torch.zeros_like(ar)[None, :])
            self.buckets.append((ids, index, valid, queries))

    def attend(self, qkv: torch.Tensor, n_head: int,
               keep: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
        """The attention output (rows, D) of the fused projections ``qkv`` (rows, 3D);
        ``keep(ids, k, v)``, when given, receives each bucket's segment ids and its
        gathered keys and values (len(ids) * heads, keys, hd), segment-major."""
        D = qkv.shape[1] // 3
        hd = D // n_head
        out = qkv.new_zeros(self.rows, D)
        for ids, index, valid, queries in self.buckets:
            S, L = index.shape
            q, k, v = (t.reshape(S, L, n_head, hd).transpose(1, 2).reshape(S * n_head, L, hd)
                       for t in qkv[index].split(D, dim=-1))
            if keep is not None:
                keep(ids, k, v)
            o = attend(q[:, :queries], k, v, torch.arange(queries, device=qkv.device)[None])
            o = o.reshape(S, n_head, queries, hd).transpose(1, 2).reshape(S, queries, D)
            ok = valid[:, :queries]
            out = out.index_put((index[:, :queries][ok],), o[ok])
        return out


def block(module: nn.Module, x: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One transformer block of the built-in GPT on rows ``x`` (M, D), with
    ``attention`` mapping the fused projections (M, 3D) to the attention output (M, D)."""
    blk = cast("_Block", module)
    up, act, down = blk.mlp
    x = x + linear(attention(linear(blk.ln1(x), blk.attn.qkv)), blk.attn.proj)
    return x + linear(act(linear(blk.ln2(x), cast(nn.Linear, up))), cast(nn.Linear, down))


def logits(model: "GPT", input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``model(input_ids, position_ids)`` (B, T, V), batch-invariant: the logits
    at a position depend on the tokens of its run (up to it) and on nothing else."""
    B, T = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
    ids, pos = input_ids.reshape(-1), position_ids.reshape(-1)
    seg = Segments(pos, row=T)
    x = model.embed(ids, pos)
    for blk in model.blocks:
        x = block(blk, x, lambda qkv: seg.attend(qkv, model.config.n_head))
    return linear(model.ln_f(x), model.lm_head).reshape(B, T, -1)


@torch.no_grad()
def sample(model: "GPT", rows: list[list[int]], max_new_tokens: int, temperature: float, stop_ids: Sequence[int],
           generator: torch.Generator | None, between_steps: Callable[[int], bool] | None) -> "Generation":
    """`GPT.sample` on the batch-invariant path (arguments checked by the caller).

    The prompts are prefilled as the runs of one flat batch (what `logits`
    does for the learner), their keys and values kept in a cache at their
    absolute positions; then each step feeds one token per row and attends
    its one query over that row's cache."""
    from agentlog.learner.model import decode

    cfg = model.config
    device = model.tok_emb.weight.device
    B = len(rows)
    H, hd, D = cfg.n_head, cfg.d_model // cfg.n_head, cfg.d_model
    lengths = torch.tensor([len(p) for p in rows], device=device)
    ids = torch.tensor([t for p in rows for t in p], device=device)
    pos = torch.cat([torch.arange(len(p), device=device) for p in rows])
    seg = Segments(pos)
    span = padded(int(lengths.max()) + max_new_tokens, KEY_BLOCK)
    cache_k = [torch.zeros(B * H, span, hd, device=device) for _ in model.blocks]
    cache_v = [torch.zeros(B * H, span, hd, device=device) for _ in model.blocks]
    head = torch.arange(H, device=device)

    def keep(i: int, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        at = (ids[:, None] * H + head).reshape(-1)
        cache_k[i][at, : k.shape[1]] = k
        cache_v[i][at, : v.shape[1]] = v

    def prefill(i: int, qkv: torch.Tensor) -> torch.Tensor:
        return seg.attend(qkv, H, partial(keep, i))

    x = model.embed(ids, pos)
    for i, blk in enumerate(model.blocks):
        x = block(blk, x, partial(prefill, i))
    first = linear(model.ln_f(x[seg.starts + seg.lengths - 1]), model.lm_head)  # each prompt's last token

    next_pos = lengths.clone()
    rows_h = torch.arange(B * H, device=device)

    def step_logits(tok: torch.Tensor, step: int) -> torch.Tensor:
        at = next_pos.repeat_interleave(H)

        def attention(i: int, qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.reshape(B * H, hd) for t in qkv.split(D, dim=-1))
            cache_k[i][rows_h, at] = k
            cache_v[i][rows_h, at] = v
            return attend(q[:, None], cache_k[i], cache_v[i], at[:, None]).reshape(B, D)

        x = model.embed(tok, next_pos)
        for i, blk in enumerate(model.blocks):
            x = block(blk, x, partial(attention, i))
        next_pos.add_(1)
        return linear(model.ln_f(x), model.lm_head)

    return decode(first, step_logits, max_new_tokens, temperature, stop_ids, generator, between_steps)
