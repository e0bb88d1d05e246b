"""Owns the model and its KV memory, and runs the batches the scheduler hands it: forward,
then sampling and logprobs."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from cadence.layers.forward_batch import ForwardBatch
from cadence.layers.lora import LoraBatch
from cadence.layers.pooler import PoolingConfig, pool
from cadence.layers.sampler import (
    sample_on_device,
    samples_on_device,
)
from cadence.mem_cache.allocator import KVAllocator
from cadence.mem_cache.kv_pool import KVPool
from cadence.model_executor.lora_manager import LoraManager
from cadence.model_executor.runner import (
    BatchItem,
    EmbedItem,
    ItemResult,
    Launched,
    Runner,
    ScheduleBatch,
)
from cadence.model_executor.step_memory import commit_step_memory
from cadence.model_executor.step_results import results_of
from cadence.model_loader.encoder_loader import read_pooling
from cadence.model_loader.loader import load_model
from cadence.platforms import get_current_platform
from cadence.server_args import ServerArgs

logger = logging.getLogger(__name__)


class ModelRunner(Runner):
    """The model on this process. With tensor or pipeline parallelism (`groups`), this rank's
    share of it: every rank runs the same steps, in the same order (the leader's, rank 0's,
    whose scheduler decides them: `model_executor/parallel.py`), and only the leader samples."""

    def __init__(self, args: ServerArgs, model_path: str, groups: Any = None):
        self.args = args
        self.groups = groups  # cadence.distributed.group.RankGroups, with tp or pp > 1
        self.samples = groups is None or groups.is_leader
        # --mem-fraction-static shares out the memory available before the weights load.
        self._available_at_start = (
            None
            if args.mem_fraction_static is None
            else get_current_platform().available_memory_bytes()
        )
        self._load(args, model_path)
        num_pages = self._make_kv_memory(args)
        self._set_up_model(args)
        self._init_decode_state(args)
        self.lora = self._init_lora(args)
        self._weights_loaded()
        if args.random_seed is not None:
            self.platform.seed(args.random_seed)
        committed = "committed" if self.is_kv_pool_committed else "lazy: committed as first written"
        logger.info("KV pool: %d tokens in %d pages of %d, %.1f MiB (%s)",
                    num_pages * self.page_size, num_pages, self.page_size,
                    self.kv_pool_bytes / 2**20, committed)  # fmt: skip

    def _load(self, args: ServerArgs, model_path: str) -> None:
        """The platform's device and dtypes, the model's weights and what the config says of
        serving it."""
        # Every device decision (device, dtypes, kernels, memory) is the platform's.
        self.platform = get_current_platform()
        self.platform.init_backend()
        self.device = self.platform.device
        self.dtype = self.platform.resolve_dtype(args.dtype)
        self.kv_dtype = self.platform.resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.platform.weights_loading()  # until _weights_loaded: the KV pool and packing too
        self.config, self.model = load_model(
            model_path,
            self.dtype,
            self.device,
            quantization=args.quantization,
            dequantize=args.dequantize,
            shard=None if self.groups is None else self.groups.shard,
        )
        cfg = self.config
        # --is-embedding: served as an embedding model (`embed`); generation is refused.
        self.is_generation = not args.is_embedding
        self.embed_needs_kv = True
        self.pooling = read_pooling(model_path, PoolingConfig("last", normalize=True))
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.context_len = args.context_length or cfg.max_position_embeddings
        if self.context_len > cfg.max_position_embeddings:
            logger.warning(
                "context_length %d exceeds the model's %d",
                self.context_len,
                cfg.max_position_embeddings,
            )

    def _make_kv_memory(self, args: ServerArgs) -> int:
        """The KV pool (committed unless --lazy-kv-pool), the page allocator the scheduler
        borrows, and the attention backend over the pool; returns the number of pages."""
        cfg, dims = self.config, self.model.dims  # this rank's heads (all of them on one rank)
        self.page_size = args.page_size
        self.max_total_tokens = self._kv_budget_tokens()
        num_pages = self.max_total_tokens // self.page_size
        self.kv_pool = self.platform.make_kv_pool(
            num_pages,
            self.page_size,
            len(self.model.layers),
            dims.num_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
        )
        if not args.lazy_kv_pool:
            self.kv_pool.commit()
        self.kv_pool_bytes = self.kv_pool.num_bytes
        self.is_kv_pool_committed = self.kv_pool.is_committed
        # The scheduler borrows this; the runner only reads the page lists it is handed.
        self.kv_allocator: KVAllocator = self.platform.make_allocator(num_pages, self.page_size)
        self.attn = self.platform.make_attention_backend(
            self.kv_pool, dims.num_heads, dims.num_kv_heads, cfg.head_dim
        )
        return num_pages

    def _set_up_model(self, args: ServerArgs) -> None:
        """The model's layers over the attention backend, the platform's linear layers and
        ops, and (with ranks) the shared memory of their collectives."""
        groups, cfg = self.groups, self.config
        if groups is not None:  # decode steps' all-reduces and logits through shared memory
            vocab_share = self.model.shard.vocab_rows(cfg.vocab_size)  # a gather's slot
            rows = min(args.max_running_requests, 64)
            groups.use_shm(max(512 * cfg.hidden_size, rows * vocab_share))
        self.model.setup(
            self.attn,
            self.context_len + 1,
            self.platform.make_linear,
            self.platform.make_layer_ops(),
            comm=groups,
        )

    def _init_decode_state(self, args: ServerArgs) -> None:
        """What decode steps keep between launches: the last step's rows, the sampled ids on
        the device, overlap scheduling, captured graphs."""
        # uids and lengths of the last decode step
        self._last_decode: tuple[list[int], list[int]] = ([], [])
        # Overlap scheduling: the ids each launched decode sampled stay on the device here,
        # where the next launch reads its items' input tokens (BatchItem.future_row); the host
        # gets them through one of two pinned buffers (one per step in flight).
        rows = args.max_running_requests
        self.future_ids = torch.zeros(rows, dtype=torch.int64, device=self.device)
        pinned = self.platform.is_pin_memory_available()
        self._ids_host = [torch.zeros(rows, dtype=torch.int64, pin_memory=pinned) for _ in "ab"]
        self._flip = 0
        # Ranks follow the leader step by step: no step is launched ahead of its results.
        self._overlaps = (
            not args.disable_overlap_schedule and self.groups is None and _has_events(self.device)
        )
        # Decode replayed from captured graphs where the platform has them (captured, and
        # recaptured after a weight update, in _weights_loaded).
        self.graphs = None
        if self.is_generation and self.groups is None and self.platform.support_cuda_graph():
            self.graphs = None if args.disable_cuda_graph else self.platform.make_graph_runner(self)

    def _init_lora(self, args: ServerArgs) -> LoraManager | None:
        if not args.enable_lora:
            return None
        if not self.is_generation or self.config.architecture != "llama":
            raise ValueError(
                "enable_lora: LoRA adapters are served on generation models of the llama "
                f"family; this one is {self.config.architecture!r}"
                + ("" if self.is_generation else " served for embeddings")
            )
        return LoraManager(args, self.config, self.dtype, self.device)

    SHAPE_FIELDS = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "attention_bias",
        "tie_word_embeddings",
    )

    def load_weights(self, model_path: str, load_format: str | None) -> str:
        from cadence.model_loader.locate import check_load_format, resolve_model_path

        path = resolve_model_path(model_path)
        check_load_format(path, load_format)
        self.platform.weights_loading()
        try:
            config, model = load_model(
                path,
                self.dtype,
                self.device,
                progress=False,
                quantization=self.args.quantization,
                dequantize=self.args.dequantize,
            )
            self.adopt_weights(config, model)  # on success, ends in weights_loaded
        except BaseException:
            self.platform.weights_loaded()  # the old weights serve on, as before the load
            raise
        del model  # its tensors now belong to this runner; anything left over goes back
        self.platform.empty_cache()
        return path

    def adopt_weights(self, config, model) -> None:
        """Serve the weights of `model`, freshly loaded in this runner's dtype and device. Its
        tensors are taken over, not copied; the projections are rebuilt from them. Raises
        ValueError, changing nothing, when the architecture differs."""
        diff = [f for f in self.SHAPE_FIELDS if getattr(config, f) != getattr(self.config, f)]
        if diff:
            raise ValueError(
                f"the new weights have a different architecture ({', '.join(diff)}); "
                "restart the server instead"
            )
        with torch.no_grad():
            for dst, src in zip(self.model.parameters(), model.parameters(), strict=True):
                dst.data = src.data
        self.model.build_linears(self.platform.make_linear)
        self._weights_loaded()

    def _weights_loaded(self) -> None:
        self.platform.weights_loaded()
        if not self.args.lazy_kv_pool and not self.args.skip_warmup:
            commit_step_memory(self)  # after settling, which returns what a step left
        if self.graphs is not None:
            try:
                self.graphs.capture()  # after the step memory: the graphs' pool comes on top
            except Exception as e:  # as SGLang: fail the start, saying what to change
                raise RuntimeError(
                    f"capturing the decode graphs failed ({type(e).__name__}: {e}); start with "
                    "--disable-cuda-graph, or a smaller --cuda-graph-max-bs"
                ) from e

    def make_generator(self, seed: int):
        return self.platform.make_generator(seed)

    def skip_draws(self, generator, num_tokens: int) -> None:
        from cadence.layers.sampler import skip_draws

        skip_draws(generator, num_tokens)

    def profiler_activities(self) -> list:
        return self.platform.profiler_activities()

    def _kv_budget_tokens(self) -> int:
        cap = self.args.max_total_tokens
        if cap is not None and self.args.mem_fraction_static is None:
            return cap // self.page_size * self.page_size
        per_token = KVPool.bytes_per_token(
            len(self.model.layers),
            self.model.dims.num_kv_heads,
            self.config.head_dim,
            self.kv_dtype,
        )
        tokens = self._kv_budget_bytes() // per_token
        if cap is not None:
            tokens = min(tokens, cap)
        if self.groups is not None:  # one page numbering for all: what every rank can hold
            tokens = self.groups.min_over_ranks(tokens)
        return max(tokens // self.page_size, 1) * self.page_size

    def _kv_budget_bytes(self) -> int:
        """The KV pool's share of the device's memory. --mem-fraction-static (SGLang's rule):
        the weights and the pool together take that share of what was available before the
        weights loaded, so the pool gets what is available now less the rest of it."""
        available = self.platform.available_memory_bytes()
        fraction = self.args.mem_fraction_static
        if fraction is None:
            return int(available * self.args.kv_cache_memory_fraction)
        at_start = self._available_at_start
        assert at_start is not None  # measured in __init__ whenever the fraction is set
        budget = available - int(at_start * (1 - fraction))
        if budget <= 0:
            raise ValueError(
                f"--mem-fraction-static {fraction:g} leaves no memory for the KV cache: "
                f"{at_start / 2**30:.2f} GiB were available at start and the weights left "
                f"{available / 2**30:.2f} GiB, while {(1 - fraction) * at_start / 2**30:.2f} "
                "GiB must stay free; raise it, or size the pool with --max-total-tokens"
            )
        return budget

    # ---- a step -----------------------------------------------------------------------

    def run(self, batch: ScheduleBatch) -> list[ItemResult]:
        self._zero_fresh_pages(batch.new_pages)
        hidden: dict[int, list[list[float]]] = {}  # item -> its rows' hidden states, when asked
        drafted = batch.is_decode and any(item.num_draft for item in batch.items)
        if batch.is_decode and (not drafted or self.attn.decode_takes_drafts):
            logits = self._forward_decode(batch.items, hidden)
        else:
            if drafted:  # a verify step as a prefill: the next decode starts its state afresh
                self.release_decode_state()
            logits = self._forward_extend(batch.items, hidden)
        if not self.samples:
            return []  # a follower rank: the leader samples
        results = results_of(batch.items, logits)
        for i, states in hidden.items():
            results[i].hidden_states = states
        return results

    def _launches_async(self, batch: ScheduleBatch) -> bool:
        """A decode of one token per item, each sampled on the device, overlap on."""
        return (
            self._overlaps
            and batch.is_decode
            and all(
                item.sampling is not None
                and len(item.token_ids) == 1
                and not item.return_hidden_states
                and samples_on_device(item.sampling)
                for item in batch.items
            )
        )

    @torch.inference_mode()
    def launch(self, batch: ScheduleBatch) -> Launched:
        if not self._launches_async(batch):
            return super().launch(batch)
        self._zero_fresh_pages(batch.new_pages)
        logits = self._forward_decode(batch.items, {})
        next_ids = sample_on_device(logits, [item.sampling for item in batch.items])
        n = len(batch.items)
        self.future_ids[:n].copy_(next_ids)  # what the next launch's items may read
        host = self._ids_host[self._flip]
        self._flip ^= 1
        host[:n].copy_(next_ids, non_blocking=True)
        done = torch.Event(device=self.device)
        done.record()
        return Launched(batch, None, (host, n, done))

    def finish(self, launched: Launched) -> list[ItemResult]:
        if launched.results is not None:
            return launched.results
        host, n, done = launched.pending
        done.synchronize()  # this step's ids are in; the step launched after it may run on
        return [ItemResult(next_id=i) for i in host[:n].tolist()]

    # ---- a decode lane of pipeline stages (parallel.LeaderRunner.launch) ----------------------

    def launches_lane(self, batch: ScheduleBatch) -> bool:
        """A decode that stays in flight through the pipeline stages while others run: one
        token per item, no hidden states reported."""
        return (
            self.model.shard.pp_size > 1
            and batch.is_decode
            and all(
                len(item.token_ids) == 1 and not item.return_hidden_states for item in batch.items
            )
        )

    @torch.inference_mode()
    def launch_lane(self, batch: ScheduleBatch) -> tuple[ScheduleBatch, ForwardBatch, Any]:
        """This stage's layers over a decode lane, their output sent on; `finish_lane` takes
        the step back. Every rank launches and finishes the same lanes in the same order."""
        self._zero_fresh_pages(batch.new_pages)
        self._last_decode = ([], [])  # lanes alternate: no decode state carries over
        items = batch.items
        news = [1] * len(items)
        seq_lens = [item.start + 1 for item in items]
        fb = self._decode_batch(items, news, seq_lens, False, False)
        return batch, fb, self.model.forward_start(fb)

    @torch.inference_mode()
    def finish_lane(self, lane: tuple[ScheduleBatch, ForwardBatch, Any]) -> list[ItemResult]:
        """The lane's results on the leader (the first stage receives the final rows, computes
        the logits and samples); [] on the other ranks, once their sends are done."""
        batch, fb, started = lane
        rows = self.model.forward_end(fb, started)
        if rows is None:
            return []
        logits = self.model.compute_logits(rows)  # the first stage's ranks gather the vocabulary
        return results_of(batch.items, logits) if self.samples else []

    def _slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        page_t = torch.tensor(pages, dtype=torch.int64)
        return page_t[pos // self.page_size] * self.page_size + pos % self.page_size

    def _replays(self, items: list[BatchItem], news: list[int]) -> bool:
        """Whether a captured graph runs this decode or verify step: its rows (a token each,
        drafts included) fit the largest graph, no hidden states reported, no adapter."""
        return (
            self.graphs is not None
            and self.graphs.can_run(sum(news))
            and not any(item.return_hidden_states or item.lora for item in items)
        )

    def _lora_batch(self, items: list[BatchItem]) -> LoraBatch | None:
        """The step's tokens grouped by adapter (None when no item has one)."""
        if self.lora is None:
            return None
        counts = [len(item.token_ids) for item in items]
        return LoraBatch.build(
            [item.lora for item in items], counts, self.device, self.lora.batch_args
        )

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @torch.inference_mode()
    def _forward_extend(
        self, items: list[BatchItem], hidden_out: dict[int, list[list[float]]]
    ) -> torch.Tensor | None:
        """Prefill each item's tokens after its computed prefix. Returns the logits of each
        item's logprob rows then its sampling row (when it samples), item by item:
        [num_rows, vocab] float32 on the device."""
        hidden_rows: list[range] = []
        ids, positions, locs, seq_pages, prefix_lens, seq_lens, logits_idx = (
            [],
            [],
            [],
            [],
            [],
            [],
            [],
        )
        offset = 0
        needs_table = self.attn.needs_page_table
        for item in items:
            start, n = item.start, len(item.token_ids)
            ids.extend(item.token_ids)
            positions.append(torch.arange(start, start + n))
            locs.append(self._slots(item.pages, start, start + n))
            if needs_table:
                seq_pages.append(None)
            elif start:
                pages = torch.tensor(
                    item.pages[: self._pages_for(start + n)], dtype=torch.int64, device=self.device
                )
                seq_pages.append(self.kv_pool.page_rows(pages))
            else:
                seq_pages.append(None)  # no prefix: attention reads the new K/V directly
            prefix_lens.append(start)
            seq_lens.append(start + n)
            logits_idx.extend(offset + r for r in item.logprob_rows)
            if item.sampling is not None:  # the last row, and the row before each draft token
                logits_idx.extend(range(offset + n - 1 - item.num_draft, offset + n))
            if item.return_hidden_states:
                hidden_rows.append(range(offset, offset + n))
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
            extend_lens=[len(item.token_ids) for item in items],
            prefix_lens=prefix_lens,
            seq_page_rows=seq_pages,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            page_table=self._page_table(items, seq_lens) if needs_table else None,
            lora=self._lora_batch(items),
        )
        if hidden_rows:
            return self._extend_with_hidden(batch, items, logits_idx, hidden_rows, hidden_out)
        hidden = self.model(batch)
        return self.model.compute_logits(hidden) if logits_idx and hidden is not None else None

    def _extend_with_hidden(self, batch, items, logits_idx, hidden_rows, hidden_out):
        """The forward pass keeps the final hidden states of the logit rows and of every row
        of the items that asked for theirs; logits are computed for the logit rows only."""
        rows = sorted({*logits_idx, *(r for span in hidden_rows for r in span)})
        where = {row: k for k, row in enumerate(rows)}
        batch.logits_indices = torch.tensor(rows, dtype=torch.int64, device=self.device)
        hidden = self.model(batch)
        if hidden is None:  # a later pipeline stage: the first one gets the rows
            return None
        spans = iter(hidden_rows)
        for i, item in enumerate(items):
            if item.return_hidden_states:
                span = next(spans)
                hidden_out[i] = hidden[[where[r] for r in span]].float().cpu().tolist()
        if not logits_idx:
            return None
        picked = hidden[[where[r] for r in logits_idx]]
        return self.model.compute_logits(picked)

    @torch.inference_mode()
    def _forward_decode(
        self, items: list[BatchItem], hidden_out: dict[int, list[list[float]]]
    ) -> torch.Tensor:
        """One new token per item, or, in a verify step, an item's last token and its drafted
        ones (the attention backend takes several rows per request: `decode_takes_drafts`).
        Returns logits [rows, vocab] float32 on the device, item by item."""
        news = [len(item.token_ids) for item in items]
        if self._replays(items, news):
            return self.graphs.run(items)
        seq_lens = [item.start + n for item, n in zip(items, news)]
        drafted = any(n > 1 for n in news)
        spans = self._micro_batches(len(items))
        if len(spans) > 1:  # pipeline stages: micro-batches in flight, each stage on its own
            self._last_decode = ([], [])
            batches = [
                self._decode_batch(items[a:b], news[a:b], seq_lens[a:b], drafted, False)
                for a, b in spans
            ]
            if not any(item.return_hidden_states for item in items):  # logits as rows return
                logits = self.model.forward_micro(batches, self.model.compute_logits)
                return None if logits is None else torch.cat(logits)
            parts = self.model.forward_micro(batches)
            hidden = None if parts is None else torch.cat(parts)
        else:
            uids = [item.uid for item in items]
            last_uids, last_lens = self._last_decode
            continues = (
                not drafted
                and uids == last_uids
                and all(n == m + 1 for n, m in zip(seq_lens, last_lens))
            )
            self._last_decode = ([], []) if drafted else (uids, seq_lens)
            hidden = self.model(self._decode_batch(items, news, seq_lens, drafted, continues))
        if hidden is None:  # a later pipeline stage: the first one gets the rows
            return None
        row = 0
        for i, item in enumerate(items):
            if item.return_hidden_states:  # never drafted: its one row
                hidden_out[i] = [hidden[row].float().cpu().tolist()]
            row += news[i]
        return self.model.compute_logits(hidden)

    def _micro_batches(self, num_items: int) -> list[tuple[int, int]]:
        """[start, end) item spans run as micro-batches: with pipeline stages, twice as many
        as stages (while the last stage runs one, the first runs the next), else one."""
        pp = self.model.shard.pp_size
        if pp == 1 or num_items < 2:
            return [(0, num_items)]
        from cadence.distributed.layout import split_evenly

        parts = min(num_items, 2 * pp)
        return [split_evenly(num_items, parts, i) for i in range(parts)]

    def _decode_batch(
        self,
        items: list[BatchItem],
        news: list[int],
        seq_lens: list[int],
        drafted: bool,
        continues: bool,
    ) -> ForwardBatch:
        """The ForwardBatch of a decode (or verify) step over `items`."""
        ps = self.page_size
        locs = [
            item.pages[pos // ps] * ps + pos % ps
            for item, n in zip(items, seq_lens)
            for pos in range(item.start, n)
        ]
        dev = self.device
        lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        out_loc = torch.tensor(locs, dtype=torch.int64, device=dev)
        max_pages = self._pages_for(max(seq_lens))
        page_table = self._page_table(items, seq_lens)
        width = max_pages * ps
        kv_mask = page_rows = None
        if self.attn.decode_reads_whole_pages:
            page_rows = self.kv_pool.page_rows(page_table)
            if min(seq_lens) != width and not drafted:  # drafts: the backend masks per row
                # True past each row's length, broadcast over [KVH, B, G, width] scores.
                kv_mask = (
                    torch.arange(width, device=dev).unsqueeze(0) >= lens_t.unsqueeze(1)
                ).view(1, len(items), 1, -1)
        if drafted:
            positions = torch.cat([torch.arange(item.start, n) for item, n in zip(items, seq_lens)])
            query_starts = torch.tensor([0, *itertools.accumulate(news)], dtype=torch.int64)
        else:
            positions, query_starts = lens_t - 1, None
        input_ids = torch.tensor(
            [t for item in items for t in item.token_ids], dtype=torch.int64, device=dev
        )
        if any(item.future_row is not None for item in items):  # one token each, then
            src = torch.tensor(
                [-1 if item.future_row is None else item.future_row for item in items],
                dtype=torch.int64,
                device=dev,
            )
            input_ids = torch.where(src >= 0, self.future_ids[src.clamp(min=0)], input_ids)
        return ForwardBatch(
            is_decode=True,
            input_ids=input_ids,
            positions=positions.to(dev),
            out_cache_loc=out_loc,
            kv_write_rows=self.kv_pool.write_rows(out_loc),
            seq_lens=seq_lens,
            extend_lens=news,
            prefix_lens=[item.start for item in items],
            page_table=page_table,
            kv_lens=lens_t,
            page_rows=page_rows,
            kv_mask=kv_mask,
            decode_continues=continues,
            query_starts=None if query_starts is None else query_starts.to(dev),
            lora=self._lora_batch(items),
        )

    # ---- embeddings (--is-embedding) -----------------------------------------------------

    @torch.inference_mode()
    def embed(self, items: list[EmbedItem]) -> list[list[float]]:
        """Pools each item's final hidden states (the last token's by default); every item
        is a whole prompt with no cached prefix. Its K/V go to the pages it was given, which
        the scheduler frees right after."""
        lens = [len(item.token_ids) for item in items]
        dev = self.device
        ends = torch.tensor(lens).cumsum(0)
        if self.pooling.mode == "last":
            rows = ends - 1
        elif self.pooling.mode == "cls":
            rows = ends - torch.tensor(lens)
        else:
            rows = torch.arange(int(ends[-1]))
        out_loc = torch.cat([self._slots(item.pages, 0, n) for item, n in zip(items, lens)]).to(dev)
        batch = ForwardBatch(
            is_decode=False,
            input_ids=torch.tensor([t for item in items for t in item.token_ids], device=dev),
            positions=torch.cat([torch.arange(n) for n in lens]).to(dev),
            out_cache_loc=out_loc,
            kv_write_rows=self.kv_pool.write_rows(out_loc),
            seq_lens=lens,
            extend_lens=lens,
            prefix_lens=[0] * len(items),
            seq_page_rows=[None] * len(items),
            logits_indices=rows.to(dev),
            page_table=self._page_table(items, lens) if self.attn.needs_page_table else None,
        )
        hidden = self.model(batch)
        if hidden is None or not self.samples:
            return []  # a follower rank: the leader pools
        hidden = hidden.float()
        if self.pooling.mode in ("last", "cls"):
            config = PoolingConfig("cls", self.pooling.normalize)  # one row per item already
            return pool(hidden, [1] * len(items), config).cpu().tolist()
        return pool(hidden, lens, self.pooling).cpu().tolist()

    def embedding_facts(self) -> dict:
        if self.is_generation:
            return {}
        return {
            "embedding_dim": self.config.hidden_size,
            "pooling": self.pooling.mode,
            "normalizes": self.pooling.normalize,
        }

    @property
    def has_decode_state(self) -> bool:
        """Something is kept for the running batch between steps (`release_decode_state`)."""
        return bool(self._last_decode[0])

    def release_decode_state(self) -> None:
        """The running batch has emptied: forget it, and let the attention backend drop what it
        kept for it (copies of its K/V)."""
        if self._last_decode[0]:
            self._last_decode = ([], [])
            self.attn.release_decode_state()

    def _zero_fresh_pages(self, pages: list[int]) -> None:
        """Zero the pages handed out for this step, where the attention backend's decode reads
        whole pages (`AttentionBackend.decode_reads_whole_pages`): a masked slot still
        multiplies its V by 0, and stale memory there could hold NaN (0 * NaN = NaN): a lazy
        pool's never-written memory, or a non-finite K/V its last holder left."""
        if pages and self.attn.decode_reads_whole_pages:
            index = torch.tensor(pages, dtype=torch.int64, device=self.device)
            for buf in self.kv_pool.kv_buffer:
                buf.index_fill_(2, index, 0)

    def _page_table(self, items: list[BatchItem], seq_lens: list[int]) -> torch.Tensor:
        """[batch, pages of the longest] int64: each item's pages covering its sequence; rows
        shorter than the longest repeat their first page as padding (never attended)."""
        table = [item.pages[: self._pages_for(n)] for item, n in zip(items, seq_lens)]
        width = max(len(p) for p in table)
        return torch.tensor(
            [p + [p[0]] * (width - len(p)) for p in table], dtype=torch.int64, device=self.device
        )


def _has_events(device: torch.device) -> bool:
    """Whether the device records events (what a launched step's results wait on): a
    device that computes each step before returning (the CPU) has none, and nothing to
    overlap."""
    try:
        torch.Event(device=device).record()
    except RuntimeError:
        return False
    return True
