"""`agentlog show LOG SESSION`: one session in depth.

Prints its header, outcome and health flags (:mod:`reducers.health`; those
that made it untrainable are marked, as the pipeline applies its run's
``untrainable_flags``: only to a member that would train,
:mod:`reducers.outcome`), then what answers "why did
it score so": its label, the reward and where it came from
(``session_finished`` or the last ``reward_assigned`` and its source), the
verifier's detail (finish metadata) and, for an aborted session, the error
and its traceback. Then
its timeline (state before -> after per event), its transcript (the
messages new at each turn, the response text and tool calls, each command's
output, each sandbox snapshot; a session without a turn, its
``session_opened`` prompt; long texts cut, ``--full`` shows all), with a
marker line where a new incarnation resumed the session and the dead
incarnation's records that resume made void marked undone
(:func:`resume_marks`, which the ui shows too), its turn tree as the reducer
routed it (per turn: routing, leaf, drift decision CLEAN / REALIGN / FORK,
trainable or why not), and each trajectory row as the sample it becomes:
prompt tokens, then the response tokens in runs marked ``train[...]`` (loss
mask 1) or ``ctx[...]`` (mask 0), with the reward and status. A session whose agent spawned subagents
names each turn's and row's lineage, and its ``lineages`` section prints the lineage tree
(:mod:`tools.lineage_view`): each lineage under its parent, with the parent turn, the tool call that
spawned it and how they were matched. Everything comes from the log through the same
reducers as reconstruction (:func:`reducers.pipeline.session_trajectory`,
:class:`reducers.pipeline.Reducer`). Unknown session: exit 2.

A partitioned log (a run folder whose ``rollout/`` holds ``p%04d``
partitions, or that ``rollout/`` itself) is searched in every partition; the
session is shown from the one partition that holds it (a session never spans
partitions), its header names that partition and every event is named
``p0003:1234`` (partition:LSN). A session id found in two partitions is a
reused id: exit 1 naming where each holds it (``agentlog verify`` reports it too).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import add_quiet, check_log_path, read_records, read_tagged, record_id, reduce_config_of
from agentlog.tools.cmd_replay import command_outcome

#: Prompts longer than this are shown as their head and tail.
PROMPT_SHOWN = 48
#: Texts (messages, command output, label) longer than this many characters are cut without --full.
TEXT_SHOWN = 400
#: The last lines of an abort traceback shown without --full.
TRACEBACK_LINES = 12


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("show", help="one session in depth: timeline, tree, drift decisions, rows with loss mask")
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument("session", metavar="SESSION", help="the session id")
    p.add_argument("--full", action="store_true", help=f"never cut texts (messages over {TEXT_SHOWN} characters, tracebacks over {TRACEBACK_LINES} lines)")
    add_quiet(p)
    p.set_defaults(func=run)


def session_envelopes(path: Any, session_id: str, *, quiet: bool = False) -> list:
    """The session's envelopes, in order (other sessions' frames are never decoded)."""
    out = []
    for rec in read_records(path, raw=True, quiet=quiet, desc="show"):
        if rec.session_id == session_id:
            try:
                out.append(rec.decode())
            except ValueError as exc:
                raise CliError(f"{path}: lsn {rec.lsn}, session {session_id!r}: payload is not a schema-v1 event: {exc}", EXIT_DATA) from None
    return out


def partition_session_envelopes(path: Any, session_id: str, *, quiet: bool = False) -> tuple[int | None, list]:
    """``(partition, envelopes)`` of the session in the partitioned log at
    ``path``: the one partition holding it and its envelopes in LSN order
    (``(None, [])`` when no partition holds it). A session found in more than
    one partition is a reused id: CliError(1) naming each partition's LSN range."""
    found: dict[int, list] = {}
    for pid, rec in read_tagged(path, raw=True, quiet=quiet, desc="show"):
        if rec.session_id == session_id:
            try:
                found.setdefault(pid, []).append(rec.decode())
            except ValueError as exc:
                raise CliError(
                    f"{path}: lsn {record_id(pid, rec.lsn)}, session {session_id!r}: payload is not a schema-v1 event: {exc}", EXIT_DATA
                ) from None
    if len(found) > 1:
        held = " and ".join(f"{record_id(pid, envs[0].lsn)}..{envs[-1].lsn} ({len(envs)} events)" for pid, envs in sorted(found.items()))
        raise CliError(
            f"{path}: session {session_id!r} is in {len(found)} partitions: {held}; a session never spans partitions"
            f" (a reused id; `agentlog verify` names it); show one partition, e.g. {path}/p{min(found):04d}", EXIT_DATA)
    return next(iter(found.items()), (None, []))


