"""A client that goes away aborts its request: within about a second the scheduler stops
generating for it and its KV pages return (read through /v1/loads)."""

from __future__ import annotations

import socket
import struct
import time

import httpx
import pytest
from e2e_server import is_idle, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LONG = {
    "text": "Tell me a very long story.",
    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
}
ABORT_WITHIN_S = 1.0


def wait_freed(server) -> tuple[bool, dict, float]:
    start = time.monotonic()
    last = {}

    def freed():
        nonlocal last
        last = server.load()
        return last["num_running_reqs"] == 0 and last["num_used_tokens"] == 0

    ok = wait_until(freed, ABORT_WITHIN_S + 0.5, interval=0.02)
    return ok, last, time.monotonic() - start


def test_closing_a_stream_mid_way_aborts_the_request(server):
    assert is_idle(server.wait_idle())
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/generate", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()  # held, so that the connection stays open until the block ends
            for _ in range(3):
                assert next(line for line in lines if line).startswith("data: {")
            busy = server.load()
            assert busy["num_running_reqs"] == 1 and busy["num_used_tokens"] > 0
    # Leaving both blocks closed the connection.
    ok, last, took = wait_freed(server)  # ok: freed by a load report asked for in time
    assert ok, f"still generating {took:.2f} s after the client left: {last}"


def test_non_streaming_request_whose_client_times_out_is_aborted(server):
    assert is_idle(server.wait_idle())
    with httpx.Client(base_url=server.url) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json=LONG, timeout=httpx.Timeout(60, read=2.0))
    ok, last, _ = wait_freed(server)
    assert ok, f"still generating {ABORT_WITHIN_S}s after the client timed out: {last}"


def test_client_that_resets_the_connection_mid_stream(server):
    """A raw socket closed with RST (no graceful FIN) also aborts the request."""
    assert is_idle(server.wait_idle())
    body = httpx.Request("POST", server.url + "/generate", json={**LONG, "stream": True})
    head = (
        f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body.content)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(head + body.content)
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    assert received.startswith(b"HTTP/1.1 200")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
    sock.close()
    ok, last, _ = wait_freed(server)
    assert ok, f"still generating after the connection was reset: {last}"
    assert is_idle(server.wait_idle())
