"""The training Sample, its canonical encoding, and the sample-stream digest.

A Sample carries the fields slime users know (``tokens``, ``response_length``,
``loss_mask``, ``rollout_log_probs``, ``reward``, ``status``,
``remove_sample``...) plus provenance: the LSN range it came from. Arrays are
stored as packed little-endian bytes (int32 tokens, uint8 mask, float32
log-probs) so the canonical encoding is byte-exact and cheap; accessors hand
back numpy views.

Invariant: ``len(loss_mask) == len(rollout_log_probs) == response_length >= 1``.

Sampling settings. Each sample carries the ``temperature``, ``top_p`` and
``top_k`` its trained turns were sampled with (from ``TurnRecorded.sampling``,
minus what the backend recorded as ``ignored``), so the learner can take
log-probs from the distribution the tokens were drawn from. One row trains
at one setting, as in slime and verl where a rollout batch has one
temperature: a row whose trained turns were sampled differently, or at a
setting whose log-probs cannot be reproduced (``top_p < 1`` or ``top_k > 0``:
the kept-token sets are not recorded), is kept for inspection but marked
``remove_sample`` with ``metadata["sampling_error"]`` saying why.

The canonical encoding leaves the sampling fields out while they are at
their defaults (1.0, 1.0, -1), so a sample sampled plainly encodes, and
digests, byte for byte as before these fields existed.

Teacher fields (on-policy distillation, ``teacher_scored`` events). A row
whose trained turns a teacher scored carries, per response token, the
teachers' log-prob of the token (``teacher_log_probs``: the mean over the
teachers that scored it), where one did (``teacher_scored``), and the top-K
when exactly one teacher sent it. Tokens that carry no loss have none.
``metadata["teachers"]`` names them (``name@version``) and
``metadata["teacher_error"]`` says why a trained turn has no scores when a
teacher failed on it; `distill_problem` says whether a row can be distilled.
The teacher fields are left out of the canonical encoding while empty.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Iterable, Mapping

import msgspec
import numpy as np

from agentlog.events.schema.lineage import ROOT_LINEAGE

COMPLETED = "completed"
TRUNCATED = "truncated"
ABORTED = "aborted"


class _SampleV1(msgspec.Struct, frozen=True):
    """The fields of a training row as first defined. Their canonical bytes
    must never change: `encode_sample` encodes a plainly sampled Sample as
    this struct, so digests of existing logs stay valid."""

    group_id: str
    session_id: str
    sample_index: int
    tokens: bytes  # int32 LE: prompt + response tokens
    response_length: int  # the last response_length tokens are the response
    loss_mask: bytes  # uint8, one per response token
    rollout_log_probs: bytes  # float32 LE, one per response token
    reward: float
    status: str
    remove_sample: bool = False
    policy_version: int = 0
    turns: int = 0
    row_index: int = 0  # which trajectory row of the session (0 for most)
    lsn_first: int = -1
    lsn_last: int = -1
    metadata: dict[str, Any] = {}


#: Sampling settings at which nothing is truncated or rescaled.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
TOP_K_OFF = -1


class _SampleV2(_SampleV1, frozen=True):
    """The fields of a training row up to the sampling settings: their
    canonical bytes must never change either (see `encode_sample`)."""

    temperature: float = DEFAULT_TEMPERATURE  # logits were divided by this before sampling
    top_p: float = DEFAULT_TOP_P  # nucleus mass kept (1.0: off)
    top_k: int = TOP_K_OFF  # tokens kept (-1: off)


class _SampleV3(_SampleV2, frozen=True):
    """The fields of a training row up to the teacher fields: their
    canonical bytes must never change either (see `encode_sample`)."""

    #: float32 LE per response token: the teachers' log-prob of the token
    #: (the mean over the teachers that scored it), 0.0 where none did.
    #: b"" when no teacher scored any trained turn of the row.
    teacher_log_probs: bytes = b""
    #: uint8 per response token: 1 where a teacher scored it (b"" as above).
    teacher_scored: bytes = b""
    #: Top-K width of ``teacher_top_ids`` / ``teacher_top_log_probs`` (0: none).
    teacher_top_k: int = 0
    #: int32 LE, ``teacher_top_k`` per response token, row-major (0 where unscored).
    teacher_top_ids: bytes = b""
    #: float32 LE, ``teacher_top_k`` per response token (0.0 where unscored).
    teacher_top_log_probs: bytes = b""


class Sample(_SampleV3, frozen=True):
    """One training row (see the module docstring for the sampling, teacher and version fields)."""

    #: int32 LE per response token: the policy version that generated it (0
    #: where the loss mask is 0). b"" unless a trained turn of the row was made
    #: by more than one version (a partial rollout: its ``version_spans``);
    #: every trained token's version is then ``policy_version`` or, for a row
    #: of whole turns made by different versions, that of its turn.
    token_versions: bytes = b""

    @property
    def versions(self) -> np.ndarray:
        """Per response token, the version that generated it (int32): ``token_versions``, or
        ``policy_version`` throughout when the row holds no partial rollout."""
        if self.token_versions:
            return np.frombuffer(self.token_versions, dtype="<i4")
        return np.full(self.response_length, self.policy_version, dtype="<i4")

    def trained_tokens_by_version(self) -> dict[int, int]:
        """How many trained tokens (loss mask 1) each policy version generated."""
        versions, counts = np.unique(self.versions[self.mask.astype(bool)], return_counts=True)
        return dict(zip(versions.tolist(), counts.tolist()))

    @property
    def teacher_lp(self) -> np.ndarray:
        """Teacher log-probs over the response as a float32 view (empty when unscored)."""
        return np.frombuffer(self.teacher_log_probs, dtype="<f4")

    @property
    def teacher_mask(self) -> np.ndarray:
        """1 where a teacher scored the response token, as a uint8 view (empty when unscored)."""
        return np.frombuffer(self.teacher_scored, dtype=np.uint8)

    def teacher_top(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids (L, K) int32, log-probs (L, K) float32) of the teacher's top-K, or None."""
        if not self.teacher_top_k:
            return None
        k = self.teacher_top_k
        return (np.frombuffer(self.teacher_top_ids, dtype="<i4").reshape(-1, k),
                np.frombuffer(self.teacher_top_log_probs, dtype="<f4").reshape(-1, k))

    @property
    def token_ids(self) -> np.ndarray:
        """All tokens (prompt + response) as an int32 view."""
        return np.frombuffer(self.tokens, dtype="<i4")

    @property
    def mask(self) -> np.ndarray:
        """Loss mask over the response as a uint8 view."""
        return np.frombuffer(self.loss_mask, dtype=np.uint8)

    @property
    def log_probs(self) -> np.ndarray:
        """Rollout log-probs over the response as a float32 view."""
        return np.frombuffer(self.rollout_log_probs, dtype="<f4")

    @property
    def prompt_length(self) -> int:
        """Number of tokens before the response."""
        return len(self.tokens) // 4 - self.response_length


