"""Bad and oversized input is stopped at the edge with a clear error, and never stalls the
front for other clients: control bodies of the wrong shape, bodies past the size limit,
invalid UTF-8, undecodable gRPC messages, oversized n / batches / logprobs, huge prompts.
After each class the server still serves a normal request.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import httpx
import pytest
from e2e_server import is_idle
from grpc_support import stub, target

from cadence.grpc import sglang_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LIMIT = 32 * 1024 * 1024  # the default --max-request-body-mb
NORMAL = {
    "text": "The capital of France is",
    "sampling_params": {"max_new_tokens": 3, "temperature": 0},
}


@pytest.fixture
def srv(fuzz_server):
    yield fuzz_server
    with fuzz_server.client() as client:  # whatever the test sent, the server still serves
        r = client.post("/generate", json=NORMAL)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3, r.text
        client.post("/continue_generation")
    assert is_idle(fuzz_server.wait_idle())


def assert_400(r: httpx.Response, param: str | None, words: str = "") -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == 400 and error["param"] == param, error
    assert words in error["message"], error


# ---- control messages ---------------------------------------------------------------------------

CONTROL_CASES = [
    # (route, body, the field the error names)
    ("/abort_request", [], None),
    ("/abort_request", "rid", None),
    ("/abort_request", 7, None),
    ("/abort_request", {"rid": 5}, "rid"),
    ("/abort_request", {"rid": ["a"]}, "rid"),
    ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ("/abort_request", {"abort_all": 1}, "abort_all"),
    ("/abort_request", {}, "rid"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/pause_generation", {"mode": 3}, "mode"),
    ("/pause_generation", ["abort"], None),
    ("/start_profile", {"output_dir": "/etc"}, "output_dir"),
    ("/start_profile", {"output_dir": "../../x"}, "output_dir"),
    ("/start_profile", {"output_dir": 5}, "output_dir"),
    ("/start_profile", {"num_steps": "3"}, "num_steps"),
    ("/start_profile", {"num_steps": 0}, "num_steps"),
    ("/start_profile", "now", None),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": ["a"]}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "x", "load_format": 1}, "load_format"),
    ("/update_weights_from_disk", "model.gguf", None),
    ("/flush_cache", b"{not json", None),
    ("/continue_generation", b"\xff\xfe", None),
    ("/stop_profile", b"[1,", None),
]


@pytest.mark.parametrize("route,body,param", CONTROL_CASES, ids=lambda v: repr(v)[:30])
def test_malformed_control_bodies_are_400_naming_the_field(srv, route, body, param):
    with srv.client() as client:
        if isinstance(body, bytes):
            r = client.post(route, content=body, headers={"content-type": "application/json"})
        else:
            r = client.post(route, json=body)
    assert_400(r, param)


def test_grpc_control_values_are_checked(srv):
    rpc = stub(srv)
    for call, request in (
        (rpc.PauseGeneration, pb.PauseGenerationRequest(mode="sideways")),
        (rpc.StartProfile, pb.StartProfileRequest(output_dir="/tmp/elsewhere")),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_booleans_given_strings_are_400(srv):
    with srv.client() as client:
        assert_400(client.post("/generate", json={**NORMAL, "stream": "true"}), "stream")
        assert_400(
            client.post("/generate", json={**NORMAL, "return_logprob": "yes"}), "return_logprob"
        )
        assert_400(
            client.post(
                "/generate", json={"text": "hi", "sampling_params": {"ignore_eos": "false"}}
            ),
            "ignore_eos",
        )
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert_400(client.post("/v1/chat/completions", json={**chat, "stream": "yes"}), "stream")
        assert_400(
            client.post("/v1/chat/completions", json={**chat, "logprobs": "true"}), "logprobs"
        )
        assert_400(
            client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": "no"}),
            "add_special_tokens",
        )
        assert_400(
            client.post("/detokenize", json={"tokens": [1], "skip_special_tokens": "no"}),
            "skip_special_tokens",
        )


# ---- JSON and UTF-8 ------------------------------------------------------------------------------

POST_ROUTES = [
    "/generate",
    "/v1/chat/completions",
    "/v1/completions",
    "/tokenize",
    "/v1/tokenize",
    "/detokenize",
    "/v1/detokenize",
    "/abort_request",
    "/pause_generation",
    "/start_profile",
    "/update_weights_from_disk",
    "/flush_cache",
    "/continue_generation",
    "/stop_profile",
]


@pytest.mark.parametrize("route", POST_ROUTES)
def test_invalid_utf8_is_a_400_on_every_route(srv, route):
    body = b'{"text": "caf\xe9 \xff", "prompt": "\xc3", "messages": "\xfe"}'
    with srv.client() as client:
        r = client.post(route, content=body, headers={"content-type": "application/json"})
    assert_400(r, None, "UTF-8")


def test_unknown_routes_and_methods_are_json(srv):
    with srv.client() as client:
        for r in (
            client.get("/no/such/route"),
            client.get("/generate"),
            client.delete("/v1/models"),
        ):
            assert r.status_code in (404, 405) and r.json()["error"]["code"] == r.status_code


# ---- sizes -----------------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_before_it_is_read(srv):
    """Headers announce 40 MiB; the server answers 413 after the first 64 KiB arrive."""
    host, port = "127.0.0.1", int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (40 * 1024 * 1024) + b" " * 65536
        )
        reply = b""
        while b"\r\n\r\n" not in reply or b"}" not in reply.split(b"\r\n\r\n", 1)[1]:
            data = sock.recv(65536)  # headers and body may come in separate segments
            if not data:
                break
            reply += data
        reply = reply.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert '"code":413' in reply and "max-request-body-mb" in reply


def test_a_chunked_body_over_the_limit_is_413(srv):
    def chunks():
        piece = b" " * (1024 * 1024)
        yield b'{"text": "'
        for _ in range(LIMIT // len(piece) + 2):
            yield piece
        yield b'"}'

    with srv.client(timeout=120) as client:
        r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text[:300]


def test_oversized_n_batch_and_logprobs_are_refused_before_work(srv):
    with srv.client() as client:
        assert_400(
            client.post("/generate", json={"text": "hi", "sampling_params": {"n": 100000}}), "n"
        )
        assert_400(
            client.post(
                "/generate", json={"text": ["hi"] * 5000, "sampling_params": {"max_new_tokens": 1}}
            ),
            "text",
        )
        assert_400(client.post("/generate", json={"input_ids": [[1, 2]] * 5000}), "input_ids")
        assert_400(
            client.post(
                "/generate", json={**NORMAL, "return_logprob": True, "top_logprobs_num": 100000}
            ),
            "top_logprobs_num",
        )
        many = {
            "text": "hi",
            "return_logprob": True,
            "top_logprobs_num": 200,
            "token_ids_logprob": list(range(4000)),
            "sampling_params": {"max_new_tokens": 2000},
        }
        assert_400(client.post("/generate", json=many), "top_logprobs_num", "entries")
        assert_400(
            client.post("/generate", json={"text": "hi", "sampling_params": {"stop": ["x"] * 65}}),
            "stop",
        )
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 100000}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


@pytest.mark.parametrize(
    "chars", [10_000_000, 600_000], ids=["10MB-refused-unread", "600k-tokenized-off-loop"]
)
def test_health_answers_within_100ms_while_a_huge_prompt_is_refused(srv, chars):
    prompt = "hello world, " * (chars // 13)
    outcome: dict = {}

    def send():
        with srv.client(timeout=300) as client:
            outcome["response"] = client.post("/generate", json={"text": prompt})

    sender = threading.Thread(target=send)
    latencies = []
    with srv.client(timeout=5) as client:
        client.get("/health")  # a warm connection
        sender.start()
        while sender.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)
    sender.join()
    assert_400(outcome["response"], "text", "context length")
    assert latencies and max(latencies) < 0.1, f"/health took up to {max(latencies) * 1000:.0f} ms"


# ---- gRPC ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b"\x0a\x05\xff\xfe\xfd\xfc\xfb", b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f"],
    ids=["bad-utf8-string", "corrupt", "truncated-length"],
)
@pytest.mark.parametrize("method", ["Tokenize", "TextGenerate"])
def test_undecodable_grpc_messages_are_invalid_argument(srv, raw, method):
    with grpc.insecure_channel(target(srv)) as channel:
        path = f"/sglang.runtime.v1.SglangService/{method}"
        call = (channel.unary_stream if method == "TextGenerate" else channel.unary_unary)(path)
        with pytest.raises(grpc.RpcError) as e:
            result = call(raw, timeout=30)
            list(result) if method == "TextGenerate" else result
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "not a valid" in e.value.details()
