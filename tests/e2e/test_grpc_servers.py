"""gRPC features that need their own server: TLS, mutual TLS, the admission limit, the
per-stream buffer, keepalive pings, the answer while loading, --disable-grpc, and a gRPC
port already in use, and calls in flight when the server stops.

The module's servers are launched together (their loads overlap) and killed in a finalizer.
Certificates are made for the test by the openssl CLI."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import pytest
from e2e_server import Server, free_port, is_idle, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_support import (
    SERVICE,
    grpc_port,
    long_stream,
    make_certs,
    openssl_available,
    read,
    short_request,
    stub,
    target,
)

from cadence.grpc import sglang_pb2 as pb
from cadence.grpc import sglang_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BUFFER = 4  # --grpc-stream-buffer of the limits server
_SMALL = ["--skip-warmup", "--max-total-tokens", "8192"]


class LoadingProbe:
    """Calls a server's gRPC port from launch until the model is loaded, keeping the first
    answers our servicer gives while loading (a refused connection is not an answer)."""

    def __init__(self, server: Server):
        self.server = server
        self.tokenize: grpc.RpcError | None = None
        self.health: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        channel = grpc.insecure_channel(target(self.server))
        rpc, health = stub_on(channel), health_pb2_grpc.HealthStub(channel)
        while not self.server.ready.is_set() and self.server.proc.poll() is None:
            # Deadlines leave room for a machine busy starting several servers at once.
            try:
                rpc.Tokenize(pb.TokenizeRequest(text="too early"), timeout=5)
            except grpc.RpcError as e:
                if "starting" in (e.details() or "") and not self.server.ready.is_set():
                    self.tokenize = e
                    try:
                        request = health_pb2.HealthCheckRequest(service=SERVICE)
                        self.health = health.Check(request, timeout=5).status
                        return
                    except grpc.RpcError as late:
                        if late.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                            raise
            time.sleep(0.05)


def stub_on(channel) -> sglang_pb2_grpc.SglangServiceStub:
    return sglang_pb2_grpc.SglangServiceStub(channel)


@pytest.fixture(scope="module")
def certs():
    if not openssl_available():
        pytest.skip("the openssl CLI is needed to make test certificates")
    with tempfile.TemporaryDirectory(prefix="cadence-grpc-certs-") as directory:
        yield make_certs(directory)


@pytest.fixture(scope="module")
def servers(certs):
    tls = ["--grpc-tls-cert", certs["server.pem"], "--grpc-tls-key", certs["server.key"]]
    specs = {
        "tls": [*tls, *_SMALL],
        "mtls": [*tls, "--grpc-tls-client-ca", certs["ca.pem"], *_SMALL],
        "limits": [
            "--grpc-max-concurrent-requests",
            "1",
            "--grpc-stream-buffer",
            str(BUFFER),
            "--grpc-min-ping-interval-s",
            "1",
            "--grpc-max-message-mb",
            "1",
            *_SMALL,
        ],
        "nogrpc": ["--disable-grpc", *_SMALL],
        "stopping": _SMALL,  # taken down by a test
    }
    launched = {name: Server(f"grpc-{name}", args).start() for name, args in specs.items()}
    probe = LoadingProbe(launched["limits"])
    try:
        for srv in launched.values():
            srv.wait_ready()
        probe.thread.join(15)
        launched["probe"] = probe
        yield launched
    finally:
        for srv in launched.values():
            if isinstance(srv, Server):
                srv.destroy()


# ---- TLS and mutual TLS --------------------------------------------------------------------


def secure_stub(server, certs, root="ca.pem", client=None) -> sglang_pb2_grpc.SglangServiceStub:
    kwargs = {"root_certificates": read(certs[root])}
    if client:
        kwargs.update(
            private_key=read(certs[f"{client}.key"]), certificate_chain=read(certs[f"{client}.pem"])
        )
    channel = grpc.secure_channel(target(server), grpc.ssl_channel_credentials(**kwargs))
    return stub_on(channel)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_tls_handshake_then_unary_and_stream(servers, certs):
    rpc = secure_stub(servers["tls"], certs)
    assert rpc.Tokenize(pb.TokenizeRequest(text="over TLS"), timeout=30).count > 0
    msgs = list(rpc.TextGenerate(short_request(max_new_tokens=3, stream=True), timeout=60))
    assert msgs[-1].finished and "".join(m.text for m in msgs)


def test_tls_refuses_plaintext_and_an_unknown_ca(servers, certs):
    plain = stub(servers["tls"])
    assert (
        refused(lambda: plain.Tokenize(pb.TokenizeRequest(text="x"), timeout=5)).code()
        == grpc.StatusCode.UNAVAILABLE
    )
    untrusted = secure_stub(servers["tls"], certs, root="other_ca.pem")
    assert (
        refused(lambda: untrusted.Tokenize(pb.TokenizeRequest(text="x"), timeout=5)).code()
        == grpc.StatusCode.UNAVAILABLE
    )


def test_mutual_tls_needs_a_client_certificate_from_the_ca(servers, certs):
    rpc = secure_stub(servers["mtls"], certs, client="client")
    assert rpc.Tokenize(pb.TokenizeRequest(text="over mTLS"), timeout=30).count > 0
    assert list(rpc.TextGenerate(short_request(max_new_tokens=2), timeout=60))[-1].finished
    anonymous = secure_stub(servers["mtls"], certs)
    assert (
        refused(lambda: anonymous.Tokenize(pb.TokenizeRequest(text="x"), timeout=5)).code()
        == grpc.StatusCode.UNAVAILABLE
    )


def test_mutual_tls_refuses_a_client_certificate_from_another_ca(servers, certs, tmp_path):
    # A client certificate that the other CA signed: the server's client CA does not know it.
    other = make_certs(str(tmp_path))
    channel = grpc.secure_channel(
        target(servers["mtls"]),
        grpc.ssl_channel_credentials(
            root_certificates=read(certs["ca.pem"]),
            private_key=read(other["client.key"]),
            certificate_chain=read(other["client.pem"]),
        ),
    )
    assert (
        refused(lambda: stub_on(channel).Tokenize(pb.TokenizeRequest(text="x"), timeout=5)).code()
        == grpc.StatusCode.UNAVAILABLE
    )


# ---- while loading ------------------------------------------------------------------------------


def test_while_loading_calls_are_unavailable_and_health_not_serving(servers):
    probe = servers["probe"]
    assert probe.tokenize is not None, "the gRPC port did not answer while the model was loading"
    assert probe.tokenize.code() == grpc.StatusCode.UNAVAILABLE
    assert probe.health == health_pb2.HealthCheckResponse.NOT_SERVING
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target(servers["limits"])))
    assert (
        health.Check(health_pb2.HealthCheckRequest()).status
        == health_pb2.HealthCheckResponse.SERVING
    )


# ---- admission limit and stream buffer ------------------------------------------------------------


def test_calls_beyond_the_admission_limit_are_resource_exhausted(servers):
    server = servers["limits"]
    rpc = stub(server)
    call = rpc.TextGenerate(long_stream(max_new_tokens=2000))
    next(call)
    e = refused(lambda: list(rpc.TextGenerate(short_request())))
    assert (
        e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "--grpc-max-concurrent-requests" in e.details()
    )
    assert (
        rpc.Tokenize(pb.TokenizeRequest(text="not a generation")).count > 0
    )  # only generation is limited
    call.cancel()
    assert wait_until(lambda: is_idle(server.load()), 5)
    assert list(rpc.TextGenerate(short_request(max_new_tokens=1)))[
        -1
    ].finished  # the slot is free again


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(servers):
    server = servers["limits"]
    # A small receive window: HTTP/2 flow control stalls the server after a few messages.
    rpc = stub(server, **{"grpc.http2.lookahead_bytes": 1024, "grpc.http2.bdp_probe": 0})
    call = rpc.TextGenerate(long_stream(max_new_tokens=2000))
    assert wait_until(lambda: server.load()["num_running_reqs"] == 1, 30)
    # Never reading: the buffer fills, the call is ended and the engine lets go on its own.
    assert wait_until(lambda: is_idle(server.load()), 120, interval=0.2), server.load()
    received = []
    e = refused(lambda: received.extend(call))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "not reading" in e.details()
    assert 0 < len(received) < 200


PINGING = {
    "grpc.keepalive_time_ms": 1500,
    "grpc.keepalive_timeout_ms": 5000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.http2.max_pings_without_data": 0,
}


def _ping_through_idle_and_a_silent_call(channel) -> list:
    """Idle, then a call that sends nothing for seconds, while the client pings every 1.5 s;
    returns the channel's connectivity states seen (a GOAWAY drops it out of READY)."""
    states = []
    channel.subscribe(states.append, try_to_connect=True)
    rpc = stub_on(channel)
    assert rpc.Tokenize(pb.TokenizeRequest(text="connect"), timeout=30).count > 0
    time.sleep(6)  # idle: four pings with no call in flight
    assert list(rpc.TextGenerate(short_request(max_new_tokens=40), timeout=120))[-1].finished
    time.sleep(0.2)
    channel.unsubscribe(states.append)
    return states[states.index(grpc.ChannelConnectivity.READY) :]


