"""`agentlog show LOG SESSION`: one session in depth.

Prints its header and outcome, its timeline (state before -> after per
event), its turn tree as the reducer routed it (per turn: routing, leaf,
drift decision CLEAN / REALIGN / FORK, trainable or why not), and each
trajectory row as the sample it becomes: prompt tokens, then the response
tokens in runs marked ``train[...]`` (loss mask 1) or ``ctx[...]`` (mask 0),
with the reward and status. Everything comes from the log through the same
reducers as reconstruction (:func:`reducers.pipeline.session_trajectory`,
:class:`reducers.pipeline.Reducer`). Unknown session: exit 2.
"""

from __future__ import annotations

import sys
from typing import Any

from tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError
from tools.cli_common import add_quiet, check_log_path, read_records

#: Prompts longer than this are shown as their head and tail.
PROMPT_SHOWN = 48


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("show", help="one session in depth: timeline, tree, drift decisions, rows with loss mask")
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument("session", metavar="SESSION", help="the session id")
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


def run(args) -> int:
    """Print the session."""
    from reducers.lifecycle import replay
    from reducers.pipeline import ReduceError, Reducer, session_trajectory

    from tools.cmd_replay import format_step

    path = check_log_path(args.log)
    sid = args.session
    envs = session_envelopes(path, sid, quiet=args.quiet)
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
            f"  agent {opened.agent or '-'}  policy v{opened.policy_version}\n"
        )
    else:
        w(f"session {sid}  (no session_opened)\n")
    if summary is not None:
        reason = f" ({summary.reason})" if summary.reason else ""
        reward = f"  reward {summary.reward}" if summary.status == "finished" else ""
        w(
            f"outcome  {summary.status}{reason}{reward}  turns {summary.turns}  tokens in {summary.tokens_in} out {summary.tokens_out}"
            f"  duration {summary.duration_s:.2f} s  lsn {summary.opened_lsn}..{summary.ended_lsn}\n"
        )
        if summary.error:
            w(f"error    {summary.error}\n")
    else:
        last = steps[-1].state_after if steps else None
        w(f"outcome  still {last or 'unknown'} at the end of the log\n")

    w("\ntimeline\n")
    for s in steps:
        for line in format_step(s.envelope, s.state_before, s.state_after, s.violations):
            w("  " + line + "\n")

    problem = None
    samples: list = []
    traj = None
    try:
        traj = session_trajectory(envs, sid)
        reducer = Reducer()
        samples = reducer.feed_many(envs).samples
    except (ReduceError, KeyError) as exc:
        problem = str(exc).strip("'\"")
    if traj is not None:
        w("\ntree (turns as routed; leaves depth-first)\n")
        for i, row in enumerate(traj.rows):
            w(f"  leaf {row.leaf} row {i}: turns {' -> '.join(str(t) for t in row.turn_indices)}\n")
        w("\nturns\n")
        for d in traj.decisions:
            routing = d.routing + (f" +{d.mounted_nodes}" if d.mounted_nodes else "")
            drift = (d.drift or "-").upper()
            train = "trained" if d.trained else ("not trained" + (f": {d.reason}" if d.reason else " (context only)"))
            w(f"  turn {d.turn_index:<3} lsn {d.lsn:<8} routing {routing:<16} leaf {d.leaf:<3} drift {drift:<8} row {d.row:<3} {train}\n")
    w("\nrows\n")
    if not samples:
        w("  (no samples: " + ("dropped sessions yield none" if summary is not None and summary.status == "dropped" else "none emitted") + ")\n")
    for s in samples:
        toks = s.token_ids
        n_prompt = s.prompt_length
        mask = s.mask
        flags = " remove_sample" if s.remove_sample else ""
        meta = s.metadata.get("abort_reason") or s.metadata.get("reward_error") or s.metadata.get("sampling_error") or ""
        w(
            f"  row {s.row_index}: {s.status}{flags}, reward {s.reward:g}, {len(toks)} tokens = {n_prompt} prompt"
            f" + {s.response_length} response, {int(mask.sum())} trained" + (f"  [{meta}]" if meta else "") + "\n"
        )
        w(f"    prompt    {_prompt(toks[:n_prompt].tolist())}\n")
        runs = " ".join(("train[" if m else "ctx[") + _ids(ids) + "]" for m, ids in mask_runs(toks[n_prompt:], mask))
        w(f"    response  {runs}\n")
    if problem:
        raise CliError(f"{path}: session {sid!r}: the reducers refuse this session: {problem}", EXIT_DATA)
    if violations:
        v = violations[0]
        raise CliError(f"{path}: {len(violations)} lifecycle violation(s); first at lsn {v.lsn}: {v.message}", EXIT_DATA)
    return EXIT_OK