def mask_runs(tokens: Any, mask: Any) -> list[tuple[int, list[int]]]:
    """Split response tokens into runs of equal mask: ``[(mask, [ids...]), ...]``."""
    runs: list[tuple[int, list[int]]] = []
    for tok, m in zip(tokens.tolist(), mask.tolist()):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(tok)
        else:
            runs.append((m, [tok]))
    return runs


def _ids(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


def _prompt(ids: list[int]) -> str:
    if len(ids) <= PROMPT_SHOWN:
        return _ids(ids)
    half = PROMPT_SHOWN // 2
    return f"{_ids(ids[:half])} ...({len(ids) - 2 * half} more)... {_ids(ids[-half:])}"


def _cut(text: str, full: bool, limit: int = TEXT_SHOWN) -> str:
    """``text`` on one line, cut to ``limit`` characters with a note unless ``full``."""
    flat = " ".join(str(text).split()) if "\n" not in str(text) else str(text).replace("\n", "\\n")
    if full or len(flat) <= limit:
        return flat
    return f"{flat[:limit]}... (+{len(flat) - limit} chars; --full shows all)"


def _value(v: Any) -> str:
    import json

    return v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)


def _message(msg: Any, full: bool) -> str:
    """One chat message as ``[role] text`` plus its tool calls / tool call id."""
    if not isinstance(msg, dict):
        return _cut(_value(msg), full)
    from agentlog.tools.dataset_rows import content_text

    role = msg.get("role", "?")
    parts = []
    content = content_text(msg.get("content"))  # content blocks: their text, the others named (export-dataset's text too)
    if content:
        parts.append(_cut(content, full))
    for call in msg.get("tool_calls") or ():
        if isinstance(call, dict):
            fn = call.get("function") if isinstance(call.get("function"), dict) else call
            args = fn.get("arguments", "")
            parts.append(_cut(f"tool call {fn.get('name', '?')}({args if isinstance(args, str) else _value(args)})", full))
    if msg.get("tool_call_id"):
        parts.append(f"(answers {msg['tool_call_id']})")
    return f"[{role}] " + (" ".join(parts) if parts else "(empty)")


