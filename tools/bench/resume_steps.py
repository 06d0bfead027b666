"""The ``resume-steps`` text task and its scripted model, for bench_resume and the worker-kill test
(run by ``tools/bench/scripted_worker.py``; see its docstring).

The task takes :data:`STEPS` + 2 turns: the model asks for ``echo stepJ >>
progress.txt`` at turn J (J < STEPS), then ``echo WORD > answer.txt``, then
answers. The verifier rewards 1 only when ``answer.txt`` holds the word and
``progress.txt`` holds exactly ``step0`` .. ``step{STEPS-1}``, once each: a
session resumed onto a sandbox from another turn writes a step twice or misses
one, and scores 0. Set-up writes ``AGENTLOG_STEPS_DATA_MB`` megabytes of files
into the sandbox, so a snapshot has real bytes to keep.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from pathlib import Path
from typing import Any, Sequence

from agentlog.engine.tasks import TextEpisode, TextTask, register_task, verdict_of_command
from agentlog.gateway import Backend, ByteChatTemplate, Generation, SamplingParams

#: Tool calls before the answer (turns of a session: STEPS + 2); ``AGENTLOG_STEPS_STEPS`` sets it.
STEPS = int(os.environ.get("AGENTLOG_STEPS_STEPS", "4"))
WORDS = ("apple", "river", "stone", "cloud", "maple", "ember")
TEMPLATE = ByteChatTemplate()
_DONE = re.compile(r"exit code 0")


class StepsTask(TextTask):
    """STEPS commands, an answer file, a final answer; verified for exactly-once steps."""

    name = "resume-steps"
    max_turns = STEPS + 3
    max_new_tokens = 160
    session_budget_s = 600.0
    command_budget_s = 30.0

    def new_episode(self, rng: random.Random) -> TextEpisode:
        word = rng.choice(WORDS)
        return TextEpisode(messages=[{"role": "user", "content": f"Log {STEPS} steps, then write {word} into answer.txt"}],
                           label=word, state={"word": word})

    async def setup(self, episode: TextEpisode, sandbox: Any) -> None:
        root = Path(sandbox.workdir)
        (root / "README").write_text("log the steps in progress.txt, then the word in answer.txt\n")
        data_mb = float(os.environ.get("AGENTLOG_STEPS_DATA_MB", "0"))
        if data_mb > 0:
            data = root / "data"
            data.mkdir()
            rng = random.Random(episode.label)
            for i in range(max(1, int(data_mb * 10))):  # 100 kB files
                (data / f"f{i:04d}.bin").write_bytes(rng.randbytes(100_000))

    async def verify(self, episode: TextEpisode, sandbox: Any):
        want = "".join(f"step{j}" for j in range(STEPS))
        check = f"grep -qx {episode.state['word']} answer.txt && [ \"$(tr -d '\\n' < progress.txt)\" = {want} ]"
        return verdict_of_command(await sandbox.run_command(check, self.command_budget_s))


register_task("resume-steps")(StepsTask)


def reply_to(conversation: str) -> str:
    """The scripted model's answer to a conversation (the decoded prompt)."""
    word = next((w for w in WORDS if f"write {w} into" in conversation), "none")
    done = len(_DONE.findall(conversation))
    if done < STEPS:
        command = f"echo step{done} >> progress.txt"
    elif done == STEPS:
        command = f"echo {word} > answer.txt"
    else:
        return "done"
    return '<tool_call>{"name": "bash", "arguments": {"command": "%s"}}</tool_call>' % command


class ScriptedModel(Backend):
    """Answers by :func:`reply_to` after ``gen_s`` seconds; keeps the version the worker loads."""

    name = "scripted"

    def __init__(self, gen_s: float) -> None:
        self.gen_s = gen_s
        self.version = 0
        self.update_pauses_s: list[float] = []
        #: Seconds spent generating, for the benchmark's lost-work figure.
        self.generated_s = 0.0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        await asyncio.sleep(self.gen_s)
        text = reply_to(TEMPLATE.decode(list(prompt_ids)))
        ids = TEMPLATE.encode_text(text)[: params.max_new_tokens - 1] + [TEMPLATE.EOS]
        self.generated_s += time.perf_counter() - t0
        return Generation(ids, [-0.1] * len(ids), "stop", self.version, time.perf_counter() - t0)

    async def reload_weights(self, source: Any, version: int) -> None:
        """Take the new version's number (the script needs no weights)."""
        self.version = version
        self.update_pauses_s.append(0.0)
