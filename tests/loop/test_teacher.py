"""Teacher clients (loop/teacher.py): the HTTP client against a fake SGLang teacher server, and the torch teacher.

The fake server is a real aiohttp server on loopback that answers
``/generate`` the way SGLang's native API does for input log-probs (one
``[logprob, token_id, text]`` entry per input position from
``logprob_start_len``, the first unscored) from a real built-in GPT, and
checks every request it receives against what the test expects: the ids,
``max_new_tokens`` 0, the temperature, ``return_logprob``,
``logprob_start_len`` and ``top_logprobs_num``. A request that differs is
answered 400 and noted, so the client's side of the exchange is checked,
not only its parsing. Fault modes make it fail the ways a teacher server
fails (HTTP 500, too slow, not JSON, too few entries, misaligned entries,
NaN).
"""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest
import torch
from aiohttp import web

from aiohttp_helpers import serve_app
from hf_helpers import build_once
from teacher_helpers import sglang_answer

from agentlog.learner.model import GPT, GPTConfig
from agentlog.loop.teacher import (HTTPTeacher, Teacher, TeacherError, TeacherScores, TorchTeacher, answer_limit,
                                   state_dict_digest)

PROMPT = [3, 9, 4, 17, 2]
OUTPUT = [11, 5, 5, 30, 1, 0]


def tiny_gpt(seed: int = 0, vocab: int = 40) -> GPT:
    """A small random built-in GPT (seeded)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, n_layer=2, n_head=2, d_model=32, max_seq_len=64)).eval()


def direct_scores(model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float, top_k: int = 0):
    """The reference: for each output token, a forward over the prefix before it and the
    log_softmax of the last position's logits / temperature (one forward per token)."""
    lps, tops = [], []
    with torch.no_grad():
        for t, tok in enumerate(output):
            prefix = torch.tensor([prompt + output[:t]])
            logp = torch.log_softmax(model(prefix)[0, -1].double() / temperature, dim=-1)
            lps.append(float(logp[tok]))
            if top_k:
                order = sorted(range(len(logp)), key=lambda i: -float(logp[i]))[:top_k]
                tops.append([(i, float(logp[i])) for i in order])
    return np.array(lps), tops


