"""The bootstrap service: registration, rooms, health, and rejection of malformed bodies."""

from __future__ import annotations

import httpx
import pytest

from framework.disaggregation.bootstrap import BootstrapClient, BootstrapService

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def service():
    svc = BootstrapService("127.0.0.1", 0).start()
    yield svc
    svc.close()


def test_health_register_and_rooms(service):
    client = BootstrapClient("127.0.0.1", service.port)
    try:
        assert client.health()
        client.register("prefill", 0, {"host": "127.0.0.1", "port": 1234})
        client.register("decode", 0, {"ptrs": [1, 2]})
        assert client.endpoints("prefill") == {0: {"host": "127.0.0.1", "port": 1234}}
        assert client.endpoints("decode") == {0: {"ptrs": [1, 2]}}
        client.post_room(42, [3, 4, 5], rank=0)
        assert service.take_room(42) == ([3, 4, 5], 0)
        assert service.take_room(42) is None
    finally:
        client.close()


@pytest.mark.parametrize(
    "path, body, error",
    [
        ("/register", {"role": "router", "rank": 0, "endpoint": {}}, "role must be"),
        ("/register", {"role": "prefill", "rank": -1, "endpoint": {}}, "rank must be"),
        ("/register", {"role": "prefill", "rank": True, "endpoint": {}}, "rank must be"),
        ("/register", {"role": "prefill", "rank": 0, "endpoint": "x"}, "endpoint must be"),
        ("/register", {"role": "prefill", "rank": 0, "endpoint": {}, "extra": 1}, "unknown fields"),
        ("/register", [1, 2], "JSON object"),
        ("/rooms/5", {"dst_pages": []}, "non-empty"),
        ("/rooms/5", {"dst_pages": [0]}, "dst_pages"),
        ("/rooms/5", {"dst_pages": ["1"]}, "dst_pages"),
        ("/rooms/abc", {"dst_pages": [1]}, "room must be an integer"),
    ],
)
def test_malformed_bodies_are_rejected(service, path, body, error):
    resp = httpx.post(f"http://127.0.0.1:{service.port}{path}", json=body, timeout=5)
    assert resp.status_code == 400
    assert error in resp.json()["error"]
    assert service.endpoints("prefill") == {} and service.num_rooms() == 0


def test_non_json_is_rejected(service):
    url = f"http://127.0.0.1:{service.port}/register"
    resp = httpx.post(url, content=b"\x80\x04not json", headers={"Content-Type": "application/json"}, timeout=5)
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]
    resp = httpx.post(url, content=b"role=prefill", headers={"Content-Type": "application/x-www-form-urlencoded"},
                      timeout=5)
    assert resp.status_code == 400 and "application/json" in resp.json()["error"]
    assert httpx.get(f"http://127.0.0.1:{service.port}/nope", timeout=5).status_code == 404


def test_unreachable_bootstrap_reports_unhealthy():
    svc = BootstrapService("127.0.0.1", 0)
    port = svc.port
    svc.close()  # never started: nothing listens
    client = BootstrapClient("127.0.0.1", port, timeout_s=1.0)
    assert not client.health()
    client.close()
