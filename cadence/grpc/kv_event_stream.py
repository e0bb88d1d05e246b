"""The scheduler's KV-cache events, read from its publisher and turned into SMG's protos.

A subscriber connects a SUB socket to the publisher (--kv-events-config's endpoint, on this
host). A request for an earlier sequence number is served from the publisher's replay
endpoint first (OUT_OF_RANGE when it has none, or no longer holds that batch), then from
the live stream, skipping what the replay already gave.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from cadence.grpc import smg_common_pb2 as common
from cadence.grpc.errors import RpcError
from cadence.kv_wire import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from cadence.mem_cache.kv_events import KVEventsConfig

REPLAY_TIMEOUT_MS = 5000


@contextlib.asynccontextmanager
async def kv_event_stream(config: KVEventsConfig, start: int = 0):
    """Yields an async iterator of (sequence number, batch)."""
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
    sub.connect(config.local_endpoint)
    try:
        replayed = await _replay(ctx, config, start) if start else []
        yield _batches(sub, replayed, start)
    finally:
        sub.close(0)
        ctx.term()


async def _replay(ctx, config: KVEventsConfig, start: int) -> list[tuple[int, KVEventBatch]]:
    address = config.local_replay_endpoint
    if address is None:
        raise RpcError(416, f"start_sequence_number {start}: this server keeps no replay buffer "
                       "(set replay_endpoint in --kv-events-config); subscribe from 0")  # fmt: skip
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            if not await dealer.poll(REPLAY_TIMEOUT_MS):
                raise RpcError(503, "the KV-event replay endpoint did not answer")
            frames = await dealer.recv_multipart()
            if frames[2] == END_OF_REPLAY:
                break
            out.append((int.from_bytes(frames[2], "big"), decode_batch(frames[3])))
    finally:
        dealer.close(0)
    if not out or out[0][0] != start:
        raise RpcError(416, f"start_sequence_number {start} is no longer buffered")
    return out


async def _batches(sub, replayed, start: int) -> AsyncIterator[tuple[int, KVEventBatch]]:
    last = start - 1
    for seq, batch in replayed:
        last = seq
        yield seq, batch
    while True:
        _topic, seq_bytes, payload = await sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq <= last:
            continue  # the replay gave it already
        last = seq
        yield seq, decode_batch(payload)


def kv_event_batch_proto(seq: int, batch: KVEventBatch, first_id: int) -> common.KvEventBatch:
    out = common.KvEventBatch(sequence_number=seq, timestamp=batch.ts)
    if batch.dp_rank is not None:
        out.dp_rank = batch.dp_rank
    for i, event in enumerate(batch.events):
        entry = out.events.add(event_id=first_id + i)
        if isinstance(event, BlockStored):
            size = event.block_size
            stored = entry.stored
            for k, block_hash in enumerate(event.block_hashes):
                block = stored.blocks.add(
                    block_hash=block_hash,
                    token_ids=event.token_ids[k * size : (k + 1) * size],
                    block_size=size,
                )
                if event.lora_id is not None:
                    block.lora_id = event.lora_id
            if event.parent_block_hash is not None:
                stored.parent_block_hash = event.parent_block_hash
            stored.medium = event.medium or ""
            stored.tier = common.KvCacheTier.Value("KV_CACHE_TIER_DEVICE")
        elif isinstance(event, BlockRemoved):
            entry.removed.block_hashes.extend(event.block_hashes)
            entry.removed.medium = event.medium or ""
            entry.removed.tier = common.KvCacheTier.Value("KV_CACHE_TIER_DEVICE")
        elif isinstance(event, AllBlocksCleared):
            entry.cleared.SetInParent()
    return out