class FakeTeacherServer:
    """A fake SGLang ``/generate`` (input log-probs only) over a real GPT; checks each request."""

    def __init__(self, model: torch.nn.Module, *, model_path: str = "/models/teacher-7b", weight_version: str = "") -> None:
        self.model = model
        self.model_path = model_path
        self.weight_version = weight_version
        #: What the next requests must be: (prompt, output, temperature, top_k).
        self.expect: tuple[list[int], list[int], float, int] | None = None
        self.mode = "ok"
        self.requests: list[dict] = []
        self.errors: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "FakeTeacherServer":
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/get_model_info", self.model_info)
        self.runner, self.url = await serve_app(app)
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def model_info(self, request: web.Request) -> web.Response:
        info = {"model_path": self.model_path, "is_generation": True}
        if self.weight_version:
            info["weight_version"] = self.weight_version
        return web.json_response(info)

    def check(self, body: dict) -> list[str]:
        """What is wrong with a request ``body`` against ``expect`` (empty: nothing)."""
        prompt, output, temperature, top_k = self.expect
        sp = body.get("sampling_params") or {}
        wrong = []
        if body.get("input_ids") != prompt + output:
            wrong.append(f"input_ids {body.get('input_ids')} != prompt + output {prompt + output}")
        if sp.get("max_new_tokens") != 0:
            wrong.append(f"max_new_tokens {sp.get('max_new_tokens')!r} != 0")
        if sp.get("temperature") != temperature:
            wrong.append(f"temperature {sp.get('temperature')!r} != {temperature}")
        if body.get("return_logprob") is not True:
            wrong.append(f"return_logprob {body.get('return_logprob')!r} != true")
        if body.get("logprob_start_len") != len(prompt) - 1:
            wrong.append(f"logprob_start_len {body.get('logprob_start_len')!r} != {len(prompt) - 1} (one before the output)")
        if body.get("top_logprobs_num", 0) != top_k:
            wrong.append(f"top_logprobs_num {body.get('top_logprobs_num')!r} != {top_k}")
        if body.get("stream") not in (None, False):
            wrong.append("stream must be off")
        return wrong

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        wrong = self.check(body)
        if wrong:
            self.errors.extend(wrong)
            return web.json_response({"error": "; ".join(wrong)}, status=400)
        if self.mode == "http500":
            return web.Response(status=500, text="CUDA out of memory")
        if self.mode == "slow":
            await asyncio.sleep(1.5)
        if self.mode == "not_json":
            return web.Response(status=200, text="<html>gateway</html>", content_type="text/html")
        if self.mode == "deep":
            # Nested far past the interpreter's recursion limit (a C decoder raises RecursionError on it).
            nest = 100_000
            text = '{"meta_info": {"input_token_logprobs": ' + "[" * nest + "]" * nest + "}}"
            return web.Response(status=200, text=text, content_type="application/json")
        if self.mode in ("huge_streamed", "huge_declared"):
            return await self.huge(request)
        out = sglang_answer(self.model, body)
        meta = out["meta_info"]
        if self.mode == "short":
            meta["input_token_logprobs"] = meta["input_token_logprobs"][:-1]
        elif self.mode == "shifted":
            # Scores of the positions one later: what logprob_start_len = len(prompt) would give.
            meta["input_token_logprobs"] = meta["input_token_logprobs"][1:] + [[-0.5, 7, None]]
        elif self.mode == "nan":
            meta["input_token_logprobs"][2][0] = math.nan
        elif self.mode == "no_meta":
            out = {"text": ""}
        elif self.mode == "positive":
            meta["input_token_logprobs"][1][0] = 0.7
        elif self.mode == "id_over_2_63":
            meta["input_token_logprobs"][2][1] = 2**63 + 11
        elif self.mode == "top_id_over_2_63":
            meta["input_top_logprobs"][1][0][1] = 2**64 + 5
        elif self.mode == "negative_top_id":
            meta["input_top_logprobs"][3][1][1] = -3
        elif self.mode == "top_minus_infinity":
            meta["input_top_logprobs"][2][1][0] = -math.inf  # json_response writes -Infinity, which is no JSON
        return web.json_response(out)

    #: What the huge answers would be in all.
    HUGE_BYTES = 300 << 20

    async def huge(self, request: web.Request) -> web.StreamResponse:
        """A 300 MB answer in 1 MB writes, chunked or with its Content-Length declared;
        ``sent`` counts the bytes written before the client hung up."""
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        if self.mode == "huge_declared":
            resp.content_length = self.HUGE_BYTES
        self.sent = 0
        await resp.prepare(request)
        block = b"[" + b"0," * ((1 << 19) - 1)
        try:
            while self.sent < self.HUGE_BYTES:
                await resp.write(block)
                self.sent += len(block)
        except (ConnectionError, RuntimeError):  # the client hung up (aiohttp raises ClientConnectionResetError)
            pass
        return resp


@pytest.fixture
def model() -> GPT:
    return tiny_gpt()


def run(coro):
    return asyncio.run(coro)


async def _with_server(model, fn, **server_kw):
    server = await FakeTeacherServer(model, **server_kw).start()
    try:
        return await fn(server)
    finally:
        await server.stop()


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_http_teacher_sends_sglang_requests_and_matches_the_model(model, temperature, top_k):
    """The client's request is SGLang's input-log-prob request (checked by the server), and its
    scores are the model's own log-probs of the output tokens at the temperature (top-K too)."""

    async def go(server):
        server.expect = (PROMPT, OUTPUT, temperature, top_k)
        teacher = HTTPTeacher(server.url, name="big", version="v7", timeout_s=5, scales_temperature=True)
        try:
            scores = await teacher.score(PROMPT, OUTPUT, temperature=temperature, top_k=top_k)
        finally:
            await teacher.close()
        return server, scores

    server, scores = run(_with_server(model, go))
    assert server.errors == [] and len(server.requests) == 1
    ref, tops = direct_scores(model, PROMPT, OUTPUT, temperature, top_k)
    assert scores.log_probs.dtype == np.float32 and scores.log_probs.shape == (len(OUTPUT),)
    np.testing.assert_allclose(scores.log_probs, ref, rtol=1e-5, atol=1e-5)
    if top_k:
        assert scores.top_ids.shape == (len(OUTPUT), top_k) and scores.top_ids.dtype == np.int32
        assert scores.top_ids.tolist() == [[i for i, _ in row] for row in tops]
        np.testing.assert_allclose(scores.top_log_probs, [[v for _, v in row] for row in tops], rtol=1e-5, atol=1e-5)
    else:
        assert scores.top_ids is None and scores.top_log_probs is None


