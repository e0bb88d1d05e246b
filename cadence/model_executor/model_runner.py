"""Owns the model and its KV memory, and turns scheduled requests into forward passes."""

from __future__ import annotations

import logging
import math

import torch

from cadence.layers.forward_batch import ForwardBatch
from cadence.mem_cache.kv_pool import KVPool, ReqToTokenPool
from cadence.model_loader.loader import load_model
from cadence.platforms import get_current_platform
from cadence.scheduler.req import Req
from cadence.server_args import ServerArgs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str):
        self.args = args
        # Every device decision (device, dtypes, kernels, memory) is the platform's.
        self.platform = get_current_platform()
        self.platform.init_backend()
        self.device = self.platform.device
        self.dtype = self.platform.resolve_dtype(args.dtype)
        self.kv_dtype = self.platform.resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.config, self.model = load_model(model_path, self.dtype, self.device)
        cfg = self.config
        self.context_len = args.context_length or cfg.max_position_embeddings
        if self.context_len > cfg.max_position_embeddings:
            logger.warning("context_length %d exceeds the model's %d", self.context_len, cfg.max_position_embeddings)
        self.page_size = args.page_size
        self.max_total_tokens = self._kv_budget_tokens()
        num_pages = self.max_total_tokens // self.page_size
        self.kv_pool = self.platform.make_kv_pool(num_pages, self.page_size, cfg.num_hidden_layers,
                                                  cfg.num_key_value_heads, cfg.head_dim, self.kv_dtype)
        self.allocator = self.platform.make_allocator(num_pages)
        self.req_to_token = ReqToTokenPool(args.max_running_requests + 1, self.context_len + 1, self.device)
        self.attn = self.platform.make_attention_backend(self.kv_pool, cfg.num_attention_heads,
                                                         cfg.num_key_value_heads, cfg.head_dim)
        self.model.setup(self.attn, self.context_len + 1, self.platform.make_linear, self.platform.make_layer_ops())
        self.platform.weights_loaded()
        self._fresh_pages: list[int] = []  # allocated since the last forward, not yet zeroed
        self._last_decode: tuple[list[Req], list[int]] = ([], [])  # requests and lengths of the last decode step
        logger.info("KV pool: %d tokens in %d pages of %d", num_pages * self.page_size, num_pages, self.page_size)

    SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "attention_bias", "tie_word_embeddings")

    def adopt_weights(self, config, model) -> None:
        """Serve the weights of `model`, freshly loaded in this runner's dtype and device. Its
        tensors are taken over, not copied; the projections are rebuilt from them. Raises
        ValueError, changing nothing, when the architecture differs."""
        diff = [f for f in self.SHAPE_FIELDS if getattr(config, f) != getattr(self.config, f)]
        if diff:
            raise ValueError(f"the new weights have a different architecture ({', '.join(diff)}); "
                             "restart the server instead")
        with torch.no_grad():
            for dst, src in zip(self.model.parameters(), model.parameters(), strict=True):
                dst.data = src.data
        self.model.build_linears(self.platform.make_linear)
        self.platform.weights_loaded()

    def _kv_budget_tokens(self) -> int:
        if self.args.max_total_tokens is not None:
            return self.args.max_total_tokens // self.page_size * self.page_size
        c = self.config
        per_token = KVPool.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.kv_dtype)
        tokens = int(self.platform.available_memory_bytes() * self.args.kv_cache_memory_fraction) // per_token
        return max(tokens // self.page_size, 1) * self.page_size

    # ---- KV slots ----------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def assign_slots(self, req: Req, start: int, end: int) -> torch.Tensor:
        """Give positions [start, end) of `req` KV slots (allocating pages from its reservation)."""
        missing = self.pages_for(end) - len(req.pages)
        if missing > 0:
            pages = self.allocator.alloc(missing)
            if pages is None:  # admission reserved these pages, so this is a bookkeeping bug
                raise RuntimeError(f"KV pool exhausted while extending reserved request {req.rid}")
            req.pages.extend(pages)
            self._fresh_pages.extend(pages)
        pos = torch.arange(start, end)
        page_t = torch.tensor(req.pages, dtype=torch.int64)
        slots = page_t[pos // self.page_size] * self.page_size + pos % self.page_size
        self.req_to_token.table[req.row, start:end] = slots
        return slots

    # ---- forward -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward_extend(self, reqs: list[Req], chunk_lens: list[int], logit_rows: list[list[int]]):
        """Prefill `chunk_lens[i]` tokens of each request after its computed prefix.

        `logit_rows[i]` are offsets within request i's chunk whose logits are wanted.
        Returns logits [sum(len(rows)), vocab] float32, rows in request order.
        """
        ids, positions, locs, seq_pages, prefix_lens, seq_lens, logits_idx = [], [], [], [], [], [], []
        offset = 0
        for req, n, rows in zip(reqs, chunk_lens, logit_rows):
            start = req.num_computed
            fill = req.fill_ids
            ids.extend(fill[start : start + n])
            positions.append(torch.arange(start, start + n))
            locs.append(self.assign_slots(req, start, start + n))
            if start:
                pages = torch.tensor(req.pages[: self.pages_for(start + n)], dtype=torch.int64, device=self.device)
                seq_pages.append(self.kv_pool.page_rows(pages))
            else:
                seq_pages.append(None)  # no prefix: attention reads the new K/V directly
            prefix_lens.append(start)
            seq_lens.append(start + n)
            logits_idx.extend(offset + r for r in rows)
            offset += n
        dev = self.device
        out_loc = torch.cat(locs).to(dev)
        batch = ForwardBatch(
            is_decode=False,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.cat(positions).to(dev),
            out_cache_loc=out_loc,
            kv_write_rows=self.kv_pool.write_rows(out_loc),
            seq_lens=seq_lens,
            extend_lens=list(chunk_lens),
            prefix_lens=prefix_lens,
            seq_page_rows=seq_pages,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
        )
        self._zero_fresh_pages()
        hidden = self.model(batch)
        return self._to_host(self.model.compute_logits(hidden)) if logits_idx else None

    @torch.inference_mode()
    def forward_decode(self, reqs: list[Req]) -> torch.Tensor:
        """One new token per request (its last output token). Returns logits [batch, vocab]."""
        seq_lens = [r.seq_len for r in reqs]
        last_reqs, last_lens = self._last_decode
        continues = (len(reqs) == len(last_reqs) and all(a is b for a, b in zip(reqs, last_reqs))
                     and all(n == m + 1 for n, m in zip(seq_lens, last_lens)))
        self._last_decode = (list(reqs), seq_lens)
        locs = []
        for req, n in zip(reqs, seq_lens):
            if self.pages_for(n) > len(req.pages):
                self.assign_slots(req, n - 1, n)
            page = req.pages[(n - 1) // self.page_size]
            locs.append(page * self.page_size + (n - 1) % self.page_size)
        dev = self.device
        lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        out_loc = torch.tensor(locs, dtype=torch.int64, device=dev)
        self.req_to_token.table[torch.tensor([r.row for r in reqs], device=dev), lens_t - 1] = out_loc
        max_pages = self.pages_for(max(seq_lens))
        # Rows shorter than the longest repeat their first page as padding (masked out below).
        table = [r.pages[: self.pages_for(n)] for r, n in zip(reqs, seq_lens)]
        page_table = torch.tensor([p + [p[0]] * (max_pages - len(p)) for p in table], dtype=torch.int64, device=dev)
        width = max_pages * self.page_size
        kv_mask = page_rows = None
        if self.attn.decode_reads_whole_pages:
            page_rows = self.kv_pool.page_rows(page_table)
            if min(seq_lens) != width:
                # True past each row's length, broadcast over [KVH, B, G, width] scores.
                kv_mask = (torch.arange(width, device=dev).unsqueeze(0) >= lens_t.unsqueeze(1)).view(1, len(reqs), 1, -1)
        batch = ForwardBatch(
            is_decode=True,
            input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=dev),
            positions=lens_t - 1,
            out_cache_loc=out_loc,
            kv_write_rows=self.kv_pool.write_rows(out_loc),
            seq_lens=seq_lens,
            extend_lens=[1] * len(reqs),
            prefix_lens=[n - 1 for n in seq_lens],
            page_table=page_table,
            kv_lens=lens_t,
            page_rows=page_rows,
            kv_mask=kv_mask,
            decode_continues=continues,
        )
        self._zero_fresh_pages()
        return self._to_host(self.model.compute_logits(self.model(batch)))

    def release_decode_state(self) -> None:
        """The running batch has emptied: forget it, and let the attention backend drop what it
        kept for it (copies of its K/V)."""
        if self._last_decode[0]:
            self._last_decode = ([], [])
            self.attn.release_decode_state()

    def _zero_fresh_pages(self) -> None:
        """Zero the pages handed out for this step, where the attention backend's decode reads
        whole pages (`AttentionBackend.decode_reads_whole_pages`): a masked slot still
        multiplies its V by 0, and stale memory there could hold NaN (0 * NaN = NaN). The pool
        itself is never zeroed up front, so untouched pages cost no memory."""
        if self._fresh_pages and self.attn.decode_reads_whole_pages:
            pages = torch.tensor(self._fresh_pages, dtype=torch.int64, device=self.device)
            for buf in self.kv_pool.kv_buffer:
                buf.index_fill_(2, pages, 0)
        self._fresh_pages.clear()

    @staticmethod
    def _to_host(logits: torch.Tensor) -> torch.Tensor:
        # The sampler runs on the host (see Platform); on the CPU platform this is a no-op.
        return logits.cpu()
