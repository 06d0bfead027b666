"""Teacher clients for on-policy distillation: log-probs of the student's own tokens.

A teacher scores a finished turn: given the turn's prompt ids and the output
ids the student sampled, it returns one log-prob per output token,
``log pi_T(output[t] | prompt + output[:t])`` at the turn's sampling
temperature (``log_softmax(logits / T)``), and optionally its top-K tokens
per position. The worker records them as ``teacher_scored`` events before
the session's terminal event (see :mod:`agentlog.loop.worker`).

Two teachers:

* :class:`HTTPTeacher`, a client of a teacher server shaped like slime's
  teacher log-prob server, which is SGLang's native ``/generate`` asked for
  input log-probs and no new tokens. The request carries the token ids
  (``input_ids`` = prompt + output), ``sampling_params`` with
  ``max_new_tokens: 0`` and the temperature, ``return_logprob: true``,
  ``logprob_start_len`` and ``top_logprobs_num``; the answer's
  ``meta_info.input_token_logprobs`` holds one ``[logprob, token_id, text]``
  entry per input position from ``logprob_start_len`` on, and
  ``meta_info.input_top_logprobs`` one list of such entries per position.
  SGLang leaves the first requested position unscored (``None``: its
  scheduler pads it), so the client starts one token before the output
  (``logprob_start_len = len(prompt) - 1``), drops that entry, and checks
  that every other entry names the output token at its position: an
  off-by-one on either side is refused, never recorded shifted.
* :class:`TorchTeacher`, an in-process torch model (the built-in GPT or a
  Hugging Face model behind :class:`~agentlog.learner.hf_model.HFCausalLM`),
  run in its own thread so scoring never blocks the event loop. Its version
  is the sha256 of its state dict.

Every failure is a :class:`TeacherError` naming the teacher, where it went
wrong and what was expected; the worker records it as a teacher failure, and
the learner then refuses the group for distillation with that reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Collection, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from agentlog.events.errors import AgentlogError
from agentlog.events.schema.validation import is_number
from agentlog.gateway.http_json import HTTPJSONError, JSONClient, NonFiniteJSON, base_url_problem
from agentlog._logging import get_logger

log = get_logger("agentlog.loop.teacher")

#: How far above 0 a log-prob may round before it is refused (float32 noise of a
#: server's log_softmax; a real log-prob is never positive).
LOG_PROB_SLACK = 1e-3

#: The answer size a teacher server may use for one request: a fixed part (meta_info's
#: own fields, a server's extra keys) ...
ANSWER_OVERHEAD_BYTES = 1 << 20
#: ... plus this much per entry: every input position (a server may echo the ids or
#: their text) and, for each scored position, its ``[logprob, token_id, text]`` entry
#: and its top-K entries. SGLang writes an entry in about 40 bytes (text null); 256
#: leaves room for a decoded token text and pretty-printing.
ANSWER_BYTES_PER_ENTRY = 256
#: How deep a teacher's JSON answer may nest. A ``/generate`` answer nests 5 levels
#: (object, meta_info, input_top_logprobs, row, entry); a deeper one is refused before
#: it is decoded, so nothing recurses near the interpreter's limit.
ANSWER_MAX_DEPTH = 32
#: Token ids are stored as int32 (``teacher_scored``'s packed ``top_ids``).
TOKEN_ID_LIMIT = 2**31


class TeacherError(AgentlogError, RuntimeError):
    """A teacher could not score a turn: unreachable, timed out, or answered something malformed."""


class TeacherScores(NamedTuple):
    """A teacher's scores of one turn's output tokens."""

    log_probs: np.ndarray
    """float32 ``(n,)``: log-prob of each output token given the prompt and the preceding output tokens."""
    top_ids: np.ndarray | None = None
    """int32 ``(n, k)``: the teacher's k most likely tokens at each position (None without top-K)."""
    top_log_probs: np.ndarray | None = None
    """float32 ``(n, k)``: their log-probs, row by row as ``top_ids``."""


@runtime_checkable
class Teacher(Protocol):
    """What the worker needs of a teacher."""

    name: str
    """Name recorded with each score (unique among a run's teachers)."""

    @property
    def version(self) -> str:
        """Digest of the teacher's weights or its version id, recorded with each score."""
        ...

    async def score(self, prompt_ids: Sequence[int], output_ids: Sequence[int], *, temperature: float,
                    top_k: int = 0) -> TeacherScores:
        """Log-probs of ``output_ids`` given ``prompt_ids`` (and the output ids before each one) at ``temperature``."""
        ...

    async def close(self) -> None:
        """Release connections and threads."""
        ...