#: The numpy dtype of each packed-array field of a Sample (one value per token,
#: little-endian): how a writer turns the field's bytes into numbers. Every bytes
#: field of Sample has one (checked below), so no output format can leave one out.
PACKED_DTYPES: dict[str, str] = {
    "tokens": "<i4",
    "loss_mask": "u1",
    "rollout_log_probs": "<f4",
    "teacher_log_probs": "<f4",
    "teacher_scored": "u1",
    "teacher_top_ids": "<i4",
    "teacher_top_log_probs": "<f4",
    "token_versions": "<i4",
}
if {f.name for f in msgspec.structs.fields(Sample) if f.type is bytes} != set(PACKED_DTYPES):
    raise TypeError("reducers.samples: every bytes field of Sample needs its dtype in PACKED_DTYPES")


def _token_versions(row: Any) -> bytes:
    """int32 LE per response token of ``row``: the version of each trained span's tokens, 0 elsewhere."""
    out = np.zeros(row.response_length, dtype="<i4")
    for (offset, n, _turn, _), version in zip(row.trained_spans, row.span_versions):
        out[offset : offset + n] = version
    return out.tobytes()


def aborted_placeholder(
    group_id: str,
    session_id: str,
    sample_index: int,
    abort_reason: str,
    *,
    policy_version: int = 0,
    turns: int = 0,
    lsn_first: int = -1,
    lsn_last: int = -1,
    untrainable: tuple[str, ...] = (),
) -> Sample:
    """The one zero-masked row an aborted session yields, so its group knows a
    member failed. It contributes nothing to any gradient or baseline.
    ``untrainable``: the health flags that made a session untrainable
    (``ReduceConfig.untrainable_flags``, :mod:`agentlog.reducers.health`): its
    one row is this placeholder too, its metadata naming them under
    ``untrainable_flags`` (and ``abort_reason`` only when it aborted)."""
    metadata: dict[str, Any] = {"abort_reason": abort_reason} if abort_reason or not untrainable else {}
    if untrainable:
        metadata["untrainable_flags"] = list(untrainable)
    return Sample(
        group_id=group_id,
        session_id=session_id,
        sample_index=sample_index,
        tokens=np.zeros(2, dtype="<i4").tobytes(),
        response_length=1,
        loss_mask=b"\x00",
        rollout_log_probs=np.zeros(1, dtype="<f4").tobytes(),
        reward=0.0,
        status=ABORTED,
        remove_sample=True,
        policy_version=policy_version,
        turns=turns,
        lsn_first=lsn_first,
        lsn_last=lsn_last,
        metadata=metadata,
    )


