"""The on-disk session index of `agentlog ui`: one SQLite file (standard library
``sqlite3``, FTS5 for the transcript text), built progressively and reused.

One row per session with the sessions table's columns. The columns are
folded by the project's owners, never re-derived: the lifecycle step through
:class:`reducers.fold.SessionFold` (status, as ``replay --status`` reads it),
the health flags by :class:`reducers.health.SessionHealth` (``replay --flag``),
the reward by :func:`reducers.outcome.session_outcome`, and the reason is the
abort's or drop's own reason (``replay --reason``), all folded with the run's
reduce settings (:func:`tools.cli_common.reduce_config_of`), the same fold
``replay``'s selection (:func:`tools.cmd_replay.index_log`) runs.

**Progressive and reused.** The index records, per partition (or for the one
log), the next LSN to read and fingerprints of the first and the last record
read. A later start (or the live follower, every poll) reads on from there.
Sessions still in flight at that point are folded again from their first
record (their fold state is not stored), every other record before it is
passed over. A log whose first record or last-read record no longer matches
its fingerprint (another stream with the same name, a truncated or rewritten
log), a log shorter than the position, other reduce settings or another index
schema make the index rebuilt from scratch, and :attr:`SessionIndex.rebuilt_why`
says why.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from agentlog._logging import get_logger
from agentlog.events.errors import AgentlogError
from agentlog.events.log.source import LogSource
from agentlog.tools.cmd_replay import STATUSES  # replay --status: the one list of statuses

log = get_logger("agentlog.tools.ui.index")

#: Bump when the tables or a column's meaning change: an older index is rebuilt.
SCHEMA_VERSION = 2  # 2: the sessions' resumes column
#: The key of a single (not partitioned) log in the position table.
SINGLE = -1
#: Sort fields the sessions query accepts (the API's ``sort``).
SORT_FIELDS = ("session_id", "group_id", "status", "reason", "reward", "turns", "version_min", "version_max",
               "partition", "first_ts", "resumes")
#: The largest integer SQLite stores (a query parameter beyond it is refused, not overflowed).
MAX_SQL_INT = 2**63 - 1
_TURN_TAGS = ("turn_recorded", "turn_delta")
_TEXT_TAGS = frozenset(("turn_recorded", "turn_delta", "command_ran", "session_aborted"))

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS position(pkey INTEGER PRIMARY KEY, next_lsn INTEGER NOT NULL,
    first_fp TEXT NOT NULL, last_fp TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions(session_id TEXT PRIMARY KEY, group_id TEXT, partition TEXT, pkey INTEGER,
    status TEXT, reason TEXT, reward REAL, turns INTEGER, version_min INTEGER, version_max INTEGER,
    flags TEXT NOT NULL, first_ts REAL, first_lsn INTEGER, ended INTEGER NOT NULL, text_id INTEGER NOT NULL,
    resumes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS session_flags(flag TEXT NOT NULL, session_id TEXT NOT NULL, PRIMARY KEY(flag, session_id));
CREATE VIRTUAL TABLE IF NOT EXISTS session_text USING fts5(session_id UNINDEXED, body);
CREATE INDEX IF NOT EXISTS flags_of ON session_flags(session_id);
CREATE INDEX IF NOT EXISTS by_group ON sessions(group_id);
CREATE INDEX IF NOT EXISTS by_status ON sessions(status, reason);
CREATE INDEX IF NOT EXISTS by_reward ON sessions(reward);
CREATE INDEX IF NOT EXISTS by_first_ts ON sessions(first_ts);
CREATE INDEX IF NOT EXISTS by_open ON sessions(ended, pkey, first_lsn);
"""
_COLUMNS = ("session_id", "group_id", "partition", "status", "reason", "reward", "turns", "version_min",
            "version_max", "flags", "first_ts", "resumes")


class IndexUnusableError(AgentlogError):
    """An index path the user named (``--index``) that SQLite cannot open: another file, a directory."""


