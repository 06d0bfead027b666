"""The tiny Hugging Face model of the HF tests, built once per test session.

``tiny_hf_dir`` (a fixture; import it into a test module) is a directory
written by ``agentlog.learner.hf_tiny.build_tiny_hf``: a 2-layer
``LlamaForCausalLM`` of width 64 and a byte-level BPE fast tokenizer with a
tool-calling chat template, saved with ``save_pretrained``, so every test
loads it through the real ``from_pretrained``. Nothing reaches a model hub:
``HF_HUB_OFFLINE`` is set before transformers is imported.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_built: dict[str, Path] = {}


def build_once(tmp_path_factory, arch: str = "llama") -> Path:
    """The tiny ``arch`` model directory of this test session (built on first use)."""
    pytest.importorskip("transformers", reason="the HF tests need the hf extra: pip install -e '.[dev]'")
    if arch not in _built:
        from agentlog.learner.hf_tiny import build_tiny_hf

        _built[arch] = build_tiny_hf(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
    return _built[arch]


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """Directory of the tiny Llama model and its tokenizer (read-only: copy before changing it)."""
    return build_once(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Directory of the tiny Qwen2 model and its tokenizer (read-only)."""
    return build_once(tmp_path_factory, "qwen2")