# Deterministic: dict keys sorted, so the bytes never depend on insertion
# order or PYTHONHASHSEED.
_canonical = msgspec.msgpack.Encoder(order="deterministic")
_sample_decoder = msgspec.msgpack.Decoder(Sample)


_V1_FIELDS = len(_SampleV1.__struct_fields__)
_V2_FIELDS = len(_SampleV2.__struct_fields__)
_V3_FIELDS = len(_SampleV3.__struct_fields__)


def encode_sample(sample: Sample) -> bytes:
    """The canonical bytes of a sample (msgpack, deterministic key order).

    The sampling fields are left out while all are at their defaults, and the
    teacher fields while the row has no teacher scores (see the module
    docstring), and ``token_versions`` while empty (no partial rollout), so
    samples of logs written before any of them existed keep their bytes and
    digests; `decode_sample` reads every form back."""
    if sample.token_versions:
        return _canonical.encode(sample)
    fields = msgspec.structs.astuple(sample)
    if sample.teacher_scored or sample.teacher_top_k:
        return _canonical.encode(_SampleV3(*fields[:_V3_FIELDS]))
    if sample.temperature == DEFAULT_TEMPERATURE and sample.top_p == DEFAULT_TOP_P and sample.top_k == TOP_K_OFF:
        return _canonical.encode(_SampleV1(*fields[:_V1_FIELDS]))
    return _canonical.encode(_SampleV2(*fields[:_V2_FIELDS]))


def decode_sample(raw: bytes) -> Sample:
    """Inverse of encode_sample."""
    return _sample_decoder.decode(raw)