def _check_request(who: str, prompt_ids: Sequence[int], output_ids: Sequence[int], temperature: float,
                   top_k: int) -> tuple[list[int], list[int]]:
    """The ids as plain ints; a ValueError names what is wrong with the request."""
    prompt = [int(t) for t in prompt_ids]
    output = [int(t) for t in output_ids]
    if not prompt:
        raise ValueError(f"{who}: the prompt is empty; the first output token needs at least one token before it to be scored")
    if not is_number(temperature, above=0):
        raise ValueError(f"{who}: temperature must be a finite number > 0, found {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{who}: top_k must be an int >= 0, found {top_k!r}")
    return prompt, output


def check_scores(who: str, scores: TeacherScores, n: int, top_k: int) -> TeacherScores:
    """``scores`` if it holds ``n`` finite log-probs <= 0 (and ``(n, top_k)`` top-K arrays when
    ``top_k`` > 0); else a TeacherError naming ``who``, the position and the value."""
    lp = np.asarray(scores.log_probs, dtype=np.float32)
    if lp.shape != (n,):
        raise TeacherError(f"{who}: expected {n} log-probs (one per output token), found shape {lp.shape}")
    lp = _check_values(who, "log-prob", lp)
    if top_k == 0:
        return TeacherScores(lp, None, None)
    if scores.top_ids is None or scores.top_log_probs is None:
        raise TeacherError(f"{who}: top-{top_k} log-probs were asked for and none came back")
    ids = np.asarray(scores.top_ids, dtype=np.int32)
    tlp = np.asarray(scores.top_log_probs, dtype=np.float32)
    for what, arr in (("top ids", ids), ("top log-probs", tlp)):
        if arr.shape != (n, top_k):
            raise TeacherError(f"{who}: expected {what} of shape ({n}, {top_k}), found {arr.shape}")
    tlp = _check_values(who, "top log-prob", tlp)
    return TeacherScores(lp, ids, tlp)


def _check_values(who: str, what: str, values: np.ndarray) -> np.ndarray:
    """``values`` with rounding noise above 0 (up to LOG_PROB_SLACK) set to 0, as the
    ``teacher_scored`` event takes only log-probs <= 0; anything else non-finite or
    positive is a TeacherError naming the position."""
    bad = ~np.isfinite(values) | (values > LOG_PROB_SLACK)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise TeacherError(f"{who}: {what} at output position {pos[0] if len(pos) == 1 else pos} is {float(values[pos]):.6g}; "
                           "expected a finite log-prob <= 0")
    return np.minimum(values, np.float32(0.0))


# ---------------------------------------------------------------- HTTP teacher


def answer_limit(n_input: int, n_output: int, top_k: int) -> int:
    """The most bytes a ``/generate`` answer scoring ``n_output`` tokens after a prompt
    (``n_input`` ids in all) with ``top_k`` may take: a larger one is refused unread."""
    entries = n_input + (n_output + 1) * (1 + top_k)
    return ANSWER_OVERHEAD_BYTES + entries * ANSWER_BYTES_PER_ENTRY


#: A log-prob's place in a ``/generate`` answer: ``input_token_logprobs[j][0]`` or ``input_top_logprobs[j][i][0]``.
_LOG_PROB_PATH = re.compile(r"\$\.meta_info\.input_(token|top)_logprobs\[(\d+)\](?:\[(\d+)\])?\[0\]")


def _non_finite_field(exc: NonFiniteJSON) -> str:
    """What a non-finite number in a teacher's answer is, in the answer's terms: a log-prob at
    an output position (entry j scores output position j - 1), else the JSON path."""
    found = _LOG_PROB_PATH.fullmatch(exc.path)
    if found and int(found[2]) >= 1 and (found[1] == "token") == (found[3] is None):
        t = int(found[2]) - 1
        what = f"log-prob at output position {t}" if found[1] == "token" else f"top log-prob at output position {(t, int(found[3]))}"
        return f"{what} is {exc.token.lower()}; expected a finite log-prob <= 0 (the answer holds {exc.token} at {exc.path})"
    return f"the answer holds the number {exc.token} at {exc.path}; expected finite numbers (JSON has no NaN or Infinity)"


