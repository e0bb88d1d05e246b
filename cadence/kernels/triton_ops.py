"""Triton kernels of the CUDA platform: paged attention over the KV pool, rotary with the
K/V store, and the element-wise ops of a decoder layer, each one launch.

They read the pool in its own layout (`KVPool`: [2, KVH, pages, page_size, D] per layer),
through each request's page table, so attention needs no gathered copy of the K/V and no
per-request Python loop, and a decode step is a fixed set of launches with fixed shapes:
what a CUDA graph captures. On a machine without a GPU they run under Triton's interpreter
(`TRITON_INTERPRET=1`, set before triton is imported), which is how CI tests them.

Importing this module imports triton; only the CUDA platform and the tests do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows one attention program takes: BLOCK_ROWS tokens x the (padded) heads of a KV group.
EXTEND_BLOCK_ROWS = 64
KV_BLOCK = 64


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    stride_q,
    kv_ptr,
    stride_plane,
    stride_head,
    o_ptr,
    stride_o,
    positions_ptr,
    page_table_ptr,
    stride_table,
    blocks_ptr,
    num_blocks,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    DECODE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: up to BLOCK_TOKENS query tokens of one request x the GROUP query heads of
    KV head `program_id(1)`, flattened into the rows of one tile, so each K/V tile is read
    once for the whole group. Row r attends to its request's keys at positions <= its own
    (causal, whatever came before: a decode token, drafts, or a prefill chunk over a cached
    prefix), online softmax in float32. Queries arrive scaled."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    if DECODE:  # one token per request: block b is request b's row b
        req = pid.to(tl.int64)
        row0 = req
        num_rows = 1
    else:
        req = tl.load(blocks_ptr + pid).to(tl.int64)
        row0 = tl.load(blocks_ptr + num_blocks + pid).to(tl.int64)
        num_rows = tl.load(blocks_ptr + 2 * num_blocks + pid)
    r = tl.arange(0, BLOCK_TOKENS * GROUP_PAD)
    tok = r // GROUP_PAD
    g = r % GROUP_PAD
    valid = (tok < num_rows) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    rows = row0 + tok
    q = tl.load(
        q_ptr + rows[:, None] * stride_q + head[:, None] * HEAD_DIM + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    qpos = tl.load(positions_ptr + rows, mask=valid, other=-1)
    kv_end = tl.max(qpos, 0) + 1
    m_i = tl.full([BLOCK_TOKENS * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_TOKENS * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_TOKENS * GROUP_PAD, HEAD_DIM], tl.float32)
    k_base = kv_ptr + kvh * stride_head
    for start in range(0, kv_end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        inside = kpos < kv_end
        page = tl.load(page_table_ptr + req * stride_table + kpos // PAGE, mask=inside, other=0)
        slot = page.to(tl.int64) * PAGE + kpos % PAGE
        at = k_base + slot[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(at, mask=inside[:, None], other=0.0)
        v = tl.load(at + stride_plane, mask=inside[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32)
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(
            tl.float32
        )
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        o_ptr + rows[:, None] * stride_o + head[:, None] * HEAD_DIM + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=valid[:, None],
    )


def extend_block_tokens(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per attention program outside decode (`attention_blocks`)."""
    return max(1, EXTEND_BLOCK_ROWS // triton.next_power_of_2(num_heads // num_kv_heads))


def attention_blocks(
    extend_lens: list[int], device: torch.device, block_tokens: int
) -> torch.Tensor:
    """The programs of a step with `extend_lens[i]` query tokens for request i, laid out
    flat in batch order, `block_tokens` (`extend_block_tokens`) at most in each: int32
    [3, blocks] of (request, first row, rows)."""
    reqs, starts, counts = [], [], []
    row = 0
    for i, n in enumerate(extend_lens):
        for first in range(0, n, block_tokens):
            reqs.append(i)
            starts.append(row + first)
            counts.append(min(block_tokens, n - first))
        row += n
    return torch.tensor([reqs, starts, counts], dtype=torch.int32).to(device, non_blocking=True)


def paged_attention(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    positions: torch.Tensor,
    page_table: torch.Tensor,
    num_heads: int,
    blocks: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `q` [T, >= H * D] (rows may be strided, heads contiguous) over each
    request's keys in `kv_buffer` [2, KVH, pages, page_size, D], up to each row's position.

    `page_table` [B, max_pages] holds request b's pages in position order. `blocks` (from
    `attention_blocks`, with `extend_block_tokens` tokens a block) maps rows to requests;
    None means decode: row b is request b's one token. Returns [T, H * D] in q's dtype."""
    _, kvh, _, page_size, head_dim = kv_buffer.shape
    group = num_heads // kvh
    group_pad = triton.next_power_of_2(group)
    t = q.shape[0]
    if out is None:
        out = torch.empty(t, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if blocks is None:
        grid, block_tokens, num_blocks = (t, kvh), max(1, 16 // group_pad), t
    else:
        num_blocks = blocks.shape[1]
        grid, block_tokens = (num_blocks, kvh), extend_block_tokens(num_heads, kvh)
    if num_blocks == 0:
        return out
    _paged_attention_kernel[grid](
        q,
        q.stride(0),
        kv_buffer,
        kv_buffer.stride(0),
        kv_buffer.stride(1),
        out,
        out.stride(0),
        positions,
        page_table,
        page_table.stride(0),
        positions if blocks is None else blocks,
        num_blocks,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_TOKENS=block_tokens,
        BLOCK_N=KV_BLOCK,
        HEAD_DIM=head_dim,
        PAGE=page_size,
        DECODE=blocks is None,
        # float32 stays float32 (no TF32 rounding): a float32 model answers as on the CPU
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    stride_t,
    factors_ptr,
    kv_ptr,
    stride_plane,
    stride_head,
    loc_ptr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    """Program (token, head) over the q, k and v heads of qkv: a q or k head is rotated in
    place (pair i times its complex factor, in float32, rounded once); a k or v head is then
    stored at the token's slot in the pool."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, HALF)
    row = qkv_ptr + t * stride_t + h * (2 * HALF)
    slot = tl.load(loc_ptr + t)
    if h < NUM_HEADS + NUM_KV_HEADS:
        x = tl.load(row + 2 * i).to(tl.float32)
        y = tl.load(row + 2 * i + 1).to(tl.float32)
        f = factors_ptr + (t * (NUM_HEADS + NUM_KV_HEADS) + h) * (2 * HALF) + 2 * i
        c = tl.load(f)
        s = tl.load(f + 1)
        xr = (x * c - y * s).to(qkv_ptr.dtype.element_ty)
        yr = (x * s + y * c).to(qkv_ptr.dtype.element_ty)
        tl.store(row + 2 * i, xr)
        tl.store(row + 2 * i + 1, yr)
        if h >= NUM_HEADS:
            dst = kv_ptr + (h - NUM_HEADS) * stride_head + slot * (2 * HALF)
            tl.store(dst + 2 * i, xr.to(kv_ptr.dtype.element_ty))
            tl.store(dst + 2 * i + 1, yr.to(kv_ptr.dtype.element_ty))
    else:
        d = tl.arange(0, 2 * HALF)
        v = tl.load(row + d)
        dst = kv_ptr + stride_plane + (h - NUM_HEADS - NUM_KV_HEADS) * stride_head
        tl.store(dst + slot * (2 * HALF) + d, v.to(kv_ptr.dtype.element_ty))


def rope_and_store(
    qkv: torch.Tensor,
    factors: torch.Tensor,
    kv_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    num_heads: int,
) -> None:
    """Rotates q and k of `qkv` [T, (H + 2 KVH) * D] in place (interleaved pairs; `factors`
    float32 [T, H + KVH, D/2, 2], the softmax scale folded into q's) and stores k and v at
    `out_cache_loc` in this layer's `kv_buffer`."""
    t = qkv.shape[0]
    _, kvh, _, _, head_dim = kv_buffer.shape
    if t == 0:
        return
    _rope_store_kernel[(t, num_heads + 2 * kvh)](
        qkv,
        qkv.stride(0),
        factors,
        kv_buffer,
        kv_buffer.stride(0),
        kv_buffer.stride(1),
        out_cache_loc,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=kvh,
        HALF=head_dim // 2,
    )


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    stride_x,
    res_ptr,
    stride_res,
    w_ptr,
    o_ptr,
    n,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: (with ADD) residual += x, rounded to the residual's dtype, then RMSNorm of
    the residual (else of x) times the weight, in float32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    inside = c < n
    x = tl.load(x_ptr + row * stride_x + c, mask=inside, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(res_ptr + row * stride_res + c, mask=inside, other=0.0).to(tl.float32)
        summed = (r + x).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + c, summed, mask=inside)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, 0) / n
    w = tl.load(w_ptr + c, mask=inside, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(var + eps) * w
    tl.store(o_ptr + row * n + c, y.to(o_ptr.dtype.element_ty), mask=inside)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of each row of `x` [T, N]; with `residual`, residual += x first (in place) and
    the norm is of the residual. Returns a new [T, N] tensor in the input's dtype."""
    src = x if residual is None else residual
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=src.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            x.stride(0),
            src,
            src.stride(0),
            weight,
            out,
            n,
            eps,
            ADD=residual is not None,
            BLOCK=triton.next_power_of_2(n),
        )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, stride_x, o_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < n
    g = tl.load(x_ptr + row * stride_x + c, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + c, mask=inside, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(o_ptr + row * n + c, y.to(o_ptr.dtype.element_ty), mask=inside)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I], in float32, rounded once."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, gate_up.stride(0), out, n, BLOCK=block
        )
    return out