def test_http_teacher_refuses_other_temperatures_unless_the_server_scales_them(model):
    """A stock SGLang server's input log-probs are at temperature 1: a turn sampled at another
    temperature is refused before anything is sent, unless the server is declared to scale them."""

    async def go(server):
        server.expect = (PROMPT, OUTPUT, 1.0, 0)
        teacher = HTTPTeacher(server.url, name="stock", version="v1")
        try:
            with pytest.raises(TeacherError, match=r"teacher 'stock' .*sampled at temperature 0\.7.*set scales_temperature"):
                await teacher.score(PROMPT, OUTPUT, temperature=0.7)
            assert server.requests == []
            await teacher.score(PROMPT, OUTPUT, temperature=1.0)  # temperature 1 needs no scaling
        finally:
            await teacher.close()
        return server

    server = run(_with_server(model, go))
    assert server.errors == [] and len(server.requests) == 1


def test_http_teacher_accepts_the_generate_url_itself(model):
    """slime configures the full ``.../generate`` URL; the base URL works too."""

    async def go(server):
        server.expect = (PROMPT, OUTPUT, 1.0, 0)
        for url in (server.url + "/generate", server.url + "/"):
            teacher = HTTPTeacher(url, version="v1")
            try:
                await teacher.score(PROMPT, OUTPUT, temperature=1.0)
            finally:
                await teacher.close()
        return server

    server = run(_with_server(model, go))
    assert server.errors == [] and len(server.requests) == 2


@pytest.mark.parametrize("weight_version,expected", [("", "/models/teacher-7b"), ("step-40", "/models/teacher-7b@step-40")])
def test_http_teacher_version_is_read_from_the_server_when_not_given(model, weight_version, expected):
    async def go(server):
        server.expect = (PROMPT, OUTPUT, 1.0, 0)
        teacher = HTTPTeacher(server.url, name="t")
        try:
            assert teacher.version == ""
            await teacher.score(PROMPT, OUTPUT, temperature=1.0)
            return teacher.version
        finally:
            await teacher.close()

    assert run(_with_server(model, go, weight_version=weight_version)) == expected


@pytest.mark.parametrize("mode,match", [
    ("http500", r"answered HTTP 500, expected 200: CUDA out of memory"),
    ("slow", r"no answer within 0\.3 s"),
    ("not_json", r"the answer is not JSON"),
    ("no_meta", r"expected a JSON object with meta_info"),
    ("short", r"6 input_token_logprobs entries for a 6-token output; expected 7"),
    ("shifted", r"at output position 0 scores token 5, expected the output token 11"),
    ("nan", r"log-prob at output position 1 is nan; expected a finite log-prob <= 0"),
    ("positive", r"log-prob at output position 0 is 0\.7"),
])
def test_http_teacher_failures_are_clear_teacher_errors(model, mode, match):
    """Each way a teacher server fails is one TeacherError naming the teacher, the URL and what was expected."""

    async def go(server):
        server.expect = (PROMPT, OUTPUT, 1.0, 0)
        server.mode = mode
        # Only the slow answer may run into the timeout: a busy machine must not turn the others into timeouts.
        teacher = HTTPTeacher(server.url, name="flaky", version="v1", timeout_s=0.3 if mode == "slow" else 30)
        t0 = time.monotonic()
        try:
            with pytest.raises(TeacherError, match=match) as info:
                await teacher.score(PROMPT, OUTPUT, temperature=1.0)
        finally:
            await teacher.close()
        return server, info.value, time.monotonic() - t0

    server, err, took = run(_with_server(model, go))
    assert server.errors == []
    assert "teacher 'flaky'" in str(err) and f"{server.url}/generate" in str(err)
    if mode == "slow":
        assert took < 2.0  # the timeout, not the server, ended the call


def test_http_teacher_refuses_non_finite_numbers_anywhere_in_its_answers(model):
    """NaN and Infinity are not JSON: a server writing them (Python's json does) is refused with the
    place they stand, in a version as in a score, never recorded as a version ``...@nan`` or a log-prob."""

    async def go(server):
        server.expect = (PROMPT, OUTPUT, 1.0, 2)
        errors = []
        for mode, version in (("ok", ""), ("top_minus_infinity", "v1")):
            server.mode = mode
            teacher = HTTPTeacher(server.url, name="inf", version=version, timeout_s=30)
            try:
                with pytest.raises(TeacherError) as info:
                    await teacher.score(PROMPT, OUTPUT, temperature=1.0, top_k=2)
                errors.append(str(info.value))
            finally:
                await teacher.close()
        return server, errors

    server, (in_version, in_top) = run(_with_server(model, go, weight_version=math.nan))
    assert server.errors == []
    assert in_version == (f"teacher 'inf': GET {server.url}/get_model_info: the answer holds the number NaN at "
                          "$.weight_version; expected finite numbers (JSON has no NaN or Infinity)")
    assert in_top.startswith(f"teacher 'inf': POST {server.url}/generate: top log-prob at output position (1, 1) is "
                             "-infinity; expected a finite log-prob <= 0 (the answer holds -Infinity at "
                             "$.meta_info.input_top_logprobs[2][1][0])")