def _clip(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about a server's answer."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def generate_url(url: str) -> str:
    """The ``/generate`` URL of a teacher server given as its base URL or as the ``/generate`` URL itself."""
    if problem := base_url_problem(url):
        raise ValueError(f"HTTPTeacher: url {url!r} is not an http(s) base URL: {problem} (expected e.g. http://127.0.0.1:30000)")
    url = url.rstrip("/")
    return url if url.endswith("/generate") else url + "/generate"


class HTTPTeacher:
    """A teacher served over HTTP: slime's teacher server / SGLang's native ``/generate``.

    ``url`` is the server's base URL or its ``/generate`` URL. ``version``
    identifies the weights it serves; when empty, it is read once from the
    server's ``/get_model_info`` (``model_path``, and ``weight_version``
    when the server reports one). Each :meth:`score` is one POST with a
    ``timeout_s`` limit on the whole exchange; no retries (the worker
    records a failure, and the group is not distilled).

    Temperature: the request carries the turn's temperature, but a stock
    SGLang server returns input log-probs of the unscaled logits (its
    temperature scaling of log-probs is off by default), i.e. at
    temperature 1. So unless ``scales_temperature`` says this server
    scales them, a turn sampled at another temperature is refused (a
    TeacherError before anything is sent) rather than recorded with
    log-probs of another distribution."""

    def __init__(self, url: str, *, name: str = "teacher", version: str = "", timeout_s: float = 60.0,
                 scales_temperature: bool = False, headers: dict[str, str] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"HTTPTeacher {name!r}: timeout_s must be > 0, found {timeout_s!r}")
        self.name = name
        self.url = generate_url(url)
        self.base_url = self.url[: -len("/generate")]
        self.timeout_s = float(timeout_s)
        self.scales_temperature = bool(scales_temperature)
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self._version = version
        self._http = JSONClient(timeout_s=self.timeout_s, headers=self.headers)
        self._version_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"HTTPTeacher(name={self.name!r}, url={self.url!r})"

    @property
    def version(self) -> str:
        """The weights' version id (given, or read from the server by the first :meth:`score`)."""
        return self._version

    async def _exchange(self, method: str, url: str, body: dict[str, Any] | None = None, *,
                        limit: int = ANSWER_OVERHEAD_BYTES) -> Any:
        """The decoded JSON answer of one request, read up to ``limit`` bytes and no further;
        a TeacherError names the URL and what went wrong (unreachable, timed out, an HTTP
        error, an answer over ``limit``, nested deeper than ANSWER_MAX_DEPTH, not JSON, or
        holding a non-finite number)."""
        try:
            return await self._http.request(method, url, body, limit=limit, max_depth=ANSWER_MAX_DEPTH)
        except NonFiniteJSON as exc:
            raise TeacherError(f"teacher {self.name!r}: {method} {url}: {_non_finite_field(exc)}") from None
        except HTTPJSONError as exc:
            raise TeacherError(f"teacher {self.name!r}: {exc}") from None

    async def resolve_version(self) -> str:
        """The version id: as given, or ``model_path[@weight_version]`` from the server's ``/get_model_info``."""
        async with self._version_lock:
            if self._version:
                return self._version
            url = self.base_url + "/get_model_info"
            info = await self._exchange("GET", url)
            path = info.get("model_path") if isinstance(info, dict) else None
            if not isinstance(path, str) or not path:
                raise TeacherError(f"teacher {self.name!r}: GET {url}: expected a JSON object with a model_path, found "
                                   f"{str(info)[:120]}; give the teacher a version instead")
            weights = info.get("weight_version")
            self._version = f"{path}@{weights}" if weights not in (None, "") else path
            return self._version

    def request_body(self, prompt: Sequence[int], output: Sequence[int], temperature: float, top_k: int) -> dict[str, Any]:
        """The ``/generate`` body that scores ``output`` after ``prompt`` (no new tokens)."""
        body: dict[str, Any] = {
            "input_ids": list(prompt) + list(output),
            "sampling_params": {"max_new_tokens": 0, "temperature": float(temperature), "skip_special_tokens": False},
            "return_logprob": True,
            # One before the output: SGLang leaves the first requested position unscored.
            "logprob_start_len": len(prompt) - 1,
            "return_text_in_logprobs": False,
            "stream": False,
        }
        if top_k:
            body["top_logprobs_num"] = int(top_k)
        return body

    async def score(self, prompt_ids: Sequence[int], output_ids: Sequence[int], *, temperature: float,
                    top_k: int = 0) -> TeacherScores:
        """Log-probs of ``output_ids`` after ``prompt_ids`` from the server; see the module docstring for the exchange."""
        prompt, output = _check_request(f"teacher {self.name!r}", prompt_ids, output_ids, temperature, top_k)
        if temperature != 1.0 and not self.scales_temperature:
            raise TeacherError(f"teacher {self.name!r} ({self.url}): the turn was sampled at temperature {temperature:g}, and this "
                               "server's input log-probs are taken at temperature 1 (stock SGLang does not scale them); set "
                               "scales_temperature for a server that does, or sample at temperature 1")
        await self.resolve_version()
        n = len(output)
        if n == 0:
            return check_scores(self.name, TeacherScores(np.zeros(0, np.float32), np.zeros((0, top_k), np.int32),
                                                         np.zeros((0, top_k), np.float32)), 0, top_k)
        body = self.request_body(prompt, output, temperature, top_k)
        out = await self._exchange("POST", self.url, body, limit=answer_limit(len(body["input_ids"]), n, top_k))
        return self.parse(out, prompt, output, top_k)

    def parse(self, out: Any, prompt: Sequence[int], output: Sequence[int], top_k: int) -> TeacherScores:
        """The scores in a ``/generate`` answer ``out`` to :meth:`request_body`; a TeacherError says what
        is malformed (missing fields, a wrong entry count, an entry naming another token, non-finite values)."""
        who = f"teacher {self.name!r}: POST {self.url}"
        n = len(output)
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if not isinstance(meta, dict):
            found = sorted(out)[:10] if isinstance(out, dict) else type(out).__name__
            raise TeacherError(f"{who}: expected a JSON object with meta_info, found {found}")
        entries = meta.get("input_token_logprobs")
        if not isinstance(entries, list):
            raise TeacherError(f"{who}: meta_info has no input_token_logprobs list (keys {sorted(meta)[:12]}); "
                               "expected one [logprob, token_id, text] per input position from logprob_start_len")
        if len(entries) != n + 1:
            raise TeacherError(f"{who}: {len(entries)} input_token_logprobs entries for a {n}-token output; expected {n + 1} "
                               f"(the last prompt token, then one per output token)")
        # Entry j is input position len(prompt) - 1 + j: the first (the last prompt token) is not scored.
        lp = np.empty(n, np.float32)
        for t in range(n):
            lp[t] = self._entry(who, "input_token_logprobs", t, entries[t + 1], output[t])
        top_ids = top_lp = None
        if top_k:
            rows = meta.get("input_top_logprobs")
            if not isinstance(rows, list) or len(rows) != n + 1:
                found = f"{len(rows)} rows" if isinstance(rows, list) else repr(rows)[:60]
                raise TeacherError(f"{who}: expected input_top_logprobs with {n + 1} rows (top_logprobs_num={top_k}), found {found}")
            top_ids = np.empty((n, top_k), np.int32)
            top_lp = np.empty((n, top_k), np.float32)
            for t in range(n):
                row = rows[t + 1]
                if not isinstance(row, list) or len(row) != top_k:
                    raise TeacherError(f"{who}: input_top_logprobs at output position {t}: expected {top_k} entries, "
                                       f"found {_clip(row, 80)}")
                for j, entry in enumerate(row):
                    top_lp[t, j] = self._entry(who, "input_top_logprobs", t, entry, None)
                    top_ids[t, j] = entry[1]
        return check_scores(who, TeacherScores(lp, top_ids, top_lp), n, top_k)

    @staticmethod
    def _entry(who: str, field: str, t: int, entry: Any, token: int | None) -> float:
        """The log-prob of one ``[logprob, token_id, ...]`` entry at output position ``t``, checking its token."""
        if (not isinstance(entry, (list, tuple)) or len(entry) < 2 or isinstance(entry[0], bool)
                or not isinstance(entry[0], (int, float)) or isinstance(entry[1], bool) or not isinstance(entry[1], int)):
            raise TeacherError(f"{who}: {field} at output position {t}: expected [logprob, token_id, text], found {_clip(entry)}")
        if not 0 <= entry[1] < TOKEN_ID_LIMIT:
            raise TeacherError(f"{who}: {field} at output position {t} names token id {_clip(entry[1], 40)}; expected "
                               f"0 <= id < 2**31")
        if token is not None and entry[1] != token:
            raise TeacherError(f"{who}: {field} at output position {t} scores token {entry[1]}, expected the output token "
                               f"{token} (misaligned logprob_start_len?)")
        try:
            return float(entry[0])
        except OverflowError:
            raise TeacherError(f"{who}: {field} at output position {t}: log-prob {_clip(entry[0], 40)} is out of "
                               "float range; expected a finite log-prob <= 0") from None

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._http.close()


# ---------------------------------------------------------------- torch teacher


def state_dict_digest(model: torch.nn.Module) -> str:
    """``sha256:<hex>`` over ``model``'s state dict: each tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        # Through uint8 so every dtype (bfloat16 included) hashes its raw bytes.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


class TorchTeacher:
    """An in-process torch teacher: ``model(ids (1, T)) -> logits (1, T, V)``.

    Scores with one forward pass over prompt + output: the logits at the
    positions that predict the output tokens, divided by the temperature,
    through ``log_softmax``. The forward runs in a one-thread executor of
    its own, so the event loop keeps serving sessions meanwhile and two
    scores never use the model at once. The version is the sha256 of the
    state dict, taken once at construction (the teacher's weights never
    change during a run)."""

    def __init__(self, model: torch.nn.Module, *, name: str = "teacher", device: str | torch.device = "cpu") -> None:
        self.name = name
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._version = state_dict_digest(self.model)
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"teacher-{name}")

    def __repr__(self) -> str:
        return f"TorchTeacher(name={self.name!r}, version={self._version[:19]}...)"

    @property
    def version(self) -> str:
        """``sha256:<hex>`` of the state dict."""
        return self._version

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, name: str = "teacher", device: str | torch.device = "cpu") -> "TorchTeacher":
        """A built-in GPT teacher from a policy file (a learner checkpoint, a weights file or a state dict)."""
        from agentlog.learner.learner import read_policy
        from agentlog.learner.model import GPT

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"TorchTeacher {name!r}: checkpoint {str(path)!r} is not a file (expected a built-in GPT .pt policy file)")
        state, config = read_policy(path)
        return cls(GPT.from_state_dict(state, config), name=name, device=device)

    @classmethod
    def from_hf(cls, path: str | os.PathLike, *, name: str = "teacher", device: str | torch.device = "cpu") -> "TorchTeacher":
        """A Hugging Face teacher from a local model directory (nothing is downloaded)."""
        from agentlog.learner.hf_model import HFCausalLM

        return cls(HFCausalLM(path), name=name, device=device)

    def score_sync(self, prompt: Sequence[int], output: Sequence[int], temperature: float, top_k: int) -> TeacherScores:
        """The scores, computed in the calling thread (what :meth:`score` runs in the executor)."""
        P, n = len(prompt), len(output)
        ids = torch.tensor([list(prompt) + list(output)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(ids)
            if logits.dim() != 3 or logits.shape[:2] != ids.shape:
                raise TeacherError(f"teacher {self.name!r}: the model returned logits of shape {tuple(logits.shape)}, "
                                   f"expected (1, {ids.shape[1]}, vocab)")
            # Position i predicts token i + 1: positions P-1 .. P+n-2 predict the output.
            logp = torch.log_softmax(logits[0, P - 1 : P - 1 + n].float() / temperature, dim=-1)
            lp = logp.gather(-1, ids[0, P:].unsqueeze(-1)).squeeze(-1)
            top_ids = top_lp = None
            if top_k:
                k = min(top_k, logp.shape[-1])
                if k != top_k:
                    raise TeacherError(f"teacher {self.name!r}: top_k={top_k} is more than the vocabulary ({logp.shape[-1]} tokens)")
                vals, idx = logp.topk(k, dim=-1)
                top_ids, top_lp = idx.to(torch.int32).cpu().numpy(), vals.cpu().numpy()
        return TeacherScores(lp.cpu().numpy().astype(np.float32), top_ids, top_lp)

    async def score(self, prompt_ids: Sequence[int], output_ids: Sequence[int], *, temperature: float,
                    top_k: int = 0) -> TeacherScores:
        """Log-probs of ``output_ids`` after ``prompt_ids`` at ``temperature`` (in the teacher's thread)."""
        who = f"teacher {self.name!r}"
        prompt, output = _check_request(who, prompt_ids, output_ids, temperature, top_k)
        if self._executor is None:
            raise TeacherError(f"{who}: closed")
        try:
            scores = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.score_sync, prompt, output, float(temperature), top_k)
        except TeacherError:
            raise
        except (ValueError, RuntimeError, IndexError) as exc:
            # The model refused the sequence (too long for its positions, an id out of its vocabulary).
            raise TeacherError(f"{who}: the model could not score a {len(prompt)}+{len(output)}-token sequence: "
                               f"{type(exc).__name__}: {exc}") from exc
        return check_scores(who, scores, len(output), top_k)

    async def close(self) -> None:
        """Stop the teacher's thread (after the score it is running, if any)."""
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)


