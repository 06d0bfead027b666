"""What a fake SGLang teacher server answers: input log-probs of a real model, shaped as SGLang's native /generate."""

from __future__ import annotations

from typing import Any

import torch


def sglang_answer(model: torch.nn.Module, body: dict[str, Any]) -> dict[str, Any]:
    """SGLang's answer to a ``/generate`` body asking for input log-probs and no new tokens:
    ``meta_info.input_token_logprobs`` holds one ``[logprob, token_id, text]`` entry per input
    position from ``logprob_start_len`` on, the first unscored (``None``: SGLang pads it), and
    ``input_top_logprobs`` (with ``top_logprobs_num``) one row of ``top_logprobs_num`` such
    entries per position, the first ``None``. Log-probs are ``log_softmax(logits / temperature)``."""
    ids = body["input_ids"]
    start = body["logprob_start_len"]
    temperature = body["sampling_params"]["temperature"]
    k = body.get("top_logprobs_num", 0)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float() / temperature, dim=-1)
    entries: list = [[None, ids[start], None]]
    tops: list = [None]
    for i in range(start + 1, len(ids)):
        entries.append([float(logp[i - 1, ids[i]]), ids[i], None])
        if k:
            vals, idx = logp[i - 1].topk(k)
            tops.append([[float(v), int(j), None] for v, j in zip(vals, idx)])
    meta = {"id": "fake", "prompt_tokens": len(ids), "completion_tokens": 0, "finish_reason": {"type": "length", "length": 0},
            "input_token_logprobs": entries, "output_token_logprobs": []}
    if k:
        meta["input_top_logprobs"] = tops
        meta["output_top_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta}
