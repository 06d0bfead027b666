"""The built-in multi-turn lookup task and its 41-token vocabulary: the task of `agentlog demo`.

Demo-only: nothing in the engine or the loop depends on it. It stays here,
next to the task interface and registry (``engine/tasks/base.py``), because
the registry lives in the engine and registers it on import, so every
process (rollout worker, learner, the ``agentlog`` commands) can select
``"lookup"`` by name; moving it into the loop's demo package would make the
engine import a layer above it, or every process import the demo.

An episode hides a table mapping each of 16 keys to one of 16 values, drawn
afresh every episode, so the model cannot memorise answers: it has to read
them from the tool's output.

::

    prompt     BOS get k7 ;                      (4 tokens)
    turn 0     lookup k7 EOS                     (generated, mask 1)
    tool       result k7 v12 ;                   (context, mask 0)
    turn 1     answer v12 EOS                    (generated, mask 1)

A turn is ``max_new_tokens`` (3) tokens long at most and ends at its first
EOS. A turn 0 that is not exactly ``lookup <key> EOS`` makes the tool answer
``result ? ? ;`` (exit code 2). The tool always answers for the key the model
asked for, so a wrong lookup reveals the wrong value.

Reward: sparse, no partial credit. 1.0 when turn 1 is exactly
``answer <value of the prompt's key> EOS``, else 0.0; ``success`` is the same
test. (A partially right episode, such as a correct lookup followed by a wrong
answer, earns nothing: with shaped credit for the lookup, the policy learned
the format and then collapsed before sampling correct answers on some seeds.)
"""

from __future__ import annotations

import random
from typing import Sequence

from .base import Episode, Task, TaskError, ToolResult, Verdict, register_task

N_KEYS = 16
N_VALUES = 16

# Special tokens first, then keys, then values: 9 + 16 + 16 = 41 ids.
PAD, BOS, EOS, GET, LOOKUP, RESULT, ANSWER, SEP, UNKNOWN = range(9)
SPECIALS = ("<pad>", "<bos>", "<eos>", "get", "lookup", "result", "answer", ";", "?")
KEY0 = len(SPECIALS)
VALUE0 = KEY0 + N_KEYS
VOCAB = SPECIALS + tuple(f"k{i}" for i in range(N_KEYS)) + tuple(f"v{i}" for i in range(N_VALUES))
VOCAB_SIZE = len(VOCAB)
_IDS = {tok: i for i, tok in enumerate(VOCAB)}


def encode(text: str) -> list[int]:
    """Whitespace-separated vocabulary words -> token ids; unknown words name themselves."""
    out = []
    for word in text.split():
        try:
            out.append(_IDS[word])
        except KeyError:
            raise TaskError(f"lookup vocabulary: unknown word {word!r}; expected one of {' '.join(VOCAB)}") from None
    return out


def decode(ids: Sequence[int]) -> str:
    """Token ids -> whitespace-separated words (out-of-range ids shown as ``#<id>``)."""
    return " ".join(VOCAB[i] if 0 <= i < VOCAB_SIZE else f"#{i}" for i in (int(t) for t in ids))


def key_token(k: int) -> int:
    """Token id of key ``k``."""
    return KEY0 + k


def value_token(v: int) -> int:
    """Token id of value ``v``."""
    return VALUE0 + v


def _upto_eos(ids: Sequence[int]) -> list[int]:
    out = []
    for t in ids:
        out.append(int(t))
        if t == EOS:
            break
    return out


@register_task("lookup")
class LookupTask(Task):
    """Look a key up with a tool, then answer with the value the tool returned."""

    name = "lookup"
    vocab_size = VOCAB_SIZE
    eos_id = EOS
    max_new_tokens = 3
    max_turns = 2

    def new_episode(self, rng: random.Random) -> Episode:
        """A random key and a fresh random table of values."""
        key = rng.randrange(N_KEYS)
        table = [rng.randrange(N_VALUES) for _ in range(N_KEYS)]
        prompt = [BOS, GET, key_token(key), SEP]
        return Episode(
            prompt_ids=tuple(prompt),
            messages=[{"role": "user", "content": decode(prompt)}],
            state={"key": key, "table": table},
            label=f"k{key}=v{table[key]}",
        )

    def group_member(self, episode: Episode, rng: random.Random) -> Episode:
        """The same key with a fresh table: values change every episode."""
        key = episode.state["key"]
        table = [rng.randrange(N_VALUES) for _ in range(N_KEYS)]
        return Episode(
            prompt_ids=episode.prompt_ids,
            messages=[dict(m) for m in episode.messages],
            state={"key": key, "table": table},
            label=f"k{key}=v{table[key]}",
        )

    def tool_step(self, episode: Episode, turn_index: int, output_ids: Sequence[int]) -> ToolResult | None:
        """After turn 0: the lookup result; after turn 1: None (episode over)."""
        if turn_index >= self.max_turns - 1:
            return None
        if turn_index != 0:
            raise TaskError(f"lookup task: tool_step for turn {turn_index}, expected turn 0 or 1")
        out = _upto_eos(output_ids)
        table = episode.state["table"]
        if len(out) == 3 and out[0] == LOOKUP and KEY0 <= out[1] < VALUE0 and out[2] == EOS:
            k = out[1] - KEY0
            ids = (RESULT, out[1], value_token(table[k]), SEP)
            return ToolResult(ids=ids, text=decode(ids), command=f"lookup k{k}", exit_code=0)
        ids = (RESULT, UNKNOWN, UNKNOWN, SEP)
        return ToolResult(ids=ids, text=decode(ids), command=f"lookup {decode(out)!r}", exit_code=2)

    def verify(self, episode: Episode, outputs: Sequence[Sequence[int]]) -> Verdict:
        """1.0 iff the last turn is ``answer <the key's value> EOS``."""
        key = episode.state["key"]
        want = value_token(episode.state["table"][key])
        lookup = _upto_eos(outputs[0]) if outputs else []
        answer = _upto_eos(outputs[1]) if len(outputs) > 1 else []
        looked_up = lookup == [LOOKUP, key_token(key), EOS]
        solved = answer == [ANSWER, want, EOS]
        return Verdict(
            reward=1.0 if solved else 0.0,
            success=solved,
            detail={"lookup_ok": looked_up, "answer": decode(answer)},
        )

    def demonstration(self, episode: Episode, rng: random.Random, *, wrong_answer_rate: float = 0.0) -> list[list[int]]:
        """The right lookup, then the right answer, except that with probability
        ``wrong_answer_rate`` the answer is replaced by a random wrong value.

        The noisy answers teach the protocol (lookup, then answer with some
        value) without teaching the copy, so RL starts from a low reward
        instead of a solved task.
        """
        key = episode.state["key"]
        value = episode.state["table"][key]
        if rng.random() < wrong_answer_rate:
            value = (value + 1 + rng.randrange(N_VALUES - 1)) % N_VALUES
        return [[LOOKUP, key_token(key), EOS], [ANSWER, value_token(value), EOS]]

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids as vocabulary words."""
        return decode(ids)