class SessionWhy:
    """What answers "why did it score so", gathered from one session's events
    as they pass (so a streaming reader, the report, keeps only this per
    session in flight): its label, each assigned reward and the final one with
    its source, the verifier's detail (finish metadata), the output of the
    verifier's test command (the last command run, when the finish metadata
    names it: a text task's tests) and an abort's traceback. The one source of
    these lines for ``show`` and the report's drill-down."""

    __slots__ = ("opened", "label", "metadata", "assigned", "finished", "aborted", "last_command", "replaces")

    def __init__(self) -> None:
        self.opened = False
        self.label: Any = None
        self.metadata: dict = {}
        self.assigned: list = []  # reward_assigned envelopes
        self.finished: Any = None  # the session_finished envelope
        self.aborted: Any = None  # the session_aborted body
        self.last_command: Any = None  # the last command_ran envelope
        self.replaces = ""  # the member this one replaces (per-sample refill)

    def feed(self, env: Any) -> None:
        """Take one of the session's envelopes (in log order)."""
        from agentlog.events.schema.types import CommandRan, RewardAssigned, SessionAborted, SessionFinished, SessionOpened

        b = env.body
        if isinstance(b, SessionOpened) and not self.opened:
            self.opened, self.label, self.metadata = True, b.label, b.metadata
            self.replaces = b.replaces or ""
        elif isinstance(b, RewardAssigned):
            self.assigned.append(env)
        elif isinstance(b, SessionFinished) and self.finished is None:
            self.finished = env
        elif isinstance(b, SessionAborted) and self.aborted is None:
            self.aborted = b
        elif isinstance(b, CommandRan):
            self.last_command = env

    def lines(self, full: bool, at: Any = str) -> list[str]:
        """The "why" lines; ``at`` names an LSN (``p0003:1234`` in a partitioned log)."""
        import json

        from agentlog.reducers.samples import final_raw_reward

        from agentlog.tools.cmd_replay import _reward

        lines: list[str] = []
        if self.opened:
            lines.append(f"label    {'(none)' if self.label is None else _cut(_value(self.label), full)}")
            if self.metadata:
                lines.append(f"opened   metadata {_cut(_value(self.metadata), full)}")
            if self.replaces:
                lines.append(f"refill   replaces {self.replaces}, an aborted member of its group (per-sample refill)")
        if self.aborted is not None and self.aborted.refill is True:
            lines.append("refill   its group is owed a replacement: a session for the same prompt joins it in its place")
        assigned, finished = self.assigned, self.finished
        for e in assigned:
            lines.append(f"assigned reward {_reward(e.body.reward)} from {e.body.source or '(no source given)'} at lsn {at(e.lsn)}")
        if finished is not None:
            # The same rule as the reducers (reducers.samples.final_raw_reward): the finish's reward wins.
            if finished.body.reward is not None:
                source = f"session_finished at lsn {at(finished.lsn)}" + (" (overrides the assigned reward)" if assigned else "")
            elif assigned:
                last = assigned[-1]
                source = f"the last reward_assigned, lsn {at(last.lsn)}, source {last.body.source or '(none given)'}"
            else:
                source = "nowhere: no reward was given (the reducers report it unusable)"
            final = final_raw_reward(finished.body.reward, assigned[-1].body.reward if assigned else None)
            lines.append(f"reward   {'-' if final is None else _reward(final)} from {source}")
            meta = finished.body.metadata
            if meta:
                detail = "  ".join(f"{k}={_cut(json.dumps(v, default=str), full, 120)}" for k, v in sorted(meta.items()))
                lines.append(f"verifier {detail}")
            cmd = self.last_command
            if cmd is not None and isinstance(meta, dict) and meta.get("command") == cmd.body.command:
                lines.append(f"test     $ {_cut(cmd.body.command, full, 120)}  -> {command_outcome(cmd.body)}  lsn {at(cmd.lsn)}")
                lines.append(f"  output {_cut(cmd.body.output_tail, full) if cmd.body.output_tail else '(none)'}")
        if self.aborted is not None and self.aborted.traceback:
            tb = self.aborted.traceback.rstrip("\n").splitlines()
            cut = not full and len(tb) > TRACEBACK_LINES
            lines.append("traceback" + (f" (last {TRACEBACK_LINES} of {len(tb)} lines; --full shows all)" if cut else ""))
            lines.extend("  " + line for line in (tb[-TRACEBACK_LINES:] if cut else tb))
        return lines


def why_lines(envs: list, full: bool, at: Any = str) -> list[str]:
    """What answers "why did it score so" (:class:`SessionWhy`) for a session's envelopes."""
    why = SessionWhy()
    for e in envs:
        why.feed(e)
    return why.lines(full, at)


def version_note(turn: Any) -> str:
    """``  policy v3 -> v4 at token 17`` for a turn a weight update interrupted (a partial rollout), else ""."""
    import msgspec

    spans = turn.version_spans
    if spans is msgspec.UNSET:
        return ""
    changes = ", ".join(f"v{v} at token {first}" for first, v in spans[1:])
    how = turn.sampling.get("weight_update", "") if isinstance(turn.sampling, dict) else ""
    return f"  policy v{spans[0][1]} -> {changes}" + (f" ({how})" if how else "")


def server_note(turn: Any) -> str:
    """``  server s1 (moved from s0)`` for a turn a fleet's server generated, else ""."""
    from agentlog.events.schema.turn import turn_server

    server, moved_from = turn_server(turn)
    if not server:
        return ""
    return f"  server {server}" + (f" (moved from {moved_from})" if moved_from else "")


class ResumeMarks(NamedTuple):
    """Where a session was resumed, for ``show`` and the ui (:func:`resume_marks`)."""

    #: LSN of each ``session_resumed`` -> its marker line.
    lines: dict[int, str]
    #: LSN of each record a resume made void -> (the resume's LSN, the dead incarnation).
    undone: dict[int, tuple[int, int]]