class SampleDigest:
    """Running sha256 over a sample stream: length-prefixed canonical bytes."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.count = 0

    def update(self, sample: Sample) -> None:
        """Fold one sample into the digest."""
        raw = encode_sample(sample)
        self._h.update(len(raw).to_bytes(8, "little"))
        self._h.update(raw)
        self.count += 1

    def hexdigest(self) -> str:
        """``sha256:<hex>`` of everything folded so far."""
        return "sha256:" + self._h.hexdigest()


def digest_samples(samples: Iterable[Sample]) -> str:
    """``sha256:<hex>`` of a whole sample stream."""
    d = SampleDigest()
    for s in samples:
        d.update(s)
    return d.hexdigest()


# ---------------------------------------------------------------- rewards and rows -> samples


def final_raw_reward(finished: Any, assigned: Any) -> Any:
    """The raw reward a finished session ends with: ``SessionFinished.reward``
    when it is given, else the last ``RewardAssigned`` value (None if neither)."""
    return finished if finished is not None else assigned


def resolve_reward(value: Any, reward_key: str | None = None) -> tuple[float | None, str]:
    """The training reward of a raw reward value, or why there is none.

    Returns ``(reward, "")`` or ``(None, problem)``. Never raises: int and
    bool become floats; a dict gives its ``reward_key`` entry, or its only
    entry; None, NaN, infinities, strings and ambiguous dicts are reported.
    """
    if isinstance(value, bool):
        return float(value), ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            f = float(value)
        except OverflowError:
            return None, f"reward {value!r} does not fit a float"
        if f != f or f in (float("inf"), float("-inf")):
            return None, f"reward is not finite: {value!r}"
        return f, ""
    if isinstance(value, dict) and any(type(k) is str and k.startswith(LINEAGE_REWARD_PREFIX) for k in value):
        _, problem = lineage_rewards(value)
        if problem:
            return None, problem
        value = {k: v for k, v in value.items() if not (type(k) is str and k.startswith(LINEAGE_REWARD_PREFIX))}
        if not value:
            return None, f"dict reward holds only lineage rewards ({LINEAGE_REWARD_PREFIX}<id>): the session's own reward is missing"
    if isinstance(value, dict):
        if reward_key is not None and reward_key in value:
            inner, problem = resolve_reward(value[reward_key], None)
            return inner, (f"reward[{reward_key!r}]: {problem}" if problem else "")
        if len(value) == 1:
            (key, inner_value), = value.items()
            if isinstance(inner_value, dict):
                return None, f"reward[{key!r}] is itself a dict"
            inner, problem = resolve_reward(inner_value, None)
            return inner, (f"reward[{key!r}]: {problem}" if problem else "")
        keys = sorted(str(k) for k in value)[:8]
        wanted = f"key {reward_key!r} missing" if reward_key is not None else "no reward_key configured"
        return None, f"dict reward with keys {keys}: {wanted} (set ReduceConfig.reward_key)"
    if value is None:
        return None, "no reward (SessionFinished.reward is None and no RewardAssigned)"
    return None, f"reward of type {type(value).__name__} is not a number"


#: The prefix of a dict reward's keys under which a verifier gives some lineages (subagents) a
#: reward of their own: ``{"reward": 1.0, "lineage/sub-1": 0.0}`` (a reward is a flat dict of
#: numbers; lineage ids never hold a ``/``). Lineages it does not name get the session's reward.
LINEAGE_REWARD_PREFIX = "lineage/"


def lineage_rewards(value: Any) -> tuple[dict[str, float], str]:
    """The per-lineage rewards a raw reward value carries (empty when none), or why they
    cannot be used: each must be a finite number."""
    if not isinstance(value, dict):
        return {}, ""
    out = {}
    for key, raw in value.items():
        if type(key) is str and key.startswith(LINEAGE_REWARD_PREFIX):
            reward, problem = resolve_reward(raw) if not isinstance(raw, dict) else (None, "a dict, expected a number")
            if reward is None:
                return {}, f"reward[{key!r}]: {problem}"
            out[key[len(LINEAGE_REWARD_PREFIX):]] = reward
    return out, ""


def lineage_metadata(lineage: str, origin: Any) -> dict[str, Any]:
    """What a row of a session with subagents says of its lineage: its id and, for a spawned
    lineage, its parent, the parent's turn and the tool call that spawned it."""
    meta: dict[str, Any] = {"lineage": lineage}
    if origin is not None:
        meta["parent_lineage"] = origin.parent
        meta["parent_turn"] = origin.parent_turn
        if origin.spawn_call:
            meta["spawn_call"] = origin.spawn_call
        if origin.how:
            meta["spawn_match"] = origin.how
    return meta


def recorded_sampling(recorded: Mapping[str, Any]) -> tuple[float, float, int] | str:
    """The ``(temperature, top_p, top_k)`` a turn was really sampled with, from
    its recorded ``sampling`` dict, or why it cannot be known.

    Missing keys are the defaults (1.0, 1.0, off); a parameter the backend
    listed under ``ignored`` did not act, so it counts as off; ``top_k`` 0 and
    -1 both mean off (returned as -1). Never raises."""
    ignored = recorded.get("ignored") or ()
    if not isinstance(ignored, (list, tuple)):
        return f"sampling.ignored: expected a list of parameter names, found {ignored!r}"

    def number(name: str, default: float) -> float | None:
        value = default if name in ignored else recorded.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value)

    temperature = number("temperature", DEFAULT_TEMPERATURE)
    if temperature is None or not (0.0 < temperature < math.inf):
        return f"sampling.temperature: expected a number > 0, found {recorded.get('temperature')!r}"
    top_p = number("top_p", DEFAULT_TOP_P)
    if top_p is None or not 0.0 < top_p <= 1.0:
        return f"sampling.top_p: expected a number in (0, 1], found {recorded.get('top_p')!r}"
    top_k = TOP_K_OFF if "top_k" in ignored else recorded.get("top_k", TOP_K_OFF)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        return f"sampling.top_k: expected an integer, found {top_k!r}"
    return temperature, top_p, (TOP_K_OFF if top_k <= 0 else top_k)


