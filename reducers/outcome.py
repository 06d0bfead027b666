"""What a session's terminal event makes of it as a member of its group: the one rule.

Every fold that decides "does this member train, with what reward, in its
group's baseline or not" takes the answer from :func:`session_outcome`: the
sample pipeline (:class:`reducers.pipeline.Reducer`, which hands it out as
``Outputs.outcomes``), the run statistics (:class:`reducers.runstats.RunStats`)
and through the pipeline ``show`` and ``export-dataset``. The rule:

* a finished session's turns become rows with the reward it resolves to
  (:func:`reducers.samples.resolve_reward` of the finish's reward, else the
  last ``reward_assigned``); it is in the baseline when that reward is usable;
* an aborted session its abort class counts as a failure
  (:func:`reducers.groups.aborted_as_failure`) trains like a finished one,
  with ``config.fail_reward``, in the baseline; any other abort is excluded:
  one zero-masked placeholder, out of the baseline;
* a member that would train (the two cases above) whose health flags
  ``config.untrainable_flags`` names is made an excluded one instead
  (:func:`reducers.health.untrainable_by`); flags never change an excluded
  abort or a drop;
* a dropped session is no member at all.

Pure: no clock, randomness, I/O or torch. ``body`` is the terminal event's
body, or any projection of it carrying the same fields (``reward``;
``reason`` and ``refill`` of an abort; the statistics' projections do).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .config import ReduceConfig
from .groups import ABORTED, DROPPED, FINISHED, GroupMember, aborted_as_failure
from .health import untrainable_by, untrainable_reason
from .samples import final_raw_reward, resolve_reward

_STATUS = {"session_finished": FINISHED, "session_aborted": ABORTED, "session_dropped": DROPPED}


class SessionOutcome(NamedTuple):
    """What an ended session is to its group (see the module docstring)."""

    #: finished / aborted / dropped.
    status: str
    #: Its recorded turns become training rows (else one zero-masked placeholder, or nothing for a drop).
    makes_rows: bool
    #: It counts in its group's baseline (:attr:`GroupMember.valid`).
    in_baseline: bool
    #: The reward it resolves to, whatever its flags: a finished session's usable reward (None when
    #: unusable), ``fail_reward`` for an abort counted as a failure, None otherwise.
    reward: float | None
    #: The member's reason: why a finished member is out of the baseline (an unusable reward, or
    #: ``untrainable: <flags>``), an abort's or a drop's reason.
    reason: str
    #: The abort's or drop's own reason ("" for a finished session).
    end_reason: str
    #: A finished session's raw reward (what the metrics count), None otherwise.
    raw_reward: Any
    #: The health flags that made a member that would train untrainable (sorted; empty: none did).
    untrainable: tuple[str, ...]

    @property
    def member_reward(self) -> float | None:
        """The reward its group's baseline counts (:attr:`GroupMember.reward`): None out of the baseline."""
        return self.reward if self.in_baseline else None

    def member(self, session_id: str, sample_index: int, samples: tuple[Any, ...] = ()) -> GroupMember | None:
        """Its :class:`GroupMember` with ``samples`` (None for a dropped session: no member)."""
        if self.status == DROPPED:
            return None
        return GroupMember(session_id, sample_index, self.status, self.in_baseline, self.member_reward, self.reason, samples)


def would_make_rows(body: Any, config: ReduceConfig) -> bool:
    """Whether the terminal ``body`` makes its session's turns into rows before its flags are
    known: finished, or aborted as a failure (the sessions whose flags can make them untrainable)."""
    return session_outcome(body, None, (), config).makes_rows  # the one rule, before any flag


def session_outcome(body: Any, last_reward: Any, flags: tuple[str, ...], config: ReduceConfig) -> SessionOutcome:
    """The outcome of a session ended by ``body`` (its terminal event), after ``last_reward``
    (the last ``reward_assigned`` value, None without one) and with health ``flags``."""
    tag = body.__struct_config__.tag
    status = _STATUS.get(tag)
    if status is None:
        raise ValueError(f"session_outcome: expected a terminal event ({', '.join(_STATUS)}), found {tag!r}")
    if status == DROPPED:
        return SessionOutcome(DROPPED, False, False, None, body.reason, body.reason, None, ())
    if status == FINISHED:
        raw = final_raw_reward(body.reward, last_reward)
        reward, problem = resolve_reward(raw, config.reward_key)
        bad = untrainable_by(flags, config)
        if bad:
            return SessionOutcome(FINISHED, False, False, reward, untrainable_reason(bad), "", raw, bad)
        return SessionOutcome(FINISHED, True, reward is not None, reward, problem, "", raw, ())
    if not aborted_as_failure(body, config):
        return SessionOutcome(ABORTED, False, False, None, body.reason, body.reason, None, ())
    bad = untrainable_by(flags, config)
    return SessionOutcome(ABORTED, not bad, not bad, config.fail_reward, body.reason, body.reason, None, bad)
