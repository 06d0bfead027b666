"""One filled-in instance of every schema-v1 event type, for round-trip and log tests."""

from __future__ import annotations

import numpy as np

from agentlog.events.schema.types import (
    EVENT_TYPES,
    CommandRan,
    PolicyUpdated,
    RewardAssigned,
    SandboxSnapshotted,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SessionResumed,
    SessionStarted,
    TeacherScored,
    TurnDelta,
    TurnRecorded,
    TurnUndelivered,
)


def golden_events() -> list:
    """One instance of each event type the golden fixtures were written with
    (tests/fixtures/make_golden.py; their bytes are pinned, so this list never
    changes), with non-default values in every field."""
    return [
        SessionOpened(
            group_id="g-0",
            group_size=4,
            sample_index=2,
            prompt=[{"role": "user", "content": "fix the bug ✓"}],
            prompt_ids=[1, 2, 3],
            label={"answer": 42},
            agent="swe",
            policy_version=7,
            metadata={"task": "t1"},
        ),
        SessionStarted(harness="mini-swe", sandbox="docker:abc", details={"image": "py311"}),
        TurnRecorded(
            turn_index=3,
            messages=[{"role": "user", "content": "hi"}],
            prompt_ids=np.arange(5, dtype=np.int64),
            output_ids=[10, -1, 2**31 - 1],
            output_log_probs=[-0.5, -1.25, 0.0],
            finish_reason="length",
            response_message={"role": "assistant", "content": "ok"},
            ill_formed=True,
            policy_version=7,
            generate_s=0.25,
            sampling={"temperature": 1.0},
        ),
        TurnUndelivered(turn_index=3, reason="client gone"),
        CommandRan(command="pytest -x", exit_code=None, budget_exceeded=True, duration_s=1.5, output_tail="E   fail"),
        RewardAssigned(reward={"pass": 1.0, "style": 0.5}, source="verifier"),
        SessionFinished(reward=0.75, metadata={"turns": 4}),
        SessionAborted(reason="timeout", error="TimeoutError()", traceback="Traceback...\n"),
        SessionDropped(reason="shutdown"),
        PolicyUpdated(step=3, policy_version=8, checkpoint="ckpt/8", metrics={"loss/policy": 0.1}, sample_digest="ab", lsn_start=0, lsn_end=9, groups=["g-0"]),
    ]


def every_event() -> list:
    """One instance of each event type: the golden ones, then the types added since."""
    out = golden_events() + [
        TurnDelta(
            turn_index=4,
            shared_tokens=8,
            new_prompt_ids=[7, 8],
            shared_messages=2,
            new_messages=[{"role": "tool", "content": "ok ✓"}],
            output_ids=[11, 12],
            output_log_probs=[-0.5, -0.25],
            finish_reason="stop",
            response_message={"role": "assistant", "content": "done"},
            ill_formed=True,
            policy_version=7,
            generate_s=0.5,
            sampling={"temperature": 0.7},
        ),
        TeacherScored(
            turn_index=4, teacher="big-gpt", teacher_version="sha256:ab12", temperature=0.7,
            log_probs=[-0.25, -1.5], start=1, top_k=2, top_ids=[11, 3, 12, 9], top_log_probs=[-0.25, -2.0, -1.5, -1.75],
        ),
        SandboxSnapshotted(turn_index=4, digest="ab" * 32, files=12, bytes=52_428_800, new_bytes=4096, seconds=0.03),
        SessionResumed(incarnation=2, durable_turns=5, snapshot="cd" * 32, snapshot_turn=4, worker="p0003"),
    ]
    assert {type(e) for e in out} == set(EVENT_TYPES), "every_event() must cover every event type"
    return out


def small_event(i: int) -> CommandRan:
    """A small (< 200 bytes framed) event whose content is derived from ``i``."""
    return CommandRan(command=f"ls {i}", exit_code=i % 3, duration_s=i / 8)