def sampling_problem(temperature: float, top_p: float, top_k: int) -> str:
    """Why log-probs sampled at these settings cannot be recomputed by the
    learner, or "" when they can (any temperature > 0, no truncation).

    ``top_p < 1`` and ``top_k > 0`` renormalise over a kept-token set that is
    not recorded, so the recomputed log-prob of a token differs from the one
    it was drawn with by an unknown amount."""
    if not (0.0 < temperature < math.inf):
        return f"temperature {temperature!r} is not a number > 0"
    truncated = [f"top_p={top_p}"] * (top_p < DEFAULT_TOP_P) + [f"top_k={top_k}"] * (top_k > 0)
    if truncated:
        return (
            f"sampled with {' and '.join(truncated)}: the kept-token sets are not recorded, so the"
            " log-probs cannot be recomputed (sample with top_p=1 and top_k off to train on these turns)"
        )
    return ""


def row_sampling(
    trained_turns: Iterable[int], turn_sampling: Callable[[int], Mapping[str, Any]]
) -> tuple[tuple[float, float, int], str]:
    """The sampling settings one row trains at, and why the row cannot be
    trained ("" when it can). All trained turns must agree: a row has one
    temperature. On a problem the settings are the defaults unless every
    turn agreed on them."""
    seen: dict[tuple[float, float, int], list[int]] = {}
    for turn in trained_turns:
        settings = recorded_sampling(turn_sampling(turn))
        if isinstance(settings, str):
            return (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, TOP_K_OFF), f"turn {turn}: {settings}"
        seen.setdefault(settings, []).append(turn)
    if not seen:
        return (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, TOP_K_OFF), ""
    if len(seen) > 1:
        parts = "; ".join(
            f"turns {turns} at temperature={t}, top_p={p}, top_k={k}" for (t, p, k), turns in seen.items()
        )
        return (
            (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, TOP_K_OFF),
            f"trained turns were sampled with different settings ({parts}); one row trains at one setting",
        )
    (settings,) = seen
    return settings, sampling_problem(*settings)


