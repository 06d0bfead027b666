"""Fixtures for the engine tests."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture
def arun():
    """Run a coroutine to completion on a fresh event loop."""
    return asyncio.run
