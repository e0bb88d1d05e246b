"""KV-cache events: what the prefix cache stores and drops, published for routers.

A router that knows which pages each replica holds can send a request to the replica that
already has its prefix. The prefix cache records an event for every change (`KVEventRecorder`:
pages stored, pages removed, everything cleared), the scheduler publishes them after each
step (`KVEventPublisher`), and the gRPC scheduler service streams them (SubscribeKvEvents).

The shapes are SGLang's (and vLLM's), so their consumers read ours:
- a page's hash chains SHA-256 over the previous page's digest and this page's token ids as
  little-endian uint32; the event carries the digest's first 8 bytes as a signed int64.
  A LoRA adapter's pages chain from a seed of their own (its KV differs for the same tokens);
- a batch is a msgpack array [ts, events, dp_rank]; each event a map tagged by "type"
  (BlockStored, BlockRemoved, AllBlocksCleared), None fields left out;
- over ZMQ, a PUB socket sends three frames per batch: topic, the sequence number (8 bytes,
  big-endian, from 0), the batch. With a replay endpoint, a ROUTER answers a DEALER's
  [b"", start_seq] with every buffered batch from there, then [b"", b"", -1, b""].
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass

from cadence.kv_wire import (  # noqa: F401 (the wire's names, for the cache's users)
    END_OF_REPLAY,
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVCacheEvent,
    KVEventBatch,
    chain_digests,
    decode_batch,
    encode_batch,
    event_hash,
    namespace_seed,
)

logger = logging.getLogger(__name__)


class KVEventRecorder:
    """Events of the prefix cache since the last `take` (only the cache's thread records)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.events: list[Event] = []

    def stored(
        self, digests: list[bytes], parent: bytes | None, tokens, namespace: int | None
    ) -> None:
        if digests:
            self.events.append(
                BlockStored(
                    block_hashes=[event_hash(d) for d in digests],  # type: ignore[misc]
                    parent_block_hash=event_hash(parent) if parent is not None else None,
                    token_ids=list(tokens),
                    block_size=self.page_size,
                    lora_id=namespace,
                    medium=MEDIUM,
                )
            )

    def removed(self, digests: list[bytes]) -> None:
        if digests:
            hashes = [event_hash(d) for d in digests]
            self.events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM))  # type: ignore[arg-type]

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


# ---- configuration and publishing ----------------------------------------------------------


@dataclass(frozen=True)
class KVEventsConfig:
    """SGLang's --kv-events-config (a JSON object)."""

    publisher: str = "null"  # "zmq" publishes; "null" publishes nothing
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """The config, or None when nothing is published. ValueError names the field."""
        if not text:
            return None
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_events_config: not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError('kv_events_config: give a JSON object, e.g. {"publisher": "zmq"}')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known - {"bind", "format", "enable_kv_cache_events"})
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        cfg = cls(**{k: v for k, v in raw.items() if k in known})
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(
                f"kv_events_config.publisher must be zmq or null, got {cfg.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"kv_events_config.{name} must be an integer ≥ 0")
        if not isinstance(cfg.endpoint, str) or "://" not in cfg.endpoint:
            raise ValueError(
                f"kv_events_config.endpoint must be a ZMQ address, got {cfg.endpoint!r}"
            )
        return cfg if cfg.publisher == "zmq" else None

    @property
    def binds(self) -> bool:
        """Bind (a wildcard host, ipc, inproc) or connect (a named host), as SGLang decides."""
        e = self.endpoint
        return any(s in e for s in ("*", "::", "0.0.0.0")) or e.startswith(("ipc://", "inproc://"))

    @property
    def local_endpoint(self) -> str:
        """Where a subscriber on this host connects."""
        return self.endpoint.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")

    @property
    def local_replay_endpoint(self) -> str | None:
        e = self.replay_endpoint
        return None if e is None else e.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")


class KVEventPublisher:
    """A PUB socket (and a replay ROUTER served by a thread of its own) for one scheduler."""

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0):
        import zmq

        self.config = config
        self.dp_rank = dp_rank
        self.topic = config.topic.encode()
        self.seq = 0
        self._ctx = zmq.Context(1)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if config.binds else self._pub.connect)(config.endpoint)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=max(config.buffer_steps, 1)
        )
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._replay_thread = None
        if config.replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(config.replay_endpoint)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(router,), name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()

    def publish(self, events: list[Event]) -> None:
        if not events:
            return
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events, dp_rank=self.dp_rank))
        seq = self.seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart([self.topic, seq, payload], copy=False, flags=1)  # NOBLOCK
        except Exception as e:  # a full queue drops the batch; replay still has it
            logger.warning("kv events: batch %d not sent: %s", self.seq, e)
        with self._lock:
            self._buffer.append((self.seq, payload))
        self.seq += 1

    def _serve_replay(self, router) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not self._closed.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 3:
                continue
            ident, start = frames[0], int.from_bytes(frames[-1][:8], "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            for s, payload in batches:
                router.send_multipart([ident, b"", self.topic, s.to_bytes(8, "big"), payload])
            router.send_multipart([ident, b"", b"", END_OF_REPLAY, b""])
        router.close(0)

    def close(self) -> None:
        self._closed.set()
        if self._replay_thread is not None:
            self._replay_thread.join(1)
        self._pub.close(0)
        self._ctx.term()