def finished_samples(
    rows: Iterable[Any],
    *,
    group_id: str,
    session_id: str,
    sample_index: int,
    reward: float | None,
    reward_problem: str = "",
    turns: int,
    lsn_first: int,
    lsn_last: int,
    turn_sampling: Callable[[int], Mapping[str, Any]] | None = None,
    row_teacher: Callable[[Any], Mapping[str, Any]] | None = None,
    abort_reason: str = "",
    lineages: Mapping[str, Any] | None = None,
    rewards_by_lineage: Mapping[str, float] | None = None,
) -> list[Sample]:
    """Samples of a finished session: one per trajectory row, each with the
    session's reward. ``abort_reason``: the session aborted, and its abort
    class counts it as a failure (``reward`` is then the failure reward); its
    rows say so (status ``aborted``, ``abort_reason`` in their metadata). A row whose chain ended on a ``length`` finish is
    TRUNCATED. Without a usable reward (``reward`` None) the rows are kept
    for inspection but marked ``remove_sample`` with ``reward_error``, so they
    carry no gradient and stay out of every baseline.

    ``turn_sampling(turn_index)`` gives a turn's recorded ``sampling`` dict
    (None: every turn at the defaults). Each row carries the settings of its
    trained turns; a row that cannot be trained at one reproducible setting
    is marked ``remove_sample`` with ``sampling_error`` (see `row_sampling`)
    but its session's reward still counts in the group baseline.

    ``row_teacher(row)`` gives the row's teacher fields and metadata
    (:meth:`agentlog.reducers.teacher.TeacherScores.row_fields`; None: no teacher).

    ``lineages``: the session's lineages (id -> first-turn record, None for a
    root), when it had more than one: each row then names its lineage
    (:func:`lineage_metadata`). ``rewards_by_lineage``: the verifier's rewards of
    some lineages (:func:`lineage_rewards`): a row of such a lineage keeps the
    session's reward (what its group's baseline and, by default, its advantage
    use) and carries its own as ``metadata["lineage_reward"]`` (what lineages as
    members use); lineage ids that name no lineage of the session are listed in
    ``metadata["lineage_reward_unknown"]``."""
    out = []
    for row_index, row in enumerate(rows):
        settings, sampling_error = (
            row_sampling(row.trained_turns, turn_sampling)
            if turn_sampling is not None
            else ((DEFAULT_TEMPERATURE, DEFAULT_TOP_P, TOP_K_OFF), "")
        )
        metadata: dict[str, Any] = {
            "turn_indices": list(row.turn_indices),
            "leaf": row.leaf,
            "use_tool": row.use_tool,
            "ill_formed": row.ill_formed,
        }
        if row.cut:
            metadata["cut_to_max_context"] = True
        if abort_reason:
            metadata["abort_reason"] = abort_reason
        if reward is None:
            metadata["reward_error"] = reward_problem
        if sampling_error:
            metadata["sampling_error"] = sampling_error
        if lineages is not None and (len(lineages) > 1 or row.lineage != ROOT_LINEAGE):
            metadata.update(lineage_metadata(row.lineage, lineages.get(row.lineage)))
            if reward is not None and rewards_by_lineage:
                if row.lineage in rewards_by_lineage:
                    metadata["lineage_reward"] = rewards_by_lineage[row.lineage]
                unknown = sorted(k for k in rewards_by_lineage if k not in lineages)
                if unknown:  # a verifier's typo would otherwise vanish without a trace
                    metadata["lineage_reward_unknown"] = unknown
        teacher = dict(row_teacher(row)) if row_teacher is not None else {}
        metadata.update(teacher.pop("metadata", {}))
        out.append(
            Sample(
                group_id=group_id,
                session_id=session_id,
                sample_index=sample_index,
                tokens=row.tokens,
                response_length=row.response_length,
                loss_mask=row.loss_mask,
                rollout_log_probs=row.rollout_log_probs,
                reward=0.0 if reward is None else reward,
                status=ABORTED if abort_reason else TRUNCATED if row.truncated else COMPLETED,
                remove_sample=reward is None or bool(sampling_error),
                policy_version=row.policy_version,
                turns=turns,
                row_index=row_index,
                lsn_first=lsn_first,
                lsn_last=lsn_last,
                metadata=metadata,
                temperature=settings[0],
                top_p=settings[1],
                top_k=settings[2],
                token_versions=_token_versions(row) if row.partial else b"",
                **teacher,
            )
        )
    return out


def distill_problem(sample: Sample) -> str:
    """Why ``sample`` cannot be distilled ("" when it can): a teacher failed
    on one of its trained turns, or a loss-masked token has no teacher score."""
    if sample.metadata.get("teacher_error"):
        return f"session {sample.session_id} row {sample.row_index}: {sample.metadata['teacher_error']}"
    mask = sample.mask
    if not mask.any():
        return ""
    if not sample.teacher_scored:
        return f"session {sample.session_id} row {sample.row_index}: no teacher scored its trained tokens"
    missing = np.flatnonzero(mask.astype(bool) & ~sample.teacher_mask.astype(bool))
    if missing.size:
        return (f"session {sample.session_id} row {sample.row_index}: {missing.size} of {int(mask.sum())} trained tokens "
                f"have no teacher score (first at response position {int(missing[0])})")
    return ""


def check_sample(sample: Sample) -> None:
    """Raise ValueError naming the session if a sample breaks the invariant
    ``len(loss_mask) == len(rollout_log_probs) == response_length >= 1``."""
    n_mask = len(sample.loss_mask)
    n_lp = len(sample.rollout_log_probs) // 4
    n_tok = len(sample.tokens) // 4
    if not (n_mask == n_lp == sample.response_length >= 1) or sample.response_length > n_tok:
        raise ValueError(
            f"sample of session {sample.session_id!r} row {sample.row_index}: expected"
            f" len(loss_mask) == len(rollout_log_probs) == response_length >= 1 (and <= {n_tok} tokens),"
            f" found {n_mask}, {n_lp}, {sample.response_length}"
        )