def test_keepalive_pings_without_calls_or_data_are_welcome(servers):
    """Pings every 1.5 s, above the server's --grpc-min-ping-interval-s 1: the connection
    stays up throughout (no GOAWAY too_many_pings, which would fail a long prefill)."""
    channel = grpc.insecure_channel(target(servers["limits"]), options=list(PINGING.items()))
    assert set(_ping_through_idle_and_a_silent_call(channel)) == {grpc.ChannelConnectivity.READY}


def test_pings_faster_than_the_minimum_interval_are_refused(servers, certs):
    """The same client against a server at the default minimum (5 s) is sent away: so the
    flag is what lets it through above."""
    channel = grpc.secure_channel(
        target(servers["tls"]),
        grpc.ssl_channel_credentials(read(certs["ca.pem"])),
        options=list(PINGING.items()),
    )
    assert set(_ping_through_idle_and_a_silent_call(channel)) != {grpc.ChannelConnectivity.READY}


def test_messages_beyond_the_size_limit_are_refused(servers):
    rpc = stub(servers["limits"], **{"grpc.max_send_message_length": 8 * 1024 * 1024})
    e = refused(lambda: rpc.Tokenize(pb.TokenizeRequest(text="a" * (1024 * 1024 + 1))))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rpc.Tokenize(pb.TokenizeRequest(text="a " * 1000)).count > 0  # below the limit


