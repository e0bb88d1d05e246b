"""The prefix cache's disk tier: KV pages kept in files when memory lets them go, found
again by the hash chain of the tokens before them, across restarts.

A page's file is named by SHA-256 over the server's identity and the page's chained digest
(the same SHA-256 chain over token ids that KV events carry), so that a page is found only
by a server that would compute the same K/V for it: the identity covers the model file, the
tokenizer, the KV dtype, the page size and the pool's shape. Each file starts with a header
that repeats the identity, the payload's size and a CRC32 of it; a file whose header or
checksum does not match (another model's, a truncated or corrupt one) is ignored, deleted,
and never served.

Writes run on a thread of their own, off the scheduler's path: the scheduler only copies the
pages out of the pool (`store`), and a bounded queue drops what the disk cannot keep up with.
Each file is written under a unique temporary name and renamed into place, so servers that
share a directory never read half a file. Files beyond --hicache-size are evicted least
recently used first. A directory that cannot be written (permissions, a full disk) turns the
tier off with one warning: the server goes on without it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import logging
import os
import queue
import struct
import threading
import uuid
import zlib

import torch

from cadence.mem_cache.kv_pool import KVPool

logger = logging.getLogger(__name__)

MAGIC = b"CDNKV01\0"
_HEADER = struct.Struct("<8s32sQI")  # magic, identity, payload bytes, crc32
SUFFIX = ".kv"
QUEUE_PAGES = 4096  # pages waiting to be written at most; beyond, writes are dropped


def identity_of(*parts) -> bytes:
    """The server's identity for the disk tier: a digest of everything that makes its K/V."""
    h = hashlib.sha256(b"cadence-disk-tier-v1")
    for part in parts:
        h.update(b"\0" + str(part).encode())
    return h.digest()


