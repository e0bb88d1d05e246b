"""Decode steps replayed from CUDA graphs: the CUDA platform's graph runner.

A decode step of the Triton layers (`cadence.layers.triton_layers`) is a fixed sequence of
~300 launches whose shapes depend only on the batch size. Launched one by one from Python,
each costs the host several microseconds and the GPU waits between them; captured once per
batch-size bucket and replayed, the step is one launch. The inputs live in static buffers
the graphs were captured on: each step writes its token ids, positions, KV slots and page
table into them (built on the host, one copy each), replays the smallest bucket that
holds the batch, and reads the logits of its rows. Rows past the batch's size (the
bucket's padding) attend to nothing of anyone's: they write their K/V into a scratch page
of the pool that no request ever owns (`KVPool.scratch_page`).

Attention metadata is prepared outside the graph (the page table); what the kernels derive
from it (each row's keys, the loop bounds) is computed on the device, so the same graph
serves every length up to the context.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from cadence.layers.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# Batch sizes captured (those up to --cuda-graph-max-bs, and that size itself): dense where
# decode batches usually are, sparser past them. A batch is padded to the next one.
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def buckets_up_to(max_bs: int) -> list[int]:
    return [b for b in BUCKETS if b < max_bs] + [max_bs]


class DecodeGraphs:
    """One CUDA graph per batch-size bucket, of the model's decode forward and its logits.

    Invariants: the graphs read only the static buffers below and the model's and pool's
    tensors, which stay where they are (a weight update recaptures: `capture`). A decode
    or verify step runs from a graph when its rows (a token each) number at most
    `max_batch_size`; anything else runs eagerly."""

    WARMUPS = 2  # eager forwards of each bucket before its capture

    def __init__(
        self,
        model,
        kv_pool,
        context_len: int,
        max_batch_size: int,
        device,
        future_ids: torch.Tensor | None = None,
    ):
        self.model = model
        self.page_size = kv_pool.page_size
        self.scratch_page = kv_pool.scratch_page
        self.max_batch_size = max_batch_size
        self.buckets = buckets_up_to(max_batch_size)
        self.device = device
        self.max_pages = -(-(context_len + 1) // self.page_size)
        rows = max_batch_size
        # The ids the previous launch sampled (overlap scheduling): a row whose source (input
        # row 3) is >= 0 takes its input token from there, inside the graph.
        self.future_ids = (
            torch.zeros(rows, dtype=torch.int64, device=device)
            if future_ids is None
            else future_ids
        )
        # [ids, positions, slots, sources] and the page table, filled on the host and copied
        # in each step, asynchronously (pinned): two sets, since with overlap scheduling the
        # next step is filled while the copies of the one before may still be queued.
        pinned = torch.cuda.is_available()
        self._hosts = [
            (
                torch.zeros((4, rows), dtype=torch.int64, pin_memory=pinned),
                torch.zeros((rows, self.max_pages), dtype=torch.int64, pin_memory=pinned),
            )
            for _ in "ab"
        ]
        self._flip = 0
        self._inputs = torch.zeros((4, rows), dtype=torch.int64, device=device)
        self._table = torch.full(
            (rows, self.max_pages), self.scratch_page, dtype=torch.int64, device=device
        )
        self._graphs: dict[int, Callable[[], None]] = {}  # bucket -> replay
        self._logits: dict[int, torch.Tensor] = {}
        self._pool = None

    def _batch(self, bs: int) -> ForwardBatch:
        ids, positions, slots = self._inputs[0, :bs], self._inputs[1, :bs], self._inputs[2, :bs]
        return ForwardBatch(
            is_decode=True,
            input_ids=ids,  # replaced in _forward by the ids with the sources resolved
            positions=positions,
            out_cache_loc=slots,
            kv_write_rows=slots,  # unused: the Triton backend stores K/V in its rotary kernel
            seq_lens=[1] * bs,
            extend_lens=[1] * bs,
            prefix_lens=[0] * bs,
            page_table=self._table[:bs],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, sharing one memory pool (smaller graphs
        reuse the larger ones' intermediate memory)."""
        started = time.perf_counter()
        self._graphs.clear()
        self._logits.clear()
        host, _ = self._hosts[0]
        self._fill_padding(host, self._hosts[0][1], 0, self.max_batch_size)
        self._inputs.copy_(host)
        with self._capture_stream() as stream:
            for bs in reversed(self.buckets):
                batch = self._batch(bs)
                for _ in range(self.WARMUPS):  # compiles the kernels, settles the allocator
                    self._forward(batch)
                self._graphs[bs], self._logits[bs] = self._capture_one(batch, stream)
        logger.info(
            "CUDA graphs captured for decode batches of %s in %.1f s",
            ", ".join(map(str, self.buckets)),
            time.perf_counter() - started,
        )

    @contextlib.contextmanager
    def _capture_stream(self):
        """Capture runs on a side stream, joined with the current one before and after."""
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield stream
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _capture_one(self, batch: ForwardBatch, stream) -> tuple[Callable[[], None], torch.Tensor]:
        """One bucket's graph: (replay, the logits tensor it writes)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            logits = self._forward(batch)
        return graph.replay, logits

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        src = self._inputs[3, :bs]
        batch.input_ids = torch.where(
            src >= 0, self.future_ids[src.clamp(min=0)], self._inputs[0, :bs]
        )
        return self.model.compute_logits(self.model(batch))

    def _fill_padding(self, host, table, start: int, end: int) -> None:
        """Rows [start, end) of host buffers as padding: token 0 at position 0, stored into
        and attending to the scratch page only."""
        host[:3, start:end] = 0
        host[2, start:end] = self.scratch_page * self.page_size
        host[3, start:end] = -1
        table[start:end, 0] = self.scratch_page

    def can_run(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_batch_size and bool(self._graphs)

    def run(self, items) -> torch.Tensor:
        """Logits [rows, vocab] float32 (on the device) of one decode step of `items`, item by
        item: one row per token. An item of a verify step (its last token and its drafted
        ones) takes a row per token, each with the item's pages up to its own position: the
        graph's attention bounds every row by its position, and the rotary kernel stores
        the K/V of every row before any row attends, so a draft token sees the ones before
        it as the eager verify step does."""
        n = sum(len(item.token_ids) for item in items)
        bs = next(b for b in self.buckets if b >= n)
        host_t, table_t = self._hosts[self._flip]
        self._flip ^= 1
        ps, host, table = self.page_size, host_t.numpy(), table_t.numpy()
        row = 0
        for item in items:
            pages, source = item.pages, -1 if item.future_row is None else item.future_row
            for k, token in enumerate(item.token_ids):
                pos = item.start + k
                used = pos // ps + 1
                host[0, row] = token
                host[1, row] = pos
                host[2, row] = pages[pos // ps] * ps + pos % ps
                host[3, row] = source if k == 0 else -1  # overlap: one token items
                table[row, :used] = pages[:used]
                row += 1
        if n < bs:
            self._fill_padding(host, table, n, bs)
        # Whole rows (contiguous, so truly asynchronous); columns past a row's pages are
        # never read.
        self._inputs.copy_(host_t, non_blocking=True)
        self._table[:bs].copy_(table_t[:bs], non_blocking=True)
        self._graphs[bs]()
        return self._logits[bs][:n]
