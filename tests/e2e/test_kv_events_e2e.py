"""KV-cache events of a launched server (`smg_server` runs with --kv-events-config): what a
request leaves in the prefix cache arrives as BlockStored with SGLang's page hashes and the
page's token ids, a flush as BlockRemoved and AllBlocksCleared, over the ZMQ publisher, its
replay endpoint, and the gRPC scheduler service's SubscribeKvEvents stream alike."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import grpc
import pytest
import zmq
from conftest import KV_EVENTS_CONFIG
from e2e_server import is_idle
from grpc_support import target

from cadence.grpc import sglang_scheduler_pb2_grpc
from cadence.grpc import smg_common_pb2 as common
from cadence.mem_cache.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = json.loads(KV_EVENTS_CONFIG)
PAGE = 16  # the server's --page-size (the default)
PROMPT = "Tell me a long story about a lighthouse keeper who " * 4


def sha_chain(tokens: list[int]) -> list[int]:
    out, prev = [], b""
    for i in range(0, len(tokens) - PAGE + 1, PAGE):
        data = prev + b"".join(t.to_bytes(4, "little") for t in tokens[i : i + PAGE])
        prev = hashlib.sha256(data).digest()
        out.append(int.from_bytes(prev[:8], "big", signed=True))
    return out


class Subscriber:
    """A ZMQ SUB on the server's publisher, collecting (seq, event) in a thread."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, CONFIG["topic"].encode())
        self.sub.connect(CONFIG["endpoint"])
        self.events: list[tuple[int, object]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            if self.sub.poll(50):
                _topic, seq, payload = self.sub.recv_multipart()
                for event in decode_batch(payload).events:
                    self.events.append((int.from_bytes(seq, "big"), event))

    def wait_for(self, predicate, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for _, e in self.events if predicate(e)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no such event; got {[type(e).__name__ for _, e in self.events]}")

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sub.close(0)
        self.ctx.term()


@pytest.fixture
def http(smg_server):
    with smg_server.client() as c:
        yield c
    assert is_idle(smg_server.wait_idle())


def test_a_requests_pages_are_stored_then_removed_by_a_flush(smg_server, http):
    sub = Subscriber()
    stream_events: list = []
    channel = grpc.insecure_channel(target(smg_server))
    rpc = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    call = rpc.SubscribeKvEvents(common.SubscribeKvEventsRequest())

    def read_stream():
        try:
            for batch in call:
                stream_events.append(batch)
        except grpc.RpcError:
            pass  # cancelled at the end

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    try:
        time.sleep(0.5)  # both subscriptions are live before the request
        assert http.post("/flush_cache").status_code == 200
        ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        out = http.post("/generate", json=body).json()
        tokens = ids + out["output_ids"]
        want = sha_chain(tokens[: len(tokens) - 1])  # the last token's K/V is never computed
        stored = sub.wait_for(lambda e: isinstance(e, BlockStored) and want[0] in e.block_hashes)
        first = stored[0]
        assert first.parent_block_hash is None and first.block_size == PAGE
        assert first.token_ids == tokens[: len(first.token_ids)]
        # The first flush's clear is already in the list: wait for one after the stores.
        # Later pages may still be on their way now; every store is published before
        # the second flush's clear, so the stored hashes are read once that has come.
        cleared_before = sum(isinstance(e, AllBlocksCleared) for _, e in sub.events)
        assert http.post("/flush_cache").status_code == 200
        deadline = time.monotonic() + 20
        while sum(isinstance(e, AllBlocksCleared) for _, e in sub.events) == cleared_before:
            assert time.monotonic() < deadline, "the second flush published no clear"
            time.sleep(0.05)
        got_hashes = [
            h for e in sub.events if isinstance(e[1], BlockStored) for h in e[1].block_hashes
        ]
        assert want[: len(ids) // PAGE] == [h for h in got_hashes if h in want][: len(ids) // PAGE]
        removed = {h for _, e in sub.events if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert set(got_hashes) <= removed
        # The gRPC stream carried the same: the stored blocks with their token ids, the clear.
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and sum(ev.HasField("cleared") for b in stream_events for ev in b.events) < 2
        ):  # the first flush's and the second's
            time.sleep(0.05)
        blocks = [blk for b in stream_events for ev in b.events if ev.HasField("stored")
                  for blk in ev.stored.blocks]  # fmt: skip
        assert [blk.block_hash for blk in blocks if blk.block_hash in want] == [
            h for h in got_hashes if h in want
        ]
        assert list(blocks[0].token_ids) == tokens[:PAGE]
        assert sum(ev.HasField("cleared") for b in stream_events for ev in b.events) >= 2
        seqs = [b.sequence_number for b in stream_events]
        assert seqs == sorted(seqs)
    finally:
        call.cancel()
        reader.join(5)
        channel.close()
        sub.close()


def test_replay_gives_buffered_batches_from_a_sequence_number(smg_server, http):
    assert http.post("/flush_cache").status_code == 200
    http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4}})
    assert http.post("/flush_cache").status_code == 200
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(CONFIG["replay_endpoint"])
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs, kinds = [], set()
        while True:
            assert dealer.poll(5000), "the replay endpoint did not answer"
            frames = dealer.recv_multipart()
            if frames[2] == END_OF_REPLAY:
                break
            assert frames[1] == CONFIG["topic"].encode()
            seqs.append(int.from_bytes(frames[2], "big"))
            kinds |= {type(e).__name__ for e in decode_batch(frames[3]).events}
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs
        assert {"BlockStored", "AllBlocksCleared"} <= kinds
        # gRPC from a buffered sequence number: the same batches, from there on.
        with grpc.insecure_channel(target(smg_server)) as channel:
            rpc = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
            call = rpc.SubscribeKvEvents(
                common.SubscribeKvEventsRequest(start_sequence_number=seqs[-1])
            )
            first = next(iter(call))
            call.cancel()
        assert first.sequence_number == seqs[-1]
    finally:
        dealer.close(0)
        ctx.term()
