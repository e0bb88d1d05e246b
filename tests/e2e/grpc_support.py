"""Helpers of the gRPC end-to-end tests: where a launched server's gRPC port is, channels
and stubs to it (plaintext or TLS), and throwaway certificates made with the openssl CLI."""

from __future__ import annotations

import os
import shutil
import subprocess

import grpc

from cadence.grpc import sglang_pb2 as pb
from cadence.grpc import sglang_pb2_grpc

SERVICE = "sglang.runtime.v1.SglangService"


def grpc_port(server) -> int:
    """The --grpc-port the harness gave `server` (the last one on its command line wins)."""
    args = list(server.proc.args)
    idx = max(i for i, a in enumerate(args) if a == "--grpc-port")
    return int(args[idx + 1])


def target(server) -> str:
    return f"127.0.0.1:{grpc_port(server)}"


def stub(server, **options) -> sglang_pb2_grpc.SglangServiceStub:
    """A stub on a fresh plaintext channel (closed with the stub's garbage collection)."""
    return sglang_pb2_grpc.SglangServiceStub(
        grpc.insecure_channel(target(server), options=list(options.items()))
    )


def long_stream(max_new_tokens: int = 4000, **kwargs) -> pb.TextGenerateRequest:
    """A streamed generation that runs until someone stops it."""
    return pb.TextGenerateRequest(
        text="Tell me a very long story.",
        stream=True,
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
        **kwargs,
    )


def short_request(text: str = "The capital of France is", max_new_tokens: int = 4, **kwargs):
    return pb.TextGenerateRequest(
        text=text,
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
        **kwargs,
    )


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_certs(directory: str) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, both
    signed by the CA, plus a second CA that signed nothing here. Returns name -> PEM path."""
    p = {
        name: os.path.join(directory, name)
        for name in (
            "ca.key",
            "ca.pem",
            "server.key",
            "server.csr",
            "server.pem",
            "client.key",
            "client.csr",
            "client.pem",
            "other_ca.key",
            "other_ca.pem",
            "san.ext",
        )
    }
    for ca, cn in (("ca", "cadence-test-ca"), ("other_ca", "some-other-ca")):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={cn}",
            "-keyout",
            p[f"{ca}.key"],
            "-out",
            p[f"{ca}.pem"],
        )
    with open(p["san.ext"], "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who, cn in (("server", "localhost"), ("client", "cadence-test-client")):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={cn}",
            "-keyout",
            p[f"{who}.key"],
            "-out",
            p[f"{who}.csr"],
        )
        extra = ["-extfile", p["san.ext"]] if who == "server" else []
        _openssl(
            "x509",
            "-req",
            "-in",
            p[f"{who}.csr"],
            "-CA",
            p["ca.pem"],
            "-CAkey",
            p["ca.key"],
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            p[f"{who}.pem"],
            *extra,
        )
    return p


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
