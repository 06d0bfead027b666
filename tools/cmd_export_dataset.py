"""`agentlog export-dataset LOG -o DIR [--format hf|sft|jsonl] [filters] [--tokens]`:
a run's sessions as a dataset, one row per session, or per lineage of a session
whose agent spawned subagents (:mod:`tools.dataset_rows` says what a row holds:
the lineage and its parent, the final conversation with its tool calls, the
tool definitions, the outcome, the GRPO advantage, optionally the tokens).

LOG is a log directory, a partition root, a run folder or a ``nats://`` URL,
as every reading command takes it; a run folder is folded with the run's own
reduce settings and its learner's advantage estimator, and ``--config FILE``
(a run's ``config.json`` or TOML config) gives those of a copy of a run's
log that holds no config (its JetStream stream, a copied ``rollout/``), as
``reconstruct --config`` does. Formats:

* ``hf``: a Hugging Face ``datasets`` dataset written with
  ``Dataset.save_to_disk`` (Arrow shards): ``datasets.load_from_disk(DIR)``;
  every column;
* ``sft``: the same, in the form TRL's ``SFTTrainer`` takes: a dataset
  directory (``load_from_disk``) with two columns, ``messages`` and
  ``tools`` (JSON text, which TRL decodes); a session without an assistant
  message (nothing to learn from) is left out;
* ``jsonl``: ``DIR/sessions.jsonl``, one JSON object per session, every
  column (messages without the keys they do not have); a row per session, or per lineage.

Tool-call arguments and the tool definitions are JSON text: Arrow gives every
struct of a column the union of their keys, so arguments kept as objects
would come back with the other tools' keys set to null.

Filters (all must hold): ``--status`` (default: every session that ended),
``--group``, ``--min-reward``; ``--sessions N`` stops after N sessions (all their rows). Rows come
in the order groups complete (see :mod:`tools.dataset_rows`). DIR must not
exist, or be empty; it is written beside itself and renamed into place, so an
interrupted export leaves nothing that looks whole. ``DIR/export.json``
records the source, the format, the filters, the counts, the reduce
settings (and the config file they came from) and the advantage estimator.
Rows are written in batches of at most :attr:`_ArrowRows.BATCH` rows or about
:attr:`_ArrowRows.FLUSH_BYTES`; the token columns go from their numpy arrays
into Arrow without Python lists. Exit 1 when the reducers refuse the log, or
a session holds what a dataset cannot (a recorded value JSON has no form
for), naming the LSN and session; 2 on usage and I/O errors. An export that
fails leaves nothing behind: no DIR, no temporary, no file open.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import (
    add_quiet, check_log_path, check_output_path, finite_float, id_scans_of, positive_int, read_tagged, reduce_config_of,
)

FORMATS = ("hf", "sft", "jsonl")
#: The sessions exported when ``--status`` is not given: every one that ended.
DEFAULT_STATUSES = ("finished", "aborted", "dropped")
#: The jsonl format's file in DIR.
JSONL_FILE = "sessions.jsonl"
#: The export's record in DIR.
MANIFEST = "export.json"


def register(sub) -> None:
    """Add the subcommand."""
    from agentlog.learner.config import ESTIMATORS
    from agentlog.tools.dataset_rows import STATUSES

    p = sub.add_parser("export-dataset", help="write the sessions as a dataset (Hugging Face, TRL SFT or JSONL): messages, tools, outcome, advantage")
    p.add_argument("log", metavar="LOG", help="the log directory, or a run folder (then its reduce settings and estimator)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the directory to write: new, or empty")
    p.add_argument("--format", choices=FORMATS, default="hf",
                   help="hf: datasets.load_from_disk(DIR), every column; sft: load_from_disk(DIR), messages and tools only, for "
                        "TRL's SFTTrainer; jsonl: DIR/sessions.jsonl, one object per row (default hf)")
    p.add_argument("--status", action="append", default=None, metavar="S[,S...]",
                   help=f"only sessions in these states ({', '.join(STATUSES)}; open and running: still in flight at the end of "
                        f"the log); repeat or comma-separate (default: {','.join(DEFAULT_STATUSES)})")
    p.add_argument("--group", action="append", default=None, metavar="ID", help="only sessions of this group (repeat for several)")
    p.add_argument("--min-reward", type=finite_float, default=None, metavar="X", help="only sessions with a reward >= X (sessions without one are left out)")
    p.add_argument("--sessions", type=positive_int, default=None, metavar="N", help="stop after N sessions, each with all its rows (the first in export order)")
    p.add_argument("--tokens", action="store_true", help="add token_ids, loss_mask and log_probs per trajectory row (the reducer's samples)")
    p.add_argument("--estimator", choices=ESTIMATORS, default=None,
                   help="the advantage estimator (default: the run's [learner] estimator, grpo for a bare log)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="fold with this run's reduce settings and learner estimator (its config.json, or a TOML config): for a "
                        "copy of a run's log that holds no config, such as its JetStream stream")
    add_quiet(p)
    p.set_defaults(func=run)


def _statuses(given: list[str] | None) -> tuple[str, ...]:
    from agentlog.tools.dataset_rows import STATUSES

    if not given:
        return DEFAULT_STATUSES
    out = tuple(s.strip() for g in given for s in g.split(",") if s.strip())
    bad = [s for s in out if s not in STATUSES]
    if bad or not out:
        raise CliError(f"export-dataset: --status: expected one or more of {', '.join(STATUSES)}, found {', '.join(map(repr, bad or given))}",
                       EXIT_USAGE)
    return out


def _check_output(out: Path) -> None:
    """DIR must be new or an empty directory (exit 2 otherwise, before the log is read)."""
    if out.is_dir():
        try:
            entries = next(os.scandir(out), None)
        except OSError as exc:
            raise CliError(f"{out}: cannot read: {exc.strerror or exc}", EXIT_USAGE) from None
        if entries is not None:
            raise CliError(f"{out}: exists and is not empty; export-dataset writes a new (or empty) directory: remove it or choose another",
                           EXIT_USAGE)
    elif out.exists() or out.is_symlink():
        raise CliError(f"{out}: exists and is not a directory; export-dataset writes a new (or empty) directory", EXIT_USAGE)


def _advantage_settings(source: Any, estimator: str | None, config_file: str | None) -> tuple[str, float, bool]:
    """(estimator, eps, lineages as members) of the run's learner: the one ``config_file`` configures when given (as
    :func:`tools.cli_common.reduce_config_of` takes it), else a run folder's, else the learner's
    defaults; ``estimator`` on top."""
    from agentlog.events.errors import ConfigError
    from agentlog.learner.config import LearnerConfig
    from agentlog.loop.config import LoopConfig
    from agentlog.loop.run_folder import Run

    learner = LearnerConfig()
    try:
        if config_file is not None:
            learner = LoopConfig.load(Path(config_file)).learner_config()
        elif source.run_dir is not None and Run.has_config(source.run_dir):
            learner = Run.load_config(source.run_dir).learner_config()
    except ConfigError as exc:
        where = "--config: " if config_file is not None else ""
        raise CliError(f"{where}{exc} (the run's learner settings)", EXIT_USAGE) from None
    return estimator or learner.estimator, learner.adv_eps, learner.lineage_advantage == "member"


def arrow_schema(fmt: str, tokens: bool) -> Any:
    """The Arrow schema of a ``fmt`` (hf or sft) dataset; the Hugging Face features follow from it."""
    import pyarrow as pa

    s, i64 = pa.string(), pa.int64()
    call = pa.struct([("id", s), ("type", s), ("function", pa.struct([("name", s), ("arguments", s)]))])
    message = pa.struct([("role", s), ("content", s), ("tool_calls", pa.list_(call)), ("tool_call_id", s), ("name", s)])
    if fmt == "sft":
        return pa.schema([("messages", pa.list_(message)), ("tools", s)])
    fields = [
        ("session_id", s), ("partition", pa.int32()), ("group_id", s), ("sample_index", i64), ("group_size", i64), ("agent", s),
        ("lineage", s), ("parent_lineage", s), ("parent_turn", i64), ("spawn_call", s),
        ("label", s), ("messages", pa.list_(message)), ("tools", s), ("tools_source", s), ("status", s), ("reason", s),
        ("reward", pa.float64()), ("in_baseline", pa.bool_()), ("truncated", pa.bool_()), ("finish_reason", s), ("turns", i64),
        ("policy_versions", pa.list_(i64)), ("advantage", pa.float64()), ("group_skip_reason", s), ("health_flags", pa.list_(s)),
    ]
    if tokens:
        fields += [("token_ids", pa.list_(pa.list_(pa.int32()))), ("loss_mask", pa.list_(pa.list_(pa.uint8()))),
                   ("log_probs", pa.list_(pa.list_(pa.float32())))]
    return pa.schema(fields)


class _JsonlRows:
    """``DIR/sessions.jsonl``: one JSON object per row. ``finish`` completes the file;
    ``close`` releases it (always called, after ``finish`` or instead of it)."""

    def __init__(self, data: Path, work: Path, fmt: str, tokens: bool, quiet: bool) -> None:
        import msgspec

        data.mkdir()
        self._encode = msgspec.json.Encoder(enc_hook=_as_list).encode
        self._f = open(data / JSONL_FILE, "wb")

    def write(self, rows: list[dict[str, Any]]) -> None:
        enc = self._encode
        self._f.write(b"".join(enc(r) + b"\n" for r in rows))

    def finish(self) -> None:
        self._f.close()

    def close(self) -> None:
        self._f.close()


def _as_list(value: Any) -> Any:
    """msgspec's hook for a token column's numpy array: its values as a JSON list."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    raise NotImplementedError(f"export-dataset: no JSON form for {type(value).__name__}")


