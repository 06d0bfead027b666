"""The in-process scorer of ``agentlog verify-tokens``: a run's own policy, loaded at each
recorded version, scores the recorded turns with the learner's numeric path.

:class:`ModelScorer` is a :class:`~agentlog.gateway.scoring.Scorer` over a torch policy
(the built-in GPT, or an :class:`~agentlog.learner.hf_model.HFCausalLM`). Its log-probs
come from :func:`agentlog.learner.model.token_log_probs` over batches built by
:func:`agentlog.learner.batching.make_batches`: the very computation the learner's loss
starts from, so a difference it reports is one the learner trains with. Its greedy
reproduction takes the arg-max at every position of the same teacher-forced forward: the
tokens greedy decoding emits as long as it agrees with the recorded ones, so the first
position where they differ is where a greedy rerun would diverge.

:func:`versioned_scorers` loads the policy of each version from a run folder's checkpoints
(``<run>/checkpoints/policy-vNNNNN.pt``, or its HF directory for an HF policy), one
version at a time; :func:`run_template` is the chat template the run's gateway encoded
prompts with (the HF model's tokenizer, or the byte-level template of the built-in text
model), for the retokenization check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from agentlog.events.errors import AgentlogError
from agentlog.gateway.chat import ChatTemplate
from agentlog.gateway.scoring import Scorer, TokenIds
from agentlog.reducers.samples import Sample

from .config import LoopConfig
from .publish import checkpoint_path, hf_checkpoint_dir

__all__ = ["ModelScorer", "PolicyLoadError", "TokenCheckError", "is_text_task", "load_policy", "run_template", "versioned_scorers"]

class PolicyLoadError(AgentlogError, ValueError):
    """A version's checkpoint exists but does not load (the message names the file and why)."""


class TokenCheckError(AgentlogError, ValueError):
    """A recorded turn the model cannot score (a token id outside its vocabulary: another tokenizer)."""


#: Tokens scored per forward batch (padded): bounds memory on long turns.
SCORE_TOKENS_PER_BATCH = 32768


class ModelScorer(Scorer):
    """Scores turns with an in-process torch policy (see the module docstring)."""

    name = "in-process"
    no_tokenize = ("no chat template (a token-level task, a bare log, or a tokenizer without one: "
                   "--model DIR brings its tokenizer's)")

    def __init__(self, model: torch.nn.Module, template: ChatTemplate | None = None, *, pad_id: int = 0) -> None:
        self.model = model.eval()
        self.template = template
        self.pad_id = pad_id

    def out_of_vocabulary(self, prompt: TokenIds, output: TokenIds) -> str:
        """Why the model cannot score this prompt and output ("" when it can): the first id outside its vocabulary."""
        cfg = getattr(self.model, "config", None)
        vocab = getattr(self.model, "vocab_size", None) or getattr(cfg, "vocab_size", None)
        if vocab is None:
            return ""
        for where, ids in (("prompt", prompt), ("output", output)):
            arr = np.asarray(ids, np.int64)
            bad = np.flatnonzero((arr < 0) | (arr >= int(vocab)))
            if bad.size:
                return (f"{where} token {int(bad[0])} is id {int(arr[bad[0]])}, outside the model's vocabulary "
                        f"[0, {int(vocab)}) (a model whose tokenizer is not the one the turns were recorded with?)")
        return ""

    def score_batch(self, items: Sequence[tuple[TokenIds, TokenIds, float]]) -> list[list[float]]:
        """The log-probs of each item's output tokens ((prompt ids, output ids, temperature) per
        item), computed in as few forward passes as the token budget allows."""
        from agentlog.learner.batching import make_batches
        from agentlog.learner.model import token_log_probs

        samples = [_scoring_sample(prompt, output, temperature) for prompt, output, temperature in items]
        out: list[list[float]] = [[] for _ in items]
        with torch.no_grad():
            # Padded rows (a causal model needs no mask for padding at the end), caller's order: a
            # caller that sorts by length wastes little padding. Measured on the tiny HF model, about
            # 1.3x faster than packed rows, whose block-diagonal masks cost more than the padding.
            for batch in make_batches(samples, packing=False, max_tokens_per_batch=SCORE_TOKENS_PER_BATCH, pad_id=self.pad_id):
                log_probs, _ = token_log_probs(self.model, batch)
                for row, index in enumerate(batch.sample_indices):
                    n = samples[index].response_length
                    out[index] = log_probs[row, :n].tolist()
        return out

    async def score(self, prompt_ids: TokenIds, output_ids: TokenIds, temperature: float) -> list[float]:
        return self.score_batch([(prompt_ids, output_ids, temperature)])[0]

    def argmax_batch(self, items: Sequence[tuple[TokenIds, TokenIds]]) -> list[list[int]]:
        """For each (prompt, recorded output): the arg-max token at every output position of
        the teacher-forced forward (the greedy tokens while they agree with the recorded ones)."""
        out = []
        with torch.no_grad():
            for prompt, output in items:
                ids = torch.from_numpy(np.concatenate([np.asarray(prompt, np.int64), np.asarray(output, np.int64)]))[None]
                logits = self.model(ids)
                n_prompt = len(prompt)
                picked = logits[0, n_prompt - 1 : n_prompt - 1 + len(output)]
                out.append(picked.argmax(dim=-1).tolist())
        return out

    async def greedy(self, prompt_ids: TokenIds, n: int, stop_ids: Sequence[int]) -> list[int]:
        raise NotImplementedError("ModelScorer reproduces greedy turns with argmax_batch (teacher forcing)")

    async def tokenize_chat(self, messages: list[dict[str, Any]]) -> list[int] | None:
        return None if self.template is None else self.template.encode_prompt(messages, [])


