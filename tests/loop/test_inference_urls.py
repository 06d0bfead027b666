"""[inference] server URLs that can never be reached (a port out of range or not a number, no host,
a space in the host) are refused by the config, naming the entry, instead of being accepted and
found only at run time as a server that is down (a fleet then runs degraded, with only a warning)."""

from __future__ import annotations

import pytest

from agentlog.events.errors import ConfigError
from agentlog.loop.config_sections import InferenceConfig


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://host:notaport", "http://", "http://a b:30000",
                                 "http://:30000"])
def test_a_malformed_server_url_is_refused_by_name(url):
    with pytest.raises(ConfigError, match=r"\[inference\] servers\[1\]: .*(URL|url|port|host)") as info:
        InferenceConfig(backend="sglang", servers=["http://127.0.0.1:30000", url])
    assert "name: expected" not in str(info.value)  # not blamed on a name the entry does not give
    with pytest.raises(ConfigError, match=r"\[inference\] url"):
        InferenceConfig(backend="sglang", url=url)


def test_good_server_urls_are_accepted():
    cfg = InferenceConfig(backend="sglang", servers=["http://127.0.0.1:30000", "https://gpu-1.example:8000/", "http://[::1]:30000"])
    assert [s["name"] for s in cfg.servers] == ["127.0.0.1:30000", "gpu-1.example:8000", "[::1]:30000"]
    assert InferenceConfig(backend="sglang", url="http://localhost").url == "http://localhost"
