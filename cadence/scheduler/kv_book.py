"""A request's KV pages next to the prefix cache: how much of its prompt the cache already
holds, the pages it computes this round (so that two requests never compute the same page
at once), growing it into its reservation, and what it hands back to the cache and the pool
as it runs and when it stops. The scheduler decides who runs; this keeps the books."""

from __future__ import annotations

from cadence.mem_cache.allocator import KVAllocator
from cadence.mem_cache.prefix_cache import PrefixCache
from cadence.scheduler.req import Req


class KvBook:
    def __init__(self, allocator: KVAllocator, cache: PrefixCache, caching: bool):
        self.allocator = allocator
        self.cache = cache
        self.caching = caching  # False: NoPrefixCache, nothing is ever shared
        self.page_size = allocator.page_size

    def match_limit(self, req: Req) -> int:
        """How many leading tokens of `req` may come from the cache: never all (the last one
        is computed, for its logits), and none of those whose prompt logprobs or hidden
        states the request wants reported."""
        limit = len(req.fill_ids) - 1
        if req.return_hidden_states:
            limit = 0
        elif req.wants_input_logprobs:
            limit = min(limit, max(req.logprob_start_len, 1) - 1)
        return limit - limit % self.page_size

    def match(self, req: Req):
        limit = self.match_limit(req)
        if limit <= 0:
            return [], None
        return self.cache.match_prefix(req.fill_ids[:limit])

    def match_len(self, req: Req) -> int:
        """Cached prefix length of a waiting request (remembered until the cache changes)."""
        if req.match_at != self.cache.version:
            pages, _ = self.match(req)
            req.match_len, req.match_at = len(pages), self.cache.version
        return req.match_len

    def page_hashes(self, req: Req, num_pages: int) -> list[int]:
        """Chained hashes of the first `num_pages` whole pages of `req.fill_ids` (page k's
        hash covers every token before it too)."""
        hashes, page = req.page_hashes, self.page_size
        ids = req.fill_ids
        while len(hashes) < num_pages:
            k = len(hashes)
            hashes.append(hash((hashes[-1] if hashes else 0, *ids[k * page : (k + 1) * page])))
        return hashes[:num_pages]

    def claim(self, req: Req, upto: int, claimed: set[int]) -> None:
        """Marks the whole pages `req` computes this round (from num_computed to `upto`)."""
        page = self.page_size
        first, last = req.num_computed // page, upto // page
        if self.caching and last > first:
            claimed.update(self.page_hashes(req, last)[first:])

    def shares_claimed(self, req: Req, num_matched: int, claimed: set[int]) -> bool:
        """Whether the first page `req` would compute is one this round already computes."""
        if not claimed or self.match_limit(req) < (num_matched + 1) * self.page_size:
            return False
        return self.page_hashes(req, num_matched + 1)[-1] in claimed

    def grow(self, req: Req, num_tokens: int, new_pages: list[int]) -> None:
        """Give `req` the pages for its first `num_tokens` positions, from its reservation."""
        missing = self.allocator.pages_for(num_tokens) - len(req.pages)
        if missing > 0:
            pages = self.allocator.alloc(missing)
            if pages is None:  # admission reserved these pages, so this is a bookkeeping bug
                raise RuntimeError(f"KV pool exhausted while extending reserved request {req.rid}")
            req.pages.extend(pages)
            new_pages.extend(pages)

    def cache_progress(self, req: Req) -> None:
        """Puts the whole pages `req` has computed into the prefix cache and moves its lock to
        the node that ends them (so they stay unevictable while it runs)."""
        num = min(req.num_computed // self.page_size, len(req.pages))
        if num == 0 or not self.caching:
            return
        tokens = req.fill_ids[: num * self.page_size]
        node = self.cache.insert(tokens, req.pages[:num])
        if node is not req.cache_node:
            self.cache.lock(node)
            self.cache.unlock(req.cache_node)
            req.cache_node = node
        self._adopt_cached_pages(req, tokens)

    def _adopt_cached_pages(self, req: Req, tokens: list[int]) -> None:
        """Where the tree already held some of these pages (another request computed the same
        prefix meanwhile), `req` reads the tree's copies from now on and its own duplicates go
        back to the pool: the KV of the same tokens at the same positions is the same."""
        cached, _ = self.cache.match_prefix(tokens)
        dup = [i for i, page in enumerate(cached) if req.pages[i] != page]
        if dup:
            self.allocator.incref([cached[i] for i in dup])
            self.allocator.decref([req.pages[i] for i in dup])
            for i in dup:
                req.pages[i] = cached[i]

    def release(self, req: Req) -> None:
        self.cache.unlock(req.cache_node)
        req.cache_node = None
        if req.pages:
            self.allocator.decref(req.pages)
            req.pages = []
        req.num_reserved_pages = 0
        req.is_admitted = False
