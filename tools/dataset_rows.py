"""Sessions as dataset rows: what ``agentlog export-dataset`` writes, one row per session.

One streaming pass over a log (:class:`DatasetFold`, fed what
:func:`tools.cli_common.read_tagged` yields) builds, per session:

* ``messages``: its final conversation, the last recorded turn's messages (a
  ``turn_delta`` expanded against the turn before, as
  :mod:`events.schema.turn_delta` defines it) followed by that turn's
  response message; a session without a turn has its ``session_opened``
  prompt. Each message in the OpenAI chat form Hugging Face chat templates
  and TRL take (:func:`export_message`): ``role``, ``content`` (text),
  ``tool_calls`` (``{"id", "type": "function", "function": {"name",
  "arguments"}}``, arguments as JSON text), ``tool_call_id``, ``name``. It is
  what ``agentlog show`` prints as the session's transcript;
* ``tools``: the tool definitions as JSON text (a list of OpenAI function
  tools). The log does not hold what a client declared, so they are the
  ``tools`` entry of the session's ``session_opened`` metadata when its
  harness recorded one (``tools_source`` "recorded"), else inferred from
  the calls the session made (``"inferred"``: one function per name called,
  its parameters the argument names seen, typed by their JSON values, no
  description), or ``[]`` (``"none"``);
* the outcome: ``status`` and ``reason``, ``reward`` (the reward the
  reducers resolve, :func:`reducers.samples.resolve_reward`; an abort its
  class counts as a failure has the run's failure reward), ``in_baseline``
  (whether its group's baseline counts it: finished with a usable reward, or
  an abort counted as a failure, unless its health flags make it
  untrainable: the run's ``untrainable_flags``), ``health_flags``
  (:mod:`reducers.health`, as ``show`` prints them; a session in flight has
  those decided so far), ``truncated`` (some turn stopped at its token limit:
  the ``truncated`` flag) and the final turn's ``finish_reason``, ``turns``,
  ``policy_versions`` (every version that generated a token of it), the
  group, and ``advantage``: the member's advantage as the learner computes
  it (:func:`learner.advantages.compute_advantages` over its released group,
  with the run's estimator), 0 for a member outside the baseline or of a
  group the reducers release as skipped, null for a dropped session and for
  one whose group is not released by the end of the log;
* with ``tokens``: per trajectory row the reducer makes of it (the samples
  ``reconstruct`` writes, :mod:`reducers.samples`), ``token_ids`` (prompt +
  response), ``loss_mask`` and ``log_probs`` over the same positions (0 over
  the prompt). An excluded abort, or a member its flags make untrainable,
  has none (its one zero-masked placeholder is no data).

The samples, groups and the lifecycle check come from the reducers
(:class:`reducers.partitioned.PartitionFold`, one reducer per partition), so
a log they refuse is refused here too. A row is complete when its session's
group is released (its advantage needs the group), so rows come in the order
groups complete, members by sample index; the rows of groups still pending at
the end of the log follow, then the sessions still in flight. Memory holds
the sessions and groups in flight.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable

from agentlog.events.schema.types import (
    RewardAssigned, SessionAborted, SessionDropped, SessionFinished, SessionOpened, SessionStarted, TurnDelta, TurnRecorded,
)
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.groups import Group, aborted_as_failure
from agentlog.reducers.health import TRUNCATED, untrainable_by
from agentlog.reducers.samples import final_raw_reward, resolve_reward

#: Statuses a row can have: the terminal states, and the states of a session still in flight at the end of the log.
STATUSES = ("finished", "aborted", "dropped", "open", "running")
#: Released groups whose advantages are computed together (one call of the learner's function).
ADVANTAGE_BATCH = 512
#: Where a row's ``tools`` come from.
TOOLS_SOURCES = ("recorded", "inferred", "none")

_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"), (dict, "object"))


def content_text(content: Any) -> str:
    """A message's content as text: a string as it is, None as "", content blocks
    as ``agentlog show`` prints them (each block's text, ``<type>`` for a block
    without text, joined by spaces)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(b.get("text", f"<{b.get('type', '?')}>") if isinstance(b, dict) else str(b) for b in content)
    return str(content)