# ---- disabled ------------------------------------------------------------------------------------


def _listening_ports(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and parts[9] in inodes:  # LISTEN
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def test_disable_grpc_binds_no_grpc_port(servers):
    server = servers["nogrpc"]
    assert "--grpc-port" not in server.proc.args
    assert _listening_ports(server.proc.pid) == {server.port}
    with server.client() as http:
        assert http.get("/health").status_code == 200


def test_an_enabled_server_listens_on_http_and_grpc_only(servers):
    server = servers["limits"]
    assert _listening_ports(server.proc.pid) == {server.port, grpc_port(server)}


def test_a_grpc_port_in_use_stops_the_server_with_the_reason(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "cadence.launch_server",
                "--port",
                str(free_port()),
                "--grpc-port",
                str(port),
                "--skip-warmup",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, TMPDIR=str(tmp_path)),
        )
    assert result.returncode == 1
    assert (
        f"gRPC: Failed to bind to address 127.0.0.1:{port}" in result.stderr
        and "--grpc-port" in result.stderr
    )
    assert not list(tmp_path.glob("cadence-ipc-*")), "the socket directory was removed"


def test_sigterm_ends_live_calls_with_unavailable_and_health_goes_not_serving(servers):
    server = servers["stopping"]
    rpc = stub(server)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target(server)))
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    call = rpc.TextGenerate(long_stream(max_new_tokens=2000))
    next(call)
    server.send_signal(signal.SIGTERM)
    assert (
        next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    )  # at once, before the exit
    e = refused(lambda: list(call))
    assert e.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.details()
    assert server.wait_exit(20) == 0, server.log_tail()