@pytest.mark.parametrize("mode,top_k,match", [
    ("deep", 0, r"the answer nests 100002 levels deep; expected at most 32"),
    ("id_over_2_63", 0, r"input_token_logprobs at output position 1 names token id 9223372036854775819; expected 0 <= id < 2\*\*31"),
    ("top_id_over_2_63", 2, r"input_top_logprobs at output position 0 names token id 18446744073709551621; expected 0 <= id"),
    ("negative_top_id", 2, r"input_top_logprobs at output position 2 names token id -3; expected 0 <= id < 2\*\*31"),
])
def test_http_teacher_refuses_deep_json_and_ids_out_of_range(model, mode, top_k, match):
    """A hostile or broken answer (nested past the recursion limit, a token id beyond 2**63,
    a negative top-K id) is a TeacherError naming the URL, never a RecursionError, an
    OverflowError or a negative id recorded as a token."""

    async def go(server):
        server.expect = (PROMPT, OUTPUT, 1.0, top_k)
        server.mode = mode
        teacher = HTTPTeacher(server.url, name="odd", version="v1", timeout_s=30)
        try:
            with pytest.raises(TeacherError, match=match) as info:
                await teacher.score(PROMPT, OUTPUT, temperature=1.0, top_k=top_k)
        finally:
            await teacher.close()
        return server, info.value

    server, err = run(_with_server(model, go))
    assert server.errors == []
    assert f"teacher 'odd': POST {server.url}/generate" in str(err)


@pytest.mark.parametrize("mode", ["huge_streamed", "huge_declared"])
def test_http_teacher_reads_no_more_than_the_request_can_need(model, mode):
    """A 300 MB answer to a 5 + 6-token request is refused once past the request's bound
    (ANSWER_OVERHEAD_BYTES + entries x ANSWER_BYTES_PER_ENTRY, about 1 MB here), read no
    further: unread when its Content-Length declares it, else abandoned past the bound."""

    async def go(server):
        server.expect = (PROMPT, OUTPUT, 1.0, 0)
        server.mode = mode
        teacher = HTTPTeacher(server.url, name="big", version="v1", timeout_s=30)
        try:
            with pytest.raises(TeacherError) as info:
                await teacher.score(PROMPT, OUTPUT, temperature=1.0)
        finally:
            await teacher.close()
        await asyncio.sleep(0.2)  # let the server see the hang-up
        return server, info.value

    server, err = run(_with_server(model, go))
    limit = answer_limit(len(PROMPT) + len(OUTPUT), len(OUTPUT), 0)
    assert limit < 2 << 20
    assert f"teacher 'big': POST {server.url}/generate" in str(err)
    if mode == "huge_declared":
        assert f"the answer is {server.HUGE_BYTES} bytes (Content-Length), over the limit of {limit}" in str(err)
    else:
        assert f"the answer is over the limit of {limit} bytes for this request" in str(err)
    # What the server got out before the client hung up: the bound and the sockets' buffers, not the 300 MB.
    assert server.sent < 64 << 20, server.sent


def test_http_teacher_unreachable_server_names_the_url():
    async def go():
        teacher = HTTPTeacher("http://127.0.0.1:9/", name="gone", version="v1", timeout_s=2)
        try:
            with pytest.raises(TeacherError, match=r"teacher 'gone': POST http://127\.0\.0\.1:9/generate failed"):
                await teacher.score(PROMPT, OUTPUT, temperature=1.0)
        finally:
            await teacher.close()

    run(go())


