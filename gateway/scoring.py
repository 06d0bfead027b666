"""Re-feeding recorded turns to an inference server: the scores ``agentlog verify-tokens`` checks.

A :class:`Scorer` answers three questions about one recorded turn:

* :meth:`Scorer.score`: the log-prob of each recorded output token given the
  recorded prompt and the tokens before it (teacher forcing), at the turn's
  temperature, as the engine computes it;
* :meth:`Scorer.greedy`: what the engine generates greedily from the
  recorded prompt (``n`` tokens, the turn's stop ids);
* :meth:`Scorer.tokenize_chat`: the engine's own tokenization of the
  recorded messages through its chat template, or None where the engine
  has no such route.

Two servers speak it over their public routes, on top of the backends that
generate through them (same connections, headers and errors):

* :class:`SGLangScorer`: ``POST /generate`` with ``input_ids`` = prompt +
  output, ``max_new_tokens`` 0, ``return_logprob`` and ``logprob_start_len``
  at the first output token: ``meta_info.input_token_logprobs`` holds one
  ``[logprob, token_id, text]`` per output token. SGLang has no route that
  applies its chat template and returns the ids, so ``tokenize_chat`` is None
  (``verify-tokens --model DIR`` checks retokenization with the model's own
  tokenizer instead).
* :class:`VLLMScorer`: ``POST /v1/completions`` with the token-id prompt
  prompt + output, ``max_tokens`` 1 and ``prompt_logprobs``:
  ``choices[0].prompt_logprobs`` holds, per prompt position, a map from token
  id to ``{"logprob", "rank", ...}`` (null for the first). Retokenization goes
  through ``POST /tokenize`` with ``messages`` and ``add_generation_prompt``.

Log-probs are compared as the engine reports them: a server whose log-probs
mode differs from the one the run recorded with (vLLM's raw against
processed log-probs, say) shows that difference, which is the point.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence, Union, cast

import numpy as np

from .backends import BackendError, OpenAICompletionsBackend, SamplingParams, SGLangBackend, id_list

__all__ = ["Scorer", "SGLangScorer", "TokenIds", "VLLMScorer"]

#: Token ids as a scorer takes them: a sequence of ints, or an int32 array (a record's view).
TokenIds = Union[Sequence[int], np.ndarray]


class Scorer(abc.ABC):
    """Scores recorded turns against one engine (see the module docstring)."""

    name = ""
    #: Why :meth:`tokenize_chat` answers None (the report prints it).
    no_tokenize = "the engine has no route that tokenizes a conversation"

    @abc.abstractmethod
    async def score(self, prompt_ids: TokenIds, output_ids: TokenIds, temperature: float) -> list[float]:
        """The engine's log-prob of each of ``output_ids`` after ``prompt_ids`` (and the outputs before it)."""

    @abc.abstractmethod
    async def greedy(self, prompt_ids: TokenIds, n: int, stop_ids: Sequence[int]) -> list[int]:
        """Up to ``n`` tokens generated greedily from ``prompt_ids``, stopping after one of ``stop_ids``."""

    async def tokenize_chat(self, messages: list[dict[str, Any]]) -> list[int] | None:
        """The engine's tokenization of ``messages`` with its chat template and the generation
        prompt; None when the engine has no route for it."""
        return None

    async def close(self) -> None:
        """Release connections."""


class _ServerScorer(Scorer):
    """What the two servers' scorers share: greedy reproduction through the backend's own ``generate``."""

    async def greedy(self, prompt_ids: TokenIds, n: int, stop_ids: Sequence[int]) -> list[int]:
        backend = cast(Any, self)  # the server backend this scorer is mixed into
        gen = await backend.generate(id_list(prompt_ids), SamplingParams(max_new_tokens=n, temperature=0.0, stop_ids=tuple(stop_ids)))
        return list(gen.output_ids)


