"""On-disk format of the file log: segments, frames, the durable watermark
and the checkpoint, with their codecs. The scanner that reads frames back is
:mod:`agentlog.events.log.scan`.

Layout of a log directory::

    00000000000000000000.seg   segment files, each named by its first LSN
    00000000000000004096.seg
    DURABLE                    durable watermark: (next durable LSN, epoch, synced?)
    INDEX                      checkpoint: sequence state + sparse index
    LOCK                       flock'd by the one writer (with the directory itself); holds its pid

Segment header (32 bytes)::

    magic b"AGLOGSEG" | u16 format version | u16 flags | u64 writer epoch
    | u64 first LSN | u32 masked CRC32C of the preceding 28 bytes

Version 1: plain frames only (flags 0). Version 2: a segment of a log that
compresses its batches (flags bit 0: zstd); it may hold compressed batches
and plain frames mixed. A reader older than version 2 refuses such a segment
("format version 2 is newer than this reader"), never misreads it.

Frame (all little-endian)::

    u32 masked CRC32C of everything after it up to the end of the frame
    u32 length     bytes after the type byte (envelope header + id + payload)
    u8  type       1 = record; 0 is never valid, so a zero-filled tail never
                   parses as a record
    u64 lsn | u64 session_seq | i64 ts_ns | u8 flags (bit 0: terminal event)
    | u16 session-id length | session id (UTF-8) | msgspec msgpack payload

Compressed batch (a version-2 segment; :mod:`agentlog.events.log.batch_compression`)::

    u32 masked CRC32C of everything after it (the stored, compressed bytes)
    u32 length     bytes after the type byte
    u8  type       2 = compressed batch
    u64 first lsn | u32 record count | u32 raw length | u8 codec (1 = zstd)
    | the codec's compression of ``count`` ordinary frames, concatenated
    (``raw length`` bytes once decompressed)

Its LSN sits where a frame's does, so a batch is one unit for recovery,
verify and the sparse index: one offset, the LSN range [first, first + count).

The CRC mask is LevelDB's: a CRC computed over data that itself embeds CRCs
is weak, so the stored value is rotated and offset.

The DURABLE file tells readers in other processes which records are durable:
the writer rewrites it (one ``pwrite`` of 20 bytes) only after the records
below it were made durable under its fsync policy. A reader or follower never
yields a record at or past it. Recovery also uses it to tell a torn tail
(records past the watermark, never acknowledged) from damage to acknowledged
records (which is corruption, never silently truncated).

Under ``fsync="never"`` the records below the watermark were written but not
synced, and the watermark itself is not synced either: a power loss can keep
it while dropping the data. Such a watermark carries the ``DURABLE_UNSYNCED``
bit (the top bit of the epoch field). Readers still stop at it; recovery
treats it as a hint only, never as proof that the records below it exist.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import NamedTuple

import google_crc32c
import msgspec

from .api import LogCorruption

#: CRC32C of bytes, and its continuation over more bytes (C code, no copies).
crc_value = google_crc32c.value
crc_extend = google_crc32c.extend

#: The newest segment format this code reads (and writes for a compressed log).
FORMAT_VERSION = 2
#: The version of a segment without compression: what readers before compression read.
FORMAT_VERSION_PLAIN = 1
#: Segment header flag (version 2): its batches are compressed with zstd.
SEG_FLAG_ZSTD = 1
#: Compression name -> segment header flags; None is a log without compression.
SEG_COMPRESSION_FLAGS = {None: 0, "zstd": SEG_FLAG_ZSTD}
#: The values of ``FileLog.open(compression=...)`` (None keeps the log's choice), of
#: ``agentlog serve --compression`` and of the loop's ``[log] compression``.
COMPRESSIONS = ("zstd", "none")


def check_compression(value: str | None) -> str | None:
    """``value`` checked as a ``compression`` option (None, "zstd" or "none")."""
    if value is not None and value not in COMPRESSIONS:
        raise ValueError(f"compression: expected one of {'/'.join(COMPRESSIONS)} or None (keep the log's), found {value!r}")
    return value

SEG_MAGIC = b"AGLOGSEG"
SEG_HDR = struct.Struct("<8sHHQQI")
SEG_HDR_SIZE = SEG_HDR.size  # 32
SEG_SUFFIX = ".seg"
SEG_NAME_RE = re.compile(r"^(\d{20})\.seg$")

#: crc, length, type
FRAME_HDR = struct.Struct("<IIB")
#: lsn, session_seq, ts_ns, flags, session-id length
ENV_HDR = struct.Struct("<QQqBH")
#: everything after the CRC, as one pack: length, type, lsn, seq, ts, flags, sid length
HEAD = struct.Struct("<IBQQqBH")
FRAME_CRC = struct.Struct("<I")
FRAME_PREFIX = FRAME_HDR.size  # 9: crc + length + type
FRAME_OVERHEAD = FRAME_CRC.size + HEAD.size  # 36 bytes before the session id
TYPE_RECORD = 1
TYPE_BATCH = 2
FLAG_TERMINAL = 1
#: first lsn, record count, raw (decompressed) length, codec: after a batch's type byte
BATCH_HDR = struct.Struct("<QIIB")
BATCH_CODEC_ZSTD = 1
#: A writer closes a compressed batch once its frames reach this many bytes (a
#: bigger single frame is a batch alone) or this many records; readers refuse more.
BATCH_RAW_BYTES = 256 << 10
BATCH_MAX_RECORDS = 4096


def batch_raw_cap(max_record_bytes: int) -> int:
    """The most bytes a compressed batch holds once decompressed: a frame
    of at most ``max_record_bytes`` may make a batch alone."""
    return max(BATCH_RAW_BYTES, max_record_bytes + FRAME_OVERHEAD + (1 << 16))

DURABLE_NAME = "DURABLE"
DURABLE_FMT = struct.Struct("<QQI")  # next durable lsn, epoch, masked crc
INDEX_NAME = "INDEX"
INDEX_MAGIC = b"AGLOGIDX"
LOCK_NAME = "LOCK"
#: The epoch fence: the highest writer epoch that has opened the log (see read_fence).
FENCE_NAME = "FENCE"
FENCE_MAGIC = b"AGLOGFNC"
FENCE_FMT = struct.Struct("<8sQI")  # magic, epoch, masked crc of magic + epoch

DEFAULT_MAX_RECORD_BYTES = 16 << 20
#: The LSN of every log's first record. Nothing removes a log's head (there
#: is no retention or truncation from the front), so the first segment is
#: always named by it: a first segment that starts later means records are lost.
LOG_START_LSN = 0
#: A sparse-index entry is kept every this many bytes of a segment.
INDEX_EVERY_BYTES = 64 << 10
#: The writer rewrites the ``INDEX`` checkpoint once the active segment has
#: grown by this many bytes since the last one (after the data it describes
#: is synced), so crash recovery rescans at most about this much whatever the
#: log's length. Measured (2-core VM): a rescan costs ~9 ms per MiB of small
#: events; a periodic checkpoint (an INDEX of ~12 kB written and renamed,
#: not fsynced) ~0.2-0.7 ms, under 1% of the time to append 8 MiB; 8 MiB
#: bounds the rescan to ~70 ms.
CHECKPOINT_EVERY_BYTES = 8 << 20

#: LevelDB's CRC mask offset (see mask_crc; the writer inlines the mask).
MASK_DELTA = 0xA282EAD8


def mask_crc(crc: int) -> int:
    """LevelDB's CRC mask: rotate right by 15 bits and add a constant."""
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & 0xFFFFFFFF