def export_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A recorded tool call (the gateway's ``{"id", "name", "arguments"}`` or the
    OpenAI ``{"id", "type", "function": {...}}``) in the OpenAI form, its
    arguments as JSON text (a string recorded as it is)."""
    inner = call.get("function")
    fn: dict[str, Any] = inner if isinstance(inner, dict) else call
    args = fn.get("arguments", "")
    return {
        "id": str(call.get("id") or ""),
        "type": str(call.get("type") or "function"),
        "function": {"name": str(fn.get("name", "")),
                     "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)},
    }


def export_message(msg: dict[str, Any]) -> dict[str, Any]:
    """One recorded chat message in the exported form (keys it does not have are left out)."""
    out: dict[str, Any] = {"role": str(msg.get("role", "")), "content": content_text(msg.get("content"))}
    calls = [export_tool_call(c) for c in msg.get("tool_calls") or () if isinstance(c, dict)]
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if msg.get(key):
            out[key] = str(msg[key])
    return out


def _json_type(value: Any) -> str:
    return next((name for t, name in _JSON_TYPES if isinstance(value, t)), "null")


def infer_tools(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Function-tool definitions read off the calls in exported ``messages``: one
    per name, in the order first called; its parameters the argument names seen
    (typed by their JSON values), required when every call gave them."""
    props: dict[str, dict[str, set[str]]] = {}
    required: dict[str, set[str]] = {}
    for m in messages:
        for call in m.get("tool_calls", ()):
            name = call["function"]["name"]
            try:
                args = json.loads(call["function"]["arguments"])
            except ValueError:
                args = None
            keys = args if isinstance(args, dict) else {}
            seen = props.setdefault(name, {})
            for k, v in keys.items():
                seen.setdefault(k, set()).add(_json_type(v))
            required[name] = set(keys) if name not in required else required[name] & set(keys)
    tools = []
    for name, seen in props.items():
        properties = {k: {"type": next(iter(types)) if len(types) == 1 else sorted(types)} for k, types in seen.items()}
        tools.append({"type": "function", "function": {
            "name": name, "description": "",
            "parameters": {"type": "object", "properties": properties, "required": sorted(required[name])}}})
    return tools


def session_tools(metadata: Any, messages: list[dict[str, Any]]) -> tuple[list[Any], str]:
    """``(definitions, source)`` of a session's tools (see the module docstring)."""
    recorded = metadata.get("tools") if isinstance(metadata, dict) else None
    if isinstance(recorded, list) and all(isinstance(t, dict) for t in recorded):
        return recorded, "recorded"
    inferred = infer_tools(messages)
    return inferred, ("inferred" if inferred else "none")


class _Live:
    """What a session in flight needs for its row."""

    __slots__ = ("pid", "opened", "state", "held", "last_turn", "versions", "turns", "assigned")

    def __init__(self, pid: int | None, opened: SessionOpened) -> None:
        self.pid = pid
        self.opened = opened
        self.state = "open"
        self.held: list[Any] | None = None  # the last turn's messages + its response (None before a turn)
        self.last_turn: Any = None
        self.versions: set[int] = set()
        self.turns = 0
        self.assigned: Any = None  # the last reward_assigned value


