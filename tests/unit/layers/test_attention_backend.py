"""The attention backends against plain dense attention, on a paged pool whose unused
memory is poisoned with NaN (what a reused allocation can hold): the portable torch one
and the CPU one whose decode is Cadence's kernel."""

from __future__ import annotations

import pytest
import torch

from cadence.kernels import cpu_kernels_available
from cadence.layers.attention import CpuPagedBackend, TorchNativeBackend
from cadence.layers.forward_batch import ForwardBatch
from cadence.layers.layer_ops import CpuFusedOps
from cadence.mem_cache.kv_pool import KVPool

HEADS, KV_HEADS, DIM, PAGE = 6, 2, 8, 4


def dense_attention(q, k, v, causal_from: int):
    """q: [T, H, D] for positions causal_from.., k/v: [L, KVH, D]; reference in float64."""
    q, k, v = (x.double().transpose(0, 1) for x in (q, k, v))
    k = k.repeat_interleave(HEADS // KV_HEADS, 0)
    v = v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = q @ k.transpose(-1, -2)
    rows = torch.arange(causal_from, causal_from + q.shape[1])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > rows, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(q.shape[1], -1)


def attend(attn, q, kv, layer_id, batch):
    """The backend's attention for pre-rotated q [T, H*D] and kv [T, 2, KVH, D]. The kernel
    backend is entered as the model does (`forward_qkv`), with factors that rotate nothing."""
    if not isinstance(attn, CpuPagedBackend):
        return attn.forward(q, kv, layer_id, batch)
    t = q.shape[0]
    qkv = torch.cat([q.reshape(t, -1), kv.reshape(t, -1)], 1)
    ones = torch.ones(t, HEADS + KV_HEADS, DIM // 2, dtype=torch.complex64)
    ops = CpuFusedOps()
    return attn.forward_qkv(qkv, ops.rope_factors(ones), ops, layer_id, batch)


def make_backend(name: str, pool: KVPool):
    if name == "cpu-kernels":
        if not cpu_kernels_available():
            pytest.skip(
                "Cadence's CPU kernels could not be built on this machine (see the log for why)"
            )
        return CpuPagedBackend(pool, HEADS, KV_HEADS, DIM)
    return TorchNativeBackend(pool, HEADS, KV_HEADS, DIM)


def poisoned_case(dtype, backend, lens, pages):
    """A one-layer pool poisoned with NaN (stale memory: nothing outside written slots may be
    read) but for the given pages (the runner zeroes every page it hands out), the backend
    over it, each request's keys and values, and its slots for given positions."""
    pool = KVPool(
        num_pages=16, page_size=PAGE, num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype
    )
    pool.kv_buffer[0].fill_(float("nan"))
    attn = make_backend(backend, pool)
    for p in pages:
        pool.kv_buffer[0].index_fill_(2, torch.tensor(p), 0)
    keys = [torch.randn(n, KV_HEADS, DIM, dtype=dtype) for n in lens]
    values = [torch.randn(n, KV_HEADS, DIM, dtype=dtype) for n in lens]

    def slots(i, positions):
        return torch.tensor([pages[i][p // PAGE] * PAGE + p % PAGE for p in positions])

    return pool, attn, keys, values, slots


@pytest.mark.parametrize(
    "backend,float32_tokens",
    [("torch", 0), ("torch", 1024), ("cpu-kernels", 0)],
    ids=["torch-kv-dtype-matmuls", "torch-float32-matmuls", "cpu-kernels"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_extend_match_dense_attention(dtype, backend, float32_tokens, monkeypatch):
    # Small decode batches attend in float32, large ones in the cache's dtype: both paths.
    monkeypatch.setattr(TorchNativeBackend, "FLOAT32_DECODE_TOKENS", float32_tokens)
    torch.manual_seed(0)
    lens = [5, 11, 2]
    pages = [[9, 2], [0, 7, 12], [5]]  # scattered, not in order
    pool, attn, keys, values, slots = poisoned_case(dtype, backend, lens, pages)

    # Prefill all but the last token of each request: request 0 without a prefix, requests 1
    # and 2 on top of a prefix already in the pool.
    for i, n in enumerate(lens):
        split = 0 if i == 0 else n // 2
        if split:
            loc = slots(i, range(split))
            pool.kv_buffer[0].view(-1, DIM).index_copy_(
                0,
                pool.write_rows(loc),
                torch.stack([keys[i][:split], values[i][:split]], 1).reshape(-1, DIM),
            )
        ext = n - 1 - split
        if ext == 0:
            continue
        q = torch.randn(ext, HEADS, DIM, dtype=dtype)
        loc = slots(i, range(split, n - 1))
        kv = torch.stack([keys[i][split : n - 1], values[i][split : n - 1]], 1)  # [ext, 2, KVH, D]
        rows = pool.page_rows(torch.tensor(pages[i][: -(-(n - 1) // PAGE)]))
        batch = ForwardBatch(
            is_decode=False,
            input_ids=torch.zeros(ext, dtype=torch.int64),
            positions=torch.arange(split, n - 1),
            out_cache_loc=loc,
            kv_write_rows=pool.write_rows(loc),
            seq_lens=[n - 1],
            extend_lens=[ext],
            prefix_lens=[split],
            seq_page_rows=[rows if split else None],
        )
        out = attend(attn, q.reshape(ext, -1), kv, 0, batch)
        ref = dense_attention(q, keys[i][: n - 1], values[i][: n - 1], split)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)

    # One decode step for all three at once: different lengths, so padding is masked.
    q = torch.randn(len(lens), HEADS, DIM, dtype=dtype)
    loc = torch.cat([slots(i, [n - 1]) for i, n in enumerate(lens)])
    kv = torch.stack([torch.stack([k[-1] for k in keys]), torch.stack([v[-1] for v in values])], 1)
    max_pages = max(len(p) for p in pages)
    table = torch.tensor([p + [p[0]] * (max_pages - len(p)) for p in pages])
    lens_t = torch.tensor(lens)
    mask = (torch.arange(max_pages * PAGE)[None, :] >= lens_t[:, None]).view(1, len(lens), 1, -1)
    batch = ForwardBatch(
        is_decode=True,
        input_ids=torch.zeros(len(lens), dtype=torch.int64),
        positions=lens_t - 1,
        out_cache_loc=loc,
        kv_write_rows=pool.write_rows(loc),
        seq_lens=lens,
        extend_lens=[1] * len(lens),
        prefix_lens=[n - 1 for n in lens],
        page_table=table,
        kv_lens=lens_t,
        page_rows=pool.page_rows(table),
        kv_mask=mask,
    )
    out = attend(attn, q.reshape(len(lens), -1), kv, 0, batch)
    assert not out.isnan().any()
    for i, n in enumerate(lens):
        ref = dense_attention(q[i : i + 1], keys[i], values[i], n - 1)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "backend,keep_blocks,float32_tokens",
    [
        ("torch", True, 0),
        ("torch", True, 1024),
        ("torch", False, 0),
        ("torch", False, 1024),
        ("cpu-kernels", False, 0),
    ],
    ids=[
        "torch-kept-blocks-kv-dtype",
        "torch-kept-blocks-float32",
        "torch-gather-kv-dtype",
        "torch-gather-float32",
        "cpu-kernels",
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_over_a_changing_batch_match_dense_attention(
    dtype, backend, keep_blocks, float32_tokens, monkeypatch
):
    """Many decode steps: the batch continues (the torch backend's kept blocks get each new
    token), crosses page boundaries, loses a request and gains one; every step matches dense
    attention. The CPU kernel keeps nothing between steps."""
    monkeypatch.setattr(TorchNativeBackend, "FLOAT32_DECODE_TOKENS", float32_tokens)
    if not keep_blocks:
        monkeypatch.setattr(TorchNativeBackend, "DECODE_BLOCK_BYTES", 0)
    torch.manual_seed(1)
    pool = KVPool(
        num_pages=32, page_size=PAGE, num_layers=2, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype
    )
    for buf in pool.kv_buffer:
        buf.fill_(float("nan"))
    attn = make_backend(backend, pool)
    pages = {"a": [3, 17, 8, 25], "b": [11, 0, 30], "c": [6, 21, 14, 2], "d": [9, 28, 19]}
    for p in pages.values():
        for buf in pool.kv_buffer:
            buf.index_fill_(2, torch.tensor(p), 0)
    seqs = {r: {"k": [], "v": []} for r in pages}  # per request, per layer: [len, KVH, D] so far

    def slot(r, pos):
        return pages[r][pos // PAGE] * PAGE + pos % PAGE

    def prefill(r, n):  # n tokens straight into the pool (attention over them is tested above)
        k, v = torch.randn(2, n, KV_HEADS, DIM, dtype=dtype)
        loc = torch.tensor([slot(r, i) for i in range(n)])
        for buf in pool.kv_buffer:
            buf.view(-1, DIM).index_copy_(
                0, pool.write_rows(loc), torch.stack([k, v], 1).reshape(-1, DIM)
            )
        seqs[r] = {"k": k, "v": v}

    prefill("a", 3), prefill("b", 6), prefill("c", 1)
    last: tuple[list[str], list[int]] = ([], [])
    schedule = [["a", "b", "c"]] * 5 + [["a", "c"]] * 3 + [["a", "c", "d"]] * 3
    for step, names in enumerate(schedule):
        if "d" in names and not len(seqs["d"]["k"]):
            prefill("d", 2)
        lens = [len(seqs[r]["k"]) + 1 for r in names]
        continues = names == last[0] and all(n == m + 1 for n, m in zip(lens, last[1]))
        last = (names, lens)
        if step in (1, 6, 9):
            assert continues
        k_new, v_new = torch.randn(2, len(names), KV_HEADS, DIM, dtype=dtype)
        loc = torch.tensor([slot(r, n - 1) for r, n in zip(names, lens)])
        max_pages = -(-max(lens) // PAGE)
        table = torch.tensor(
            [
                (pages[r][: -(-n // PAGE)] + [pages[r][0]] * max_pages)[:max_pages]
                for r, n in zip(names, lens)
            ]
        )
        lens_t = torch.tensor(lens)
        mask = None
        if min(lens) != max_pages * PAGE:
            mask = (torch.arange(max_pages * PAGE)[None, :] >= lens_t[:, None]).view(
                1, len(names), 1, -1
            )
        batch = ForwardBatch(
            is_decode=True,
            input_ids=torch.zeros(len(names), dtype=torch.int64),
            positions=lens_t - 1,
            out_cache_loc=loc,
            kv_write_rows=pool.write_rows(loc),
            seq_lens=lens,
            extend_lens=[1] * len(names),
            prefix_lens=[n - 1 for n in lens],
            page_table=table,
            kv_lens=lens_t,
            page_rows=pool.page_rows(table),
            kv_mask=mask,
            decode_continues=continues,
        )
        for r, k, v in zip(names, k_new, v_new):
            seqs[r] = {
                "k": torch.cat([seqs[r]["k"], k[None]]),
                "v": torch.cat([seqs[r]["v"], v[None]]),
            }
        for layer in range(2):
            q = torch.randn(len(names), HEADS, DIM, dtype=dtype)
            out = attend(
                attn, q.reshape(len(names), -1), torch.stack([k_new, v_new], 1), layer, batch
            )
            for i, (r, n) in enumerate(zip(names, lens)):
                ref = dense_attention(q[i : i + 1], seqs[r]["k"], seqs[r]["v"], n - 1)
                torch.testing.assert_close(
                    out[i : i + 1].double(),
                    ref,
                    atol=2e-2,
                    rtol=2e-2,
                    msg=lambda m: f"step {step}, layer {layer}, request {r}: {m}",
                )
    assert (attn.decode_state_bytes() > 0) == keep_blocks
    attn.release_decode_state()
    assert attn.decode_state_bytes() == 0


@pytest.mark.parametrize(
    "backend,float32_tokens",
    [("torch", 0), ("torch", 1024), ("cpu-kernels", 0)],
    ids=["torch-kv-dtype-matmuls", "torch-float32-matmuls", "cpu-kernels"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_step_attends_causally_among_each_requests_drafts(
    dtype, backend, float32_tokens, monkeypatch
):
    """A decode step with several rows per request (the last token, then drafted ones):
    each row sees its sequence up to itself, nothing of the rows after it, and nothing of
    other requests; the batch mixes a request without drafts, drafts inside one page and
    drafts across a page boundary."""
    monkeypatch.setattr(TorchNativeBackend, "FLOAT32_DECODE_TOKENS", float32_tokens)
    torch.manual_seed(1)
    lens, news = [5, 7, 10], [1, 3, 4]
    pages = [[9, 2], [0, 7], [5, 12, 3]]
    pool, attn, keys, values, slots = poisoned_case(dtype, backend, lens, pages)
    assert attn.decode_takes_drafts

    for i, (n, k) in enumerate(zip(lens, news)):  # the cached prefix of each request
        loc = slots(i, range(n - k))
        pool.kv_buffer[0].view(-1, DIM).index_copy_(
            0,
            pool.write_rows(loc),
            torch.stack([keys[i][: n - k], values[i][: n - k]], 1).reshape(-1, DIM),
        )
    rows = sum(news)
    q = torch.randn(rows, HEADS, DIM, dtype=dtype)
    loc = torch.cat([slots(i, range(n - k, n)) for i, (n, k) in enumerate(zip(lens, news))])
    kv = torch.cat(
        [
            torch.stack([keys[i][n - k :], values[i][n - k :]], 1)
            for i, (n, k) in enumerate(zip(lens, news))
        ]
    )
    max_pages = max(len(p) for p in pages)
    table = torch.tensor([p + [p[0]] * (max_pages - len(p)) for p in pages])
    lens_t = torch.tensor(lens)
    batch = ForwardBatch(
        is_decode=True,
        input_ids=torch.zeros(rows, dtype=torch.int64),
        positions=torch.cat([torch.arange(n - k, n) for n, k in zip(lens, news)]),
        out_cache_loc=loc,
        kv_write_rows=pool.write_rows(loc),
        seq_lens=lens,
        extend_lens=news,
        prefix_lens=[n - k for n, k in zip(lens, news)],
        page_table=table,
        kv_lens=lens_t,
        page_rows=pool.page_rows(table),
        query_starts=torch.tensor([0, 1, 4, 8]),
    )
    out = attend(attn, q.reshape(rows, -1), kv, 0, batch)
    assert out.shape == (rows, HEADS * DIM) and not out.isnan().any()
    start = 0
    for i, (n, k) in enumerate(zip(lens, news)):
        ref = dense_attention(q[start : start + k], keys[i], values[i], n - k)
        torch.testing.assert_close(out[start : start + k].double(), ref, atol=2e-2, rtol=2e-2)
        start += k