def resume_marks(envs: list) -> ResumeMarks:
    """The marker line of each ``session_resumed`` in a session's envelopes, and the records it
    made void: the commands and snapshots its dead incarnation made after the last durable turn
    (after the restored snapshot when no turn was durable), in a sandbox the restore discarded.
    The durable turns themselves are kept: the new incarnation continues from them."""
    from agentlog.events.schema.types import CommandRan, SandboxSnapshotted, SessionResumed, TurnDelta, TurnRecorded

    lines: dict[int, str] = {}
    undone: dict[int, tuple[int, int]] = {}
    turn_at: dict[int, int] = {}  # turn index -> position of its record in envs
    snapshot_at: dict[str, int] = {}  # digest -> position of its last sandbox_snapshotted
    since = 0  # the first position after the last resume: what an earlier resume undid is not undone again
    for i, e in enumerate(envs):
        b = e.body
        kind = type(b)
        if kind is TurnRecorded or kind is TurnDelta:
            turn_at[b.turn_index] = i
        elif kind is SandboxSnapshotted:
            snapshot_at[b.digest] = i
        elif kind is SessionResumed:
            anchor = turn_at.get(b.durable_turns - 1, -1) if b.durable_turns else snapshot_at.get(b.snapshot, -1)
            void = [v for v in envs[max(since, anchor + 1):i] if type(v.body) in (CommandRan, SandboxSnapshotted)]
            for v in void:
                undone[v.lsn] = (e.lsn, b.incarnation - 1)
            lines[e.lsn] = resume_line(b, void)
            since = i + 1
    return ResumeMarks(lines, undone)


def resume_line(body: Any, void: list) -> str:
    """The marker of one ``session_resumed``: who took over from whom, what was kept and restored,
    which records above were the dead incarnation's (``void``), what runs again below."""
    from agentlog.events.schema.types import CommandRan

    from agentlog.tools.cmd_replay import DIGEST_SHOWN

    dead = body.incarnation - 1
    worker = f" on {body.worker}" if body.worker else ""
    n = body.durable_turns
    kept = f"after {n} durable turn(s) (0..{n - 1})" if n else "before its first turn (no turn was durable)"
    line = (f"-- resumed: incarnation {body.incarnation}{worker} took over from incarnation {dead} {kept};"
            f" sandbox restored from snapshot {body.snapshot[:DIGEST_SHOWN]}... taken before turn {body.snapshot_turn}")
    if void:
        commands = sum(1 for v in void if type(v.body) is CommandRan)
        line += (f"; the {commands} command(s) and {len(void) - commands} snapshot(s) above marked 'undone' were"
                 f" incarnation {dead}'s, in the sandbox the restore discarded")
    line += f"; turn {n - 1}'s commands run again below --" if n else "; turn 0 is asked for again below --"
    return line


def undone_note(marks: ResumeMarks, lsn: int, at: Any = str) -> str:
    """``  [undone: incarnation 0's, before the resume at lsn 9]`` for a record a resume made void, else ""."""
    got = marks.undone.get(lsn)
    if got is None:
        return ""
    return f"  [undone: incarnation {got[1]}'s, before the resume at lsn {at(got[0])}]"


def new_messages(held: list, msgs: list) -> tuple[list, bool]:
    """(the messages of a turn's ``msgs`` new since the turn before, whether the history was
    rewritten): ``held`` is the previous turn's messages and its response. A turn extends them,
    or the previous turn's messages with another response; any other history was rewritten,
    and all its messages are new."""
    if held and msgs[: len(held)] == held:
        return msgs[len(held):], False
    if held and msgs[: len(held) - 1] == held[:-1]:
        return msgs[len(held) - 1:], False
    return msgs, bool(held)