class DatasetFold:
    """Rows of the sessions of a log, in one pass (see the module docstring).

    ``feed(pid, env)`` takes each envelope (``pid`` None for a single log) and
    returns the rows it completed; :meth:`finish` returns the rest once the log
    is read. ``keep(row)`` says which rows to build (filters); ``advantages``
    computes the member advantages of released groups (:func:`group_advantages`),
    taken :data:`ADVANTAGE_BATCH` groups at a time; ``tokens`` adds the token columns."""

    def __init__(self, config: ReduceConfig, advantages: Callable[[list[float], list[int], list[bool]], list[float]], *,
                 tokens: bool = False, keep: Callable[[dict[str, Any]], bool] = lambda row: True) -> None:
        from agentlog.reducers.partitioned import PartitionFold

        self.config = config
        self.fold = PartitionFold(config)
        self.tokens = tokens
        self.keep = keep
        self._advantages = advantages
        self._live: dict[tuple[int | None, str], _Live] = {}
        self._held: dict[tuple[int | None, str], dict[str, dict[str, Any]]] = {}  # (pid, group) -> session -> row
        self._released_groups: list[tuple[Group, dict[str, dict[str, Any]]]] = []  # awaiting their advantages
        self.sessions = 0  # sessions that ended (every one, kept or not)
        self.left_out = 0  # ended sessions the filters left out

    def feed(self, pid: int | None, env: Any) -> list[dict[str, Any]]:
        """Fold one envelope. Raises ReduceError (naming LSN and session) on what the reducers refuse."""
        out = self.fold.reducer_of(pid or 0).feed(env)
        body = env.body
        key = (pid, env.session_id)
        if type(body) is SessionOpened:
            self._live[key] = _Live(pid, body)
            return []
        live = self._live.get(key)
        if live is None:  # not a session's event (a learner record)
            return []
        if type(body) is TurnDelta:
            before = live.held or []
            self._turn(live, body, before[: body.shared_messages] + body.new_messages)
        elif type(body) is TurnRecorded:
            self._turn(live, body, list(body.messages))
        elif type(body) is SessionStarted:
            live.state = "running"
        elif type(body) is RewardAssigned:
            live.assigned = body.reward
        elif isinstance(body, (SessionFinished, SessionAborted, SessionDropped)):
            del self._live[key]
            self._ended(live, env, body, out.samples, out.flags[env.session_id])
            for g in out.groups:
                rows = self._held.pop((pid, g.group_id), None)
                if rows:
                    self._released_groups.append((g, rows))
            return self._settle() if len(self._released_groups) >= ADVANTAGE_BATCH else []
        return []

    @staticmethod
    def _turn(live: _Live, body: Any, messages: list[Any]) -> None:
        import msgspec

        if body.response_message is not None:
            messages.append(body.response_message)
        live.held = messages
        live.last_turn = body
        live.turns += 1
        live.versions.add(body.policy_version)
        if body.version_spans is not msgspec.UNSET:
            live.versions.update(v for _, v in body.version_spans)

    def _row(self, sid: str, live: _Live, status: str, flags: tuple[str, ...]) -> dict[str, Any]:
        opened = live.opened
        recorded = live.held if live.held is not None else opened.prompt
        messages = [export_message(m) for m in recorded]
        tools, source = session_tools(opened.metadata, messages)
        last = live.last_turn
        return {
            "session_id": sid, "partition": live.pid, "group_id": opened.group_id, "sample_index": opened.sample_index,
            "group_size": opened.group_size, "agent": opened.agent,
            "label": None if opened.label is None else json.dumps(opened.label, ensure_ascii=False, default=str),
            "messages": messages, "tools": json.dumps(tools, ensure_ascii=False), "tools_source": source,
            "status": status, "reason": "", "reward": None, "in_baseline": False,
            "truncated": TRUNCATED in flags,
            "finish_reason": None if last is None else last.finish_reason,
            "turns": live.turns, "policy_versions": sorted(live.versions),
            "advantage": None, "group_skip_reason": None, "health_flags": list(flags),
        }

    def _ended(self, live: _Live, env: Any, body: Any, samples: list[Any], flags: tuple[str, ...]) -> None:
        self.sessions += 1
        row = self._row(env.session_id, live, body.__struct_config__.tag.removeprefix("session_"), flags)
        trains = True  # whether the reducers made rows of it (else one placeholder, or nothing)
        if isinstance(body, SessionFinished):
            row["reward"], _problem = resolve_reward(final_raw_reward(body.reward, live.assigned), self.config.reward_key)
            row["in_baseline"] = row["reward"] is not None
        elif isinstance(body, SessionAborted) and aborted_as_failure(body, self.config):
            row["reason"], row["reward"], row["in_baseline"] = body.reason, self.config.fail_reward, True
        else:
            row["reason"], trains = body.reason, False
        if trains and untrainable_by(flags, self.config):
            row["in_baseline"] = trains = False  # its flags make it untrainable: one placeholder, out of the baseline
        if not trains:
            samples = []  # a placeholder carries no data
        if not self.keep(row):
            self.left_out += 1
            return
        if self.tokens:
            row.update(token_columns(samples))
        self._held.setdefault((live.pid, live.opened.group_id), {})[env.session_id] = row

    def _settle(self) -> list[dict[str, Any]]:
        """The rows of the released groups waiting, with their advantages (one call for all their groups)."""
        waiting, self._released_groups = self._released_groups, []
        rewards: list[float] = []
        index: list[int] = []
        valid: list[bool] = []
        for i, (group, _held) in enumerate(waiting):
            if not group.skipped:
                for m in group.members:
                    rewards.append(m.reward if m.valid and m.reward is not None else 0.0)
                    index.append(i)
                    valid.append(m.valid)
        adv = iter(self._advantages(rewards, index, valid) if rewards else ())
        rows: list[dict[str, Any]] = []
        for group, held in waiting:
            for m in group.members:
                a = 0.0 if group.skipped else next(adv)
                row = held.get(m.session_id)
                if row is not None:
                    row["advantage"] = a if m.valid else 0.0
                    row["in_baseline"] = m.valid
            for row in held.values():
                row["group_skip_reason"] = group.skip_reason
            rows += sorted(held.values(), key=lambda r: (r["sample_index"], r["session_id"]))
        return rows

    def finish(self) -> list[dict[str, Any]]:
        """The rows left at the end of the log: those of groups not released, then the sessions in flight."""
        rows = self._settle() + [row for held in self._held.values() for row in held.values()]
        self._held = {}
        for (pid, sid), live in self._live.items():
            row = self._row(sid, live, live.state, self.fold.reducer_of(pid or 0).session_flags(sid))
            if self.keep(row):
                if self.tokens:
                    row.update(token_columns([]))
                rows.append(row)
        self._live = {}
        return rows