def segment_name(first_lsn: int) -> str:
    """File name of the segment whose first record is ``first_lsn``."""
    return f"{first_lsn:020d}{SEG_SUFFIX}"


def list_segments(directory: Path) -> list[int]:
    """First LSNs of the segment files in ``directory``, ascending."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = SEG_NAME_RE.match(name)
        if m:
            out.append(int(m.group(1)))
    out.sort()
    return out


def is_log_dir(directory: Path) -> bool:
    """True when ``directory`` holds segment files or a DURABLE watermark."""
    return directory.is_dir() and (bool(list_segments(directory)) or (directory / DURABLE_NAME).exists())


# ---------------------------------------------------------------- segment header


def pack_segment_header(epoch: int, first_lsn: int, compression: str | None = None) -> bytes:
    """The 32-byte header of a new segment; ``compression`` ("zstd" or None)
    is the log's choice. A segment without it keeps version 1, which every
    reader reads."""
    flags = SEG_COMPRESSION_FLAGS[compression]
    version = FORMAT_VERSION if flags else FORMAT_VERSION_PLAIN
    body = SEG_HDR.pack(SEG_MAGIC, version, flags, epoch, first_lsn, 0)[:-4]
    return body + FRAME_CRC.pack(mask_crc(crc_value(body)))


class SegmentHeader(NamedTuple):
    """A checked segment header: format version, writer epoch, first LSN,
    and the compression its writer chose ("zstd" or None)."""

    version: int
    epoch: int
    first_lsn: int
    compression: str | None = None


def parse_segment_header(raw: bytes, name: str, expected_first: int) -> SegmentHeader:
    """Check a segment header; raises LogCorruption naming the segment and what is wrong."""
    if len(raw) < SEG_HDR_SIZE:
        raise LogCorruption(
            f"segment {name}, offset 0: header is {len(raw)} bytes, expected {SEG_HDR_SIZE}", segment=name, offset=0
        )
    magic, version, flags, epoch, first, crc = SEG_HDR.unpack_from(raw)
    if magic != SEG_MAGIC:
        raise LogCorruption(f"segment {name}, offset 0: bad magic {magic!r}, expected {SEG_MAGIC!r}", segment=name, offset=0)
    if mask_crc(crc_value(bytes(raw[: SEG_HDR_SIZE - 4]))) != crc:
        raise LogCorruption(f"segment {name}, offset 0: header CRC mismatch", segment=name, offset=0)
    if version > FORMAT_VERSION:
        raise LogCorruption(
            f"segment {name}: format version {version} is newer than this reader ({FORMAT_VERSION}); upgrade agentlog",
            segment=name,
            offset=0,
        )
    if first != expected_first:
        raise LogCorruption(
            f"segment {name}, offset 0: header says first lsn {first}, the file name says {expected_first}",
            segment=name,
            offset=0,
        )
    compression = None
    if version >= 2:
        if flags & ~SEG_FLAG_ZSTD:
            raise LogCorruption(
                f"segment {name}, offset 0: header flags {flags:#06x} hold bits this reader does not know "
                f"(expected only {SEG_FLAG_ZSTD:#06x}: zstd); upgrade agentlog",
                segment=name,
                offset=0,
            )
        compression = "zstd" if flags & SEG_FLAG_ZSTD else None
    return SegmentHeader(version, epoch, first, compression)


# ---------------------------------------------------------------- frames


def encode_frame(lsn: int, seq: int, ts_ns: int, flags: int, sid: bytes, payload: bytes) -> bytes:
    """One framed record (see the module docstring for the layout)."""
    head = HEAD.pack(ENV_HDR.size + len(sid) + len(payload), TYPE_RECORD, lsn, seq, ts_ns, flags, len(sid)) + sid
    crc = crc_extend(crc_value(head), payload)
    return FRAME_CRC.pack(mask_crc(crc)) + head + payload


# ---------------------------------------------------------------- durable watermark


#: Set in DURABLE's epoch field when the records below the watermark were not synced.
DURABLE_UNSYNCED = 1 << 63


class Watermark(NamedTuple):
    """The DURABLE file: records below ``lsn`` are acknowledged; ``synced``
    says whether they were also synced (False under ``fsync="never"``)."""

    lsn: int
    epoch: int
    synced: bool


def pack_durable(next_lsn: int, epoch: int, *, synced: bool = True) -> bytes:
    """Contents of the DURABLE file."""
    body = struct.pack("<QQ", next_lsn, epoch if synced else epoch | DURABLE_UNSYNCED)
    return body + FRAME_CRC.pack(mask_crc(crc_value(body)))


def read_durable(directory: Path) -> tuple[int, int] | None:
    """(next durable lsn, writer epoch) from DURABLE, or None when the file is
    missing or unreadable (then no watermark is known)."""
    mark = read_watermark(directory)
    return None if mark is None else (mark.lsn, mark.epoch)


def read_watermark(directory: Path) -> Watermark | None:
    """The DURABLE file with its synced bit, or None when it is missing or unreadable."""
    try:
        with open(directory / DURABLE_NAME, "rb") as f:
            raw = f.read(DURABLE_FMT.size)
    except FileNotFoundError:
        return None
    if len(raw) != DURABLE_FMT.size:
        return None
    lsn, epoch, crc = DURABLE_FMT.unpack(raw)
    if mask_crc(crc_value(raw[:16])) != crc:
        return None
    return Watermark(lsn, epoch & ~DURABLE_UNSYNCED, not epoch & DURABLE_UNSYNCED)


# ---------------------------------------------------------------- epoch fence


def pack_fence(epoch: int) -> bytes:
    """Contents of the FENCE file naming writer epoch ``epoch``."""
    body = struct.pack("<8sQ", FENCE_MAGIC, epoch)
    return body + FRAME_CRC.pack(mask_crc(crc_value(body)))


def parse_fence(raw: bytes, path: Path | str) -> int:
    """The epoch a FENCE file's bytes name; LogCorruption naming ``path`` when
    they are not a FENCE (it is written atomically, so it is never torn by a
    crash: damage means something else wrote it)."""
    if len(raw) != FENCE_FMT.size:
        raise LogCorruption(f"{path}: expected a {FENCE_FMT.size}-byte epoch fence, found {len(raw)} bytes")
    magic, epoch, crc = FENCE_FMT.unpack(raw)
    if magic != FENCE_MAGIC or mask_crc(crc_value(raw[:16])) != crc:
        raise LogCorruption(f"{path}: epoch fence has a bad magic or CRC (expected {FENCE_MAGIC!r} and a matching CRC)")
    return epoch


def read_fence(directory: Path) -> int:
    """The highest writer epoch that has opened the log in ``directory``, per
    its FENCE file; 0 when there is none (a new log, or one written before
    fences existed). Opens the file afresh: it is replaced by rename, and a
    fresh open is what makes NFS revalidate it (close-to-open consistency)."""
    path = directory / FENCE_NAME
    raw = read_fence_bytes(path)
    return 0 if raw is None else parse_fence(raw, path)


def read_fence_bytes(path: Path | str) -> bytes | None:
    """The bytes of the FENCE file at ``path`` (a byte more than a FENCE
    holds, when there are more), opened afresh as :func:`read_fence` says;
    None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.pread(fd, FENCE_FMT.size + 1, 0)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- checkpoint