def _aligned(name: str, route: str, entries: list[tuple[float, int]], output_ids: list[int]) -> list[float]:
    """The log-probs of ``output_ids`` from the last ``len(output_ids)`` of ``entries``
    ((log-prob, token id) per position, as the server echoed them); the echoed ids
    must be the recorded ones, or the server scored something else."""
    n = len(output_ids)
    if len(entries) < n:
        raise BackendError(name, f"{route}: {len(entries)} scored positions for {n} output tokens", 200)
    tail = entries[len(entries) - n:]
    for k, ((_lp, tok), want) in enumerate(zip(tail, output_ids)):
        if tok != want:
            raise BackendError(name, f"{route}: scored position {k} holds token {tok}, expected the recorded {want}", 200)
    return [lp for lp, _tok in tail]


class SGLangScorer(SGLangBackend, _ServerScorer):
    """SGLang's ``/generate`` as a scorer (see the module docstring)."""

    no_tokenize = "SGLang has no route that applies its chat template (check retokenization with --model DIR)"

    async def score(self, prompt_ids: TokenIds, output_ids: TokenIds, temperature: float) -> list[float]:
        prompt, output = id_list(prompt_ids), id_list(output_ids)
        body = {
            "input_ids": prompt + output,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": len(prompt),
            "stream": False,
        }
        out = await self._post("/generate", body)
        meta = out.get("meta_info")
        triples = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(triples, list):
            raise BackendError(self.name, "/generate: meta_info lacks input_token_logprobs (was return_logprob honoured?)", 200)
        try:
            entries = [(float(t[0]), int(t[1])) for t in triples if t[0] is not None]
        except (TypeError, ValueError, IndexError) as exc:
            raise BackendError(self.name, f"/generate input_token_logprobs: expected [logprob, token_id, ...] items: {exc}", 200) from exc
        return _aligned(self.name, "/generate input_token_logprobs", entries, output)


class VLLMScorer(OpenAICompletionsBackend, _ServerScorer):
    """vLLM's ``/v1/completions`` and ``/tokenize`` as a scorer (see the module docstring)."""

    name = "vllm"

    async def score(self, prompt_ids: TokenIds, output_ids: TokenIds, temperature: float) -> list[float]:
        output = id_list(output_ids)
        body = {
            **({"model": self.model} if self.model else {}),
            "prompt": id_list(prompt_ids) + output,
            "max_tokens": 1,
            "temperature": temperature,
            "prompt_logprobs": 1,
        }
        out = await self._post("/v1/completions", body)
        try:
            positions = out["choices"][0]["prompt_logprobs"]
            if not isinstance(positions, list):
                raise TypeError(f"prompt_logprobs is {type(positions).__name__}")
        except (KeyError, IndexError, TypeError) as exc:
            raise BackendError(self.name, f"/v1/completions: expected choices[0].prompt_logprobs (a list): {exc}", 200) from exc
        tail = positions[len(positions) - len(output):] if len(positions) >= len(output) else positions
        entries: list[tuple[float, int]] = []
        for k, (scored, want) in enumerate(zip(tail, output)):
            if not isinstance(scored, dict) or str(want) not in scored:
                found = sorted(scored)[:5] if isinstance(scored, dict) else scored
                raise BackendError(self.name, f"/v1/completions prompt_logprobs: output position {k} has no entry for "
                                              f"the recorded token {want} (found {found})", 200)
            try:
                entries.append((float(scored[str(want)]["logprob"]), want))
            except (KeyError, TypeError, ValueError) as exc:
                raise BackendError(self.name, f"/v1/completions prompt_logprobs[{k}][{want}]: expected a logprob: {exc}", 200) from exc
        return _aligned(self.name, "/v1/completions prompt_logprobs", entries, output)

    async def tokenize_chat(self, messages: list[dict[str, Any]]) -> list[int] | None:
        body = {**({"model": self.model} if self.model else {}), "messages": messages, "add_generation_prompt": True}
        out = await self._post("/tokenize", body)
        tokens = out.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BackendError(self.name, f"/tokenize: expected a list of token ids under 'tokens', found {str(tokens)[:200]}", 200)
        return tokens
