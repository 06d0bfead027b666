"""`agentlog reconstruct LOG [-o OUT] [--format jsonl|msgpack|parquet]
[--fork-threshold N] [--max-context-tokens N] [--allow-repeated-targets]`: the training samples of a
recorded run, through the same :class:`reducers.pipeline.Reducer` the online
loop feeds, streamed to OUT in emission order (without ``-o`` nothing is
written: the counts, the per-step check and the digest are printed).

A run folder (or its ``rollout/``) is folded with the run's own reduce
settings, those its learner trained with (:func:`tools.cli_common.reduce_config_of`),
the options on top; a bare log with the reducers' defaults. A run folder's
learner log is then checked step by step against the samples
(``online per-step digests vs offline: EQUAL``).

The last line printed is ``digest sha256:<hex>``: the reducer's digest of
the sample stream (canonical bytes, :class:`reducers.samples.SampleDigest`),
so it is the same for the same log and options on every run and machine,
and equal to the online reducer's digest. Formats:

* ``msgpack``: each sample's canonical encoding (``reducers.samples.encode_sample``)
  preceded by its length as a little-endian u64: exactly the bytes the
  digest hashes, so ``sha256sum OUT`` prints the digest too;
  :func:`read_msgpack_samples` reads them back;
* ``jsonl``: one JSON object per sample, packed arrays (tokens, masks, rollout
  and teacher log-probs, teacher top-K) as lists;
* ``parquet``: one row per sample (needs the ``parquet`` extra: pyarrow);
  the reduce configuration and its digest are in the file's metadata.

jsonl and parquet write every field of the Sample, one column each, named as
the field (:func:`sample_columns`), so each carries what msgpack carries.

Exit 1 when the log holds something the reducers refuse, naming the LSN and
session: a lifecycle violation (a ``session_seq`` gap or repeat, an event
after the terminal one, ...; the one check every fold composes,
:func:`reducers.lifecycle_step.evolve`, which this fold may not go past) names
its kind too.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import (
    add_quiet, check_log_path, check_output_path, id_scans_of, nonneg_int, read_tagged, reduce_config_of,
)

FORMATS = ("jsonl", "msgpack", "parquet")


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser(
        "reconstruct", help="rebuild the training samples; prints their digest last (exit 1 at the first lifecycle violation)"
    )
    p.add_argument("log", metavar="LOG", help="the log directory, or a run folder (then folded with the run's own reduce settings, and checked per step against the learner)")
    p.add_argument("-o", "--output", default=None, metavar="OUT",
                   help="where to write the samples (without it: none are written; the counts, the per-step check of a run folder and the digest are printed)")
    p.add_argument("--format", choices=FORMATS, default=None, help="output format (default: from OUT's suffix, else jsonl)")
    p.add_argument("--fork-threshold", type=nonneg_int, default=None, metavar="N", help="REALIGN only outputs shorter than N tokens (0: always fork)")
    p.add_argument("--max-context-tokens", type=nonneg_int, default=None, metavar="N", help="cut rows to N tokens (0: no limit)")
    p.add_argument("--allow-repeated-targets", action="store_true",
                   help="train a branching session's shared turns in every row that holds them (default: once, in the first)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="fold with this run's reduce settings (its config.json, or a TOML config): for a copy of a run's "
                        "log that holds no config, such as its JetStream stream")
    p.add_argument("--policy", default=None, metavar="FILE",
                   help="a run folder only: re-reduce the recorded run under FILE's settings (a TOML of LoopConfig fields on "
                        "top of the run's: min_valid, allow_repeated_targets, untrainable_flags, max_staleness, staleness_mode, [learner] estimator, [groups]) and, with --diff, "
                        "print what the learner would have trained differently; nothing is re-run")
    p.add_argument("--diff", action="store_true", help="with --policy: print the groups whose outcome changes")
    p.add_argument("--json", action="store_true", help="with --policy --diff: the diff as one JSON object")
    add_quiet(p)
    p.set_defaults(func=run)


def run_counterfactual(args) -> int:
    """``--policy FILE --diff``: the recorded run replayed under its own settings and under FILE's."""
    import tomllib

    import msgspec

    from agentlog.events.errors import ConfigError
    from agentlog.loop.counterfactual import compare, format_diff, policy_config
    from agentlog.loop.run_folder import Run

    # What a plain reconstruct takes and --policy would drop without a word: the policy's TOML says the settings.
    ignored = [flag for flag, given in (
        ("-o", args.output is not None), ("--format", args.format is not None), ("--fork-threshold", args.fork_threshold is not None),
        ("--max-context-tokens", args.max_context_tokens is not None), ("--allow-repeated-targets", args.allow_repeated_targets),
        ("--config", args.config is not None)) if given]
    if ignored:
        raise CliError(f"reconstruct --policy: {', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} not go with "
                       "--policy (it writes no samples; put "
                       "reduce settings in the policy file)", EXIT_USAGE)
    path = check_log_path(args.log)
    run_dir = path.run_dir
    if run_dir is None:
        raise CliError(f"reconstruct --policy: {args.log} is not a run folder (its learner log and config.json "
                       "name what was trained)", EXIT_USAGE)
    if not args.diff:
        raise CliError("reconstruct --policy: add --diff (what would have changed is all it prints)", EXIT_USAGE)
    try:
        with open(args.policy, "rb") as f:
            policy = tomllib.load(f)
    except OSError as exc:
        raise CliError(f"reconstruct --policy {args.policy}: cannot read it: {exc.strerror or exc}", EXIT_USAGE) from None
    except tomllib.TOMLDecodeError as exc:
        raise CliError(f"reconstruct --policy {args.policy}: not TOML: {exc}", EXIT_USAGE) from None
    with Run.open(run_dir) as run:
        recorded = run.config
    try:
        other = policy_config(recorded, policy)
    except ConfigError as exc:
        raise CliError(f"reconstruct --policy {args.policy}: {exc}", EXIT_USAGE) from None
    diff = compare(run_dir, recorded, other)
    if args.json:
        sys.stdout.write(msgspec.json.encode(diff).decode() + "\n")
    else:
        for line in format_diff(diff):
            print(line)
    return EXIT_OK


