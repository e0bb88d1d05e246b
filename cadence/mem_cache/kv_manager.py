"""The one book of KV pages: who holds which page of the pool, what is promised, what the
prefix cache keeps. The scheduler asks it; nothing else in the scheduler touches the
allocator or the cache.

Like nano-vllm's `BlockManager` and vLLM's `KVCacheManager`, admission is one call:
`admit` matches the cached prefix, locks it, evicts what it must and reserves every page the
request can ever hold, all or nothing (when it returns None no page, hold, lock or promise
changed; the match may have refreshed the cache's LRU times). A request then `grow`s into its
reservation page by page, hands what it computed to the cache (`cache_progress`), and
`release`s everything when it stops. An embedding step of a decoder takes its pages with
`reserve_embedding` and gives them back with `release`.

Invariants (`check` recounts them from the holders' side; the unit tests run it after every
scheduler step):
- free + evictable + in use == the pool, where in use are the pages held by live handles
  (admitted requests, embedding steps) and by locked cache nodes (their prefixes, pinned
  session turns), and evictable are the cache's other pages.
- promised <= free: the pages admitted requests may still grow into are always on the free
  list, so `grow` never evicts and never fails, and nothing else (new admissions, embedding
  steps) takes them.
- Only the scheduler's thread calls the manager, between forward steps (no locking).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

from cadence.mem_cache.allocator import KVAllocator
from cadence.mem_cache.disk_tier import DiskTier
from cadence.mem_cache.kv_events import KVEventRecorder
from cadence.mem_cache.prefix_cache import Node, NoPrefixCache, PrefixCache, RadixCache

# A prefix-cache node as its holders see it: opaque, passed back to `unpin`.
CacheNode = Node


FETCH_POLL_S = 0.002  # how long a round waits for a disk read in flight before it goes on


@dataclass(eq=False)
class KVHandle:
    """What one holder (an admitted request, an embedding step) has of the pool. Only the
    manager changes it; the runner reads `pages`."""

    pages: list[int]  # pages held, in position order
    num_reserved: int  # pages promised at admission: held plus those it may still grow into
    node: CacheNode | None = None  # the prefix-cache node it keeps locked (its cached prefix)
    num_cached_tokens: int = 0  # leading tokens whose KV came from the cache at admission
    namespace: int | None = None  # whose KV (a LoRA adapter's uid; None: the base model's)

    @property
    def num_promised(self) -> int:
        """Pages it may still take with `grow`."""
        return self.num_reserved - len(self.pages)


@dataclass(frozen=True)
class KVUsage:
    """The pool at one moment, in pages. free + evictable + in use == pages."""

    page_size: int  # token slots per page
    num_pages: int  # pages in the pool
    num_free: int  # pages no one holds (the promised ones among them)
    num_evictable: int  # pages only the prefix cache keeps, unlocked: freed on demand
    num_in_use: int  # pages held by live requests, embedding steps and pinned sessions
    num_cached: int  # pages in the prefix cache, locked or not
    num_promised: int  # free pages that admitted requests may still grow into

    @property
    def num_used_tokens(self) -> int:
        """Token slots held by live requests and pinned sessions (/v1/loads; the evictable
        cache is not counted: it gives way to the first request that needs it)."""
        return self.num_in_use * self.page_size

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size


class KVManager:
    """The KV pages of one pool, over its allocator and prefix cache (see the module)."""

    def __init__(self, allocator: KVAllocator, cache: PrefixCache):
        if cache.page_size != allocator.page_size:
            raise ValueError(
                f"the prefix cache's page_size ({cache.page_size}) is not the pool's "
                f"({allocator.page_size})"
            )
        self._allocator = allocator
        self._cache = cache
        self.page_size = allocator.page_size
        self.num_pages = allocator.num_pages
        self.is_caching = not isinstance(cache, NoPrefixCache)  # False: nothing is ever shared
        self._num_promised = 0  # every live handle's num_promised, together
        self._handles: set[KVHandle] = set()  # live handles (for `check`)
        # Disk-tier reads in flight, by the whole-page prefix they serve: (pages of it in
        # memory when the read started, the read's future).
        self._fetches: dict[tuple[int, ...], tuple[int, Any, float]] = {}

    @classmethod
    def build(
        cls,
        allocator: KVAllocator,
        *,
        enable_prefix_cache: bool = True,
        kv_events: bool = False,
        disk: DiskTier | None = None,
        write_through: bool = True,
    ) -> KVManager:
        """The manager of `allocator`'s pool with a radix prefix cache, or with none; with
        `kv_events`, the cache records its changes for `take_kv_events`; with `disk`, pages
        the cache lets go are kept there and found again at admission."""
        if enable_prefix_cache:
            events = KVEventRecorder(allocator.page_size) if kv_events else None
            return cls(allocator, RadixCache(allocator, events, disk, write_through))
        return cls(allocator, NoPrefixCache(allocator.page_size))

    def close(self) -> None:
        """Finishes what the disk tier is writing (a clean stop keeps every page)."""
        disk = getattr(self._cache, "disk", None)
        if disk is not None:
            self._cache.write_back_all()  # type: ignore[attr-defined]
            disk.close()

    def take_kv_events(self) -> list:
        """The prefix cache's changes since the last call (KV events; none when not recorded)."""
        events = getattr(self._cache, "events", None)
        return events.take() if events is not None else []

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    # ---- the prefix cache, read ----------------------------------------------------------

    @property
    def cache_version(self) -> int:
        """Grows whenever the cached content changes: a match length read at one version
        holds until it changes."""
        return self._cache.version

    def match_len(self, prefix: list[int], namespace: int | None = None) -> int:
        """Pages of `prefix` (the tokens that may come from the cache) cached now."""
        if not prefix or not self.is_caching:
            return 0
        return len(self._cache.match_prefix(prefix, namespace)[0])

    # ---- requests ------------------------------------------------------------------------

    def admit(
        self, prefix: list[int], num_tokens: int, namespace: int | None = None
    ) -> KVHandle | None:
        """Takes the cached pages of `prefix` (the leading tokens that may come from the
        cache, whole pages), locks their node, and reserves the pages of everything else up
        to `num_tokens` (all the request can ever hold), evicting unlocked cache as needed.
        None, with nothing changed, when the pool cannot promise that many pages now."""
        pages, node = self._cache.match_prefix(prefix, namespace) if prefix else ([], None)
        num_reserved = max(self.pages_for(num_tokens), len(pages))
        need = num_reserved - len(pages)
        self._cache.lock(node)  # before counting: its pages are not evictable any more
        free = self._allocator.num_free_pages - self._num_promised
        if need > free + self._cache.num_evictable_pages:
            self._cache.unlock(node)
            return None
        if need > free:
            self._cache.evict(need - free)
        if pages:
            self._allocator.incref(pages)
        handle = KVHandle(list(pages), num_reserved, node, len(pages) * self.page_size, namespace)
        self._num_promised += need
        self._handles.add(handle)
        return handle

    def fetch_from_disk(self, prefix: list[int], namespace: int | None = None) -> bool:
        """Whether `prefix` may be admitted now. Pages of it past what memory holds that the
        disk tier has are read back on the tier's reader thread (started by the first call):
        False while that read runs, so the request waits while others compute; once it is
        done, its pages go into the pool and the cache (`_install`), where the admission's
        match takes them."""
        cache = self._cache
        if not prefix or namespace is not None or not isinstance(cache, RadixCache):
            return True
        disk = cache.disk
        if disk is None or not disk.is_enabled:
            return True
        page = self.page_size
        pages, node = cache.match_prefix(prefix)
        whole = len(prefix) // page
        key = tuple(prefix[: whole * page])
        fetch = self._fetches.get(key)
        if fetch is None:
            if whole <= len(pages):
                return True
            self._forget_stale_fetches()
            digests = cache.chain_after(node, prefix[len(pages) * page : whole * page])
            num = disk.num_available(digests)
            if num == 0:
                return True
            self._fetches[key] = (len(pages), disk.read_async(digests[:num]), time.monotonic())
            return False
        start, future, _ = fetch
        if not future.done():
            # A moment for the reader thread (a loop that polls at once would hold the GIL
            # it needs); other requests' steps go on after it.
            concurrent.futures.wait([future], timeout=FETCH_POLL_S)
            if not future.done():
                return False
        del self._fetches[key]
        try:
            data = future.result()
        except Exception:  # a failed read: the request prefills instead
            return True
        # Memory may have gained (or lost) pages of this prefix meanwhile: install what
        # follows the match now, only where it still follows.
        skip = len(pages) - start
        if 0 <= skip < len(data):
            self._install(prefix, pages, node, data[skip:])
        return True

    def _install(self, prefix: list[int], pages: list[int], node, data) -> None:
        """Pages read back for `prefix` (after its `pages` in memory, ending at `node`) go
        into the pool and the cache. Room for them: free pages first, then the least
        recently used unlocked cache (this prefix's pages stay: locked meanwhile); pages
        promised to admitted requests never."""
        cache = self._cache
        assert isinstance(cache, RadixCache) and cache.disk is not None
        free = self._allocator.num_free_pages - self._num_promised
        if len(data) > free:
            cache.lock(node)
            cache.evict(min(len(data) - free, cache.num_evictable_pages))
            cache.unlock(node)
            free = self._allocator.num_free_pages - self._num_promised
        num = min(len(data), free)
        fresh = self._allocator.alloc(num) if num > 0 else None
        if fresh:
            cache.disk.install(data[:num], fresh)
            cache.insert(prefix[: (len(pages) + num) * self.page_size], pages + fresh)
            self._allocator.decref(fresh)  # the cache holds them now

    def _forget_stale_fetches(self, max_age_s: float = 30.0) -> None:
        """Reads nobody came back for (their request was aborted while it waited)."""
        now = time.monotonic()
        for key in [
            k for k, (_, f, t) in self._fetches.items() if f.done() and now - t > max_age_s
        ]:
            del self._fetches[key]

    def grow(self, handle: KVHandle, num_tokens: int) -> list[int]:
        """Gives `handle` the pages for its first `num_tokens` positions, from its
        reservation; returns the pages it took (none when it had them)."""
        missing = self.pages_for(num_tokens) - len(handle.pages)
        if missing <= 0:
            return []
        if missing > handle.num_promised:
            raise RuntimeError(
                f"KV bookkeeping: {num_tokens} tokens need {missing} more pages, "
                f"{handle.num_promised} were reserved"
            )
        pages = self._allocator.alloc(missing)
        if pages is None:  # promised pages are always free: this is a bookkeeping bug
            raise RuntimeError("KV bookkeeping: the pool lost pages promised to a request")
        handle.pages.extend(pages)
        self._num_promised -= missing
        return pages

    def cache_progress(self, handle: KVHandle, tokens: list[int]) -> None:
        """Puts the whole pages of `tokens` (what `handle` has computed, from position 0)
        into the prefix cache and moves its lock to the node that ends them, so they stay
        unevictable while it runs. Where the tree already held some of these pages (another
        request computed the same prefix meanwhile), `handle` takes the tree's copies and its
        own duplicates go back to the pool: the KV of the same tokens is the same."""
        num = min(len(tokens) // self.page_size, len(handle.pages))
        if num == 0 or not self.is_caching:
            return
        tokens = tokens[: num * self.page_size]
        node = self._cache.insert(tokens, handle.pages[:num], handle.namespace)
        if node is not handle.node:
            self._cache.lock(node)
            self._cache.unlock(handle.node)
            handle.node = node
        cached, _ = self._cache.match_prefix(tokens, handle.namespace)
        dup = [i for i, page in enumerate(cached) if handle.pages[i] != page]
        if dup:
            self._allocator.incref([cached[i] for i in dup])
            self._allocator.decref([handle.pages[i] for i in dup])
            for i in dup:
                handle.pages[i] = cached[i]

    def release(self, handle: KVHandle) -> None:
        """Gives back everything `handle` holds and was promised (what went into the cache
        stays there, evictable unless pinned). Releasing twice is a bookkeeping bug."""
        if handle not in self._handles:
            raise RuntimeError("KV bookkeeping: a handle released twice")
        self._handles.remove(handle)
        self._num_promised -= handle.num_promised
        self._cache.unlock(handle.node)
        if handle.pages:
            self._allocator.decref(handle.pages)
        handle.pages, handle.num_reserved, handle.node = [], 0, None

    # ---- embedding steps -----------------------------------------------------------------

    def reserve_embedding(self, num_tokens: int) -> KVHandle | None:
        """The pages a decoder's embedding input writes its K/V into during one step (give
        them back with `release` when the step ends), or None when the pool cannot spare
        them: pages promised to admitted requests are not spared."""
        need = self.pages_for(num_tokens)
        free = self._allocator.num_free_pages - self._num_promised
        if need > free + self._cache.num_evictable_pages:
            return None
        if need > free:
            self._cache.evict(need - free)
        pages = self._allocator.alloc(need)
        if pages is None:  # free - promised >= need after the eviction
            raise RuntimeError("KV bookkeeping: the pool has fewer free pages than it counts")
        handle = KVHandle(pages, need)
        self._handles.add(handle)
        return handle

    # ---- sessions ------------------------------------------------------------------------

    def pin(self, handle: KVHandle) -> CacheNode | None:
        """Keeps the cached prefix `handle` has locked after `handle` is released (a session
        turn's KV for the next turn); returns what to `unpin`, None when nothing is cached."""
        self._cache.lock(handle.node)
        return handle.node

    def unpin(self, node: CacheNode | None) -> None:
        """Lets a pinned prefix become ordinary, evictable cache."""
        self._cache.unlock(node)

    # ---- the pool as a whole -------------------------------------------------------------

    def flush(self) -> None:
        """Drops every unlocked cached page (what live requests and pins lock stays)."""
        self._cache.reset()

    def usage(self) -> KVUsage:
        """The pool now (O(1): read for every /v1/loads)."""
        free = self._allocator.num_free_pages
        evictable = self._cache.num_evictable_pages
        return KVUsage(
            page_size=self.page_size,
            num_pages=self.num_pages,
            num_free=free,
            num_evictable=evictable,
            num_in_use=self.num_pages - free - evictable,
            num_cached=self._cache.num_cached_pages,
            num_promised=self._num_promised,
        )

    def check(self) -> KVUsage:
        """`usage()`, with its in-use and evictable pages recounted from the holders' side
        (live handles, the cache's nodes); raises RuntimeError where the books disagree.
        O(pool): for tests and debugging, not the hot path."""
        usage = self.usage()
        held = {page for handle in self._handles for page in handle.pages}
        locked: set[int] = set()
        unlocked: set[int] = set()
        for node in self._cache.nodes():
            (locked if node.lock_ref > 0 else unlocked).update(node.pages)
        in_use = held | locked
        problems = []
        if held & unlocked:
            problems.append(f"pages {sorted(held & unlocked)} are held but not locked in cache")
        if len(unlocked) != usage.num_evictable:
            problems.append(f"{len(unlocked)} unlocked cached pages, {usage.num_evictable} counted")
        if usage.num_free + len(unlocked) + len(in_use) != usage.num_pages:
            problems.append(
                f"free {usage.num_free} + evictable {len(unlocked)} + in use {len(in_use)} "
                f"!= {usage.num_pages} pages"
            )
        promised = sum(handle.num_promised for handle in self._handles)
        if promised != usage.num_promised or any(h.num_promised < 0 for h in self._handles):
            problems.append(f"{promised} pages promised to handles, {usage.num_promised} counted")
        if usage.num_promised > usage.num_free:
            problems.append(f"{usage.num_promised} pages promised, {usage.num_free} free")
        if problems:
            raise RuntimeError("KV books disagree: " + "; ".join(problems))
        return usage