def transcript_lines(envs: list, full: bool, at: Any = str, marks: ResumeMarks | None = None, lineages: Any = None) -> list[str]:
    """Per turn the messages new since its lineage's turn before, then the response; each command and its output.
    A session that recorded no turn shows its ``session_opened`` prompt first (its conversation, as
    ``export-dataset`` writes it). Each sandbox snapshot is a line, and each resume its marker
    (:func:`resume_marks`; ``marks`` when the caller has them), records of a dead incarnation
    marked undone. ``at`` names an LSN (``p0003:1234`` in a partitioned log). A session with subagents
    (``lineages``, :class:`tools.lineage_view.SessionLineages`; gathered here when None) names each
    turn's lineage, and a turn's new messages are those since its own lineage's previous turn."""
    from agentlog.events.schema.lineage import turn_lineage
    from agentlog.events.schema.turn_delta import TurnContext
    from agentlog.events.schema.types import (
        CommandRan, SandboxSnapshotted, SessionOpened, SessionResumed, TeacherScored, TurnDelta, TurnRecorded, TurnUndelivered,
    )

    from agentlog.tools.cmd_replay import snapshot_summary
    from agentlog.tools.lineage_view import session_lineages

    named = (lineages if lineages is not None else session_lineages(envs)).shown
    lines: list[str] = []
    opened = next((e for e in envs if type(e.body) is SessionOpened), None)
    if opened is not None and opened.body.prompt and not any(type(e.body) in (TurnRecorded, TurnDelta) for e in envs):
        lines.append(f"  prompt (session_opened; no turn recorded)  lsn {at(opened.lsn)}")
        lines.extend("    " + _message(m, full) for m in opened.body.prompt)
    helds: dict[str, list] = {}  # per lineage, its previous turn's messages and response: what a new turn's extend
    context = TurnContext()  # what a turn_delta expands against
    if marks is None:
        marks = resume_marks(envs)
    for e in envs:
        b = e.body
        if type(b) is TurnDelta:
            b = context.expand(b, f"lsn {at(e.lsn)}: ")
        if isinstance(b, TurnRecorded):
            context = TurnContext.after(b)
            msgs = list(b.messages)
            lineage = turn_lineage(b)
            new, rewritten = new_messages(helds.get(lineage, []), msgs)
            note = " (history rewritten: all messages)" if rewritten else ""
            flags = " ill-formed" if b.ill_formed else ""
            where = f"  lineage {lineage}" if named else ""
            lines.append(f"  turn {b.turn_index}{where}  lsn {at(e.lsn)}  finish {b.finish_reason}{flags}{note}{version_note(b)}{server_note(b)}")
            lines.extend("    " + _message(m, full) for m in new)
            lines.append("    -> " + (_message(b.response_message, full) if b.response_message is not None else "(no response message)"))
            helds[lineage] = msgs + ([b.response_message] if b.response_message is not None else [])
        elif isinstance(b, CommandRan):
            lines.append(f"  $ {_cut(b.command, full)}  -> {command_outcome(b)} in {b.duration_s:.2f}s  lsn {at(e.lsn)}"
                         + undone_note(marks, e.lsn, at))
            if b.output_tail:
                lines.append(f"    output {_cut(b.output_tail, full)}")
        elif type(b) is SandboxSnapshotted:
            lines.append(f"  {snapshot_summary(b)}  lsn {at(e.lsn)}" + undone_note(marks, e.lsn, at))
        elif type(b) is SessionResumed:
            lines.append(f"  {marks.lines[e.lsn]}  lsn {at(e.lsn)}")
        elif isinstance(b, TurnUndelivered):
            lines.append(f"  turn {b.turn_index} undelivered (the client was gone): {b.reason or '-'}  lsn {at(e.lsn)}")
        elif isinstance(b, TeacherScored):
            who = f"{b.teacher}@{b.teacher_version}"
            if b.error:
                lines.append(f"  teacher {who} FAILED on turn {b.turn_index}: {_cut(b.error, full)}  lsn {at(e.lsn)}")
            else:
                n = len(b.log_probs) // 4
                top = f", top-{b.top_k}" if b.top_k else ""
                lines.append(f"  teacher {who} scored turn {b.turn_index} tokens {b.start}..{b.start + n - 1} at temperature "
                             f"{b.temperature:g}{top}  lsn {at(e.lsn)}")
    return lines


def log_prob_pairs(sample: Any, full: bool, limit: int = PROMPT_SHOWN) -> str:
    """``token:rollout/teacher`` for each trained response token (teacher ``-``
    where none scored it); the first ``limit`` unless ``full``."""
    toks = sample.token_ids[sample.prompt_length:]
    mask = sample.mask
    rollout = sample.log_probs
    teacher = sample.teacher_lp if sample.teacher_scored else None
    scored = sample.teacher_mask if sample.teacher_scored else None
    parts = []
    for i in range(sample.response_length):
        if not mask[i]:
            continue
        t = f"{teacher[i]:.2f}" if teacher is not None and scored[i] else "-"
        parts.append(f"{int(toks[i])}:{rollout[i]:.2f}/{t}")
    if not full and len(parts) > limit:
        return " ".join(parts[:limit]) + f" ... ({len(parts) - limit} more: --full)"
    return " ".join(parts)