def test_http_teacher_refuses_bad_requests_before_sending():
    teacher = HTTPTeacher("http://127.0.0.1:9", version="v1")
    with pytest.raises(ValueError, match="the prompt is empty"):
        run(teacher.score([], OUTPUT, temperature=1.0))
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, found 0"):
        run(teacher.score(PROMPT, OUTPUT, temperature=0))
    with pytest.raises(ValueError, match="is not an http"):
        HTTPTeacher("127.0.0.1:30000")


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.6, 4), (1.5, 2)])
def test_torch_teacher_equals_a_direct_model_computation(model, temperature, top_k):
    """One forward over prompt + output equals a forward per prefix, token by token."""
    teacher = TorchTeacher(model, name="gpt")

    async def go():
        try:
            return await teacher.score(PROMPT, OUTPUT, temperature=temperature, top_k=top_k)
        finally:
            await teacher.close()

    scores = run(go())
    ref, tops = direct_scores(model, PROMPT, OUTPUT, temperature, top_k)
    np.testing.assert_allclose(scores.log_probs, ref, rtol=1e-5, atol=1e-5)
    assert scores.log_probs.dtype == np.float32
    if top_k:
        assert scores.top_ids.tolist() == [[i for i, _ in row] for row in tops]
        np.testing.assert_allclose(scores.top_log_probs, [[v for _, v in row] for row in tops], rtol=1e-5, atol=1e-5)
    assert isinstance(teacher, Teacher)


def test_torch_teacher_version_is_the_digest_of_its_weights(tmp_path):
    a, b = TorchTeacher(tiny_gpt(0)), TorchTeacher(tiny_gpt(0))
    c = TorchTeacher(tiny_gpt(1))
    assert a.version == b.version != c.version
    assert a.version.startswith("sha256:") and len(a.version) == len("sha256:") + 64
    model = tiny_gpt(0)
    with torch.no_grad():
        model.blocks[1].mlp[0].bias[3] += 1e-3
    assert state_dict_digest(model) != a.version
    # From a policy file: same weights, same version, same scores.
    from agentlog.learner.learner import save_state

    path = save_state({"model": tiny_gpt(0).state_dict(), "model_config": {"n_head": 2}}, tmp_path / "teacher.pt")
    loaded = TorchTeacher.from_checkpoint(path, name="file")
    assert loaded.version == a.version
    s1 = run(a.score(PROMPT, OUTPUT, temperature=1.0))
    s2 = run(loaded.score(PROMPT, OUTPUT, temperature=1.0))
    np.testing.assert_array_equal(s1.log_probs, s2.log_probs)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        TorchTeacher.from_checkpoint(tmp_path / "missing.pt")


class SlowModel(torch.nn.Module):
    """A model whose forward blocks its thread for a while (a big teacher)."""

    def __init__(self, inner: torch.nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner = inner
        self.seconds = seconds

    def forward(self, ids):
        time.sleep(self.seconds)
        return self.inner(ids)


def test_torch_teacher_does_not_block_the_event_loop(model):
    """While the model computes, other coroutines run (the forward is in the teacher's thread)."""
    teacher = TorchTeacher(SlowModel(model, 0.4))

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.ensure_future(ticker())
        try:
            scores = await teacher.score(PROMPT, OUTPUT, temperature=1.0)
        finally:
            tick.cancel()
            await teacher.close()
        return ticks, scores

    ticks, scores = run(go())
    assert ticks >= 5  # a blocked loop would tick once at most
    np.testing.assert_allclose(scores.log_probs, direct_scores(model, PROMPT, OUTPUT, 1.0)[0], rtol=1e-5, atol=1e-5)


def test_torch_teacher_refuses_what_the_model_cannot_score(model):
    """A sequence past the model's positions is a TeacherError naming the teacher, not a crash of the caller."""
    teacher = TorchTeacher(model, name="short")
    with pytest.raises(TeacherError, match=r"teacher 'short': the model could not score a 5\+70-token sequence.*max_seq_len=64"):
        run(teacher.score(PROMPT, [1] * 70, temperature=1.0))
    run(teacher.close())
    with pytest.raises(TeacherError, match="closed"):
        run(teacher.score(PROMPT, OUTPUT, temperature=1.0))


def test_torch_teacher_scores_with_a_hugging_face_model(tmp_path_factory):
    """An HF teacher from a local directory equals the HF model's own log-probs."""
    hf_dir = build_once(tmp_path_factory, "llama")
    teacher = TorchTeacher.from_hf(hf_dir, name="hf")
    scores = run(teacher.score(PROMPT, OUTPUT, temperature=0.8, top_k=2))
    run(teacher.close())
    ref, tops = direct_scores(teacher.model, PROMPT, OUTPUT, 0.8, 2)
    np.testing.assert_allclose(scores.log_probs, ref, rtol=1e-4, atol=1e-4)
    assert scores.top_ids.tolist() == [[i for i, _ in row] for row in tops]
    assert isinstance(scores, TeacherScores) and teacher.version.startswith("sha256:")