class IndexLockedError(AgentlogError):
    """Another process (or server) holds the index file: two writers would corrupt its position."""


class QueryError(AgentlogError, ValueError):
    """A query the index cannot answer: ``param`` names the query parameter that was wrong."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def default_index_path(source: LogSource, arg: str) -> Path:
    """``<run>/.agentlog-ui/index.sqlite`` for a run folder (or its ``rollout/``); for a bare log
    directory ``<parent>/.agentlog-ui/<name>.sqlite``, beside it; for a ``nats://`` source a file
    under the user's cache directory keyed by the URL (the stream's identity is checked on reuse)."""
    from agentlog.events.log.source import is_location_url

    if is_location_url(arg):
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        key = hashlib.sha256(arg.encode()).hexdigest()[:16]
        return cache / "agentlog" / "ui" / f"{key}.sqlite"
    if source.run_dir is not None:
        return Path(source.run_dir) / ".agentlog-ui" / "index.sqlite"
    # A bare log: beside it, never inside (a log directory holds only the log's own files).
    log_dir = Path(arg).resolve()
    return log_dir.parent / ".agentlog-ui" / f"{log_dir.name}.sqlite"


def _fingerprint(rec: Any) -> str:
    h = hashlib.sha256()
    h.update(f"{rec.lsn}|{rec.session_id}|{rec.session_seq}|{rec.ts_ns}|".encode())
    h.update(rec.payload)
    return h.hexdigest()


class _Session:
    """What the index folds for one session in flight."""

    __slots__ = ("life", "sid", "group_id", "pkey", "first_ts", "first_lsn", "turns", "health", "text",
                 "n_messages", "status", "reason", "reward", "ended", "text_id", "resumes")

    def __init__(self, life: Any, sid: str, group_id: str, pkey: int, health: Any) -> None:
        self.life, self.sid, self.group_id, self.pkey, self.health = life, sid, group_id, pkey, health
        self.first_ts = 0.0
        self.first_lsn = 0
        self.turns = 0
        self.text: list[str] = []
        self.n_messages = 0
        self.status = "open"
        self.reason: str | None = None
        self.reward: float | None = None
        self.ended = False
        self.text_id: int | None = None  # its row in session_text (FTS5 rowid), once written
        self.resumes = 0  # session_resumed events: one session, resumed by new incarnations


class _EndedIds:
    """The fold's filter of sessions that ended (:class:`reducers.fold.IdSet`), kept in the index
    file rather than in memory: an id opened or ended since the last flush is held here, every
    other one is an ended row of the ``sessions`` table. A record of an ended session (a second
    ``session_opened`` with its id included) is then refused as replay's fold refuses it, while
    memory holds only the sessions in flight."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self.unflushed: set[str] = set()

    def add(self, session_id: str) -> None:
        self.unflushed.add(session_id)

    def __contains__(self, session_id: object) -> bool:
        if session_id in self.unflushed:
            return True
        return self._db.execute("SELECT 1 FROM sessions WHERE session_id = ? AND ended = 1",
                                (session_id,)).fetchone() is not None


