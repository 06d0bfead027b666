"""A tiny Hugging Face causal LM and a real fast tokenizer, built in code.

Tests, the example and ``tiny-llama`` / ``tiny-qwen2`` loop runs need a
Hugging Face model without reaching a model hub. :func:`build_tiny_hf`
writes one to a directory with ``save_pretrained``, so everything after it
goes through the real ``from_pretrained`` load path:

* the tokenizer is a byte-level BPE trained by the ``tokenizers`` library on
  a fixed in-code corpus (agent chat, shell commands, Python), so any text
  encodes losslessly and no id is unknown; it is wrapped as a
  ``PreTrainedTokenizerFast`` with ChatML special tokens;
* its chat template (Qwen 2.5 style) renders tool declarations, assistant
  tool calls as Hermes ``<tool_call>{json}</tool_call>`` blocks (what
  ``gateway.chat.HermesToolParser`` parses) and tool results, and marks the
  assistant's part with ``{% generation %}`` so
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives the
  loss mask;
* the model is a 2-layer ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` of
  width 64 with random weights (seeded), its vocabulary exactly the
  tokenizer's, so every id it samples decodes.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Names of the in-code models (``LoopConfig.hf_model``) and their architecture.
TINY_MODELS = {"tiny-llama": "llama", "tiny-qwen2": "qwen2"}

#: Special tokens: ChatML turn markers; the Hermes tool-call tags are added
#: (not special) tokens, so they survive ``decode(skip_special_tokens=True)``.
PAD, BOS, IM_START, IM_END = "<|endoftext|>", "<|begin|>", "<|im_start|>", "<|im_end|>"
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

#: A ChatML template with Hermes tool calls; ``{% generation %}`` marks what the
#: model generates (the assistant's content, its calls and ``<|im_end|>``).
#: An assistant message renders exactly as gateway.chat.HermesToolParser reads
#: it back: the content, then each call on its own line.
CHAT_TEMPLATE = (
    # transformers renders with trim_blocks: a newline right after a block tag
    # is dropped, so every newline next to a tag is written as {{ nl }}.
    "{% set nl = '\\n' %}"
    "{% if tools %}"
    "<|im_start|>system{{ nl }}"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}{{ nl }}{{ nl }}{% endif %}"
    "# Tools{{ nl }}<tools>"
    "{% for t in tools %}{{ nl }}{{ t | tojson }}{% endfor %}{{ nl }}</tools>{{ nl }}"
    "Call a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>{{ nl }}"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system{{ nl }}{{ messages[0].content }}<|im_end|>{{ nl }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant{{ nl }}"
    "{% generation %}"
    "{{ m.content if m.content else '' }}"
    "{% for tc in (m.tool_calls or []) %}"
    "{% set f = tc.function if tc.function is defined else tc %}"
    "{% if m.content or not loop.first %}{{ nl }}{% endif %}"
    "<tool_call>{\"name\": {{ f.name | tojson }}, \"arguments\": "
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}"
    "<|im_end|>"
    "{% endgeneration %}{{ nl }}"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>user{{ nl }}<tool_response>{{ nl }}{{ m.content }}{{ nl }}</tool_response><|im_end|>{{ nl }}"
    "{% else %}"
    "<|im_start|>{{ m.role }}{{ nl }}{{ m.content }}<|im_end|>{{ nl }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% endif %}"
)

# The fixed corpus the BPE merges are learnt from: what agents, shells and
# Python code in tests and the example say. Any other text still encodes
# (byte-level), just in more tokens.
_CORPUS = [
    "You are a helpful coding agent. Fix the bug so that the tests pass.",
    "The repository has a failing test. Run the tests, read the code, edit the file and run the tests again.",
    "def add(a, b):\n    return a + b\n",
    "def test_add():\n    assert add(2, 3) == 5\n",
    "import os\nimport sys\nimport json\nfrom pathlib import Path\n",
    "python -m pytest -q tests\n", "cat src/calc.py\n", "ls -la\n", "sed -n 1,40p file.py\n",
    "python -c \"print('hello world')\"\n", "echo done; exit 0\n", "grep -rn TODO .\n",
    "1 failed, 2 passed in 0.05s", "3 passed in 0.02s", "AssertionError: assert 6 == 5",
    "Traceback (most recent call last):\n  File \"calc.py\", line 2, in add\n",
    '{"command": "python -m pytest -q"}', '{"path": "calc.py", "content": "def add(a, b):\\n    return a + b\\n"}',
    '{"name": "bash", "arguments": {"command": "ls"}}', '{"name": "write_file", "arguments": {"path": "a.py"}}',
    "The tests pass now. I fixed the off-by-one error in the loop.",
    "What is the value of the key? Look it up with the tool and answer with the number.",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "user assistant system tool function name arguments content result error output exit code",
    "read write edit file path line return value true false null None True False",
]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, IM_START, IM_END]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TAGS), special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    # Repeated so every pair in the corpus clears the trainer's min frequency.
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    # Atomic, but not special: decode(skip_special_tokens=True) keeps them for the tool parser.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=IM_END, pad_token=PAD, unk_token=None,
        additional_special_tokens=[IM_START], clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_hf(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 4096,
    vocab_size: int = 512,
) -> Path:
    """Build a tiny random ``arch`` ("llama" or "qwen2") causal LM and its tokenizer,
    and ``save_pretrained`` both into ``out_dir``; returns the directory.

    The model's ``vocab_size`` is the tokenizer's length, its ``eos``/``pad``
    ids the tokenizer's; weights are seeded by ``seed``. Nothing is
    downloaded."""
    import torch
    import transformers

    if arch not in ("llama", "qwen2"):
        raise ValueError(f"build_tiny_hf: arch must be 'llama' or 'qwen2', found {arch!r}")
    out = Path(out_dir)
    tok = build_tokenizer(vocab_size)
    common = dict(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_position_embeddings, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    out.mkdir(parents=True, exist_ok=True)
    from .hf_model import quiet_transformers

    quiet_transformers()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
