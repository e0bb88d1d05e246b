"""A bounded buffer between a result iterator and a gRPC stream.

The engine produces results at its own pace; a gRPC stream sends them at the client's.
One producer task pulls results into a small buffer while the call's handler sends
them. If the client stops reading, HTTP/2 flow control stalls the sends, the buffer fills,
and the call ends with RESOURCE_EXHAUSTED (its request aborted) instead of holding an
ever-growing backlog. A client that reads slowly but steadily gets results batched: the
handler takes everything buffered at once, so it can send fewer, larger messages.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncIterator, Awaitable, Callable

import grpc

from cadence.grpc.errors import RpcError


async def buffered(results: AsyncIterator, limit: int,
                   on_overflow: Callable[[RpcError], Awaitable] | None = None) -> AsyncIterator[list]:
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
                    raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"the client is not reading its stream: {limit} messages are waiting "
                                   "(--grpc-stream-buffer); the request was aborted")
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