def _scoring_sample(prompt: TokenIds, output: TokenIds, temperature: float) -> Sample:
    """A one-row Sample holding prompt + output, every output token scored."""
    tokens = np.concatenate([np.asarray(prompt, np.int32), np.asarray(output, np.int32)]).tobytes()
    n = len(output)
    return Sample(
        group_id="", session_id="", sample_index=0, tokens=tokens, response_length=n,
        loss_mask=b"\x01" * n, rollout_log_probs=bytes(4 * n), reward=0.0, status="finished",
        temperature=float(temperature),
    )


def load_policy(run_dir: Path, cfg: LoopConfig, version: int) -> torch.nn.Module | None:
    """The run's policy at ``version`` from its checkpoints, or None when that version's
    checkpoint was pruned (or never written); PolicyLoadError when it is there but does not load."""
    ckpt = checkpoint_path(Path(run_dir) / "checkpoints", version)
    try:
        if cfg.hf_model:
            hf_dir = hf_checkpoint_dir(ckpt)
            if not hf_dir.is_dir():
                return None
            from agentlog.learner.hf_model import HFCausalLM

            return HFCausalLM(hf_dir)
        if not ckpt.is_file():
            return None
        from agentlog.learner.learner import read_policy
        from agentlog.learner.model import GPT

        state, config = read_policy(ckpt)
        return GPT.from_state_dict(state, config or {"n_head": cfg.n_head})
    except (OSError, ValueError, RuntimeError) as exc:  # torch and transformers raise these for files that are not ours
        why = (str(exc).strip().splitlines() or [""])[0]
        raise PolicyLoadError(f"policy version {version} ({ckpt}): cannot load it: {type(exc).__name__}: {why}") from None


def run_template(run_dir: Path | None, cfg: LoopConfig | None, model_dir: str | None = None) -> ChatTemplate | None:
    """The chat template prompts were encoded with: ``model_dir``'s tokenizer when given, else
    the run's for a text task (its HF model's tokenizer, or the built-in text model's
    byte-level template); None when neither says (a bare log, a token-level task)."""
    from agentlog.gateway.chat import ByteChatTemplate, HFChatTemplate

    if model_dir is not None:
        template = HFChatTemplate.from_pretrained(model_dir)
        # A base model's tokenizer has no chat template: nothing to retokenize with (log-probs still checked).
        return template if getattr(template.tok, "chat_template", None) else None
    if cfg is None:
        return None
    if not is_text_task(cfg):
        return None  # token-level tasks: their prompts are ids, whatever messages they record for display
    if cfg.hf_model:
        from .policy import resolve_hf_model

        hf_dir = resolve_hf_model(cfg, run_dir)
        return HFChatTemplate.from_pretrained(str(hf_dir)) if hf_dir is not None else None
    return ByteChatTemplate()


def is_text_task(cfg: LoopConfig) -> bool:
    """Whether the run's task is a text task, whose prompts its gateway encoded from messages
    (a token-level task's prompts are ids; the messages it records are for display)."""
    from agentlog.engine.tasks import TextTask, load_tasks, select_task

    load_tasks(cfg.task_modules, cfg.task_path)
    return isinstance(select_task(cfg.task), TextTask)


def versioned_scorers(run_dir: Path, cfg: LoopConfig, template: ChatTemplate | None) -> Callable[[int], ModelScorer | None]:
    """``scorer_at(version)``: a ModelScorer over the run's policy at that version (None when
    its checkpoint is gone); the last one loaded is kept, so turns taken in version order load
    each version once."""
    held: dict[int, ModelScorer | None] = {}

    def scorer_at(version: int) -> ModelScorer | None:
        if version not in held:
            held.clear()
            model = load_policy(run_dir, cfg, version)
            held[version] = None if model is None else ModelScorer(model, template)
        return held[version]

    return scorer_at