def sample_columns() -> list[tuple[str, str]]:
    """``(field, kind)`` for every field of :class:`reducers.samples.Sample`, in the
    struct's order: what jsonl and parquet write, one column per field, named as the
    field. ``kind`` is the dtype of a packed array (``PACKED_DTYPES``: written as a
    list of numbers), ``json`` for the metadata mapping, else the scalar's type name.
    A field of any other type raises TypeError naming it: a new field is written by
    every format or the command refuses to run, never dropped from one of them."""
    import msgspec

    from agentlog.reducers.samples import PACKED_DTYPES, Sample

    out = []
    for f in msgspec.structs.fields(Sample):
        if f.type is bytes:
            out.append((f.name, PACKED_DTYPES[f.name]))
        elif f.type in (str, int, float, bool):
            out.append((f.name, f.type.__name__))
        elif getattr(f.type, "__origin__", None) is dict:
            out.append((f.name, "json"))
        else:
            raise TypeError(f"reconstruct: Sample.{f.name} has type {f.type!r}, which no output format knows how to write")
    return out


def sample_json(s: Any) -> dict[str, Any]:
    """A sample as JSON-ready data: every field (:func:`sample_columns`), packed arrays as lists."""
    import numpy as np

    row = {}
    for name, kind in sample_columns():
        value = getattr(s, name)
        row[name] = np.frombuffer(value, dtype=kind).tolist() if kind not in _SCALAR_KINDS else value
    return row


#: Column kinds of :func:`sample_columns` that are not packed arrays.
_SCALAR_KINDS = ("str", "int", "float", "bool", "json")


class _JsonlWriter:
    def __init__(self, path: str, header: dict[str, Any]) -> None:
        import msgspec

        self._enc = msgspec.json.Encoder()
        self._f = _open(path, "wb")

    def write(self, samples: list) -> None:
        enc = self._enc.encode
        self._f.write(b"".join(enc(sample_json(s)) + b"\n" for s in samples))

    def close(self) -> None:
        self._f.close()


class _MsgpackWriter:
    def __init__(self, path: str, header: dict[str, Any]) -> None:
        self._f = _open(path, "wb")

    def write(self, samples: list) -> None:
        from agentlog.reducers.samples import encode_sample

        parts = []
        for s in samples:
            raw = encode_sample(s)
            parts.append(len(raw).to_bytes(8, "little"))
            parts.append(raw)
        self._f.write(b"".join(parts))

    def close(self) -> None:
        self._f.close()


