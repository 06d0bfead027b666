"""A Hugging Face causal LM behind the learner's model interface
(:class:`HFCausalLM`, see :mod:`agentlog.learner.model` for the interface),
and :func:`quiet_transformers`. Needs ``transformers`` (the ``hf`` extra)
only when a model is built.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn

from .model import Generation, decode, sample_rows


class HFCausalLM(nn.Module):
    """Adapter: a Hugging Face causal LM behind the (ids -> logits) interface.

    Needs ``transformers`` (the ``hf`` extra). ``HFCausalLM(path)`` loads a
    local directory with ``AutoModelForCausalLM.from_pretrained`` (and its
    tokenizer, when the directory has one, for :meth:`save_pretrained`).

    Training forwards pass ``use_cache=False``. Packing: with eager or SDPA
    attention a packed batch passes per-sample ``position_ids`` and the
    block-diagonal causal mask as a 4-D additive float mask, which both
    apply exactly, so no token attends across samples; with a flash-attention
    implementation (which takes no dense masks) the batch passes
    ``position_ids`` alone and the kernel's variable-length path keeps
    attention within each run of positions that starts at 0
    (``packs_by_position_ids``). ``gradient_checkpointing=True`` recomputes
    each layer's activations in the backward pass (non-reentrant).

    :meth:`sample` generates like ``GPT.sample`` (left-padded batch, KV cache,
    log-probs of ``log_softmax(logits / temperature)``), so the gateway's
    ``TorchBackend`` and the loop serve it as they serve the built-in GPT.
    """

    def __init__(self, model_or_path, *, gradient_checkpointing: bool = False, tokenizer=None,
                 **from_pretrained_kwargs) -> None:
        super().__init__()
        self.source_dir: str | None = None
        if isinstance(model_or_path, (str, os.PathLike)):
            path = str(model_or_path)
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"HFCausalLM: {path!r} is not a directory; expected a local Hugging Face model directory "
                    f"(config.json + weights); nothing is downloaded"
                )
            try:
                from transformers import AutoModelForCausalLM
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise ImportError("HFCausalLM needs `transformers`: pip install 'agentlog[hf]'") from exc
            quiet_transformers()
            from_pretrained_kwargs.setdefault("local_files_only", True)
            with _weights_load(f"HFCausalLM: {path!r}"):
                model_or_path = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)
            self.source_dir = path
            if tokenizer is None and _has_tokenizer_files(path):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = model_or_path
        self.tokenizer = tokenizer
        hf_cfg = self.model.config
        self.vocab_size = int(hf_cfg.vocab_size)
        self.max_seq_len = int(getattr(hf_cfg, "max_position_embeddings", 0) or 1 << 20)
        impl = str(getattr(hf_cfg, "_attn_implementation", "") or "")
        #: Flash-attention kernels take no dense masks: pack by position ids.
        self.packs_by_position_ids = "flash" in impl
        # transformers 5.x renamed ``past_key_values`` to ``cache`` (and deprecated the old name).
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        if gradient_checkpointing:
            # transformers 5.x renamed it activation checkpointing (the old name warns).
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @property
    def checkpointing(self) -> bool:
        """Whether activations are recomputed in the backward pass (gradient checkpointing)."""
        m = self.model
        flag = getattr(m, "is_activation_checkpointing", None)
        return bool(flag if flag is not None else m.is_gradient_checkpointing)

    @property
    def config(self):
        """The wrapped model's Hugging Face config."""
        return self.model.config

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        """Logits ``(B, T, V)``; see the class docstring for how packed batches attend."""
        kwargs = {"use_cache": False}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if attention_mask is not None:
            dtype = next(self.model.parameters()).dtype
            additive = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
            additive.masked_fill_(~attention_mask, torch.finfo(dtype).min)
            kwargs["attention_mask"] = additive.unsqueeze(1)
        return self.model(input_ids=input_ids, **kwargs).logits

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
        """Sample continuations of a batch of prompts with the model's KV cache.

        Same contract as `GPT.sample`: each sequence stops after one of
        ``stop_ids`` (included) or ``max_new_tokens``; log-probs are those of
        ``log_softmax(logits / temperature)``; ``between_steps`` as in
        :func:`~agentlog.learner.model.decode`."""
        rows = sample_rows("HFCausalLM.sample", prompts, temperature, max_new_tokens, self.vocab_size,
                           self.max_seq_len, "max_position_embeddings")
        if not rows:
            return Generation()
        B, P = len(rows), max(len(p) for p in rows)
        device = next(self.model.parameters()).device
        was_training = self.training
        self.eval()
        try:
            ids = torch.zeros(B, P, dtype=torch.long)
            real = torch.zeros(B, P + max_new_tokens, dtype=torch.long)  # 2-D mask: 1 on real tokens
            for i, p in enumerate(rows):
                ids[i, P - len(p):] = torch.tensor(p)
                real[i, P - len(p): P] = 1
            ids, real = ids.to(device), real.to(device)
            lengths = real[:, :P].sum(1)
            pos = (torch.arange(P, device=device) - (P - lengths).unsqueeze(1)).clamp(min=0)
            out = self.model(input_ids=ids, attention_mask=real[:, :P], position_ids=pos, use_cache=True)
            cache, logits = self._cache_of(out), out.logits[:, -1]
            next_pos = lengths.clone()
            state = {"cache": cache}

            def step_logits(tok: torch.Tensor, step: int) -> torch.Tensor:
                real[:, P + step] = 1
                out = self.model(input_ids=tok[:, None], attention_mask=real[:, : P + step + 1],
                                 position_ids=next_pos[:, None], use_cache=True, **{self._cache_arg: state["cache"]})
                state["cache"] = self._cache_of(out)
                next_pos.add_(1)
                return out.logits[:, -1]

            return decode(logits, step_logits, max_new_tokens, temperature, stop_ids, generator, between_steps)
        finally:
            self.train(was_training)

    def load_hf_weights(self, directory: str | os.PathLike) -> None:
        """Load the weights of an HF directory written by :meth:`save_pretrained`
        (``model.safetensors`` or its shards) into this model, in place.

        Every parameter must be there, except an output layer tied to the
        input embedding; a missing or unexpected tensor raises naming it."""
        self.apply_hf_weights(self.read_hf_weights(directory))

    def read_hf_weights(self, directory: str | os.PathLike) -> dict[str, torch.Tensor]:
        """The state of an HF directory, read and checked against this model
        (as :meth:`load_hf_weights` checks it) but not applied: a server reads
        the next version while it still generates with this one."""
        from safetensors.torch import load_file

        d = Path(directory)
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{d}: no *.safetensors weights in this directory (expected an HF checkpoint)")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            with _weights_load(str(f)):
                state.update(load_file(str(f)))
        # Checked before anything is copied, so a bad directory leaves the weights as they were.
        own = self.model.state_dict()
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = [k for k in own if k not in state and k not in tied]
        unexpected = [k for k in state if k not in own]
        wrong = [f"{k} {tuple(v.shape)} (model {tuple(own[k].shape)})" for k, v in state.items()
                 if k in own and v.shape != own[k].shape]
        if missing or unexpected or wrong:
            raise ValueError(
                f"{d}: weights do not fit the model ({type(self.model).__name__}): "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong[:3]}"
            )
        return state

    def apply_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a state from :meth:`read_hf_weights` into the model, in place."""
        self.model.load_state_dict(state, strict=False)

    def _cache_of(self, out):
        return getattr(out, self._cache_arg)

    def save_pretrained(self, out_dir: str | os.PathLike) -> Path:
        """Write an HF model directory (``config.json``, ``model.safetensors``, the tokenizer's
        files when known) that ``from_pretrained``, vLLM and SGLang load as is."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        quiet_transformers()
        self.model.save_pretrained(out, safe_serialization=True)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)
        return out


def quiet_transformers() -> None:
    """Turn off transformers' progress bars ("Loading weights", "Writing model
    shards"): the learner and the workers load and save a model at every
    version, and each bar would be a burst of lines in their logs. Its own
    logging stays at warning unless ``$TRANSFORMERS_VERBOSITY`` asks for more.
    Called before each load and save (cheap), so a bar turned back on is off again."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not os.environ.get("TRANSFORMERS_VERBOSITY") and hf_logging.get_verbosity() < hf_logging.WARNING:
        hf_logging.set_verbosity_warning()


def _has_tokenizer_files(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


@contextlib.contextmanager
def _weights_load(what: str) -> Iterator[None]:
    """safetensors' error as an OSError naming ``what``: it is not one (a file cut short, or not
    safetensors), and every caller that names the version or the directory catches OSError."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as exc:
        raise OSError(f"{what}: its weights do not load: {exc}") from exc