def file_identity(path: str | None) -> str:
    """A file's (or a directory's files') identity: real path, size and modification time."""
    if not path or not os.path.exists(path):
        return "none"
    paths = [path]
    if os.path.isdir(path):
        paths = sorted(os.path.join(path, f) for f in os.listdir(path))
    out = []
    for p in paths:
        st = os.stat(p)
        out.append(f"{os.path.realpath(p)}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(out)


class DiskTier:
    """Pages of one server's KV pool in a directory (see the module docstring)."""

    def __init__(self, directory: str, identity: bytes, pool: KVPool, max_bytes: int = 0):
        self.identity = identity
        self.pool = pool
        self.max_bytes = max_bytes  # 0: no cap
        self.dir = os.path.join(directory, identity.hex()[:16])
        self.page_bytes = (
            int(torch.Size(pool.page_shape).numel())
            * torch.empty((), dtype=pool.dtype).element_size()
        )
        self.is_enabled = True
        self.num_written = 0
        self.num_loaded = 0
        self.num_rejected = 0  # files found bad (and deleted)
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU
        self._bytes = 0
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_PAGES)
        # Reads run here, so a request's pages come back while other requests compute.
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f".probe-{uuid.uuid4().hex}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.unlink(probe)
        except OSError as e:
            self._disable(f"the directory {self.dir} is not writable: {e}")
            return
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    # ---- keys and the index ----------------------------------------------------------------

    def key(self, digest: bytes) -> str:
        return hashlib.sha256(self.identity + digest).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + SUFFIX)

    def _scan(self) -> None:
        """What earlier runs (and other servers of the same identity) left, oldest first."""
        entries = []
        for name in os.listdir(self.dir):
            if name.endswith(SUFFIX):
                try:
                    st = os.stat(os.path.join(self.dir, name))
                except OSError:
                    continue
                entries.append((st.st_mtime_ns, name[: -len(SUFFIX)], st.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self._bytes += size
        if entries:
            logger.info("disk tier: %d pages from earlier runs in %s", len(entries), self.dir)
        self._evict_over_cap()

    def has(self, key: str) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return os.path.exists(self._path(key))  # written by another server meanwhile

    def num_available(self, digests: list[bytes]) -> int:
        """How many leading pages of this chain the disk holds."""
        if not self.is_enabled:
            return 0
        n = 0
        for digest in digests:
            if not self.has(self.key(digest)):
                break
            n += 1
        return n

    # ---- writing ----------------------------------------------------------------------------

    def store(self, digests: list[bytes], pages: list[int]) -> None:
        """Queues these pages for writing (their K/V copied out of the pool now)."""
        if not self.is_enabled:
            return
        todo = [(self.key(d), p) for d, p in zip(digests, pages)]
        with self._lock:
            todo = [(k, p) for k, p in todo if k not in self._index]
        if not todo:
            return
        data = self.pool.read_pages([p for _, p in todo])
        for (key, _), page in zip(todo, data):
            try:
                self._queue.put_nowait((key, page))
            except queue.Full:
                logger.debug("disk tier: the write queue is full; a page is not kept")
                return

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, page = item
            if key == "__flush__":  # everything queued before it is written
                page.set()
                continue
            if not self.is_enabled:
                continue
            try:
                self._write(key, page)
            except OSError as e:
                self._disable(f"writing {self.dir} failed: {e}")

    def _write(self, key: str, page: torch.Tensor) -> None:
        payload = page.contiguous().view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(MAGIC, self.identity, len(payload), zlib.crc32(payload))
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)  # readers see the whole file or none
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        size = len(header) + len(payload)
        with self._lock:
            if key not in self._index:
                self._bytes += size
            self._index[key] = size
            self._index.move_to_end(key)
        self.num_written += 1
        self._evict_over_cap()

    def _evict_over_cap(self) -> None:
        if not self.max_bytes:
            return
        while True:
            with self._lock:
                if self._bytes <= self.max_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._bytes -= size
            try:
                os.unlink(self._path(key))
            except OSError:
                pass

    # ---- reading ----------------------------------------------------------------------------

    def read_async(self, digests: list[bytes]) -> concurrent.futures.Future:
        """Reads the leading pages of this chain that are good, on the reader thread: a
        future of their K/V ([n, *page_shape]; n may be 0)."""
        return self._reader.submit(self._read_run, digests)

    def _read_run(self, digests: list[bytes]) -> torch.Tensor:
        datas = []
        for digest in digests:
            page = self._read(self.key(digest))
            if page is None:
                break
            datas.append(page)
        if not datas:
            return torch.empty((0, *self.pool.page_shape), dtype=self.pool.dtype)
        return torch.stack(datas)

    def install(self, data: torch.Tensor, pages: list[int]) -> None:
        """Writes pages read by `read_async` into the pool."""
        self.pool.write_pages(pages, data)
        self.num_loaded += len(pages)

    def load(self, digests: list[bytes], pages: list[int]) -> int:
        """Reads these pages' K/V into the pool; returns how many leading ones it could (a
        missing, foreign or corrupt file ends the run: it is deleted, never served)."""
        datas = []
        for digest in digests:
            page = self._read(self.key(digest))
            if page is None:
                break
            datas.append(page)
        if datas:
            self.pool.write_pages(pages[: len(datas)], torch.stack(datas))
            self.num_loaded += len(datas)
        return len(datas)

    def _read(self, key: str) -> torch.Tensor | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:
            self._forget(key)
            return None
        problem = self._check(blob)
        if problem is not None:
            logger.warning("disk tier: ignoring %s: %s", path, problem)
            self.num_rejected += 1
            self._forget(key)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        payload = bytearray(blob[_HEADER.size :])
        flat = torch.frombuffer(payload, dtype=torch.uint8)
        return flat.view(self.pool.dtype).view(self.pool.page_shape)

    def _check(self, blob: bytes) -> str | None:
        if len(blob) < _HEADER.size:
            return "truncated header"
        magic, identity, nbytes, crc = _HEADER.unpack_from(blob)
        if magic != MAGIC:
            return "not a page file"
        if identity != self.identity:
            return "written by a server with another model, tokenizer, dtype or page size"
        if nbytes != self.page_bytes or len(blob) - _HEADER.size != nbytes:
            return f"{len(blob) - _HEADER.size} payload bytes, {self.page_bytes} expected"
        if zlib.crc32(blob[_HEADER.size :]) != crc:
            return "checksum mismatch"
        return None

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    # ---- life -------------------------------------------------------------------------------

    def _disable(self, why: str) -> None:
        if self.is_enabled:
            logger.warning("disk tier off: %s; the prefix cache goes on in memory only", why)
        self.is_enabled = False

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until every queued page is written (tests; shutdown)."""
        done = threading.Event()
        if not self.is_enabled:
            return
        self._queue.put(("__flush__", done))
        done.wait(timeout)

    def stats(self) -> dict:
        with self._lock:
            return {
                "enabled": self.is_enabled,
                "pages": len(self._index),
                "bytes": self._bytes,
                "written": self.num_written,
                "loaded": self.num_loaded,
                "rejected": self.num_rejected,
            }

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self.is_enabled:
            self.flush()
            self._queue.put(None)