class _ParquetWriter:
    BATCH = 4096

    def __init__(self, path: str, header: dict[str, Any]) -> None:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise CliError(
                "reconstruct --format parquet needs pyarrow: pip install 'agentlog[parquet]'", EXIT_USAGE
            ) from None
        import json

        self._pa = pa
        self._columns = sample_columns()
        types = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
                 "json": pa.string(),  # JSON text: the metadata's keys vary by sample kind
                 "<i4": pa.list_(pa.int32()), "u1": pa.list_(pa.uint8()), "<f4": pa.list_(pa.float32())}
        self._schema = pa.schema(
            [(name, types[kind]) for name, kind in self._columns],
            metadata={"agentlog.reduce_config": json.dumps(header["reduce_config"], sort_keys=True),
                      "agentlog.reduce_config_digest": header["reduce_config_digest"]},
        )
        try:
            self._w = pq.ParquetWriter(path, self._schema)
        except OSError as exc:
            raise CliError(f"{path}: cannot write: {exc}", EXIT_USAGE) from None
        self._buf: list = []

    def write(self, samples: list) -> None:
        self._buf.extend(samples)
        if len(self._buf) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        import msgspec
        import numpy as np

        b = self._buf
        self._buf = []
        cols = {}
        for name, kind in self._columns:
            values = [getattr(s, name) for s in b]
            if kind == "json":
                values = [msgspec.json.encode(v).decode() for v in values]
            elif kind not in _SCALAR_KINDS:
                values = [np.frombuffer(v, dtype=kind) for v in values]
            cols[name] = values
        self._w.write_table(self._pa.table(cols, schema=self._schema))

    def close(self) -> None:
        self._flush()
        self._w.close()


class _NoWriter:
    """No ``-o``: the samples are reduced, counted and digested, and written nowhere."""

    def __init__(self, path: Any, header: dict[str, Any]) -> None:
        pass

    def write(self, samples: list) -> None:
        pass

    def close(self) -> None:
        pass


def read_msgpack_samples(path: str | os.PathLike) -> list:
    """The samples of a ``--format msgpack`` file, in order. Raises ValueError
    naming the offset on a truncated or malformed file."""
    from agentlog.reducers.samples import decode_sample

    data = memoryview(open(path, "rb").read())
    out, off = [], 0
    while off < len(data):
        if off + 8 > len(data):
            raise ValueError(f"{path}: offset {off}: truncated length prefix")
        n = int.from_bytes(data[off : off + 8], "little")
        if off + 8 + n > len(data):
            raise ValueError(f"{path}: offset {off}: sample of {n} bytes runs past the end ({len(data)} bytes)")
        out.append(decode_sample(bytes(data[off + 8 : off + 8 + n])))
        off += 8 + n
    return out


_WRITERS = {"jsonl": _JsonlWriter, "msgpack": _MsgpackWriter, "parquet": _ParquetWriter, "none": _NoWriter}


