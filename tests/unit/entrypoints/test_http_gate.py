"""The HTTP adapter's gate, without a model: API key, readiness, shutdown, body size, JSON
errors. Through Starlette's test client (ASGI in process, no sockets)."""

import pytest
from starlette.testclient import TestClient

from cadence.entrypoints.http_server import build_app
from cadence.server_args import ServerArgs
from cadence.serving.state import ServerState


def client(ready=True, shutting_down=False, **args) -> TestClient:
    state = ServerState(ServerArgs(**args))
    state.is_ready, state.is_shutting_down = ready, shutting_down
    return TestClient(build_app(state), raise_server_exceptions=False)


def test_requests_during_shutdown_get_the_json_503():
    c = client(shutting_down=True)
    for method, route in (
        ("POST", "/generate"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("POST", "/tokenize"),
    ):
        r = c.request(method, route, json={"text": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503, (route, r.text)
        assert "shutting down" in r.json()["error"]["message"]


def test_requests_while_loading_get_the_json_503():
    r = client(ready=False).post("/generate", json={"text": "hi"})
    assert r.status_code == 503 and "starting" in r.json()["error"]["message"]


def test_api_key_is_required_and_compared_whole():
    c = client(api_key="sk-secret")
    for auth in (None, "Bearer sk-secre", "Bearer sk-secretX", "sk-secret", "Bearer \u00e9"):
        headers = {} if auth is None else {"Authorization": auth.encode("latin-1")}
        r = c.get("/model_info", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", auth


def test_body_over_the_limit_is_413_by_content_length():
    c = client(max_request_body_mb=0.001)  # 1048 bytes
    r = c.post("/generate", content=b"x" * 2000, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert "max-request-body-mb" in r.json()["error"]["message"]


def test_chunked_body_over_the_limit_is_413():
    c = client(max_request_body_mb=0.001)

    def chunks():
        for _ in range(10):
            yield b"x" * 500

    for route in ("/generate", "/tokenize", "/v1/chat/completions"):
        r = c.post(route, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, (route, r.text)


def test_bad_content_length_is_400():
    r = client().post("/generate", content=b"{}", headers={"content-length": "abc"})
    assert r.status_code in (400, 422) and r.headers["content-type"].startswith(
        ("application/json", "text/plain")
    )


@pytest.mark.parametrize("route", ["/generate", "/tokenize", "/abort_request", "/v1/completions"])
def test_invalid_utf8_is_a_400_naming_it(route):
    r = client().post(
        route, content=b'{"text": "\xff"}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], r.text


def test_unexpected_exceptions_are_json_500_marked_as_the_requests_own():
    # No engine client behind a ready state: the route fails inside; the client gets JSON,
    # and the mark that tells a router not to retry it nor hold it against the server.
    r = client().get("/model_info")
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    assert "internal error" in r.json()["error"]["message"]
    assert r.headers["x-cadence-fault"] == "request"


@pytest.mark.parametrize("route", ["/generate", "/tokenize", "/v1/chat/completions"])
def test_json_nested_too_deep_is_a_400_naming_the_field(route):
    body = b'{"text": "hi", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    r = client().post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x" and "nested too deep" in r.text


def test_unknown_routes_are_json_404():
    r = client().get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


@pytest.mark.parametrize(
    "bad",
    [
        {"api_key": "ключ"},
        {"api_key": ""},
        {"max_request_body_mb": 0},
        {"watchdog_timeout": 0},
        {"request_timeout_s": -1},
    ],
)
def test_bad_server_arguments_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServerArgs(**bad)
