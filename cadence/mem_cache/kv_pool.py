"""Paged KV memory: the K/V tensors of every layer. Which page belongs to whom is the
allocator's business (`cadence.mem_cache.allocator`); a page holds `page_size` consecutive
token slots, and a token's slot is `page * page_size + offset`.
"""

from __future__ import annotations

import torch


class KVPool:
    """K/V storage for every layer: kv_buffer[layer] is [2, num_kv_heads, num_pages, page_size,
    head_dim] (K then V).

    Head-major, so gathering a batch's pages along the page dimension gives [2, heads, batch,
    length, head_dim] blocks that batched matmuls take without another copy; and paged, so each
    gathered index moves a whole page (one large memcpy) rather than one token. A token's slot
    is `page * page_size + offset`.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        scratch_page: bool = False,
    ):
        if num_pages < 1:
            raise ValueError("max_total_tokens is too small to hold a single KV page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # With `scratch_page`, one page past the last that no request is ever given: rows
        # that must write somewhere but belong to no one (a CUDA graph's padding) write there.
        self.scratch_page = num_pages if scratch_page else None
        physical = num_pages + int(scratch_page)
        self.num_slots = physical * page_size
        self.dtype = dtype
        self.device = device
        # torch.empty does not touch the memory: on the host, the OS commits each page only
        # when it is first written, unless `commit` writes them all now.
        shape = (2, num_kv_heads, physical, page_size, head_dim)
        self.kv_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.is_committed = False
        # Row offset of each (K/V, head) plane in a layer's flat [-1, head_dim] view.
        self._planes = (
            torch.arange(2 * num_kv_heads, dtype=torch.int64, device=device) * self.num_slots
        )

    @property
    def num_bytes(self) -> int:
        """Bytes of K/V storage, every layer's together."""
        return sum(buf.nbytes for buf in self.kv_buffer)

    def commit(self) -> None:
        """Writes every page once (zeros), so that the memory the pool will use under full
        load is taken now: a server's resident memory at idle is then what it needs at its
        busiest, and a memory limit set from it holds. Each buffer is written in place, layer
        by layer, so nothing is ever held twice; on a device whose allocator commits at
        allocation (CUDA) it only zeroes."""
        for buf in self.kv_buffer:
            buf.zero_()
        self.is_committed = True

    def write_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of the flat [-1, head_dim] view of a layer's buffer where tokens at `slots`
        keep their K and V heads: [len(slots) * 2 * heads], in (token, K/V, head) order —
        the order of a [tokens, 2, heads, head_dim] K/V tensor."""
        return (slots.unsqueeze(1) + self._planes).reshape(-1)

    def page_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Rows of the [-1, page_size * head_dim] view of a layer's buffer holding these pages,
        for every (K/V, head) plane: gathering them gives [2, heads, len(pages) * page_size,
        head_dim]. One index_select over dim 0 of that view moves whole pages with memcpy."""
        return (self._planes.unsqueeze(1) // self.page_size + pages.reshape(1, -1)).reshape(-1)

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A host copy of these pages' K/V, every layer: [len(pages), layers, 2, heads,
        page_size, head_dim], contiguous (what the disk tier writes, page by page)."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        stacked = torch.stack([buf.index_select(2, index) for buf in self.kv_buffer])
        return stacked.permute(3, 0, 1, 2, 4, 5).contiguous().cpu()

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Writes `data` (as `read_pages` gives it) into these pages."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        data = data.to(device=self.device, dtype=self.dtype)
        for layer, buf in enumerate(self.kv_buffer):
            buf.index_copy_(2, index, data[:, layer].permute(1, 2, 0, 3, 4))

    # ---- whole pages as bytes (prefill/decode disaggregation) ------------------------------

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page's K/V, every layer's together."""
        return self.num_bytes // self.kv_buffer[0].shape[2]

    @property
    def layout(self) -> str:
        """What two pools must share for pages to move between them as bytes."""
        return f"{str(self.dtype).replace('torch.', '')}:{list(self.page_shape)}"

    def gather_pages(
        self, pages: list[int], out: torch.Tensor, layers: slice = slice(None)
    ) -> None:
        """Packs these pages into `out` (1-D uint8 on the host, len(pages) * page_nbytes):
        layer by layer, each layer's [2, heads, len(pages), page_size, head_dim] block. With
        `layers`, only those layers' blocks, packed from the start of `out`."""
        buffers = self.kv_buffer[layers]
        if self._move_pages(pages, out, True, buffers):
            return
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        for buf, block in zip(buffers, self._blocks(out, len(pages), len(buffers))):
            if buf.device == block.device:
                torch.index_select(buf, 2, index, out=block)
            else:
                block.copy_(buf.index_select(2, index))

    def scatter_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Writes into these pages what `gather_pages` packed (from a pool of the same layout)."""
        if self._move_pages(pages, data, False, self.kv_buffer):
            return
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        for buf, block in zip(self.kv_buffer, self._blocks(data, len(pages))):
            buf.index_copy_(2, index, block.to(buf.device, non_blocking=False))

    def move_into(self, storage: torch.Tensor) -> None:
        """Moves every layer's buffer into `storage` (1-D uint8 on this pool's device, at
        least `num_bytes`; e.g. shared memory a peer maps), contents kept. Only between
        forward passes: the buffers are read from `kv_buffer` at each use."""
        if storage.dtype != torch.uint8 or storage.dim() != 1 or storage.numel() < self.num_bytes:
            raise ValueError(f"KV pool storage must be 1-D uint8 of {self.num_bytes} bytes")
        moved, offset = [], 0
        for buf in self.kv_buffer:
            view = storage[offset : offset + buf.nbytes].view(buf.dtype).view(buf.shape)
            view.copy_(buf)
            moved.append(view)
            offset += buf.nbytes
        self.kv_buffer = moved

    def copy_pages_from(
        self, src: list[torch.Tensor], src_pages: list[int], pages: list[int]
    ) -> None:
        """Copies pages `src_pages` of another pool's layers `src` (the same page layout,
        any number of pages) into this pool's `pages`."""
        src_index = torch.tensor(src_pages, dtype=torch.int64)
        index = torch.tensor(pages, dtype=torch.int64)
        if str(self.device) == "cpu" and all(t.is_cpu for t in src):
            from cadence.kernels import cpu_kernels_available

            if cpu_kernels_available():
                torch.ops.cadence.copy_pages_(src, src_index, self.kv_buffer, index)
                return
        for buf, other in zip(self.kv_buffer, src):
            buf.index_copy_(
                2, index.to(buf.device), other.index_select(2, src_index).to(buf.device)
            )

    def _move_pages(
        self, pages: list[int], packed: torch.Tensor, to_packed: bool, buffers: list[torch.Tensor]
    ) -> bool:
        """Cadence's CPU kernel for the move (memcpy per page plane), where it serves: a host
        pool and a host buffer. False: torch's index ops do it."""
        if str(self.device) != "cpu" or packed.device.type != "cpu":
            return False
        from cadence.kernels import cpu_kernels_available

        if not cpu_kernels_available():
            return False
        need = len(pages) * self.page_nbytes * len(buffers) // len(self.kv_buffer)
        if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() < need:
            raise ValueError(f"a page buffer must be 1-D uint8 of {need} bytes")
        index = torch.tensor(pages, dtype=torch.int64)
        torch.ops.cadence.move_pages_(buffers, index, packed[:need], to_packed)
        return True

    def _blocks(
        self, flat: torch.Tensor, num_pages: int, num_layers: int | None = None
    ) -> list[torch.Tensor]:
        """`flat`'s bytes as one [2, heads, num_pages, page_size, head_dim] view per layer
        (the first `num_layers` layers' worth; all by default)."""
        num_layers = len(self.kv_buffer) if num_layers is None else num_layers
        shape = (2, self.num_kv_heads, num_pages, self.page_size, self.head_dim)
        need = num_pages * self.page_nbytes * num_layers // len(self.kv_buffer)
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < need:
            raise ValueError(f"a page buffer must be 1-D uint8 of {need} bytes")
        typed = flat[:need].view(self.dtype)
        per_layer = typed.numel() // num_layers
        return [typed[i * per_layer : (i + 1) * per_layer].view(shape) for i in range(num_layers)]

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One page's K/V, every layer: [layers, 2, heads, page_size, head_dim]."""
        return (len(self.kv_buffer), 2, self.num_kv_heads, self.page_size, self.head_dim)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )
