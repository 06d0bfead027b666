"""Sessions as dataset rows: what ``agentlog export-dataset`` writes, one row per lineage of a session.

A session whose agent spawned subagents holds several conversations, its
lineages (:mod:`events.schema.lineage`): it makes one row per lineage, in the
order they began, each with ``lineage`` (its id), ``parent_lineage``,
``parent_turn`` and ``spawn_call`` (the parent's tool call that spawned it;
"", null and "" for a root). A session without subagents
makes one row, lineage ``main``. The columns below are per lineage where they
read turns (messages, tools inferred, finish reason, turns, policy versions,
tokens), and the session's elsewhere (outcome, reward, advantage: every lineage
shares its session's).

One streaming pass over a log (:class:`DatasetFold`, fed what
:func:`tools.cli_common.read_tagged` yields) builds, per session and lineage:

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
* the outcome, as the sample pipeline decided it (``Outputs.outcomes``,
  :mod:`reducers.outcome`): ``status`` and ``reason`` (an abort's or a
  drop's), ``reward`` (the reward the reducers resolve,
  :func:`reducers.samples.resolve_reward`; an abort its class counts as a
  failure has the run's failure reward), ``in_baseline`` (whether its
  group's baseline counts it: finished with a usable reward, or an abort
  counted as a failure, unless its health flags make it untrainable: the
  run's ``untrainable_flags``), ``health_flags``
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
  the prompt), as numpy arrays (:func:`token_columns`). An excluded abort,
  or a member its flags make untrainable, has none (its one zero-masked
  placeholder is no data).

Text columns hold JSON text; a recorded value JSON has no form for (bytes in
the ``tools`` metadata or in a tool call's arguments) is refused with a
:class:`DatasetError` naming the LSN, the session and the field.

The samples, groups, outcomes and the lifecycle check come from the reducers
(one :class:`reducers.pipeline.Reducer` per partition: a session never spans
partitions), so a log they refuse is refused here too. A row is complete
when its session's group is released (its advantage needs the group), so
rows come in the order groups complete, members by sample index; the rows of
groups still pending at the end of the log follow, then the sessions still
in flight. Memory holds the sessions and groups in flight, and released
groups' rows up to :data:`ADVANTAGE_BATCH` groups or :data:`SETTLE_BYTES`.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable

from msgspec import UNSET

from agentlog.events.errors import AgentlogError
from agentlog.events.schema.lineage import ROOT_LINEAGE, turn_lineage
from agentlog.events.schema.turn_delta import TurnContext, prompt_token_count
from agentlog.events.schema.types import (
    SessionAborted, SessionDropped, SessionFinished, SessionOpened, SessionStarted, TurnDelta, TurnRecorded,
)
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.fold import ConfirmUsed
from agentlog.reducers.groups import Group
from agentlog.reducers.health import TRUNCATED
from agentlog.reducers.outcome import SessionOutcome
from agentlog.reducers.pipeline import Reducer

#: Statuses a row can have: the terminal states, and the states of a session still in flight at the end of the log.
STATUSES = ("finished", "aborted", "dropped", "open", "running")
#: Released groups whose advantages are computed together (one call of the learner's function), at most ...
ADVANTAGE_BATCH = 512
#: ... and at most about this many bytes of their rows (:func:`row_nbytes`) waiting for it.
SETTLE_BYTES = 32 << 20
#: Where a row's ``tools`` come from.
TOOLS_SOURCES = ("recorded", "inferred", "none")

_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"), (dict, "object"))


class DatasetError(AgentlogError, ValueError):
    """A session whose row cannot be written (a value that is no JSON, a message that is no
    message); the message names the LSN, the session and the field."""


def content_text(content: Any) -> str:
    """A message's content as text, the one reading ``agentlog show`` prints and ``export-dataset``
    writes: a string as it is, None as "", content blocks as each block's text (``<type>`` for a
    block without text) joined by spaces, anything else as ``str``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join((f"<{b.get('type', '?')}>" if b.get("text") is None else str(b["text"])) if isinstance(b, dict) else str(b)
                        for b in content)
    return str(content)


def export_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A recorded tool call (the gateway's ``{"id", "name", "arguments"}`` or the
    OpenAI ``{"id", "type", "function": {...}}``) in the OpenAI form, its
    arguments as JSON text (a string recorded as it is). DatasetError when they
    hold a value JSON has no form for (bytes, say)."""
    inner = call.get("function")
    fn: dict[str, Any] = inner if isinstance(inner, dict) else call
    args = fn.get("arguments", "")
    try:
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"function.arguments: expected JSON values, found {exc}") from None
    return {
        "id": str(call.get("id") or ""),
        "type": str(call.get("type") or "function"),
        "function": {"name": str(fn.get("name", "")), "arguments": text},
    }


def export_message(msg: dict[str, Any]) -> dict[str, Any]:
    """One recorded chat message in the exported form (keys it does not have are left out).
    DatasetError, naming the field, for what cannot be written."""
    if not isinstance(msg, dict):
        raise DatasetError(f"expected a chat message (a dict with a 'role'), found {type(msg).__name__}")
    out: dict[str, Any] = {"role": str(msg.get("role", "")), "content": content_text(msg.get("content"))}
    calls = []
    for j, c in enumerate(msg.get("tool_calls") or ()):
        if isinstance(c, dict):
            try:
                calls.append(export_tool_call(c))
            except DatasetError as exc:
                raise DatasetError(f"tool_calls[{j}].{exc}") from None
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if msg.get(key):
            out[key] = str(msg[key])
    return out


def export_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """:func:`export_message` of each; a DatasetError names the message: ``messages[3].tool_calls[0]...``."""
    out = []
    for i, m in enumerate(messages):
        try:
            out.append(export_message(m))
        except DatasetError as exc:
            raise DatasetError(f"messages[{i}]: {exc}") from None
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


class _Thread:
    """One lineage of a session in flight: what its row needs."""

    __slots__ = ("id", "origin", "held", "last_turn", "turn_lsn", "versions", "turns")

    def __init__(self, lineage: str, origin: Any) -> None:
        self.id = lineage
        self.origin = origin  # its first turn's Lineage record when it names a parent, else None
        self.held: list[Any] = []  # its last turn's messages + its response
        self.last_turn: Any = None
        self.turn_lsn = -1
        self.versions: set[int] = set()
        self.turns = 0


class _Live:
    """What a session in flight needs for its rows."""

    __slots__ = ("pid", "opened", "lsn", "state", "held", "held_tokens", "threads")

    def __init__(self, pid: int | None, opened: SessionOpened, lsn: int) -> None:
        self.pid = pid
        self.opened = opened
        self.lsn = lsn  # its session_opened's
        self.state = "open"
        # The last turn's messages + its response, whatever its lineage (None before a turn), and its
        # prompt + output tokens: what the next turn_delta expands against.
        self.held: list[Any] | None = None
        self.held_tokens = 0
        self.threads: dict[str, _Thread] = {}  # its lineages, in the order they began


def _partition(live: _Live) -> str:
    return "" if live.pid is None else f"partition p{live.pid:04d}: "


class DatasetFold:
    """Rows of the sessions of a log, in one pass (see the module docstring).

    ``feed(pid, env)`` takes each envelope (``pid`` None for a single log) and
    returns the rows it completed; :meth:`finish` returns the rest once the log
    is read. ``keep(row)`` says which rows to build (filters); ``advantages``
    computes the member advantages of released groups (:func:`group_advantages`),
    for up to :data:`ADVANTAGE_BATCH` groups or :data:`SETTLE_BYTES` of rows at a
    time; ``tokens`` adds the token columns (numpy arrays, see :func:`token_columns`)."""

    def __init__(self, config: ReduceConfig, advantages: Callable[[list[float], list[int], list[bool]], list[float]], *,
                 tokens: bool = False, keep: Callable[[dict[str, Any]], bool] = lambda row: True,
                 lineage_members: bool = False, confirm_of: Callable[[int | None], ConfirmUsed] | None = None) -> None:
        """``confirm_of(pid)``: the ``confirm_used`` of partition ``pid``'s reducer (see
        :class:`~agentlog.reducers.pipeline.Reducer`)."""
        self.config = config
        self.confirm_of = confirm_of
        #: The learner's ``lineage_advantage = "member"``: each lineage is a member of its group.
        self.lineage_members = lineage_members
        self._reducers: dict[int | None, Reducer] = {}  # one per partition: a session never spans partitions
        self.tokens = tokens
        self.keep = keep
        self._advantages = advantages
        self._live: dict[tuple[int | None, str], _Live] = {}
        self._held: dict[tuple[int | None, str], dict[str, list[dict[str, Any]]]] = {}  # (pid, group) -> session -> its rows
        self._released_groups: list[tuple[Group, dict[str, list[dict[str, Any]]]]] = []  # awaiting their advantages
        self._released_bytes = 0  # their rows' size (row_nbytes)
        self.sessions = 0  # sessions that ended (every one, kept or not)
        self.left_out = 0  # ended sessions the filters left out

    def _reducer(self, pid: int | None) -> Reducer:
        reducer = self._reducers.get(pid)
        if reducer is None:
            confirm = None if self.confirm_of is None else self.confirm_of(pid)
            reducer = self._reducers[pid] = Reducer(self.config, confirm_used=confirm)
        return reducer

    def feed(self, pid: int | None, env: Any) -> list[dict[str, Any]]:
        """Fold one envelope. Raises ReduceError (naming LSN and session) on what the reducers
        refuse, DatasetError (naming them too) on a session whose row cannot be written."""
        out = self._reducer(pid).feed(env)
        body = env.body
        sid = env.session_id
        key = (pid, sid)
        if type(body) is SessionOpened:
            self._live[key] = _Live(pid, body, env.lsn)
            return []
        live = self._live.get(key)
        if live is None:  # not a session's event (a learner record)
            return []
        if type(body) is TurnDelta:
            # The reducer checked it already; expanded by the owner of the encoding, with its checks.
            context = TurnContext(b"", live.held or [])
            self._turn(live, env.lsn, body, context.expand_messages(body, f"lsn {env.lsn}, session {sid!r}: ", live.held_tokens))
        elif type(body) is TurnRecorded:
            self._turn(live, env.lsn, body, list(body.messages))
        elif type(body) is SessionStarted:
            live.state = "running"
        elif isinstance(body, (SessionFinished, SessionAborted, SessionDropped)):
            del self._live[key]
            self._ended(live, sid, out.outcomes[sid], out.samples, out.flags[sid])
            for g in out.groups:
                rows = self._held.pop((pid, g.group_id), None)
                if rows:
                    self._released_groups.append((g, rows))
                    self._released_bytes += sum(row_nbytes(r) for session in rows.values() for r in session)
            if len(self._released_groups) >= ADVANTAGE_BATCH or self._released_bytes >= SETTLE_BYTES:
                return self._settle()
        return []

    @staticmethod
    def _turn(live: _Live, lsn: int, body: Any, messages: list[Any]) -> None:
        import msgspec

        if body.response_message is not None:
            messages.append(body.response_message)
        live.held = messages
        live.held_tokens = prompt_token_count(body) + len(body.output_ids) // 4
        lineage = turn_lineage(body)
        thread = live.threads.get(lineage)
        if thread is None:
            origin = body.lineage if body.lineage is not UNSET and body.lineage.spawned else None
            thread = live.threads[lineage] = _Thread(lineage, origin)
        thread.held = messages
        thread.last_turn = body
        thread.turn_lsn = lsn
        thread.turns += 1
        thread.versions.add(body.policy_version)
        if body.version_spans is not msgspec.UNSET:
            thread.versions.update(v for _, v in body.version_spans)

    def _rows(self, sid: str, live: _Live, status: str, flags: tuple[str, ...]) -> list[dict[str, Any]]:
        """One row per lineage of the session (one, lineage ``main``, for a session without a turn)."""
        threads: list[_Thread | None] = [*live.threads.values()] or [None]
        return [self._row(sid, live, thread, status, flags) for thread in threads]

    def _row(self, sid: str, live: _Live, thread: _Thread | None, status: str, flags: tuple[str, ...]) -> dict[str, Any]:
        opened = live.opened
        recorded = thread.held if thread is not None else opened.prompt
        where = "" if thread is None or thread.id == ROOT_LINEAGE else f", lineage {thread.id!r}"
        try:
            messages = export_messages(recorded)
        except DatasetError as exc:
            lsn, what = (thread.turn_lsn, "its last turn's") if thread is not None else (live.lsn, "its session_opened prompt's")
            raise DatasetError(f"{_partition(live)}lsn {lsn}, session {sid!r}{where}: {what} {exc}") from None
        tools, source = session_tools(opened.metadata, messages)
        try:
            tools_text = json.dumps(tools, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise DatasetError(f"{_partition(live)}lsn {live.lsn}, session {sid!r}: session_opened metadata 'tools': expected JSON values "
                               f"(a list of function tools), found {exc}") from None
        last = thread.last_turn if thread is not None else None
        origin = thread.origin if thread is not None else None
        return {
            "session_id": sid, "partition": live.pid, "group_id": opened.group_id, "sample_index": opened.sample_index,
            "group_size": opened.group_size, "agent": opened.agent,
            "lineage": thread.id if thread is not None else ROOT_LINEAGE,
            "parent_lineage": origin.parent if origin is not None else "",
            "parent_turn": origin.parent_turn if origin is not None else None,
            "spawn_call": origin.spawn_call if origin is not None else "",
            "label": None if opened.label is None else json.dumps(opened.label, ensure_ascii=False, default=str),
            "messages": messages, "tools": tools_text, "tools_source": source,
            "status": status, "reason": "", "reward": None, "in_baseline": False,
            "truncated": TRUNCATED in flags,
            "finish_reason": None if last is None else last.finish_reason,
            "turns": thread.turns if thread is not None else 0, "policy_versions": sorted(thread.versions) if thread is not None else [],
            "advantage": None, "group_skip_reason": None, "health_flags": list(flags),
        }

    def _ended(self, live: _Live, sid: str, outcome: SessionOutcome, samples: list[Any], flags: tuple[str, ...]) -> None:
        """The rows of a session the pipeline just ended: its outcome as the pipeline decided it
        (:mod:`reducers.outcome`), each lineage's rows' tokens when it makes rows (a placeholder is no data)."""
        self.sessions += 1
        rows = self._rows(sid, live, outcome.status, flags)
        for row in rows:
            row["reason"], row["reward"], row["in_baseline"] = outcome.end_reason, outcome.reward, outcome.in_baseline
        if not self.keep(rows[0]):  # the filters read the session's columns: the same for each of its rows
            self.left_out += 1
            return
        if self.tokens:
            made = samples if outcome.makes_rows else []
            for row in rows:
                row.update(token_columns([s for s in made if s.metadata.get("lineage", ROOT_LINEAGE) == row["lineage"]]))
        self._held.setdefault((live.pid, live.opened.group_id), {})[sid] = rows

    def _settle(self) -> list[dict[str, Any]]:
        """The rows of the released groups waiting, with their advantages (one call for all their groups)."""
        waiting, self._released_groups, self._released_bytes = self._released_groups, [], 0
        advantages = member_advantages([group for group, _held in waiting], self._advantages, self.lineage_members)
        rows: list[dict[str, Any]] = []
        for (group, held), adv in zip(waiting, advantages):
            for m, a in zip(group.members, adv):
                for row in held.get(m.session_id, ()):  # by default every lineage shares its session's advantage
                    row["advantage"] = a.get(row["lineage"], 0.0) if isinstance(a, dict) else a
                    row["in_baseline"] = m.valid
            for session in held.values():
                for row in session:
                    row["group_skip_reason"] = group.skip_reason
            # Members by sample index, each session's lineages in the order they began.
            rows += [r for session in sorted(held.values(), key=lambda rs: (rs[0]["sample_index"], rs[0]["session_id"])) for r in session]
        return rows

    def finish(self) -> list[dict[str, Any]]:
        """The rows left at the end of the log: those of groups not released, then the sessions in flight."""
        rows = self._settle() + [row for held in self._held.values() for session in held.values() for row in session]
        self._held = {}
        for (pid, sid), live in self._live.items():
            session = self._rows(sid, live, live.state, self._reducers[pid].session_flags(sid))
            if self.keep(session[0]):
                for row in session:
                    if self.tokens:
                        row.update(token_columns([]))
                    rows.append(row)
        self._live = {}
        return rows


#: The token columns (``--tokens``), each one array per trajectory row.
TOKEN_COLUMNS = ("token_ids", "loss_mask", "log_probs")


def token_columns(samples: list[Any]) -> dict[str, list[Any]]:
    """Per sample: ``token_ids`` (prompt + response, int32), and ``loss_mask`` (uint8) and
    ``log_probs`` (float32) over the same positions (0 over the prompt); numpy arrays, 4, 1 and
    4 bytes a token (the writers turn them into Arrow arrays or JSON lists)."""
    import numpy as np

    ids, masks, lps = [], [], []
    for s in samples:
        n_prompt = s.prompt_length
        tokens = s.token_ids
        mask = np.zeros(len(tokens), dtype=np.uint8)
        mask[n_prompt:] = s.mask
        lp = np.zeros(len(tokens), dtype=np.float32)
        lp[n_prompt:] = s.log_probs
        ids.append(tokens)
        masks.append(mask)
        lps.append(lp)
    return {"token_ids": ids, "loss_mask": masks, "log_probs": lps}


def row_nbytes(row: dict[str, Any]) -> int:
    """About the bytes a row holds, what the buffers of an export are bounded by: its token
    arrays and its texts (messages, tool-call arguments, tools)."""
    n = len(row.get("tools", ""))
    for m in row["messages"]:
        n += len(m["content"]) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", ()))
    for column in TOKEN_COLUMNS:
        n += sum(a.nbytes for a in row.get(column, ()))
    return n


def _lineage_rewards(member: Any) -> dict[str, float]:
    """A member's lineages, in the order they began, each with its reward: the verifier's own
    for it (``metadata["lineage_reward"]``), else the session's (lineages as members)."""
    out: dict[str, float] = {}
    base = member.reward if member.valid and member.reward is not None else 0.0
    for s in member.samples:
        lineage = s.metadata.get("lineage", ROOT_LINEAGE)
        if lineage not in out:
            own = s.metadata.get("lineage_reward")
            out[lineage] = float(own) if member.valid and own is not None else base
    return out or {ROOT_LINEAGE: base}


def member_advantages(groups: list[Group], advantages: Callable[[list[float], list[int], list[bool]], list[float]],
                      lineage_members: bool = False) -> list[list[Any]]:
    """Per group, its members' advantages (in ``group.members`` order) as the learner computes
    them, in one call of ``advantages`` (:func:`group_advantages`) for all the groups: 0.0 for a
    member outside the baseline (not valid) and for every member of a skipped group. With
    ``lineage_members`` each lineage of a session is a member of its own (the learner's
    ``lineage_advantage = "member"``), and a member's advantage is a dict lineage -> advantage."""
    rewards: list[float] = []
    index: list[int] = []
    valid: list[bool] = []
    for i, group in enumerate(groups):
        if not group.skipped:
            for m in group.members:
                parts = _lineage_rewards(m).values() if lineage_members else [m.reward if m.valid and m.reward is not None else 0.0]
                for reward in parts:
                    rewards.append(reward)
                    index.append(i)
                    valid.append(m.valid)
    adv = iter(advantages(rewards, index, valid) if rewards else ())
    out: list[list[Any]] = []
    for group in groups:
        values: list[Any] = []
        for m in group.members:
            if lineage_members:
                per_lineage = {}
                for lineage in _lineage_rewards(m):
                    a = 0.0 if group.skipped else next(adv)
                    per_lineage[lineage] = a if m.valid else 0.0
                values.append(per_lineage)
            else:
                a = 0.0 if group.skipped else next(adv)
                values.append(a if m.valid else 0.0)
        out.append(values)
    return out


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
