"""The CUDA platform's Triton kernels against torch references, run on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported). Skipped, with the
reason printed, where triton does not install."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed on this machine")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from cadence.kernels import triton_ops  # noqa: E402
from cadence.mem_cache.kv_pool import KVPool  # noqa: E402

DEVICE = (
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
PAGE, HEADS, KV_HEADS, DIM = 4, 6, 2, 16


def _pool(num_pages: int = 80) -> KVPool:
    pool = KVPool(num_pages, PAGE, 1, KV_HEADS, DIM, torch.float32, DEVICE)
    pool.kv_buffer[0].normal_()
    return pool


def _reference(q, buf, pages_of, positions, extend_lens) -> torch.Tensor:
    """Row by row: softmax(q k^T) v over the request's keys at positions <= the row's."""
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    row = 0
    for i, n in enumerate(extend_lens):
        for _ in range(n):
            pos = int(positions[row])
            slots = [pages_of[i][p // PAGE] * PAGE + p % PAGE for p in range(pos + 1)]
            flat = buf.view(2, KV_HEADS, -1, DIM)[:, :, slots]  # [2, KVH, pos + 1, D]
            for h in range(HEADS):
                qh = q[row, h * DIM : (h + 1) * DIM]
                k, v = flat[0, h // group], flat[1, h // group]
                out[row, h * DIM : (h + 1) * DIM] = torch.softmax(k @ qh, 0) @ v
            row += 1
    return out


def _layout(seq_lens, extend_lens, num_pages=80, seed=0):
    """Each request's pages (shuffled over the pool), its page table, and row positions."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_pages, generator=g).tolist()
    pages_of, taken = [], 0
    for n in seq_lens:
        need = -(-n // PAGE)
        pages_of.append(order[taken : taken + need])
        taken += need
    width = max(len(p) for p in pages_of)
    table = torch.tensor([p + [p[0]] * (width - len(p)) for p in pages_of], dtype=torch.int64)
    positions = torch.cat([torch.arange(n - e, n) for n, e in zip(seq_lens, extend_lens)]).to(
        torch.int64
    )
    return pages_of, table, positions


@pytest.mark.parametrize(
    "seq_lens, extend_lens",
    [
        ([1, 7, 33, 130], [1, 1, 1, 1]),  # decode, lengths across page and tile edges
        ([5, 90], [5, 70]),  # prefill without and with a cached prefix (two row blocks)
        ([12, 20, 9], [4, 1, 3]),  # a verify step: drafts attend causally among themselves
    ],
)
def test_paged_attention_matches_the_reference(seq_lens, extend_lens):
    pool = _pool()
    pages_of, table, positions = _layout(seq_lens, extend_lens)
    t = sum(extend_lens)
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * DIM)  # q rows strided, as in the model
    q = qkv[:, : HEADS * DIM]
    decode = all(e == 1 for e in extend_lens)
    blocks = None
    if not decode:
        per_block = triton_ops.extend_block_tokens(HEADS, KV_HEADS)
        blocks = triton_ops.attention_blocks(extend_lens, torch.device(DEVICE), per_block)
    got = triton_ops.paged_attention(
        q.to(DEVICE), pool.kv_buffer[0], positions.to(DEVICE), table.to(DEVICE), HEADS, blocks
    )
    want = _reference(q, pool.kv_buffer[0].cpu(), pages_of, positions, extend_lens)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_attention_blocks_split_long_requests():
    blocks = triton_ops.attention_blocks([3, 130, 1], torch.device("cpu"), block_tokens=64)
    assert blocks.tolist() == [[0, 1, 1, 1, 2], [0, 3, 67, 131, 133], [3, 64, 64, 2, 1]]


def test_rope_and_store_rotates_and_writes_the_pool():
    pool = _pool()
    pool.kv_buffer[0].zero_()
    t = 3
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * DIM)
    angles = torch.rand(t, HEADS + KV_HEADS, DIM // 2) * 6
    factors = torch.polar(torch.rand_like(angles) + 0.5, angles)  # scale x rotation
    loc = torch.tensor([5, 17, 2], dtype=torch.int64)
    want = qkv.clone()
    qk = torch.view_as_complex(want[:, : (HEADS + KV_HEADS) * DIM].reshape(t, -1, DIM // 2, 2))
    want[:, : (HEADS + KV_HEADS) * DIM] = torch.view_as_real(qk * factors).reshape(t, -1)
    got = qkv.to(DEVICE)
    triton_ops.rope_and_store(
        got,
        torch.view_as_real(factors).contiguous().to(DEVICE),
        pool.kv_buffer[0],
        loc.to(DEVICE),
        HEADS,
    )
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    flat = pool.kv_buffer[0].cpu().view(2, KV_HEADS, -1, DIM)
    k = want[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(t, KV_HEADS, DIM)
    v = want[:, (HEADS + KV_HEADS) * DIM :].view(t, KV_HEADS, DIM)
    torch.testing.assert_close(flat[0][:, loc].transpose(0, 1), k)
    torch.testing.assert_close(flat[1][:, loc].transpose(0, 1), v)
    flat[0][:, loc] = 0
    flat[1][:, loc] = 0
    assert not flat.any()  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_and_the_residual_add(dtype):
    x = torch.randn(5, 100).to(dtype)
    residual = torch.randn(5, 100).to(dtype)
    w = torch.rand(100).to(dtype)
    want = torch.nn.functional.rms_norm(x.float(), (100,), w.float(), 1e-5).to(dtype)
    got = triton_ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5)
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=2e-3)
    summed = (residual.float() + x.float()).to(dtype)
    res = residual.to(DEVICE)
    got = triton_ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5, residual=res)
    torch.testing.assert_close(res.cpu(), summed)
    want = torch.nn.functional.rms_norm(summed.float(), (100,), w.float(), 1e-5).to(dtype)
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=2e-3)


def test_silu_and_mul():
    x = torch.randn(3, 2 * 1500)
    got = triton_ops.silu_and_mul(x.to(DEVICE))
    want = torch.nn.functional.silu(x[:, :1500]) * x[:, 1500:]
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
