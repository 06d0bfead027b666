"""Token ids and log-probs as stored: raw little-endian ``int32`` /
``float32`` bytes. Constructors of the bodies accept lists or numpy arrays for
those fields and convert them here; accessors hand back read-only numpy
views over the stored bytes."""

from __future__ import annotations

import math
import struct
import sys
from array import array
from typing import Any, Callable

import msgspec
import numpy as np

from . import speedups
from .validation import EventValidationError, fail

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")


# A list of Python numbers (what backends and agents hand over) packs through
# ``struct`` in one C pass: for a turn's few hundred values about twice as fast
# as numpy's conversion, and as ``array`` (which parses each item through
# ``PyArg_Parse``: a tenth of a captured turn's instructions). For plain ints,
# floats and numpy scalars the result is numpy's, bytes and refusals alike (a
# differential test): ``struct`` refuses a float or str among token ids, a token
# past int32 and a log-prob past float32, and numpy's path then runs and words
# the error (or stores the infinity the finite check refuses). It converts each
# item as ``operator.index()`` / ``float()`` would, so it also takes items
# numpy's shape inference refuses in a list: a one-element tensor, any object
# with ``__index__`` (tokens) or ``__float__`` (log-probs); the values stored are
# those items' values. Its ``<`` formats are little-endian, 4 bytes an item, as stored.
_ARRAY_PACKS = sys.byteorder == "little" and array("f").itemsize == 4  # all_finite's sum over the stored bytes


def pack_tokens(values: Any) -> bytes:
    """Token ids (list, tuple, numpy array or bytes) -> little-endian int32 bytes."""
    # An all-bool list is refused by numpy's path (dtype bool): a first item that is a bool goes there.
    if type(values) is list and values and type(values[0]) is not bool:
        fast = speedups.native
        if fast is not None:
            packed = fast.pack_int32(values)  # None unless every item is an exact int in range
            if packed is not None:
                return packed
        try:
            return struct.pack(f"<{len(values)}i", *values)
        except (TypeError, OverflowError, struct.error):
            pass  # refused: numpy's path says why
    if isinstance(values, (bytes, bytearray, memoryview)):
        raw = bytes(values)
        if len(raw) % 4:
            raise EventValidationError(f"token bytes: expected a multiple of 4 bytes, found {len(raw)}")
        return raw
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:  # ragged nesting and the like
        raise EventValidationError(f"token ids: expected a 1-D sequence of ints, found {type(values).__name__} ({exc})") from None
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise EventValidationError(f"token ids: expected a 1-D sequence of ints, found dtype {arr.dtype} shape {arr.shape}")
    if arr.min() < -(2**31) or arr.max() >= 2**31:
        raise EventValidationError(f"token ids: expected int32 range, found min {arr.min()} max {arr.max()}")
    return arr.astype(TOKEN_DTYPE, copy=False).tobytes()


def pack_log_probs(values: Any) -> bytes:
    """Log-probs (list, tuple, numpy array or bytes) -> little-endian float32 bytes."""
    if type(values) is list:
        fast = speedups.native
        if fast is not None:
            packed = fast.pack_float32(values)  # None unless every item is an exact float within float32
            if packed is not None:
                return packed
        try:
            return struct.pack(f"<{len(values)}f", *values)  # rounds each double to float32 as numpy's astype does
        except (TypeError, OverflowError, struct.error):
            pass  # a str or other non-number, or past float32: numpy's path converts it or says why
    if isinstance(values, (bytes, bytearray, memoryview)):
        raw = bytes(values)
        if len(raw) % 4:
            raise EventValidationError(f"log-prob bytes: expected a multiple of 4 bytes, found {len(raw)}")
        return raw
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise EventValidationError(f"log-probs: expected a 1-D sequence of floats, found {type(values).__name__} ({exc})") from None
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise EventValidationError(f"log-probs: expected a 1-D sequence of floats, found shape {arr.shape}")
    return arr.astype(LOGPROB_DTYPE).tobytes()


#: Below this many bytes of float32 log-probs (a typical turn's output), :func:`all_finite` sums them in
#: ``array``'s C loop; above, numpy's vectorised test is faster than its fixed cost of a few calls.
_SUM_SCAN_BYTES = 1024


def all_finite(raw: bytes) -> bool:
    """Whether every float32 in packed log-prob bytes is finite (neither NaN nor infinite).
    A short run is summed as doubles: a NaN or an infinity makes the sum non-finite (inf - inf
    is NaN), and float32 values cannot overflow a double's sum below 2**900 of them. The compiled
    speedups test each value's exponent bits instead (:mod:`.speedups`)."""
    fast = speedups.native
    if fast is not None:
        return fast.all_finite_f32(raw)
    if len(raw) < _SUM_SCAN_BYTES and _ARRAY_PACKS:
        return math.isfinite(sum(array("f", raw)))
    return bool(np.isfinite(log_probs_view(raw)).all())


def tokens_view(raw: bytes) -> np.ndarray:
    """Zero-copy read-only int32 view over packed token bytes."""
    return np.frombuffer(raw, dtype=TOKEN_DTYPE)


def log_probs_view(raw: bytes) -> np.ndarray:
    """Zero-copy read-only float32 view over packed log-prob bytes."""
    return np.frombuffer(raw, dtype=LOGPROB_DTYPE)


def packed_field(obj: msgspec.Struct, field: str, packer: Callable[[Any], bytes]) -> bytes:
    """A body's token or log-prob field as packed bytes, stored back on the
    (frozen) body when it was given as a list or array. Raises
    EventValidationError naming the body and the field."""
    value = getattr(obj, field)
    if isinstance(value, bytes):
        if len(value) % 4:
            fail(type(obj).__name__, field, "a multiple of 4 bytes", f"{len(value)} bytes")
        return value
    try:
        packed = packer(value)
    except EventValidationError as exc:
        raise EventValidationError(f"{type(obj).__name__}.{field}: {exc}") from None
    msgspec.structs.force_setattr(obj, field, packed)
    return packed
