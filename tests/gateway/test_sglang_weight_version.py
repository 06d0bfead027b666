"""Partial rollouts record each part with the ``meta_info.weight_version`` SGLang reports. A server
answering a weight_version that names no version must be refused by name, not recorded silently
as the backend's launch version (a wrong version span)."""

from __future__ import annotations

import pytest
from aiohttp import web

from aiohttp_helpers import serve_app

from agentlog.gateway import SamplingParams, SGLangBackend
from agentlog.gateway.backends import BackendError
from gateway_helpers import run


@pytest.mark.parametrize("answered", ["v3", "", "-2", "3.5"])
def test_a_weight_version_that_names_no_version_is_refused(answered):
    async def main():
        async def generate(request: web.Request) -> web.Response:
            meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 65, None], [-0.5, 2, None]],
                    "weight_version": answered}
            return web.json_response({"text": "", "meta_info": meta})

        app = web.Application()
        app.router.add_post("/generate", generate)
        runner, url = await serve_app(app)
        backend = SGLangBackend(url)
        backend.partial = True  # what GatedBackend(weight_update="resubmit") sets
        try:
            with pytest.raises(BackendError, match="weight_version"):
                gen = await backend.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
                pytest.fail(f"weight_version {answered!r} recorded as version {gen.policy_version}")
        finally:
            await backend.close()
            await runner.cleanup()

    run(main(), timeout=20)
