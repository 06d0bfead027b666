"""Abort classes: what an aborted session means for its group, one rule.

Every abort reason belongs to one class, by the reason itself or by its head
(the text before the first ``:``, so ``verifier_failed:KeyError`` is the
``verifier_failed`` reason):

* **infrastructure** — the abort says nothing about the policy: the sandbox or
  the harness failed to set up, the engine restarted, a server or a tool died;
* **policy** — the policy caused it: it ran past its wall-clock budget, made
  too many tool calls, outgrew its context;
* **task** — the task's own code failed: the verifier crashed;
* **other** — a reason none of the tables name (a user's own).

Each class gets one outcome:

* ``exclude`` — the member stays out of its group's baseline and contributes
  exactly zero (one zero-masked placeholder row);
* ``fail`` — the member counts as a failure: it joins the baseline with
  ``fail_reward``, and its recorded turns train like a finished session's;
* ``refill`` — excluded, and the engine owes the group a replacement: a new
  session for the same prompt that ``replaces`` it (per-sample refill). The
  engine records that decision on the abort itself (``session_aborted.refill``),
  so the reducers follow the log, never a setting.

A new run's ``[groups]`` table defaults to :data:`RUN_OUTCOMES`: a policy abort
is a failure (refilling it would hide from training what the policy spent;
excluding it would drop exactly the episodes the policy made too long), every
other class is excluded. The reducers' own default
(:class:`~agentlog.reducers.config.ReduceConfig`, what a bare log is folded
with) is :data:`EXCLUDE_ALL`, what every log before abort classes was trained
with, so an old log rebuilds byte for byte; so does a run folder saved before
the table existed (:func:`agentlog.loop.config.saved_groups_table`). Reasons
are matched exactly first, then by head.
"""

from __future__ import annotations

from typing import Any, Mapping

from agentlog.events.schema.validation import is_number

INFRASTRUCTURE = "infrastructure"
POLICY = "policy"
TASK = "task"
OTHER = "other"
#: Every abort class, in the order tables list them.
ABORT_CLASSES: tuple[str, ...] = (INFRASTRUCTURE, POLICY, TASK, OTHER)

EXCLUDE = "exclude"
FAIL = "fail"
REFILL = "refill"
#: What an aborted member of each class can get.
ABORT_OUTCOMES: tuple[str, ...] = (EXCLUDE, FAIL, REFILL)

#: A new run's ``[groups]`` defaults: a policy abort is a failure, the others are excluded.
RUN_OUTCOMES: dict[str, str] = {INFRASTRUCTURE: EXCLUDE, POLICY: FAIL, TASK: EXCLUDE, OTHER: EXCLUDE}
#: The reducers' default, and what every log before abort classes was trained with: each abort excluded.
EXCLUDE_ALL: dict[str, str] = dict.fromkeys(ABORT_CLASSES, EXCLUDE)

#: The class of each abort reason agentlog itself records (by the reason or its
#: head). A run's ``[groups] reasons`` table adds to it and overrides it.
DEFAULT_REASON_CLASSES: dict[str, str] = {
    # The sandbox, harness, engine or a server failed: nothing the policy did.
    "engine_restart": INFRASTRUCTURE,
    "setup_failed": INFRASTRUCTURE,
    "admin_open_failed": INFRASTRUCTURE,
    "agent_crashed": INFRASTRUCTURE,
    "exception": INFRASTRUCTURE,
    "empty_done_marker": INFRASTRUCTURE,
    "server_error": INFRASTRUCTURE,
    "partition_lost": INFRASTRUCTURE,
    # The policy ran out of a budget it spent itself.
    "wall_clock_timeout": POLICY,
    "too_many_tool_calls": POLICY,
    "max_turns": POLICY,
    "context_exceeded": POLICY,
    # The task's own code.
    "verifier_failed": TASK,
}


def reason_head(reason: str) -> str:
    """The reason without its detail: the text before the first ``:``."""
    return reason.split(":", 1)[0]


def abort_class(reason: str, overrides: Mapping[str, str] | None = None) -> str:
    """The class of abort ``reason``: ``overrides`` (reason or head -> class) first,
    then :data:`DEFAULT_REASON_CLASSES`, each by the exact reason, then by its head;
    :data:`OTHER` when neither names it."""
    head = reason_head(reason)
    for table in (overrides or {}, DEFAULT_REASON_CLASSES):
        found = table.get(reason) or table.get(head)
        if found:
            return found
    return OTHER


def abort_outcome(reason: str, outcomes: Mapping[str, str], overrides: Mapping[str, str] | None = None) -> str:
    """What an aborted member gets for ``reason``: ``outcomes[its class]``, else
    :data:`EXCLUDE` (zero contribution, out of the baseline)."""
    return outcomes.get(abort_class(reason, overrides), EXCLUDE)


def check_abort_settings(outcomes: Mapping[str, str], reasons: Mapping[str, str], fail_reward: Any, max_refills: Any,
                         where: str) -> str:
    """Why the abort-class settings are not valid, naming ``where`` (the table) and the entry,
    or "" when they are: ``outcomes`` (class -> outcome), ``reasons`` (reason -> class), the
    failure reward (a finite number) and the refill cap (an int >= 0). The one check of them,
    for the reducers' configuration and a run's ``[groups]`` table alike."""
    if not is_number(fail_reward):
        return f"{where} fail_reward: expected a finite number, found {fail_reward!r}"
    if type(max_refills) is not int or max_refills < 0:
        return f"{where} max_refills: expected an int >= 0, found {max_refills!r}"
    if not isinstance(outcomes, Mapping) or not isinstance(reasons, Mapping):
        return f"{where}: expected tables (class -> outcome, reason -> class), found {outcomes!r} and {reasons!r}"
    for cls, outcome in outcomes.items():
        if cls not in ABORT_CLASSES:
            return f"{where}: unknown abort class {cls!r}; expected one of {', '.join(ABORT_CLASSES)}"
        if outcome not in ABORT_OUTCOMES:
            return f"{where}: class {cls!r} gets {outcome!r}; expected one of {', '.join(ABORT_OUTCOMES)}"
    for reason, cls in reasons.items():
        if not isinstance(reason, str) or not reason:
            return f"{where}: an abort reason must be a non-empty string, found {reason!r}"
        if cls not in ABORT_CLASSES:
            return f"{where}: reason {reason!r} is put in class {cls!r}; expected one of {', '.join(ABORT_CLASSES)}"
    return ""
