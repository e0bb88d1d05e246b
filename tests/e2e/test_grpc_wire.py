"""The service as other clients see it: hand-encoded protobuf bytes on the method paths
(the field numbers of the contract, independent of our stubs), server reflection, the
standard health service, and a Node.js client built from the .proto with @grpc/grpc-js."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_support import SERVICE, target

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "proto" / "sglang" / "runtime" / "v1" / "sglang.proto"
NODE_PACKAGES = ("@grpc/grpc-js@1", "@grpc/proto-loader@0")


# ---- a minimal protobuf wire codec ------------------------------------------------------------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 values travel as 10-byte two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, value) -> bytes:
    """One field: bool/int as varint (wire type 0), float as fixed32 (5), bytes/str/nested as
    length-delimited (2)."""
    if isinstance(value, float):
        return varint(number << 3 | 5) + struct.pack("<f", value)
    if isinstance(value, (bool, int)):
        return varint(number << 3 | 0) + varint(int(value))
    data = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(data)) + data


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def parse(data: bytes) -> dict[int, list]:
    """Field number -> values (ints for varints, bytes for length-delimited)."""
    fields: dict[int, list] = {}
    pos = 0
    while pos < len(data):
        key, pos = read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = read_varint(data, pos)
        elif wire_type == 2:
            length, pos = read_varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire_type == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise AssertionError(f"unexpected wire type {wire_type} for field {number}")
        fields.setdefault(number, []).append(value)
    return fields


def packed_varints(data: bytes) -> list[int]:
    values, pos = [], 0
    while pos < len(data):
        value, pos = read_varint(data, pos)
        values.append(value)
    return values


def raw_method(server, name: str, streaming: bool):
    channel = grpc.insecure_channel(target(server))
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(
        f"/{SERVICE}/{name}", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )


# ---- raw protobuf ------------------------------------------------------------------------


def test_tokenize_by_hand_encoded_bytes(server):
    with server.client() as http:
        want = http.post(
            "/tokenize", json={"prompt": "Hello wire", "add_special_tokens": False}
        ).json()
    reply = parse(raw_method(server, "Tokenize", False)(field(1, "Hello wire") + field(2, False)))
    assert packed_varints(reply[1][0]) == want["tokens"]  # tokens = 1, packed
    assert reply[2] == [want["count"]]  # count = 2
    assert reply[3] == [want["max_model_len"]]  # max_model_len = 3
    assert reply[4] == [b"Hello wire"]  # input_text = 4


def test_text_generate_by_hand_encoded_bytes(server):
    # SamplingParams: max_new_tokens (8) = 5, temperature (1) = 0.0 sent explicitly, ignore_eos (12)
    sampling = field(8, 5) + field(1, 0.0) + field(12, True)
    # TextGenerateRequest: text (1), sampling_params (2), stream (3), rid (8)
    request = (
        field(1, "The capital of France is")
        + field(2, sampling)
        + field(3, True)
        + field(8, "raw-wire-rid")
    )
    replies = [parse(r) for r in raw_method(server, "TextGenerate", True)(request)]
    assert [r.get(3, [0])[0] for r in replies][-1] == 1  # finished = 3, on the last message only
    assert all(r.get(3, [0])[0] == 0 for r in replies[:-1])
    meta = {}
    for entry in replies[-1][2]:  # meta_info = 2: map entries {key = 1, value = 2}
        kv = parse(entry)
        meta[kv[1][0].decode()] = json.loads(kv[2][0])
    assert meta["id"] == "raw-wire-rid" and meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    text = "".join(r[1][0].decode() for r in replies if 1 in r)  # text = 1
    with server.client() as http:
        want = http.post(
            "/generate",
            json={
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            },
        ).json()["text"]
    assert text == want


def test_generate_with_negative_token_id_by_hand_is_invalid(server):
    with pytest.raises(grpc.RpcError) as e:
        list(
            raw_method(server, "Generate", True)(field(1, varint(1) + varint(-7)))
        )  # packed input_ids
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "-7" in e.value.details()


# ---- reflection and health ---------------------------------------------------------------------


def _reflect(server, request: reflection_pb2.ServerReflectionRequest):
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(target(server)))
    (response,) = stub.ServerReflectionInfo(iter([request]))
    return response


def test_reflection_lists_and_describes_the_service(server):
    listed = _reflect(server, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names

    from google.protobuf import descriptor_pb2

    described = _reflect(
        server, reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)
    )
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    (proto_file,) = [f for f in files if f.package == "sglang.runtime.v1"]
    assert proto_file.name == "sglang/runtime/v1/sglang.proto"
    methods = {m.name for m in proto_file.service[0].method}
    assert {
        "TextGenerate",
        "Generate",
        "Tokenize",
        "ChatComplete",
        "UpdateWeightsFromDisk",
        "SynthesizeSpeech",
    } <= methods
    assert len(methods) == 26


def test_standard_health_reports_serving(server):
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target(server)))
    for service in ("", SERVICE):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as e:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


# ---- Node.js ---------------------------------------------------------------------------


NODE_CLIENT = r"""
const grpc = require('@grpc/grpc-js');
const loader = require('@grpc/proto-loader');
const [protoPath, address] = process.argv.slice(2);
const def = loader.loadSync(protoPath, {keepCase: true, longs: Number, defaults: true});
const pkg = grpc.loadPackageDefinition(def).sglang.runtime.v1;
const client = new pkg.SglangService(address, grpc.credentials.createInsecure());
const out = {};
client.Tokenize({text: 'Hello from Node', add_special_tokens: false}, (err, res) => {
  if (err) { console.error(err); process.exit(2); }
  out.tokenize = res;
  const call = client.TextGenerate({text: 'The capital of France is', stream: true,
      sampling_params: {max_new_tokens: 6, temperature: 0, ignore_eos: true}});
  out.chunks = [];
  call.on('data', (m) => out.chunks.push({text: m.text, finished: m.finished, meta_info: m.meta_info}));
  call.on('error', (e) => { console.error(e); process.exit(3); });
  call.on('end', () => { console.log(JSON.stringify(out)); client.close(); });
});
"""


@pytest.fixture(scope="module")
def node_modules():
    """@grpc/grpc-js and @grpc/proto-loader from npm, in a directory kept between runs."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip(
            "Node.js (node and npm) is not installed on this machine; the cross-language test needs it"
        )
    cache = Path(tempfile.gettempdir()) / "cadence-grpc-node-client"
    if not (cache / "node_modules" / "@grpc" / "proto-loader").is_dir():
        cache.mkdir(exist_ok=True)
        result = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(cache), *NODE_PACKAGES],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, f"npm install failed:\n{result.stderr[-3000:]}"
    return cache


def test_node_client_tokenizes_and_streams(server, node_modules, tmp_path):
    script = tmp_path / "client.js"
    script.write_text(NODE_CLIENT)
    env = dict(os.environ, NODE_PATH=str(node_modules / "node_modules"))
    result = subprocess.run(
        ["node", str(script), str(PROTO), target(server)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    with server.client() as http:
        want = http.post(
            "/tokenize", json={"prompt": "Hello from Node", "add_special_tokens": False}
        ).json()
        text = http.post(
            "/generate",
            json={
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            },
        ).json()["text"]
    assert out["tokenize"]["tokens"] == want["tokens"] and out["tokenize"]["count"] == want["count"]
    chunks = out["chunks"]
    assert [c["finished"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["text"] for c in chunks) == text
    assert json.loads(chunks[-1]["meta_info"]["completion_tokens"]) == 6