def _nested_list_array(rows: list[list[Any]], value_type: Any) -> Any:
    """Each row's list of numpy arrays as one Arrow ``list<list<value_type>>`` array, built
    from their buffers (the offsets, and the values concatenated), without Python lists."""
    import numpy as np
    import pyarrow as pa

    arrays = [a for row in rows for a in row]
    outer = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(row) for row in rows], out=outer[1:])
    inner = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=inner[1:])
    values = np.concatenate(arrays) if arrays else np.empty(0, dtype=value_type.to_pandas_dtype())
    lists = pa.ListArray.from_arrays(pa.array(inner), pa.array(values, type=value_type))
    return pa.ListArray.from_arrays(pa.array(outer), lists)


class _ArrowRows:
    """A ``datasets`` dataset: rows streamed to an Arrow file in ``work`` (bounded
    memory), then ``Dataset.from_file`` (memory-mapped) and ``save_to_disk(data)``
    (``finish``). ``close`` releases the file (always called)."""

    #: Rows buffered before a record batch is written, at most ...
    BATCH = 2048
    #: ... and at most about this many bytes of them (:func:`tools.dataset_rows.row_nbytes`).
    FLUSH_BYTES = 32 << 20

    def __init__(self, data: Path, work: Path, fmt: str, tokens: bool, quiet: bool) -> None:
        import pyarrow as pa

        from agentlog.tools.dataset_rows import TOKEN_COLUMNS

        self._pa, self._data, self._quiet = pa, data, quiet
        self._schema = arrow_schema(fmt, tokens)
        # The token columns are built from numpy buffers; the rest from the rows' Python values.
        self._arrays = [self._schema.field(c) for c in TOKEN_COLUMNS if c in self._schema.names]
        self._plain = pa.schema([f for f in self._schema if f not in self._arrays])
        self._file = work / "rows.arrow"
        self._sink = pa.OSFile(str(self._file), "wb")
        try:
            self._writer = pa.ipc.new_stream(self._sink, self._schema)
        except BaseException:
            self._sink.close()
            raise
        self._buf: list[dict[str, Any]] = []
        self._bytes = 0
        self._batches = 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        from agentlog.tools.dataset_rows import row_nbytes

        self._buf.extend(rows)
        self._bytes += sum(map(row_nbytes, rows))
        if len(self._buf) >= self.BATCH or self._bytes >= self.FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._buf or not self._batches:  # an export of no row still writes its (empty) table
            rows = self._buf
            table = self._pa.Table.from_pylist(rows, schema=self._plain)
            for field in self._arrays:
                table = table.append_column(field, _nested_list_array([r[field.name] for r in rows], field.type.value_type.value_type))
            self._writer.write_table(table)
            self._buf, self._bytes = [], 0
            self._batches += 1

    def finish(self) -> None:
        import datasets

        self._flush()
        self._writer.close()
        self._sink.close()
        if self._quiet or not sys.stderr.isatty():
            datasets.disable_progress_bars()
        dataset = datasets.Dataset.from_file(str(self._file))
        # One shard for no row: datasets' default writes no shard then, and load_from_disk fails on that.
        dataset.save_to_disk(str(self._data), num_shards=None if len(dataset) else 1)

    def close(self) -> None:
        # After finish, or instead of it when the export failed: the file is then discarded,
        # so its stream is not ended, only the file let go.
        if not self._sink.closed:
            self._sink.close()