class SessionIndex:
    """The session index of ``source`` in the SQLite file ``path`` (see the module docstring).

    Writes (:meth:`catch_up`) happen on one thread at a time (a lock: :meth:`close` waits for a
    catch-up in progress, which it asks to stop at the next record); reads (:meth:`query`,
    :meth:`summary`) use their own connection and may run on another thread meanwhile (WAL
    journal). One process at a time holds the index: an exclusive lock on ``<path>.lock``
    (holding its pid); a second opener gets :class:`IndexLockedError`."""

    def __init__(self, source: LogSource, path: Path, config: Any, *, owned: bool = False) -> None:
        self.source, self.path, self.config = source, Path(path), config
        self.owned = owned  #: the default path, this tool's own cache: rebuilt when SQLite cannot read it
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rebuilt_why: str | None = None  # why this start rebuilt the index (None: new or reused)
        self.resumed = False  # this start reused an index that held records
        self.records_read = 0  # records folded since this start
        self.build_s = 0.0  # seconds spent reading since this start
        self._write_lock = threading.Lock()  # catch_up and close: never both at once
        self._stopping = False  # close() asks a catch-up in progress to stop at the next record
        self._closed = False
        self._lock_file = self._take_lock()
        try:
            self._open()
        except BaseException:
            self._release_lock()
            raise

    def _open(self) -> None:
        from agentlog.reducers.fold import SessionFold

        try:
            self._db = self._connect()
            self._check_identity()
        except sqlite3.DatabaseError as exc:  # not a SQLite file (or a directory): damaged, or someone else's
            if not self.owned:  # a file the user named is left as it is
                raise IndexUnusableError(f"--index {self.path}: not an index `agentlog ui` can open (sqlite3: {exc}); "
                                         "name a new file or one it wrote, or leave --index out for the default") from None
            self._rebuild(f"the index file could not be read (sqlite3: {exc})")
            self._check_identity()
        self._reader = self._connect()
        self._pos: dict[int, tuple[int, str, str]] = {
            k: (n, f, lf) for k, n, f, lf in self._db.execute("SELECT pkey, next_lsn, first_fp, last_fp FROM position")}
        self.resumed = bool(self._pos)
        # Sessions in flight at the stored position are folded again from their first record.
        self._refold = {sid for (sid,) in self._db.execute("SELECT session_id FROM sessions WHERE ended = 0")}
        self._restart: dict[int, int] = {
            k: lsn for k, lsn in self._db.execute("SELECT pkey, MIN(first_lsn) FROM sessions WHERE ended = 0 GROUP BY pkey")}
        self._live: dict[str, _Session] = {}
        # Ended sessions leave the fold's live map (evict) and this index's: only sessions in flight
        # stay in memory; the id filter (in the file) still refuses anything after a session's end.
        self._ended_ids = _EndedIds(self._db)
        self._fold: SessionFold = SessionFold(opened=self._opened, applied=self._applied, ended=self._ended,
                                              refused=lambda violation: None, check_lsn=False, resync=False,
                                              evict=True, ids=self._ended_ids)
        self._pkey = SINGLE
        self._record: Any = None
        self._next_text_id = 1 + (self._db.execute("SELECT MAX(text_id) FROM sessions").fetchone()[0] or 0)

    # ------------------------------------------------------------------ opening

    def _take_lock(self) -> Any:
        lock_path = Path(f"{self.path}.lock")
        handle = open(lock_path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise IndexLockedError(
                f"{self.path}: the index is in use by another process (pid {holder}, lock file {lock_path});"
                " stop that `agentlog ui`, or give --index PATH for another index file") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        return handle

    def _release_lock(self) -> None:
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._lock_file.close()

    def _rebuild(self, why: str) -> None:
        """Start the index file afresh, ``why`` saying what made the old one unusable."""
        self.rebuilt_why = why
        log.warning("ui.index.rebuild", path=str(self.path), source=str(self.source), why=why)
        if getattr(self, "_db", None) is not None:  # not when the first connect failed
            self._db.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        self._db = self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def _meta(self) -> dict[str, str]:
        try:
            return dict(self._db.execute("SELECT key, value FROM meta"))
        except sqlite3.DatabaseError:
            return {}

    def _check_identity(self) -> None:
        """Rebuild the index when it is of another schema, settings or log (see the module docstring)."""
        want = {"schema": str(SCHEMA_VERSION), "source": str(self.source), "config": repr(self.config)}
        meta = self._meta()
        why = None
        if meta:
            for key in ("schema", "config"):
                if meta.get(key) != want[key]:
                    why = f"its {key} changed ({meta.get(key)!r:.60} -> {want[key]!r:.60})"
                    break
            if why is None:
                why = self._position_mismatch()
        if why is not None:
            self._rebuild(why)
        self._db.executescript(_SCHEMA)
        self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", want.items())

    def _position_mismatch(self) -> str | None:
        """Why the stored position no longer fits the log, or None when it does."""
        for pkey, next_lsn, first_fp, last_fp in self._db.execute("SELECT pkey, next_lsn, first_fp, last_fp FROM position"):
            log_ = self._log(pkey)
            where = str(log_)
            first = next(iter(self._read(log_, 0)), None)
            if first is None or _fingerprint(first) != first_fp:
                return f"{where}: its first record changed (another log with the same name, or rewritten)"
            last = next(iter(self._read(log_, next_lsn - 1)), None)
            if last is None or last.lsn != next_lsn - 1:
                return f"{where}: the log ends before LSN {next_lsn - 1}, where the index had read to (truncated)"
            if _fingerprint(last) != last_fp:
                return f"{where}: the record at LSN {next_lsn - 1} changed (the log was rewritten)"
        return None

    def _log(self, pkey: int) -> LogSource:
        return self.source if pkey == SINGLE else self.source.partition(pkey)

    @staticmethod
    def _read(source: LogSource, from_lsn: int) -> Iterable[Any]:
        return source.read(from_lsn, raw=True)

    def _pkeys(self) -> list[int]:
        if self.source.partitioned:
            return self.source.partitions()
        return [SINGLE] if self.source.exists() else []

    # ------------------------------------------------------------------ building

    def catch_up(self, bar: Any = None) -> set[str]:
        """Fold every record appended since the last call (or start); returns the ids of the
        sessions whose row changed. ``bar``: a byte progress bar to advance. After :meth:`close`
        (or while it waits for this call, which then stops early, keeping what it read) reads nothing."""
        with self._write_lock:
            if self._stopping:
                return set()
            started = time.perf_counter()
            changed: set[str] = set()
            for pkey in self._pkeys():
                changed |= self._catch_up_one(pkey, bar)
                if self._stopping:
                    break
            self.build_s += time.perf_counter() - started
            return changed

    def _catch_up_one(self, pkey: int, bar: Any) -> set[str]:
        from agentlog.reducers.runstats import decode_projection
        from agentlog.events.schema.types import event_tag

        next_lsn, first_fp, last_fp = self._pos.get(pkey, (0, "", ""))
        start = min(self._restart.pop(pkey, next_lsn), next_lsn)
        self._pkey = pkey
        changed: set[str] = set()
        out: set[str] = set()
        last = None  # the last new record read (its fingerprint is taken at each flush)
        n = 0
        for rec in self._read(self._log(pkey), start):
            if self._stopping:
                break  # close() waits: what was read so far is flushed below, a later start goes on from it
            if rec.lsn < next_lsn and rec.session_id not in self._refold:
                continue  # read before, and its session's row is final
            if rec.lsn == 0:
                first_fp = _fingerprint(rec)
            body = decode_projection(rec.payload)
            tag = event_tag(body)
            self._record = rec
            self._fold.feed(rec.lsn, rec.session_id, rec.session_seq, tag, body)
            if rec.session_id in self._live:
                changed.add(rec.session_id)
            if rec.lsn >= next_lsn:
                next_lsn, last = rec.lsn + 1, rec
            n += 1
            if bar is not None:
                bar.update(len(rec.payload) + 40)
            if n % 20000 == 0:  # a long build commits as it goes: a later start continues from here
                last_fp = last_fp if last is None else _fingerprint(last)
                self._flush(changed, pkey, next_lsn, first_fp, last_fp)
                out |= changed
                changed, last = set(), None
        self.records_read += n
        if n:
            last_fp = last_fp if last is None else _fingerprint(last)
            self._flush(changed, pkey, next_lsn, first_fp, last_fp)
        return out | changed

    def _opened(self, lsn: int, sid: str, body: Any, life: Any) -> _Session:
        from agentlog.reducers.health import SessionHealth

        s = _Session(life, sid, body.group_id, self._pkey, SessionHealth(sid, self.config, keep_turns=True))
        s.first_ts, s.first_lsn = self._record.ts_ns / 1e9, lsn
        self._live[sid] = s
        return s

    def _applied(self, s: _Session, lsn: int, tag: str, body: Any) -> None:
        payload = self._record.payload
        s.health.observe(tag, body, payload)
        if tag in _TURN_TAGS:
            s.turns += 1
        if tag in _TEXT_TAGS:
            s.text.extend(self._text_of(s, tag, payload))
        s.status = "running" if tag == "session_started" else s.status
        if tag == "session_resumed":
            s.resumes += 1

    def _ended(self, s: _Session, lsn: int, sid: str, state: Any, body: Any) -> None:
        from agentlog.reducers.outcome import session_outcome

        self._ended_ids.add(sid)  # ended before its row says so (see _EndedIds)
        s.ended = True
        s.status = str(state)
        if s.status != "finished":
            s.reason = body.reason
        s.reward = session_outcome(body, s.health.last_reward, s.health.flags(), self.config).reward

    @staticmethod
    def _text_of(s: _Session, tag: str, payload: bytes) -> list[str]:
        """The searchable text of a turn (its new messages and response), a command (line and output), an abort's error."""
        from agentlog.events.schema.types import decode_body

        body = decode_body(payload)
        if tag == "command_ran":
            return [body.command, body.output_tail]
        if tag == "session_aborted":
            return [body.error or ""]
        if tag == "turn_recorded":
            messages = body.messages[s.n_messages:]
            s.n_messages = len(body.messages) + 1
        else:
            messages = body.new_messages
            s.n_messages = body.shared_messages + len(body.new_messages) + 1
        out = [_content(m) for m in messages]
        if body.response_message is not None:
            out.append(_content(body.response_message))
        return out

    def _flush(self, changed: set[str], pkey: int, next_lsn: int, first_fp: str, last_fp: str) -> None:
        """Write the changed sessions' rows and the position, in one transaction."""
        db = self._db
        db.execute("BEGIN")
        try:
            for sid in changed:
                s = self._live.get(sid)
                if s is None:
                    continue
                self._write_row(s)
            db.execute("INSERT OR REPLACE INTO position VALUES (?, ?, ?, ?)", (pkey, next_lsn, first_fp, last_fp))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        # Written: an ended session's row is final, so its transcript and health leave memory.
        for sid in changed:
            s = self._live.get(sid)
            if s is not None and s.ended:
                del self._live[sid]
        self._ended_ids.unflushed.clear()
        self._pos[pkey] = (next_lsn, first_fp, last_fp)

    def _write_row(self, s: _Session) -> None:
        h = s.health
        flags = h.flags()  # for a session in flight: the flags known so far, as replay --flag reads them
        from agentlog.events.log.partitions import partition_name

        part = None if s.pkey == SINGLE else partition_name(s.pkey)
        fresh = False  # no row of it is stored yet: nothing to replace
        if s.text_id is None:  # a session folded again keeps its text row
            old = self._db.execute("SELECT text_id FROM sessions WHERE session_id = ?", (s.sid,)).fetchone()
            if old is None:
                old, fresh = (self._next_text_id,), True
                self._next_text_id += 1
            s.text_id = old[0]
        self._db.execute("INSERT OR REPLACE INTO sessions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", (
            s.sid, s.group_id, part, s.pkey, s.status, s.reason, s.reward, s.turns, h.v_lo, h.v_hi,
            " ".join(flags), s.first_ts, s.first_lsn, int(s.ended), s.text_id, s.resumes))
        if not fresh:
            self._db.execute("DELETE FROM session_flags WHERE session_id = ?", (s.sid,))
            self._db.execute("DELETE FROM session_text WHERE rowid = ?", (s.text_id,))
        self._db.executemany("INSERT INTO session_flags VALUES (?, ?)", [(f, s.sid) for f in flags])
        self._db.execute("INSERT INTO session_text(rowid, session_id, body) VALUES (?, ?, ?)",
                         (s.text_id, s.sid, "\n".join(t for t in s.text if t)))

    # ------------------------------------------------------------------ reading

    @property
    def built_to(self) -> str:
        """How far the index has read: ``lsn N`` (the next LSN) or ``p0000:N p0001:M``."""
        from agentlog.events.log.partitions import partition_name

        if set(self._pos) == {SINGLE}:
            return f"lsn {self._pos[SINGLE][0]}"
        return " ".join(f"{partition_name(k)}:{v[0]}" for k, v in sorted(self._pos.items())) or "lsn 0"

    def count(self) -> int:
        """How many sessions the index holds."""
        return self._reader.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]

    def summary(self) -> dict[str, Any]:
        """Counts for the run view: sessions by status, reasons, flags, and the sessions resumed at least once."""
        r = self._reader
        by_status = dict(r.execute("SELECT status, COUNT(*) FROM sessions GROUP BY status"))
        sessions = {"total": sum(by_status.values()), "finished": by_status.get("finished", 0),
                    "aborted": by_status.get("aborted", 0), "dropped": by_status.get("dropped", 0),
                    "running": by_status.get("running", 0), "open": by_status.get("open", 0)}
        reasons = dict(r.execute("SELECT reason, COUNT(*) FROM sessions WHERE reason IS NOT NULL GROUP BY reason ORDER BY 2 DESC"))
        flags = dict(r.execute("SELECT flag, COUNT(*) FROM session_flags GROUP BY flag ORDER BY 2 DESC"))
        resumed = r.execute("SELECT COUNT(*) FROM sessions WHERE resumes > 0").fetchone()[0]
        return {"sessions": sessions, "reasons": reasons, "flags": flags, "sessions_resumed": resumed}

    def aborts_over_time(self, buckets: int = 30) -> list[dict[str, Any]]:
        """Aborts and drops per bucket of ``first_ts`` and reason. A bucket holds the sessions with
        ``bucket_ts <= first_ts < bucket_end``: the same comparisons :meth:`query`'s ``since`` and
        ``until`` make, so ``reason=R&since=bucket_ts&until=bucket_end`` lists exactly ``count`` sessions."""
        r = self._reader
        lo, hi = r.execute("SELECT MIN(first_ts), MAX(first_ts) FROM sessions WHERE reason IS NOT NULL").fetchone()
        if lo is None:
            return []
        width = max((hi - lo) / buckets, 1e-3)
        edges = [lo + i * width for i in range(buckets)]
        # The last bucket ends past the latest session (lo + buckets * width may round below it).
        edges.append(max(lo + buckets * width, math.nextafter(hi, math.inf)))
        spans = ", ".join("(?, ?, ?)" for _ in range(buckets))
        rows = r.execute(f"WITH b(i, since, until) AS (VALUES {spans}) SELECT b.i, reason, COUNT(*) FROM b JOIN sessions "
                         "ON first_ts >= b.since AND first_ts < b.until WHERE reason IS NOT NULL "
                         "GROUP BY b.i, reason ORDER BY b.i, reason",
                         [v for i in range(buckets) for v in (i, edges[i], edges[i + 1])])
        return [{"bucket_ts": edges[i], "bucket_end": edges[i + 1], "reason": reason, "count": n} for i, reason, n in rows]

    def locate(self, session_id: str) -> tuple[int, int] | None:
        """(partition key, first LSN) of a session the index holds, or None."""
        got = self._reader.execute("SELECT pkey, first_lsn FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if got is None else (got[0], got[1])

    def row(self, session_id: str) -> dict[str, Any] | None:
        """One session's row, or None."""
        got = self._reader.execute(f"SELECT {', '.join(_COLUMNS)} FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if got is None else _as_row(got)

    def query(self, *, offset: int = 0, limit: int = 50, sort: str = "first_ts", status: str | None = None,
              reason: str | None = None, flag: str | None = None, version: int | None = None,
              partition: str | None = None, group: str | None = None, q: str | None = None,
              min_reward: float | None = None, max_reward: float | None = None, since: float | None = None,
              until: float | None = None) -> tuple[int, list[dict[str, Any]]]:
        """(total matching, the page of rows): the sessions table's question (see the contract).
        Raises :class:`QueryError` naming a parameter the index cannot take."""
        if status is not None and status not in STATUSES:
            raise QueryError("status", f"status: expected one of {', '.join(STATUSES)}, found {status!r}")
        for name, value in (("version", version), ("offset", offset), ("limit", limit)):
            if value is not None and not 0 <= value <= MAX_SQL_INT:
                raise QueryError(name, f"{name}: expected an integer in [0, {MAX_SQL_INT}], found {value}")
        where: list[str] = []
        args: list[Any] = []
        # version: the sessions whose policy versions span it; since/until: the bounds of an aborts_over_time
        # bucket (first_ts in [since, until)).
        for condition, bound in (("status = ?", status), ("reason = ?", reason), ("partition = ?", partition),
                                 ("group_id = ?", group),
                                 ("session_id IN (SELECT session_id FROM session_flags WHERE flag = ?)", flag),
                                 ("version_min <= ?", version), ("version_max >= ?", version),
                                 ("reward >= ?", min_reward), ("reward <= ?", max_reward),
                                 ("first_ts >= ?", since), ("first_ts < ?", until)):
            if bound is not None:
                where.append(condition)
                args.append(bound)
        if q:
            where.append("text_id IN (SELECT rowid FROM session_text WHERE session_text MATCH ?)")
            args.append(_fts_phrase(q))
        desc = sort.startswith("-")
        field = sort.lstrip("-")
        if field not in SORT_FIELDS:
            raise QueryError("sort", f"sort: expected one of {', '.join(SORT_FIELDS)} (prefix - for descending), found {sort!r}")
        cond = (" WHERE " + " AND ".join(where)) if where else ""
        order = f" ORDER BY {field} IS NULL, {field} {'DESC' if desc else 'ASC'}, session_id"
        r = self._reader
        r.execute("BEGIN")  # one read transaction: the total and the page see the same index
        try:
            total = r.execute(f"SELECT COUNT(*) FROM sessions{cond}", args).fetchone()[0]
            rows = r.execute(f"SELECT {', '.join(_COLUMNS)} FROM sessions{cond}{order} LIMIT ? OFFSET ?",
                             [*args, limit, offset]).fetchall()
        finally:
            r.execute("COMMIT")
        return total, [_as_row(row) for row in rows]

    def close(self) -> None:
        """Stop a catch-up in progress (at its next record, keeping what it read), wait for it,
        then close both connections and release the index's lock. Idempotent."""
        self._stopping = True
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            self._reader.close()
            self._db.close()
            self._release_lock()


def _fts_phrase(q: str) -> str:
    """``q`` as one FTS5 phrase (quoted: the user's text is searched, not parsed as a query)."""
    # NUL is no text anyone searches for, and SQLite refuses it in a query string.
    return '"' + q.replace("\x00", "").replace('"', '""') + '"'


def _content(message: Any) -> str:
    if not isinstance(message, dict):
        return str(message)
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif content is None:
        text = ""
    else:
        text = json.dumps(content)
    calls = message.get("tool_calls")
    return text + ("\n" + json.dumps(calls) if calls else "")


def _as_row(r: tuple) -> dict[str, Any]:
    row = dict(zip(_COLUMNS, r))
    row["flags"] = row["flags"].split() if row["flags"] else []
    return row