def flags_line(flags: tuple[str, ...], outcome: Any) -> str:
    """``flags    drift, truncated`` (:mod:`reducers.health`) and what the pipeline made of them:
    ``outcome`` is the session's :class:`~agentlog.reducers.outcome.SessionOutcome` (None while it
    is in flight: more flags may come). The flags that made it untrainable are named; flags never
    make an excluded abort or a dropped session untrainable (they train nothing anyway)."""
    line = f"flags    {', '.join(flags) or '(none)'}"
    if outcome is None:
        return line + "  (so far: the session is still in flight)"
    if outcome.untrainable:
        line += (f"  (untrainable by untrainable_flags: {', '.join(outcome.untrainable)}: one zero-masked placeholder, "
                 "out of its group's baseline)")
    return line


def _reduced(envs: list, sid: str, path: Any) -> tuple[str | None, Any, list, tuple[str, ...] | None, Any]:
    """The session through the reducers, with the run's own settings (as the learner folded it):
    ``(problem, trajectory, samples, health flags, outcome)``: the outcome is what the pipeline made
    of the session (:mod:`reducers.outcome`; None while it is in flight); a refusal leaves the
    problem and no flags."""
    from agentlog.reducers.pipeline import ReduceError, Reducer, session_trajectory

    config = reduce_config_of(path)
    traj = None
    try:
        traj = session_trajectory(envs, sid, config)
        reducer = Reducer(config)
        out = reducer.feed_many(envs)
        flags = out.flags[sid] if sid in out.flags else reducer.session_flags(sid)
    except (ReduceError, KeyError) as exc:
        return str(exc).strip("'\""), traj, [], None, None
    return None, traj, out.samples, flags, out.outcomes.get(sid)


def _row_lineage(meta: dict) -> str:
    """``  lineage sub-1 (parent main turn 0, its own reward 0)`` for a row of a session with subagents, else ""."""
    if "lineage" not in meta:
        return ""
    parent = f"parent {meta['parent_lineage']} turn {meta['parent_turn']}" if meta.get("parent_lineage") else "a root"
    own = f", its own reward {meta['lineage_reward']:g}" if "lineage_reward" in meta else ""
    return f"  lineage {meta['lineage']} ({parent}{own})"


