"""`agentlog reconstruct LOG -o OUT [--format jsonl|msgpack|parquet]
[--fork-threshold N] [--max-context-tokens N]`: the training samples of a
recorded run, through the same :class:`reducers.pipeline.Reducer` the online
loop feeds, streamed to OUT in emission order.

The last line printed is ``digest sha256:<hex>``: the reducer's digest of
the sample stream (canonical bytes, :class:`reducers.samples.SampleDigest`),
so it is the same for the same log and options on every run and machine,
and equal to the online reducer's digest. Formats:

* ``msgpack``: each sample's canonical encoding (``reducers.samples.encode_sample``)
  preceded by its length as a little-endian u64: exactly the bytes the
  digest hashes, so ``sha256sum OUT`` prints the digest too;
  :func:`read_msgpack_samples` reads them back;
* ``jsonl``: one JSON object per sample, token / mask / log-prob arrays as lists;
* ``parquet``: one row per sample (needs the ``parquet`` extra: pyarrow);
  the reduce configuration and its digest are in the file's metadata.

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
from agentlog.tools.cli_common import add_quiet, check_log_path, nonneg_int, read_tagged

FORMATS = ("jsonl", "msgpack", "parquet")


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser(
        "reconstruct", help="rebuild the training samples; prints their digest last (exit 1 at the first lifecycle violation)"
    )
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write the samples")
    p.add_argument("--format", choices=FORMATS, default=None, help="output format (default: from OUT's suffix, else jsonl)")
    p.add_argument("--fork-threshold", type=nonneg_int, default=None, metavar="N", help="REALIGN only outputs shorter than N tokens (0: always fork)")
    p.add_argument("--max-context-tokens", type=nonneg_int, default=None, metavar="N", help="cut rows to N tokens (0: no limit)")
    add_quiet(p)
    p.set_defaults(func=run)


def sample_json(s: Any) -> dict[str, Any]:
    """A sample as JSON-ready data: arrays as lists."""
    return {
        "group_id": s.group_id,
        "session_id": s.session_id,
        "sample_index": s.sample_index,
        "row_index": s.row_index,
        "tokens": s.token_ids.tolist(),
        "response_length": s.response_length,
        "loss_mask": s.mask.tolist(),
        "rollout_log_probs": s.log_probs.tolist(),
        "reward": s.reward,
        "status": s.status,
        "remove_sample": s.remove_sample,
        "policy_version": s.policy_version,
        "turns": s.turns,
        "lsn_first": s.lsn_first,
        "lsn_last": s.lsn_last,
        "metadata": s.metadata,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
    }


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
        self._schema = pa.schema(
            [
                ("group_id", pa.string()),
                ("session_id", pa.string()),
                ("sample_index", pa.int64()),
                ("row_index", pa.int64()),
                ("tokens", pa.list_(pa.int32())),
                ("response_length", pa.int64()),
                ("loss_mask", pa.list_(pa.uint8())),
                ("rollout_log_probs", pa.list_(pa.float32())),
                ("reward", pa.float64()),
                ("status", pa.string()),
                ("remove_sample", pa.bool_()),
                ("policy_version", pa.int64()),
                ("turns", pa.int64()),
                ("lsn_first", pa.int64()),
                ("lsn_last", pa.int64()),
                ("metadata", pa.string()),  # JSON text: its keys vary by sample kind
                ("temperature", pa.float64()),
                ("top_p", pa.float64()),
                ("top_k", pa.int64()),
            ],
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

        pa = self._pa
        b = self._buf
        self._buf = []
        cols = {
            "group_id": [s.group_id for s in b],
            "session_id": [s.session_id for s in b],
            "sample_index": [s.sample_index for s in b],
            "row_index": [s.row_index for s in b],
            "tokens": [s.token_ids for s in b],
            "response_length": [s.response_length for s in b],
            "loss_mask": [s.mask for s in b],
            "rollout_log_probs": [s.log_probs for s in b],
            "reward": [s.reward for s in b],
            "status": [s.status for s in b],
            "remove_sample": [s.remove_sample for s in b],
            "policy_version": [s.policy_version for s in b],
            "turns": [s.turns for s in b],
            "lsn_first": [s.lsn_first for s in b],
            "lsn_last": [s.lsn_last for s in b],
            "metadata": [msgspec.json.encode(s.metadata).decode() for s in b],
            "temperature": [s.temperature for s in b],
            "top_p": [s.top_p for s in b],
            "top_k": [s.top_k for s in b],
        }
        self._w.write_table(pa.table(cols, schema=self._schema))

    def close(self) -> None:
        self._flush()
        self._w.close()


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


_WRITERS = {"jsonl": _JsonlWriter, "msgpack": _MsgpackWriter, "parquet": _ParquetWriter}


def _open(path: str, mode: str) -> Any:
    try:
        return open(path, mode)
    except OSError as exc:
        raise CliError(f"{path}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None


def _format_of(args) -> str:
    if args.format:
        return args.format
    ext = os.path.splitext(args.output)[1].lower().lstrip(".")
    return {"msgpack": "msgpack", "mpk": "msgpack", "parquet": "parquet", "pq": "parquet"}.get(ext, "jsonl")


def run(args) -> int:
    """Reduce the log and write its samples; the digest is the last line."""
    from agentlog.reducers.config import DEFAULT_CONFIG, ConfigError, ReduceConfig
    from agentlog.reducers.partitioned import PartitionFold
    from agentlog.reducers.pipeline import ReduceError
    from agentlog.reducers.samples import SampleDigest

    path = check_log_path(args.log)
    overrides = {}
    if args.fork_threshold is not None:
        overrides["fork_threshold"] = args.fork_threshold
    if args.max_context_tokens is not None:
        overrides["max_context_tokens"] = args.max_context_tokens
    try:
        config = ReduceConfig(**{**DEFAULT_CONFIG.to_dict(), **overrides})
    except ConfigError as exc:
        raise CliError(f"reconstruct: {exc}", EXIT_USAGE) from None
    fmt = _format_of(args)
    header = {"reduce_config": config.to_dict(), "reduce_config_digest": config.digest()}
    writer = _WRITERS[fmt](args.output, header)
    # One reducer per partition (a single log is partition 0): sessions never span
    # partitions, and each partition's LSNs are its own.
    fold = PartitionFold(config)
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
        if not ok and args.output != "-":
            try:
                os.unlink(args.output)  # never leave a partial sample file that looks whole
            except OSError:
                pass
    reducers = list(fold.reducers.values())
    pending = sum(len(r.pending_groups()) for r in reducers)
    in_flight = sum(len(r.open_sessions()) for r in reducers)
    print(
        f"{args.output}: {sum(r.samples_emitted for r in reducers)} samples ({fmt}) from {sum(r.events for r in reducers)} events;"
        f" {groups} groups released ({skipped} skipped), {pending} pending, {in_flight} sessions in flight;"
        f" config {config.digest()[:19]}"
    )
    verdict = _check_online_digests(path)
    if verdict is not None:
        print(verdict[0])
    print(f"digest {digest.hexdigest()}")
    sys.stdout.flush()
    return EXIT_OK if verdict is None or verdict[1] else EXIT_DATA


def _check_online_digests(path) -> tuple[str, bool] | None:
    """For the rollout log of a loop run folder (its learner log and config
    beside it; or a run folder whose logs are on JetStream): the line comparing every online per-step sample digest with
    an offline replay of the learner's records against the rollout
    partitions (:func:`agentlog.loop.check.check_run`), and whether all are
    equal. None for a bare log."""
    from pathlib import Path

    from agentlog.tools.cli_common import RemoteLog, learner_log_of

    if isinstance(path, RemoteLog):
        # A run folder whose logs are on JetStream (config.json [log] backend = "nats") is checked through
        # the same RunLogs the loop wrote with; a bare stream URL has no config to replay the learner against.
        if path.run_dir is None or path.name is not None or learner_log_of(path) is None:
            return None
        run = path.run_dir
    else:
        run = Path(path).parent
        if Path(path).name != "rollout" or not (run / "config.json").is_file() or not (run / "learner").is_dir():
            return None
    from agentlog.loop.check import check_run

    check = check_run(run)
    verdict = "EQUAL" if check.ok else "DIFFERENT"
    lines = [f"online per-step digests vs offline: {verdict} ({check.digests_equal}/{check.steps} steps equal, "
             f"{check.groups_consumed} groups each consumed once)"]
    lines += [f"  {line}" for line in (check.mismatches + check.duplicates + check.missing + check.unknown)[:10]]
    return "\n".join(lines), check.ok