def _writer(fmt: str) -> Any:
    if fmt == "jsonl":
        return _JsonlRows
    try:
        import datasets  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError:
        raise CliError(f"export-dataset --format {fmt} needs the datasets package: pip install 'agentlog[export]'", EXIT_USAGE) from None
    return _ArrowRows


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist, innermost first (what ``mkdir(parents=True)`` makes)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """Remove ``dirs`` (innermost first) that are empty, as a failed export found them: absent."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def _sft_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The rows with an assistant message (something to learn from); and how many had none."""
    out = [r for r in rows if any(m["role"] == "assistant" for m in r["messages"])]
    return out, len(rows) - len(out)


def _sft_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row in TRL's conversational form: its messages and tools."""
    return {"messages": row["messages"], "tools": row["tools"]}


def run(args) -> int:
    """Fold the log into rows, write them, print one line."""
    from agentlog.reducers.pipeline import ReduceError
    from agentlog.tools.dataset_rows import DatasetError, DatasetFold, group_advantages

    fmt = args.format
    statuses = _statuses(args.status)
    out = Path(args.output)
    writer_type = _writer(fmt)
    path = check_log_path(args.log)
    check_output_path(path, args.output)
    _check_output(out)
    config = reduce_config_of(path, args.config)
    estimator, eps, lineage_members = _advantage_settings(path, args.estimator, args.config)
    groups = set(args.group or ())
    min_reward = args.min_reward

    def keep(row: dict[str, Any]) -> bool:
        if row["status"] not in statuses or (groups and row["group_id"] not in groups):
            return False
        return min_reward is None or (row["reward"] is not None and row["reward"] >= min_reward)

    fold = DatasetFold(config, group_advantages(estimator, eps), tokens=args.tokens, keep=keep, lineage_members=lineage_members,
                       confirm_of=id_scans_of(path))
    made = _missing_dirs(out.parent)  # removed again when the export fails
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        work = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
    except OSError as exc:
        _remove_empty(made)
        raise CliError(f"{out}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None
    counts: dict[str, int] = {}  # sessions written, by status
    written = no_assistant = sessions = 0
    last_session: Any = None  # a session's rows (one per lineage) come together
    limit = args.sessions

    def emit(rows: list[dict[str, Any]]) -> bool:
        """Write ``rows`` (up to the limit); whether the limit is reached."""
        nonlocal written, no_assistant, sessions, last_session
        if fmt == "sft":
            rows, skipped = _sft_rows(rows)
            no_assistant += skipped
        kept = []
        for r in rows:
            if (r["partition"], r["session_id"]) != last_session:
                if limit is not None and sessions >= limit:
                    break  # the limit counts sessions: a session's rows (one per lineage) are never cut
                last_session = (r["partition"], r["session_id"])
                sessions += 1
                counts[r["status"]] = counts.get(r["status"], 0) + 1
            kept.append(r)
        writer.write([_sft_row(r) for r in kept] if fmt == "sft" else kept)
        written += len(kept)
        return limit is not None and sessions >= limit

    def refused(pid: int | None, exc: Exception) -> CliError:
        where = "" if pid is None else f" partition p{pid:04d}:"
        return CliError(f"{path}:{where} {exc}", EXIT_DATA)


    data = work / "data"
    writer: Any = None
    placed = False  # DIR is in place: the export is done
    emptied = False  # DIR was an empty directory, removed for the rename
    try:
        writer = writer_type(data, work, fmt, args.tokens, args.quiet)
        done = False
        pid = None
        try:
            for pid, env in read_tagged(path, quiet=args.quiet, desc="export-dataset"):
                rows = fold.feed(pid, env)
                if rows and emit(rows):
                    done = True
                    break
            pid = None
            if not done:
                emit(fold.finish())
        except ReduceError as exc:
            raise refused(pid, exc) from None
        except DatasetError as exc:  # it names the partition itself
            raise CliError(f"{path}: {exc}", EXIT_DATA) from None
        writer.finish()
        manifest = {
            "source": str(path), "format": fmt, "rows": written, "sessions": sessions, "by_status": counts,
            "filters": {"status": list(statuses), "group": sorted(groups), "min_reward": min_reward, "sessions": limit},
            "tokens": args.tokens, "advantage": {"estimator": estimator, "eps": eps,
                                                 "lineage_advantage": "member" if lineage_members else "session"},
            "reduce_config": config.to_dict(), "reduce_config_digest": config.digest(),
            "config_file": None if args.config is None else str(Path(args.config).resolve()),
        }
        (data / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        if out.is_dir():
            out.rmdir()  # empty (checked above): the rename takes its place
            emptied = True
        os.replace(data, out)
        placed = True
    except OSError as exc:
        raise CliError(f"{out}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None
    finally:
        # Whatever ended the export (a refused log, an I/O error, an interrupt): no file left
        # open, no temporary, and DIR as it was found.
        if writer is not None:
            writer.close()
        shutil.rmtree(work, ignore_errors=True)
        if not placed:
            if emptied:
                with contextlib.suppress(OSError):
                    out.mkdir()
            _remove_empty(made)
    by_status = ", ".join(f"{s} {counts[s]}" for s in sorted(counts))
    note = f"; {no_assistant} without an assistant message left out" if no_assistant else ""
    spread = f" in {written} rows (one per lineage)" if written != sessions else ""
    print(f"{out}: {sessions} sessions ({fmt}{'; ' + by_status if by_status else ''}){spread}{note}; {fold.left_out} of "
          f"{fold.sessions} ended sessions left out by the filters; advantage {estimator}; config {config.digest()[:19]}")
    return EXIT_OK
