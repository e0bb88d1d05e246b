"""Several front processes over one scheduler (--api-workers 2): both answer on the same
ports, an abort reaches a request whichever front receives it, pause holds both, /metrics
adds up both, a port in use fails start-up, SIGTERM ends every process and SIGKILL of one
front stops the server cleanly. Also stream coalescing: a reader slower than the tokens
gets them merged, text and logprobs intact; one that keeps up gets one message per token."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import grpc
import httpx
import pytest
from e2e_server import BENCH_PLUGINS_DIR, is_idle, sse_events, wait_until
from grpc_support import stub

from cadence.grpc import sglang_pb2 as pb

if BENCH_PLUGINS_DIR not in sys.path:
    sys.path.append(BENCH_PLUGINS_DIR)
from cadence_zero_cost import PACED_PREFIX  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PID = "x-cadence-front-pid"


def front_pid(srv, client: httpx.Client | None = None) -> int:
    c = client or srv.client()
    try:
        return int(c.get("/v1/models").headers[PID])
    finally:
        if client is None:
            c.close()


def client_on_other_front(srv, pid: int, tries: int = 200) -> httpx.Client:
    """A keep-alive client whose connection the kernel gave to a front other than `pid`."""
    for _ in range(tries):
        c = srv.client()
        if front_pid(srv, c) != pid:
            return c
        c.close()
    raise AssertionError(f"every connection went to front {pid}")


def both_fronts(srv, tries: int = 200) -> set[int]:
    pids: set[int] = set()
    for _ in range(tries):
        pids.add(front_pid(srv))
        if len(pids) == 2:
            break
    return pids


def metric(text: str, name: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


# ---- two fronts, one scheduler -----------------------------------------------------------------


def test_both_fronts_answer_on_one_port_and_are_children_of_the_server(workers_server):
    pids = both_fronts(workers_server)
    assert len(pids) == 2, pids
    assert pids <= set(workers_server.children())
    # gRPC on the shared port answers too (whichever front the kernel picks).
    for _ in range(4):
        assert stub(workers_server).Tokenize(pb.TokenizeRequest(text="hello")).count >= 1


def test_a_stream_is_aborted_through_the_other_front(workers_server):
    srv = workers_server
    body = {
        "text": "Tell me a long story.",
        "rid": "cross-front",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "n": 2},
    }
    with srv.client() as a, a.stream("POST", "/generate", json=body) as r:
        owner = int(r.headers[PID])
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        b = client_on_other_front(srv, owner)
        try:
            assert int(b.post("/abort_request", json={"rid": "cross-front"}).headers[PID]) != owner
        finally:
            b.close()
        events = [e for e in sse_events(lines) if e != "[DONE]"]
    finals = {
        e["index"]: e["meta_info"]["finish_reason"]
        for e in events
        if e["meta_info"]["finish_reason"]
    }
    # Both samples of the n = 2 request end aborted, though their front never saw the abort.
    assert set(finals) == {0, 1} and all(f["type"] == "abort" for f in finals.values()), finals
    assert is_idle(srv.wait_idle())


def test_each_front_logs_the_requests_it_serves(workers_server):
    """--log-requests --log-requests-level 3: a request's arrival and end are logged in full
    by whichever front serves it, the rid, its sampling parameters, the prompt and the output
    text included; one a client leaves is logged as aborted."""
    srv = workers_server
    tag = uuid.uuid4().hex[:8]
    sent = {}
    with srv.client() as a:
        b = client_on_other_front(srv, front_pid(srv, a))
        try:
            for i, c in enumerate((a, b)):
                rid, prompt = f"log-{tag}-{i}", f"Count to five, attempt {tag} {i}:"
                body = {"text": prompt, "rid": rid, "sampling_params": {"max_new_tokens": 5}}
                sent[rid] = (prompt, c.post("/generate", json=body).json()["text"])
        finally:
            b.close()
    left = f"log-{tag}-left"
    body = {
        "text": "Tell me a long story.",
        "rid": left,
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    with srv.client() as c, c.stream("POST", "/generate", json=body) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))  # then leave

    def logged() -> bool:
        return f"Finish: rid={left} " in srv.log_text()

    assert wait_until(logged, timeout=10), srv.log_tail()
    lines = srv.log_text().splitlines()
    for rid, (prompt, text) in sent.items():
        (received,) = [x for x in lines if f"Receive: rid={rid} " in x]
        (finished,) = [x for x in lines if f"Finish: rid={rid} " in x]
        assert "'max_new_tokens': 5" in received
        assert f"text={prompt!r}" in received and "prompt_tokens=" in received
        assert f"text={text!r}" in finished and "completion_tokens=5" in finished
        assert "'type': 'length'" in finished and "e2e_latency=" in finished
    (finished,) = [x for x in lines if f"Finish: rid={left} " in x]
    assert "'type': 'abort'" in finished
    assert is_idle(srv.wait_idle())


def test_configure_logging_through_one_front_sets_both(workers_server):
    """/configure_logging (SGLang's route): a change through one front holds on the other;
    a bad level or a request dump is a 400 naming the field, and changes nothing."""
    srv = workers_server
    tag = uuid.uuid4().hex[:8]

    def lines_of(rid: str) -> list[str]:
        return [x for x in srv.log_text().splitlines() if f": rid={rid} " in x]

    with srv.client() as a:
        b = client_on_other_front(srv, front_pid(srv, a))
        try:
            for body, param in [
                ({"log_requests_level": 7}, "log_requests_level"),
                ({"dump_requests_folder": "/tmp/dumps"}, "dump_requests_folder"),
            ]:
                r = a.post("/configure_logging", json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            a.post("/configure_logging", json={"log_requests_level": 0}).raise_for_status()
            meta_only = f"cfg-{tag}-0"
            body = {"text": "Hi", "rid": meta_only, "sampling_params": {"max_new_tokens": 2}}
            b.post("/generate", json=body).raise_for_status()
            a.post("/configure_logging", json={"log_requests": False}).raise_for_status()
            unlogged = f"cfg-{tag}-1"
            b.post("/generate", json={**body, "rid": unlogged}).raise_for_status()
        finally:
            a.post("/configure_logging", json={"log_requests": True, "log_requests_level": 3})
            b.close()
    assert wait_until(lambda: len(lines_of(meta_only)) == 2, timeout=10), srv.log_tail()
    received, finished = lines_of(meta_only)
    assert f"Receive: rid={meta_only} prompt_tokens=" in received
    assert "sampling_params" not in received and "text=" not in received  # level 0
    assert f"Finish: rid={meta_only} " in finished and "text=" not in finished
    assert lines_of(unlogged) == []


def test_a_pause_through_one_front_holds_generation_on_both(workers_server):
    srv = workers_server
    with srv.client() as c:
        c.post("/pause_generation", json={"mode": "abort"}).raise_for_status()
        try:
            for _ in range(6):  # fresh channels: both fronts refuse
                with pytest.raises(grpc.RpcError) as info:
                    list(stub(srv).TextGenerate(pb.TextGenerateRequest(text="hi")))
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            c.post("/continue_generation").raise_for_status()
    sp = pb.SamplingParams(max_new_tokens=2)
    for _ in range(4):
        (msg,) = list(stub(srv).TextGenerate(pb.TextGenerateRequest(text="hi", sampling_params=sp)))
        assert msg.finished


def test_metrics_add_up_both_fronts_and_the_scheduler(workers_server):
    srv = workers_server
    with srv.client() as c:
        before = metric(c.get("/metrics").text, "sglang:num_requests_total")
    served_by: set[int] = set()
    sent = 0
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    while len(served_by) < 2 and sent < 100:
        with srv.client() as c:
            r = c.post("/generate", json=body)
            r.raise_for_status()
            served_by.add(int(r.headers[PID]))
            sent += 1
    assert len(served_by) == 2
    scrapes = []
    for pid in served_by:  # a scrape on either front sees both fronts' requests
        with srv.client() as c:
            while front_pid(srv, c) != pid:
                c.close()
                c = srv.client()
            scrapes.append(c.get("/metrics").text)
            c.close()
    for text in scrapes:
        assert metric(text, "sglang:num_requests_total") - before >= sent
        assert metric(text, "sglang:generation_tokens_total") >= 2 * sent
        assert metric(text, "sglang:time_to_first_token_seconds_count") >= sent
        assert 'cadence:responses_total{protocol="http",status="200"}' in text
        assert "sglang:num_running_reqs" in text and "sglang:token_usage" in text
    # Metric values live in files inside the server's private socket directory.
    (directory,) = srv.socket_dirs()
    assert os.listdir(os.path.join(directory, "metrics"))


def test_sigterm_ends_every_process_and_leaves_no_file(workers_server):
    srv = workers_server
    assert len(srv.children()) >= 4  # scheduler, detokenizer, two fronts
    (directory,) = srv.socket_dirs()
    assert srv.stop(signal.SIGTERM, timeout=30) == 0, srv.log_tail()
    assert wait_until(lambda: not srv.leftover_pids(), 5), srv.leftover_pids()
    assert not os.path.exists(directory)


def test_a_port_in_use_fails_start_up(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    grpc_holder = socket.socket()
    grpc_holder.bind(("127.0.0.1", 0))
    grpc_holder.listen(1)
    try:
        for http_port, grpc_port, what in (
            (port, _free_port(), "HTTP"),
            (_free_port(), grpc_holder.getsockname()[1], "gRPC"),
        ):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "cadence.launch_server",
                    "--api-workers",
                    "2",
                    "--port",
                    str(http_port),
                    "--grpc-port",
                    str(grpc_port),
                    "--skip-warmup",
                ],  # fmt: skip
                capture_output=True,
                text=True,
                timeout=60,
                env=dict(os.environ, TMPDIR=str(tmp_path)),
            )
            assert out.returncode == 1, out.stderr[-2000:]
            assert f"cannot bind {what}" in out.stderr and "in use" in out.stderr, out.stderr
    finally:
        holder.close()
        grpc_holder.close()
    assert not [p for p in os.listdir(tmp_path) if p.startswith("cadence-ipc-")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- stream coalescing (zero-cost engine: tokens as fast as the server moves them) -------------


def _slow_sse(srv, path: str, body: dict) -> tuple[list, int]:
    """Posts `body` and reads the SSE answer through a tiny receive buffer, and not at all
    until the request has finished in the engine: the server's sends stall meanwhile and
    what waits must be merged. Returns the events and the answering front's pid."""
    payload = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", srv.port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    time.sleep(0.5)
    assert wait_until(lambda: srv.load()["num_running_reqs"] == 0, 60)  # generated, unread
    data = bytearray()
    while chunk := sock.recv(65536):
        data += chunk
        time.sleep(0.001)
    sock.close()
    head, _, body_bytes = bytes(data).partition(b"\r\n\r\n")
    pid = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(PID.encode())
    )
    return _dechunk_sse(body_bytes), pid


