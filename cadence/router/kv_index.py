"""What each worker's prefix cache holds, learned from its KV-cache events.

A worker started with SGLang's --kv-events-config publishes every page its prefix cache
stores and drops (cadence.kv_wire). The router reads the config from the worker's
/server_info, subscribes to the publisher (the worker's host in place of a wildcard), and
keeps, per worker, the hashes of the pages it holds now. To route a request by them it needs
the request's token ids: the worker's own /tokenize gives them (a chat rendered with the chat
template), so that the router stays free of any tokenizer; from those, the same hash chain
names the request's pages, and the worker holding the longest run of them wins.

A gap in a worker's sequence numbers (a missed batch, a restarted worker) empties what the
router knows of it, rather than keep pages it may have dropped; a worker without events (or
whose events stop) is simply not in the index, and the policy falls back to its own tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp
import msgspec

from cadence.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, chain_digests, decode_batch
from cadence.kv_wire import event_hash as to_event_hash

logger = logging.getLogger(__name__)

RETRY_SECS = 30.0  # a worker without events is asked again this often
TOKENIZE_TIMEOUT_SECS = 2.0
MAX_ROUTING_PAGES = 512  # pages of a request hashed for routing at most


class KvEventIndex:
    """Per worker: the page hashes its prefix cache holds (see the module docstring)."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session = session
        self.blocks: dict[str, set[int]] = {}
        self.block_size: dict[str, int] = {}
        self._last_seq: dict[str, int] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    # ---- following workers ------------------------------------------------------------------

    def watch(self, worker_id: str, url: str) -> None:
        """Starts following the worker's events (once per worker)."""
        if worker_id not in self._tasks:
            self._tasks[worker_id] = asyncio.get_running_loop().create_task(
                self._follow(worker_id, url), name=f"kv-events:{worker_id}"
            )

    def forget(self, worker_id: str) -> None:
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self._drop(worker_id)

    async def close(self) -> None:
        for worker_id in list(self._tasks):
            self.forget(worker_id)
        await asyncio.sleep(0)

    async def _follow(self, worker_id: str, url: str) -> None:
        while True:
            endpoint = await self._endpoint(url)
            if endpoint is None:
                await asyncio.sleep(RETRY_SECS)
                continue
            try:
                await self._subscribe(worker_id, *endpoint)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the worker went away: try again later
                logger.info("kv events of %s: %s; retrying", url, e)
                self._drop(worker_id)
                await asyncio.sleep(1.0)

    async def _endpoint(self, url: str) -> tuple[str, str] | None:
        """(address, topic) of the worker's publisher, or None when it publishes none."""
        try:
            async with self.session.get(
                url + "/server_info", timeout=aiohttp.ClientTimeout(5)
            ) as r:
                info = await r.json(content_type=None)
        except Exception:
            return None
        text = info.get("kv_events_config") if isinstance(info, dict) else None
        try:
            config = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            return None
        if not isinstance(config, dict) or config.get("publisher") != "zmq":
            return None
        address = str(config.get("endpoint", "tcp://*:5557"))
        host = urlsplit(url).hostname or "127.0.0.1"
        for wildcard in ("*", "0.0.0.0"):
            address = address.replace(f"://{wildcard}:", f"://{host}:")
        return address, str(config.get("topic", ""))

    async def _subscribe(self, worker_id: str, address: str, topic: str) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.connect(address)
        logger.info("following the kv events of %s at %s", worker_id, address)
        try:
            while True:
                _topic, seq_bytes, payload = await sub.recv_multipart()
                self.apply(worker_id, int.from_bytes(seq_bytes, "big"), payload)
        finally:
            sub.close(0)
            ctx.term()

    # ---- the index ----------------------------------------------------------------------------

    def apply(self, worker_id: str, seq: int, payload: bytes) -> None:
        """One batch of a worker's events, with its sequence number."""
        last = self._last_seq.get(worker_id)
        if last is not None and seq != last + 1:
            self.blocks[worker_id] = set()  # missed batches: forget rather than guess
        self._last_seq[worker_id] = seq
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError:
            return
        held = self.blocks.setdefault(worker_id, set())
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.lora_id is None:  # an adapter's pages serve only that adapter
                    held.update(event.block_hashes)
                    self.block_size[worker_id] = event.block_size
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def _drop(self, worker_id: str) -> None:
        self.blocks.pop(worker_id, None)
        self.block_size.pop(worker_id, None)
        self._last_seq.pop(worker_id, None)

    def knows(self, worker_ids: Sequence[str]) -> bool:
        """Whether any of these workers' events have told us a page size (and pages)."""
        return any(w in self.block_size for w in worker_ids)

    def overlaps(self, worker_ids: Sequence[str], tokens: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading pages of `tokens` it holds."""
        out: dict[str, int] = {}
        chains: dict[int, list[int]] = {}
        for worker_id in worker_ids:
            size = self.block_size.get(worker_id)
            if size is None:
                continue
            if size not in chains:
                usable = tokens[: size * MAX_ROUTING_PAGES]
                chains[size] = [to_event_hash(d) for d in chain_digests(None, usable, size)]  # type: ignore[misc]
            held, run = self.blocks.get(worker_id, set()), 0
            for h in chains[size]:
                if h not in held:
                    break
                run += 1
            out[worker_id] = run
        return out


async def tokens_for_routing(
    session: aiohttp.ClientSession, url: str, route: str, body: bytes
) -> list[int] | None:
    """The request's prompt as the worker tokenizes it (its /tokenize), or None when the
    body has no prompt we can read or the worker does not answer in time."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    if route == "/v1/chat/completions":
        ask = {"messages": parsed.get("messages")}
    else:
        value = parsed.get("input_ids") if route == "/generate" else None
        value = (
            value if value is not None else parsed.get("text" if route == "/generate" else "prompt")
        )
        if isinstance(value, list) and value and isinstance(value[0], (list, str)):
            value = value[0]  # a batch: route on the first prompt
        if isinstance(value, list) and all(isinstance(t, int) for t in value):
            return value
        if not isinstance(value, str):
            return None
        ask = {"prompt": value}
    if not isinstance(ask.get("messages", ask.get("prompt")), (list, str)):
        return None
    with contextlib.suppress(Exception):
        timeout = aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_SECS)
        async with session.post(url + "/tokenize", json=ask, timeout=timeout) as r:
            if r.status == 200:
                tokens = (await r.json(content_type=None)).get("tokens")
                if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                    return tokens
    return None
