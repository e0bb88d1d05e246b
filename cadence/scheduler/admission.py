"""Admission: the waiting queue, and which waiting requests join the next prefill batch.

A request is admitted once the KV manager reserves every page it can ever need (prompt plus
max_new_tokens), so a running request never runs out of KV memory mid-generation; one that
does not fit yet waits, and nothing behind it jumps the queue. Admission counts evictable
cache pages as free (the manager evicts them on demand); pages pinned by open sessions
yield only when nothing at all runs.

The order: arrival, or priority first with --enable-priority-scheduling; with
`--schedule-policy lpm`, the longest cached prefix first. A request whose next pages another
request of the same round is computing waits one round to take them from the cache (n > 1,
batches with a common prefix): pages are compared by a chained hash of their tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from cadence.mem_cache.kv_manager import KVManager
from cadence.scheduler.req import Req
from cadence.server_args import ServerArgs

# Beyond this many waiting requests, lpm falls back to arrival order (matching every waiting
# request each round would cost more than it saves).
LPM_MAX_WAITING = 128


class Admission:
    """The waiting queue and the prefill side of a scheduling round. Only the scheduler's
    thread calls it."""

    def __init__(
        self,
        kv: KVManager,
        args: ServerArgs,
        context_len: int,
        relieve: Callable[[], bool],
    ):
        self.kv = kv
        self.context_len = context_len
        self.max_running = args.max_running_requests
        self.chunk_size = args.prefill_token_budget(context_len)  # tokens a round prefills at most
        # --chunked-prefill-size -1: a prompt is prefilled whole, never split over rounds.
        self.splits_prompts = args.chunked_prefill_size != -1
        self.lpm = args.effective_schedule_policy == "lpm"
        self.by_priority = args.enable_priority_scheduling
        # Distinct adapters (the base model counted as one) one step may mix.
        self.max_loras = args.max_loras_per_batch if args.enable_lora else None
        self.low_values_first = args.schedule_low_priority_values_first
        # Unpins the least recently active session's KV; True when it unpinned something.
        self.relieve = relieve
        self.waiting: deque[Req] = deque()
        self.num_prompt_tokens = 0  # prompt tokens admitted (first admissions)
        self.num_cache_hit_tokens = 0  # of those, served from the prefix cache

    # ---- the queue -------------------------------------------------------------------------

    def enqueue(self, req: Req) -> None:
        """With priorities: behind every waiting request of the same or a higher priority
        (higher values first, or lower with --schedule-low-priority-values-first; no
        priority is the lowest). Otherwise at the back."""
        if self.by_priority:
            rank = self.priority_rank(req)
            for i, other in enumerate(self.waiting):
                if self.priority_rank(other) < rank:
                    self.waiting.insert(i, req)
                    return
        self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted request goes back first: it was admitted before everyone waiting."""
        self.waiting.appendleft(req)

    def priority_rank(self, req: Req) -> float:
        if req.priority is None:
            return float("-inf")
        return -req.priority if self.low_values_first else req.priority

    def cache_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served from the prefix cache, since start."""
        if not self.num_prompt_tokens:
            return 0.0
        return self.num_cache_hit_tokens / self.num_prompt_tokens

    # ---- a round ---------------------------------------------------------------------------

    def take(
        self, chunked: Req | None, num_running: int, loras: set[int | None] | None = None
    ) -> list[tuple[Req, int]]:
        """This round's prefill: the unfinished chunk first, then waiting requests in
        admission order while the token budget, --max-running-requests and KV memory allow,
        and, with LoRA, while the adapters of the running requests (`loras`, None for the
        base model) and of the chosen ones stay within --max-loras-per-batch (a request
        whose adapter would exceed it waits; others may pass it). Returns each request with
        the number of its tokens to compute now; only the last one may stop short of its
        end (the next round's chunk)."""
        budget = self.chunk_size
        chosen: list[tuple[Req, int]] = []
        claimed: set[int] = set()  # pages (by chained hash) this round's prefill computes
        loras = set(loras or ())
        if chunked is not None:
            loras.add(chunked.lora_uid)
            budget -= self._choose(chunked, budget, chosen, claimed)
        for req in self._order():
            if budget <= 0 or num_running + len(chosen) >= self.max_running:
                break
            if not self.splits_prompts and chosen and len(req.fill_ids) > budget:
                break  # runs whole in a round of its own, next
            if claimed and self._shares_claimed(req, claimed):
                continue  # takes the pages another request computes now from the cache next round
            if not self.kv.fetch_from_disk(req.fill_ids[: self._match_limit(req)], req.lora_uid):
                continue  # its cached prefix is being read back from disk; others go on
            if self.max_loras is not None and req.lora_uid not in loras:
                if len(loras) >= self.max_loras:
                    continue  # its adapter waits for a step with room for one more
                loras.add(req.lora_uid)
            if not self._admit(req, may_unpin=not (num_running or chosen)):
                break  # waits for memory; nothing behind it jumps the queue
            budget -= self._choose(req, budget, chosen, claimed)
        return chosen

    def _choose(
        self, req: Req, budget: int, chosen: list[tuple[Req, int]], claimed: set[int]
    ) -> int:
        n = min(len(req.fill_ids) - req.num_computed, budget)
        chosen.append((req, n))
        self._claim(req, req.num_computed + n, claimed)
        return n

    def _order(self) -> list[Req]:
        """Waiting requests in the order admission considers them: arrival (or priority)
        order; with lpm, longest cached prefix first within a priority."""
        order = list(self.waiting)
        if self.lpm and 1 < len(order) <= LPM_MAX_WAITING:
            if self.by_priority:
                order.sort(key=lambda r: (-self.priority_rank(r), -self._match_len(r)))
            else:
                order.sort(key=lambda r: -self._match_len(r))
        return order

    def _admit(self, req: Req, may_unpin: bool) -> bool:
        """`req` takes its cached prefix and its reservation and leaves the queue; False,
        with nothing changed, when the pool cannot hold it now. Pinned sessions are unpinned,
        least recently active first, only when nothing runs (`may_unpin`)."""
        prefix = req.fill_ids[: self._match_limit(req)]
        num_tokens = req.total_tokens_needed(self.context_len)
        handle = self.kv.admit(prefix, num_tokens, req.lora_uid)
        while handle is None and may_unpin and self.relieve():
            handle = self.kv.admit(prefix, num_tokens, req.lora_uid)
        if handle is None:
            return False
        self.waiting.remove(req)
        req.kv = handle
        req.num_computed = handle.num_cached_tokens
        if not req.was_admitted:  # a retracted request is not counted again
            req.was_admitted = True
            req.cached_tokens = req.num_computed
            self.num_prompt_tokens += len(req.input_ids)
            self.num_cache_hit_tokens += req.num_computed
        return True

    # ---- the prefix cache, per request ----------------------------------------------------

    def _match_limit(self, req: Req) -> int:
        """How many leading tokens of `req` may come from the cache: never all (the last one
        is computed, for its logits), and none of those whose prompt logprobs or hidden
        states the request wants reported; whole pages only."""
        limit = len(req.fill_ids) - 1
        if req.return_hidden_states:
            limit = 0
        elif req.wants_input_logprobs:
            limit = min(limit, max(req.logprob_start_len, 1) - 1)
        return max(limit - limit % self.kv.page_size, 0)

    def _match_len(self, req: Req) -> int:
        """Cached prefix length of a waiting request, in pages (remembered until the cache
        changes)."""
        if req.match_at != self.kv.cache_version:
            req.match_len = self.kv.match_len(req.fill_ids[: self._match_limit(req)], req.lora_uid)
            req.match_at = self.kv.cache_version
        return req.match_len

    def _page_hashes(self, req: Req, num_pages: int) -> list[int]:
        """Chained hashes of the first `num_pages` whole pages of `req.fill_ids` (page k's
        hash covers every token before it too)."""
        hashes, page = req.page_hashes, self.kv.page_size
        ids = req.fill_ids
        while len(hashes) < num_pages:
            k = len(hashes)
            seed = hashes[-1] if hashes else hash(("lora", req.lora_uid))  # adapters apart
            hashes.append(hash((seed, *ids[k * page : (k + 1) * page])))
        return hashes[:num_pages]

    def _claim(self, req: Req, upto: int, claimed: set[int]) -> None:
        """Marks the whole pages `req` computes this round (from num_computed to `upto`)."""
        page = self.kv.page_size
        first, last = req.num_computed // page, upto // page
        if self.kv.is_caching and last > first:
            claimed.update(self._page_hashes(req, last)[first:])

    def _shares_claimed(self, req: Req, claimed: set[int]) -> bool:
        """Whether the first page `req` would compute is one this round already computes."""
        num_matched = self._match_len(req)
        if self._match_limit(req) < (num_matched + 1) * self.kv.page_size:
            return False
        return self._page_hashes(req, num_matched + 1)[-1] in claimed