def _dechunk_sse(raw: bytes) -> list:
    """The SSE events of a chunked HTTP/1.1 body."""
    out, rest = bytearray(), raw
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    lines = [line for line in out.decode().split("\n") if line.startswith("data: ")]
    return sse_events(lines)


def test_a_slow_reader_gets_merged_deltas_with_text_and_logprobs_intact(zero_cost_server):
    srv = zero_cost_server
    tokens = 3000
    body = {
        "model": "any",
        "prompt": "Count:",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "stream": True,
    }
    events, _ = _slow_sse(srv, "/v1/completions", body)
    chunks = [e for e in events if e != "[DONE]" and e["choices"]]
    with srv.client() as c:
        whole = c.post("/v1/completions", json={**body, "stream": False}).json()
    text = "".join(ch["choices"][0]["text"] for ch in chunks)
    assert text == whole["choices"][0]["text"]
    streamed_tokens = [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]]
    assert streamed_tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert len(streamed_tokens) == tokens
    # The reader fell behind: far fewer messages than tokens, some carrying many tokens.
    assert len(chunks) < tokens // 2, len(chunks)
    assert max(len(ch["choices"][0]["logprobs"]["tokens"]) for ch in chunks) > 10


def test_a_slow_grpc_reader_gets_merged_messages(zero_cost_server):
    srv = zero_cost_server
    tokens = 1000
    sp = pb.SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=0)
    messages = []
    for msg in stub(srv).TextGenerate(
        pb.TextGenerateRequest(text="Count:", stream=True, sampling_params=sp)
    ):
        messages.append(msg)
        # Slower than the tokens come, even on a machine busy with other tests' servers: what
        # waits is sent as one message.
        time.sleep(0.05)
    (whole,) = list(
        stub(srv).TextGenerate(pb.TextGenerateRequest(text="Count:", sampling_params=sp))
    )
    assert messages[-1].finished
    assert "".join(m.text for m in messages) == whole.text
    counts = [json.loads(m.meta_info["completion_tokens"]) for m in messages]
    assert counts[-1] == tokens
    # How many messages depends on how fast a busy machine makes tokens against the reader's
    # pace; that tokens which waited went out together does not.
    steps = [b - a for a, b in zip([0, *counts], counts)]
    assert max(steps) > 1 and len(messages) < tokens, steps