class Checkpoint(msgspec.Struct, frozen=True):
    """Writer state as of record ``lsn``, which starts at ``offset`` in segment
    ``segment`` (or would, if nothing follows). Rebuildable from the log."""

    epoch: int
    lsn: int
    segment: int
    offset: int
    segments: list[int]
    open_sessions: dict[str, int]
    #: segment first lsn -> sparse [(lsn, offset), ...]
    index: dict[int, list[tuple[int, int]]]


_ckpt_encoder = msgspec.msgpack.Encoder()
_ckpt_decoder = msgspec.msgpack.Decoder(Checkpoint)


def pack_checkpoint(ckpt: Checkpoint) -> bytes:
    """Magic, masked CRC, length, then msgpack."""
    body = _ckpt_encoder.encode(ckpt)
    return INDEX_MAGIC + struct.pack("<II", mask_crc(crc_value(body)), len(body)) + body


def load_checkpoint(directory: Path) -> tuple[Checkpoint | None, str]:
    """The checkpoint, or (None, why not)."""
    try:
        raw = (directory / INDEX_NAME).read_bytes()
    except FileNotFoundError:
        return None, "no INDEX file"
    if len(raw) < 16 or raw[:8] != INDEX_MAGIC:
        return None, "INDEX has a bad header"
    crc, n = struct.unpack_from("<II", raw, 8)
    body = raw[16:]
    if len(body) != n or mask_crc(crc_value(body)) != crc:
        return None, "INDEX CRC or length mismatch"
    try:
        return _ckpt_decoder.decode(body), ""
    except msgspec.DecodeError as exc:
        return None, f"INDEX does not decode: {exc}"