def _open(path: str, mode: str) -> Any:
    try:
        return open(path, mode)
    except OSError as exc:
        raise CliError(f"{path}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None


def _format_of(args) -> str:
    if args.format:
        return args.format
    if args.output is None:
        return "none"
    ext = os.path.splitext(args.output)[1].lower().lstrip(".")
    return {"msgpack": "msgpack", "mpk": "msgpack", "parquet": "parquet", "pq": "parquet"}.get(ext, "jsonl")


def run(args) -> int:
    """Reduce the log and write its samples; the digest is the last line."""
    if args.policy is not None:
        return run_counterfactual(args)
    if args.diff or args.json:
        raise CliError("reconstruct: --diff and --json go with --policy FILE", EXIT_USAGE)
    from agentlog.reducers.config import ConfigError, ReduceConfig
    from agentlog.reducers.partitioned import PartitionFold
    from agentlog.reducers.pipeline import ReduceError
    from agentlog.reducers.samples import SampleDigest

    path = check_log_path(args.log)
    check_output_path(path, args.output)
    # A run folder's own settings (the samples and groups its learner trained), or the run's config given.
    base = reduce_config_of(path, args.config)
    overrides = {}
    if args.fork_threshold is not None:
        overrides["fork_threshold"] = args.fork_threshold
    if args.max_context_tokens is not None:
        overrides["max_context_tokens"] = args.max_context_tokens
    if args.allow_repeated_targets:
        overrides["allow_repeated_targets"] = True
    try:
        config = ReduceConfig(**{**base.to_dict(), **overrides})
    except ConfigError as exc:
        raise CliError(f"reconstruct: {exc}", EXIT_USAGE) from None
    fmt = _format_of(args)
    if args.output is None and fmt != "none":
        raise CliError(f"reconstruct: --format {fmt} needs -o OUT, the file to write", EXIT_USAGE)
    header = {"reduce_config": config.to_dict(), "reduce_config_digest": config.digest()}
    writer = _WRITERS[fmt](args.output, header)
    # One reducer per partition (a single log is partition 0): sessions never span
    # partitions, and each partition's LSNs are its own.
    # Each partition's reducer refuses a reused id however long ago it ended, a reuse its id
    # filter alone reports confirmed by a scan of that partition (the filter has false positives).
    fold = PartitionFold(config, confirm_of=id_scans_of(path))
    digest = SampleDigest()
    groups = skipped = 0
    ok = False
    try:
        for pid, env in read_tagged(path, quiet=args.quiet, desc="reconstruct"):
            try:
                out = fold.reducer_of(pid or 0).feed(env)
            except ReduceError as exc:
                where = "" if pid is None else f" partition p{pid:04d}:"
                raise CliError(f"{path}:{where} {exc}", EXIT_DATA) from None
            if out.samples:
                writer.write(out.samples)
                for sample in out.samples:
                    digest.update(sample)
            for g in out.groups:
                groups += 1
                skipped += g.skipped
        ok = True
    finally:
        writer.close()
        if not ok and args.output not in (None, "-"):
            try:
                os.unlink(args.output)  # never leave a partial sample file that looks whole
            except OSError:
                pass
    reducers = list(fold.reducers.values())
    pending = sum(len(r.pending_groups()) for r in reducers)
    in_flight = sum(len(r.open_sessions()) for r in reducers)
    written = f"{args.output}: " if args.output is not None else ""
    print(
        f"{written}{sum(r.samples_emitted for r in reducers)} samples ({fmt if args.output is not None else 'not written: no -o'}) from {sum(r.events for r in reducers)} events;"
        f" {groups} groups released ({skipped} skipped), {pending} pending, {in_flight} sessions in flight;"
        f" config {config.digest()[:19]} ({_settings(config, base)})"
    )
    verdict = _check_online_digests(path)
    if verdict is not None:
        print(verdict[0])
    print(f"digest {digest.hexdigest()}")
    sys.stdout.flush()
    return EXIT_OK if verdict is None or verdict[1] else EXIT_DATA


def _settings(config: Any, base: Any) -> str:
    """Where the reduce settings came from, and those that differ from the reducers' defaults
    (of a table, the entries that differ)."""
    from agentlog.reducers.config import DEFAULT_CONFIG

    source = "the run's config.json" if base != DEFAULT_CONFIG else "defaults"
    changed = []
    for k, v in config.to_dict().items():
        default = getattr(DEFAULT_CONFIG, k)
        if isinstance(v, dict) and isinstance(default, dict):
            changed += [f"{k}.{key} {value}" for key, value in v.items() if default.get(key) != value]
        elif v != default:
            changed.append(f"{k} {v}")
    return source + (f": {', '.join(changed)}" if changed else "")


def _check_online_digests(path) -> tuple[str, bool] | None:
    """For the rollout log of a loop run folder (its learner log and config
    beside it, wherever its logs live): the line comparing every online per-step sample digest with
    an offline replay of the learner's records against the rollout
    partitions (:func:`agentlog.loop.check.check_run`), and whether all are
    equal. None for a bare log."""
    from agentlog.tools.cli_common import learner_log_of

    # The whole rollout of a run folder (files, or the stream its config.json names), its learner log
    # beside it: checked through the same Run the loop wrote with. A bare log or URL has no config to replay against.
    run = path.run_dir
    if run is None or learner_log_of(path) is None:
        return None
    from agentlog.loop.check import check_run

    check = check_run(run)
    verdict = "EQUAL" if check.ok else "DIFFERENT"
    lines = [f"online per-step digests vs offline: {verdict} ({check.digests_equal}/{check.steps} steps equal, "
             f"{check.groups_consumed} groups each consumed once)"]
    lines += [f"  {line}" for line in (check.mismatches + check.duplicates + check.missing + check.unknown)[:10]]
    return "\n".join(lines), check.ok