def token_columns(samples: list[Any]) -> dict[str, list[list[Any]]]:
    """Per sample: ``token_ids`` (prompt + response), and ``loss_mask`` and ``log_probs`` over the
    same positions (0 over the prompt)."""
    import numpy as np

    ids, masks, lps = [], [], []
    for s in samples:
        n_prompt = s.prompt_length
        mask = np.zeros(len(s.tokens) // 4, dtype=np.uint8)
        mask[n_prompt:] = s.mask
        lp = np.zeros(len(mask), dtype=np.float32)
        lp[n_prompt:] = s.log_probs
        ids.append(s.token_ids.tolist())
        masks.append(mask.tolist())
        lps.append(lp.tolist())
    return {"token_ids": ids, "loss_mask": masks, "log_probs": lps}


def group_advantages(estimator: str, eps: float) -> Callable[[list[float], list[int], list[bool]], list[float]]:
    """``(rewards, group index, valid) -> advantages`` of the members of some groups, as
    the learner computes them for a batch (:func:`learner.advantages.compute_advantages`,
    per group, float64 in, float32 out)."""
    import torch

    from agentlog.learner.advantages import compute_advantages

    def of(rewards: list[float], groups: list[int], valid: list[bool]) -> list[float]:
        adv = compute_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups, dtype=torch.long),
                                 torch.tensor(valid, dtype=torch.bool), estimator=estimator, eps=eps)
        return adv.to(torch.float32).tolist()

    return of
