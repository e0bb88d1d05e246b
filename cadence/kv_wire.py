"""KV-cache events on the wire: SGLang's (and vLLM's) shapes, and the page hash chain.

Shared by the scheduler that publishes them (`cadence.mem_cache.kv_events`), the gRPC service
that streams them and the router that routes by them, none of which imports the others.

- a page's hash chains SHA-256 over the previous page's digest and this page's token ids as
  little-endian uint32; an event carries the digest's first 8 bytes as a signed int64;
- a batch is a msgpack array [ts, events, dp_rank]; each event a map tagged by "type"
  (BlockStored, BlockRemoved, AllBlocksCleared), None fields left out;
- over ZMQ, a PUB socket sends three frames per batch: topic, the sequence number (8 bytes,
  big-endian, from 0), the batch; a replay ROUTER answers a DEALER's [b"", start_seq] with
  every buffered batch from there, then [b"", b"", -1, b""].
"""

from __future__ import annotations

import hashlib
import sys
from array import array

import msgspec

MEDIUM = "GPU"  # SGLang's name for the device tier, whatever the device
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


# ---- events ---------------------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the event types (tagged "type": the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # where the pages are: the recorder says MEDIUM


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    dp_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    return _decoder.decode(data)


# ---- page hashes -----------------------------------------------------------------------------


def chain_digests(parent: bytes | None, tokens, page_size: int) -> list[bytes]:
    """SHA-256 digests of the whole pages of `tokens`, each over the previous one's digest
    (`parent` for the first; None under the root) and the page's ids as little-endian uint32."""
    ids = array("I", tokens)  # uint32 (4 bytes on every platform we run on)
    if sys.byteorder == "big":
        ids.byteswap()
    digests = []
    for start in range(0, len(ids) - page_size + 1, page_size):
        h = hashlib.sha256()
        if parent is not None:
            h.update(parent)
        h.update(ids[start : start + page_size].tobytes())
        parent = h.digest()
        digests.append(parent)
    return digests


def namespace_seed(namespace: int | None) -> bytes | None:
    """Where a namespace's chains start: None for the base model, a digest of the adapter's
    uid for a LoRA adapter's pages."""
    if namespace is None:
        return None
    return hashlib.sha256(b"cadence-kv-namespace\0" + str(namespace).encode()).digest()


def event_hash(digest: bytes | None) -> int | None:
    """A page digest as events carry it: its first 8 bytes as a signed big-endian int64."""
    return None if digest is None else int.from_bytes(digest[:8], "big", signed=True)