def test_a_reader_that_keeps_up_gets_one_message_per_token(zero_cost_server):
    # Tokens 50 ms apart (a paced request of the zero-cost runner): a reader that keeps up
    # gets each on its own, however busy the machine is with other tests' servers.
    body = {
        "text": "Once upon a time",
        "rid": f"{PACED_PREFIX}{uuid.uuid4().hex}",
        "stream": True,
        "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0},
    }
    with zero_cost_server.client() as c, c.stream("POST", "/generate", json=body) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    # SGLang's stream: each event carries the output so far, one token more than the last.
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == list(range(1, 25)), lengths


def test_sigkill_of_one_front_stops_the_server_cleanly(zero_cost_server):
    srv = zero_cost_server
    pids = both_fronts(srv)
    assert len(pids) == 2
    victim = sorted(pids)[0]
    os.kill(victim, signal.SIGKILL)
    code = srv.wait_exit(30)
    assert code == 1, srv.log_tail()
    assert "front 0" in srv.log_text() or "front 1" in srv.log_text()
    assert "front 0 process died (was killed by SIGKILL)" in srv.log_text() or (
        "front 1 process died (was killed by SIGKILL)" in srv.log_text()
    ), srv.log_tail()
    assert wait_until(lambda: not srv.leftover_pids(), 10), srv.leftover_pids()
    assert not srv.socket_dirs()
