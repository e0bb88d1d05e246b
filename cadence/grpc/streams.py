"""Bounds on what a gRPC stream may hold back while its client does not read.

The engine produces results at its own pace; a gRPC stream sends them at the client's.
If the client stops reading, HTTP/2 flow control stalls the sends and results pile up in
the front process. Two guards end such a call with RESOURCE_EXHAUSTED (its request
aborted) instead of holding an ever-growing backlog:

- `BacklogWatch` (native generate streams): one task for all streams compares, a few
  times a second, what each request has produced with what its call has sent. It costs
  nothing per message, which matters on the hottest path of the server.
- `buffered` (OpenAI pass-through streams, whose requests the adapter cannot see): a
  producer task pulls results into a bounded buffer while the handler sends them; a
  reader that is slow but steady gets everything buffered at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from cadence.grpc.errors import RpcError

logger = logging.getLogger(__name__)


async def buffered(
    results: AsyncIterator, limit: int, on_overflow: Callable[[RpcError], Awaitable] | None = None
) -> AsyncIterator[list]:
    """Yields lists of the items of `results` buffered since the previous yield, in order.

    When `limit` items wait unsent, `results` is closed (aborting its request) and
    `on_overflow(error)` runs in the producer: the reader is most likely stuck in a send
    that only ending the call can undo (the servicer passes `context.abort`). The reader
    gets that `RpcError(RESOURCE_EXHAUSTED)` if it comes back, and whatever `results`
    raises. Leaving early (or being cancelled) closes `results` too.
    """
    pending: deque = deque()
    wake = asyncio.Event()
    done = False
    error: BaseException | None = None

    async def produce():
        nonlocal done, error
        try:
            async for item in results:
                if len(pending) >= limit:
                    raise RpcError(
                        429,
                        f"the client is not reading its stream: {limit} messages are waiting "
                        "(--grpc-stream-buffer); the request was aborted",
                    )
                pending.append(item)
                wake.set()
        except Exception as e:
            error = e
        finally:
            done = True
            wake.set()
            await results.aclose()
        if isinstance(error, RpcError) and on_overflow is not None:
            try:
                await on_overflow(error)
            except Exception:  # context.abort raises by design
                pass

    task = asyncio.create_task(produce())
    try:
        while True:
            if error is not None:
                raise error
            if pending:
                items = list(pending)
                pending.clear()
                yield items
                continue
            if done:
                return
            wake.clear()
            await wake.wait()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class BacklogWatch:
    """Ends the streams whose backlog (results produced but not sent) exceeds `limit`.

    `watch(backlog, on_overflow)` registers a stream: `backlog()` says how much it holds
    back now, `on_overflow(error)` ends its call (the servicer passes `context.abort`, which
    also undoes a send stalled on flow control). One task checks every `interval` seconds
    while any stream is watched; a stream is checked until `unwatch`, or once overflowed.
    """

    def __init__(self, limit: int, interval: float = 0.25, what: str = "tokens"):
        self.limit = limit
        self.interval = interval
        self.what = what
        self._watched: dict[int, tuple[Callable[[], int], Callable[[RpcError], Awaitable]]] = {}
        self._next_key = 0
        self._task: asyncio.Task | None = None

    def watch(
        self, backlog: Callable[[], int], on_overflow: Callable[[RpcError], Awaitable]
    ) -> int:
        key = self._next_key
        self._next_key += 1
        self._watched[key] = (backlog, on_overflow)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return key

    def unwatch(self, key: int) -> None:
        self._watched.pop(key, None)

    def __len__(self) -> int:
        return len(self._watched)

    async def _run(self) -> None:
        try:
            while self._watched:
                await asyncio.sleep(self.interval)
                for key, (backlog, on_overflow) in list(self._watched.items()):
                    held = backlog()
                    if held > self.limit:
                        self._watched.pop(key, None)
                        error = RpcError(
                            429,
                            f"the client is not reading its stream: {held} {self.what} are waiting "
                            f"(--grpc-stream-buffer {self.limit}); the request was aborted",
                        )
                        asyncio.ensure_future(_end(on_overflow, error))
        finally:
            self._task = None


async def _end(on_overflow: Callable[[RpcError], Awaitable], error: RpcError) -> None:
    try:
        await on_overflow(error)
    except grpc.aio.AbortError:
        pass  # context.abort raises by design
    except Exception:
        logger.exception("ending a stalled gRPC stream failed")