def run(args) -> int:
    """Print the session."""
    from agentlog.reducers.health import untrainable_reason
    from agentlog.reducers.lifecycle import replay

    from agentlog.tools.cmd_replay import format_step
    from agentlog.tools.lineage_view import row_lineages, session_lineages

    path = check_log_path(args.log)
    sid = args.session
    pid = None
    if path.partitioned:
        pid, envs = partition_session_envelopes(path, sid, quiet=args.quiet)
    else:
        envs = session_envelopes(path, sid, quiet=args.quiet)

    def at(lsn: int) -> str:
        return record_id(pid, lsn)

    where = "" if pid is None else f"  partition p{pid:04d}"
    if not envs:
        raise CliError(f"{path}: unknown session id {sid!r} (no event of it in the log)", EXIT_USAGE)
    w = sys.stdout.write
    steps = list(replay(envs))
    violations = [v for s in steps for v in s.violations]
    opened = envs[0].body if envs[0].body.__struct_config__.tag == "session_opened" else None
    summary = next((s.summary for s in steps if s.summary is not None), None)
    if opened is not None:
        w(
            f"session {sid}  group {opened.group_id} [{opened.sample_index}/{opened.group_size}]"
            f"  agent {opened.agent or '-'}  policy v{opened.policy_version}{where}\n"
        )
    else:
        w(f"session {sid}  (no session_opened){where}\n")
    marks = resume_marks(envs)
    resumed = f"  resumed {len(marks.lines)}x" if marks.lines else ""
    if summary is not None:
        reason = f" ({summary.reason})" if summary.reason else ""
        reward = f"  reward {summary.reward}" if summary.status == "finished" else ""
        w(
            f"outcome  {summary.status}{reason}{reward}  turns {summary.turns}  tokens in {summary.tokens_in} out {summary.tokens_out}"
            f"  duration {summary.duration_s:.2f} s  lsn {at(summary.opened_lsn)}..{at(summary.ended_lsn)}{resumed}\n"
        )
        if summary.error:
            w(f"error    {_cut(summary.error, args.full)}\n")
    else:
        last = steps[-1].state_after if steps else None
        w(f"outcome  still {last or 'unknown'} at the end of the log{resumed}\n")
    problem, traj, samples, health, outcome = _reduced(envs, sid, path)
    if health is not None:
        w(flags_line(health, outcome) + "\n")
    for line in why_lines(envs, args.full, at):
        w(line + "\n")

    w("\ntimeline\n")
    for s in steps:
        lsn = s.envelope.lsn
        if lsn in marks.lines:
            w("  " + marks.lines[lsn] + "\n")
        step_lines = format_step(s.envelope, s.state_before, s.state_after, s.violations, None if pid is None else at(lsn))
        step_lines[0] += undone_note(marks, lsn, at)
        for line in step_lines:
            w("  " + line + "\n")
    lineages = session_lineages(envs)
    transcript = transcript_lines(envs, args.full, at, marks, lineages)
    if transcript:
        w(f"\ntranscript (messages new at each turn, -> the response; texts over {TEXT_SHOWN} chars are cut: --full)\n")
        for line in transcript:
            w(line + "\n")

    named = lineages.shown
    if named:
        w(f"\nlineages ({len(lineages.lineages)} conversations; each subagent under the parent turn and tool call that spawned it)\n")
        for line in lineages.lines(args.full, row_lineages(traj.rows) if traj is not None else None):
            w(line + "\n")
    lineage_of = {t: entry.id for entry in lineages.lineages for t in entry.turns} if named else {}
    if traj is not None:
        w("\ntree (turns as routed; leaves depth-first)\n")
        for i, row in enumerate(traj.rows):
            w(f"  leaf {row.leaf} row {i}: turns {' -> '.join(str(t) for t in row.turn_indices)}" + (f"  lineage {row.lineage}" if named else "") + "\n")
        w("\nturns\n")
        for d in traj.decisions:
            routing = d.routing + (f" +{d.mounted_nodes}" if d.mounted_nodes else "")
            drift = (d.drift or "-").upper()
            train = "trained" if d.trained else ("not trained" + (f": {d.reason}" if d.reason else " (context only)"))
            where = f"  lineage {lineage_of.get(d.turn_index, '?')}" if named else ""
            w(f"  turn {d.turn_index:<3} lsn {at(d.lsn):<8} routing {routing:<16} leaf {d.leaf:<3} drift {drift:<8} row {d.row:<3} {train}{where}\n")
    w("\nrows\n")
    if not samples:
        w("  (no samples: " + ("dropped sessions yield none" if summary is not None and summary.status == "dropped" else "none emitted") + ")\n")
    for s in samples:
        toks = s.token_ids
        n_prompt = s.prompt_length
        mask = s.mask
        flags = " remove_sample" if s.remove_sample else ""
        meta = (s.metadata.get("abort_reason") or s.metadata.get("reward_error") or s.metadata.get("sampling_error")
                or (untrainable_reason(s.metadata["untrainable_flags"]) if "untrainable_flags" in s.metadata else ""))
        w(
            f"  row {s.row_index}: {s.status}{flags}, reward {s.reward:g}, {len(toks)} tokens = {n_prompt} prompt"
            f" + {s.response_length} response, {int(mask.sum())} trained" + (f"  [{meta}]" if meta else "") + _row_lineage(s.metadata) + "\n"
        )
        w(f"    prompt    {_prompt(toks[:n_prompt].tolist())}\n")
        runs = " ".join(("train[" if m else "ctx[") + _ids(ids) + "]" for m, ids in mask_runs(toks[n_prompt:], mask))
        w(f"    response  {runs}\n")
        if s.teacher_scored or s.metadata.get("teacher_error"):
            teachers = ", ".join(s.metadata.get("teachers", [])) or "-"
            w(f"    teachers  {teachers}" + (f"  [{s.metadata['teacher_error']}]" if s.metadata.get("teacher_error") else "") + "\n")
            w(f"    log-probs token:rollout/teacher  {log_prob_pairs(s, args.full)}\n")
    if problem:
        raise CliError(f"{path}: session {sid!r}: the reducers refuse this session: {problem}", EXIT_DATA)
    if violations:
        v = violations[0]
        raise CliError(f"{path}: {len(violations)} lifecycle violation(s); first at lsn {at(v.lsn)}: {v.message}", EXIT_DATA)
    return EXIT_OK