# ---------------------------------------------------------------- the loop's side


class TurnToScore(NamedTuple):
    """One recorded turn of a session, as a teacher scores it."""

    turn_index: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    temperature: float | None
    """The turn's recorded sampling temperature (the scores must be taken at it; None: not a number, unscorable)."""


def build_teachers(cfg: Any) -> list[Teacher]:
    """The teachers of a ``[distill]`` table (:class:`~agentlog.loop.config.DistillConfig`), in its order."""
    out: list[Teacher] = []
    for spec in cfg.teachers:
        if spec.url:
            out.append(HTTPTeacher(spec.url, name=spec.name, version=spec.version, timeout_s=cfg.timeout_s,
                                   scales_temperature=spec.scales_temperature))
        elif spec.checkpoint:
            out.append(TorchTeacher.from_checkpoint(spec.checkpoint, name=spec.name))
        else:
            out.append(TorchTeacher.from_hf(spec.hf_model, name=spec.name))
    return out


async def score_session(h: Any, turns: Sequence[TurnToScore], teachers: Sequence[Teacher], *, top_k: int = 0,
                        timeout_s: float = 60.0, skip: Collection[tuple[int, str]] = ()) -> dict[str, int]:
    """Score every turn of a finished session ``h`` (still running: call before its terminal
    event) with every teacher, and record each result in the session: ``teacher_scored`` with
    the log-probs, or, when the teacher raised or took longer than ``timeout_s``, a teacher
    failure with the error text (the learner then refuses the group for distillation with it,
    and never trains it without scores). Turns with no output tokens have nothing to score.
    All scores run concurrently; they are recorded in turn order, teacher by teacher.
    ``skip``: ``(turn_index, teacher name)`` pairs the log holds a result of already (a
    resumed session's). Returns ``{"scored": n, "failed": m}``."""

    async def one(teacher: Teacher, turn: TurnToScore) -> TeacherScores | BaseException:
        if turn.temperature is None:
            return TeacherError(f"teacher {teacher.name!r}: turn {turn.turn_index} recorded no numeric sampling temperature to score at")
        try:
            return await asyncio.wait_for(
                teacher.score(turn.prompt_ids, turn.output_ids, temperature=turn.temperature, top_k=top_k), timeout_s)
        except asyncio.TimeoutError:
            return TeacherError(f"teacher {teacher.name!r}: no scores within {timeout_s:g} s ([distill] timeout_s)")
        except Exception as exc:  # noqa: BLE001 - any teacher failure is recorded in the session, and logged
            return exc

    jobs = [(teacher, turn) for turn in turns if len(turn.output_ids) for teacher in teachers
            if (turn.turn_index, teacher.name) not in skip]
    results = await asyncio.gather(*(one(teacher, turn) for teacher, turn in jobs))
    counts = {"scored": 0, "failed": 0}
    for (teacher, turn), res in zip(jobs, results):
        i = turn.turn_index
        if isinstance(res, TeacherScores):
            await h.record_teacher_scores(i, teacher=teacher.name, teacher_version=teacher.version, temperature=turn.temperature,
                                          log_probs=res.log_probs, top_ids=res.top_ids, top_log_probs=res.top_log_probs)
            counts["scored"] += 1
        else:
            error = str(res) if isinstance(res, TeacherError) else f"teacher {teacher.name!r}: {type(res).__name__}: {res}"
            log.warning("teacher.score_failed", session_id=h.session_id, turn_index=i, teacher=teacher.name, error=error)
            await h.record_teacher_failure(i, teacher=teacher.name, teacher_version=teacher.version or "unknown", error=error)
            counts["failed"] += 1
    return counts
