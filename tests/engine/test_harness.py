"""The harness registry: selection by name or $AGENTLOG_AGENT, errors that list the valid names."""

from __future__ import annotations

import pytest

from agentlog.engine import harness


@pytest.fixture
def registered():
    names = []

    def add(name):
        def factory(**kw):
            return (name, kw)

        harness.register(name)(factory)
        names.append(name)
        return factory

    yield add
    for n in names:
        harness.unregister(n)


def test_registered_harness_is_found_by_name(registered):
    f = registered("test-swe")
    assert harness.get("test-swe") is f
    assert harness.select("test-swe") is f
    assert "test-swe" in harness.names()


def test_select_falls_back_to_the_environment_variable(registered, monkeypatch):
    f = registered("test-env")
    monkeypatch.setenv("AGENTLOG_AGENT", "test-env")
    assert harness.select() is f


def test_unknown_harness_name_fails_listing_the_valid_names(registered):
    registered("test-a")
    registered("test-b")
    with pytest.raises(harness.UnknownHarness) as info:
        harness.select("test-typo")
    msg = str(info.value)
    assert "unknown harness 'test-typo'" in msg and "test-a" in msg and "test-b" in msg
    with pytest.raises(harness.UnknownHarness, match="test-a"):
        harness.get("nope")


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_name_from_the_environment_fails_listing_the_valid_names(registered, monkeypatch, value):
    registered("test-c")
    monkeypatch.setenv("AGENTLOG_AGENT", value)
    with pytest.raises(harness.UnknownHarness, match=r"empty harness name \(from \$AGENTLOG_AGENT\).*test-c"):
        harness.select()


def test_no_name_and_no_environment_variable_fails(registered, monkeypatch):
    registered("test-d")
    monkeypatch.delenv("AGENTLOG_AGENT", raising=False)
    with pytest.raises(harness.UnknownHarness, match="neither an argument nor.*test-d"):
        harness.select()


def test_a_taken_name_is_not_silently_rebound(registered):
    registered("test-e")
    with pytest.raises(ValueError, match="already registered"):
        harness.register("test-e")(lambda: None)
