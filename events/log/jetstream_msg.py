"""A log's records as JetStream messages: the headers and their decoding.

Each record is the file log's frame, one message each, its ``Nats-Msg-Id``
(``<log>:<epoch>:<lsn>[:<chunk>]``) naming its LSN; a frame over the
server's max payload is split into chunks (``Agentlog-Chunk: i/k``) inside
one atomic batch; a writer's fence is a message of kind ``fence`` naming the
LSN it appends next. This module owns those headers, :class:`ChunkJoiner`
(chunks back into frames), :func:`decode_message` (a frame checked exactly
as a segment reader checks it: CRC, length, LSN continuity) and the LSN a
message names (:func:`msg_id_lsn`, :func:`lsn_after`).
"""

from __future__ import annotations

from .api import LogCorruption
from .format import ENV_HDR, FLAG_TERMINAL, FRAME_HDR, FRAME_PREFIX, TYPE_RECORD, crc_value, mask_crc
from .read import RawRecord

HDR_MSG_ID = "Nats-Msg-Id"
HDR_KIND = "Agentlog-Kind"
#: "i/k" on the messages of a record split into k chunks (i from 1); absent on a whole record.
HDR_CHUNK = "Agentlog-Chunk"
KIND_FENCE = "fence"
#: On a fence message: the LSN its writer appends next.
HDR_NEXT_LSN = "Agentlog-Next-Lsn"


def decode_message(data: bytes, where: str, expected_lsn: int) -> RawRecord:
    """The record one JetStream message holds: its frame checked exactly as a
    segment reader checks it (type, length, CRC, LSN). Raises LogCorruption
    naming ``where`` and what was wrong."""

    def bad(reason: str) -> LogCorruption:
        return LogCorruption(f"{where}: {reason}", segment=where, last_good_lsn=expected_lsn - 1)

    if len(data) < FRAME_PREFIX + ENV_HDR.size:
        raise bad(f"message of {len(data)} bytes is shorter than a frame header ({FRAME_PREFIX + ENV_HDR.size})")
    crc, length, typ = FRAME_HDR.unpack_from(data, 0)
    if typ != TYPE_RECORD:
        raise bad(f"type byte {typ} (expected a record, type {TYPE_RECORD})")
    if FRAME_PREFIX + length != len(data):
        raise bad(f"frame length {length} does not match the message ({len(data) - FRAME_PREFIX} bytes after the header)")
    view = memoryview(data)
    if mask_crc(crc_value(data[4:])) != crc:
        raise bad("CRC mismatch")
    lsn, seq, ts, flags, sidlen = ENV_HDR.unpack_from(data, FRAME_PREFIX)
    if lsn != expected_lsn:
        raise bad(f"lsn {lsn}, expected {expected_lsn}")
    p = FRAME_PREFIX + ENV_HDR.size
    if p + sidlen > len(data):
        raise bad(f"session-id length {sidlen} exceeds the frame")
    try:
        sid = bytes(view[p : p + sidlen]).decode("utf-8")
    except UnicodeDecodeError:
        raise bad("session id is not UTF-8") from None
    return RawRecord(lsn, sid, seq, ts, bool(flags & FLAG_TERMINAL), view[p + sidlen :])


def msg_id_lsn(headers: dict | None) -> int | None:
    """The LSN a record message's ``Nats-Msg-Id`` (``<log>:<epoch>:<lsn>[:<chunk>]``) names; None for a fence or a foreign message."""
    parts = (headers or {}).get(HDR_MSG_ID, "").split(":")
    return int(parts[2]) if len(parts) >= 3 and parts[2].isdigit() else None


def lsn_after(last, where: str) -> int:
    """The LSN that follows a log whose subject ends in message ``last``: a record's
    msg id names its LSN, a fence the next LSN; anything else is LogCorruption."""
    headers = last.headers or {}
    lsn = msg_id_lsn(headers)
    if lsn is not None:
        return lsn + 1
    if headers.get(HDR_KIND) == KIND_FENCE and headers.get(HDR_NEXT_LSN, "").isdigit():
        return int(headers[HDR_NEXT_LSN])
    raise LogCorruption(f"{where} seq {last.seq}: the last message is neither a record nor a fence naming "
                        f"the next LSN (headers {sorted(headers)})", segment=where)


class ChunkJoiner:
    """Joins a subject's messages into frames: a whole record as it is, the
    chunks of a split record joined at its last chunk (never yielded in
    part); fence messages skipped. Chunks out of order are LogCorruption."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.parts: list[bytes] = []
        self.first = 0

    def push(self, seq: int, headers: dict | None, data: bytes) -> bytes | None:
        """The frame completed by this message, or None (a fence, or a chunk before the last)."""
        headers = headers or {}
        if headers.get(HDR_KIND) == KIND_FENCE:
            return None
        chunk = headers.get(HDR_CHUNK)
        if chunk is None:
            if self.parts:
                raise LogCorruption(f"{self.where} seq {seq}: a whole message inside the chunks begun at seq {self.first}", segment=self.where)
            return data
        i, _, k = chunk.partition("/")
        if not (i.isdigit() and k.isdigit() and int(i) == len(self.parts) + 1 <= int(k)):
            raise LogCorruption(f"{self.where} seq {seq}: chunk {chunk!r}, expected {len(self.parts) + 1}/k", segment=self.where)
        if not self.parts:
            self.first = seq
        self.parts.append(data)
        if int(i) < int(k):
            return None
        joined, self.parts = b"".join(self.parts), []
        return joined
