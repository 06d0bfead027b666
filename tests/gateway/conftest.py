"""Fixtures for every gateway test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _loopback_bypasses_proxies(monkeypatch):
    """The gateway under test listens on loopback. A CI runner that reaches
    its package registries through HTTP(S)_PROXY must not send the tests'
    own requests (httpx in the openai/anthropic clients, urllib, the agent
    CLIs) to that proxy, which cannot reach our loopback."""
    import os

    held = os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or ""
    value = ",".join(x for x in (held, "127.0.0.1", "localhost") if x)
    monkeypatch.setenv("NO_PROXY", value)
    monkeypatch.setenv("no_proxy", value)
