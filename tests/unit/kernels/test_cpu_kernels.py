"""Cadence's CPU kernels (cadence/kernels) against torch's own ops (`LayerOps`) and float64
references: the same numbers, rounding where torch rounds, on strided rows, every dtype."""

from __future__ import annotations

import pytest
import torch

from cadence.kernels import cpu_kernels_available
from cadence.layers.layer_ops import CpuFusedOps, LayerOps

if not cpu_kernels_available():
    pytest.skip(
        "Cadence's CPU kernels could not be built on this machine (see the log for why)",
        allow_module_level=True,
    )

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5


def ulps(dtype) -> float:
    """Relative tolerance of one rounding step, for sums that may add in another order."""
    return {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]


def strided_rows(rows: int, cols: int, dtype, seed: int) -> torch.Tensor:
    """[rows, cols] as a view with a row stride wider than cols (like q inside qkv)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols + 7, generator=g).to(dtype)[:, 3 : 3 + cols]


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_its_fused_residual_add_match_torch(dtype, rows):
    eager, fused = LayerOps(), CpuFusedOps()
    x = strided_rows(rows, 576, dtype, 0)
    weight = torch.randn(576).to(dtype)
    torch.testing.assert_close(
        fused.rms_norm(x, weight, EPS),
        eager.rms_norm(x, weight, EPS),
        rtol=ulps(dtype),
        atol=ulps(dtype),
    )
    residual = torch.randn(rows, 576).to(dtype) * 4
    res_eager, res_fused = residual.clone(), residual.clone()
    out_eager = eager.add_rms_norm_(res_eager, x, weight, EPS)
    out_fused = fused.add_rms_norm_(res_fused, x, weight, EPS)
    assert torch.equal(res_fused, res_eager)  # the in-place add rounds exactly as torch's add_
    torch.testing.assert_close(out_fused, out_eager, rtol=ulps(dtype), atol=ulps(dtype))


@pytest.mark.parametrize("rows", [1, 4, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype, rows):
    gate_up = strided_rows(rows, 2 * 1536, dtype, 1) * 3
    got = CpuFusedOps().silu_and_mul(gate_up)
    assert got.shape == (rows, 1536) and got.dtype == dtype
    # Two roundings (silu, then the product), as torch's two ops do: one step apart at most.
    torch.testing.assert_close(
        got, LayerOps().silu_and_mul(gate_up), rtol=2 * ulps(dtype), atol=ulps(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_q_and_k_in_place_and_leaves_v_alone(dtype):
    rows, heads, dim = 6, 12, 64  # 9 query heads and 3 key heads, then 3 value heads
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(rows, (heads + 3) * dim, generator=g).to(dtype)
    angles = torch.rand(rows, heads, dim // 2, generator=g) * 6.3
    factors = torch.polar(torch.full_like(angles, 0.125), angles)  # a rotation times a head scale
    eager_qkv, fused_qkv = qkv.clone(), qkv.clone()
    LayerOps().rotary_(eager_qkv[:, : heads * dim], factors)
    ops = CpuFusedOps()
    ops.rotary_(fused_qkv[:, : heads * dim], ops.rope_factors(factors))
    torch.testing.assert_close(fused_qkv, eager_qkv, rtol=ulps(dtype), atol=ulps(dtype))
    assert torch.equal(fused_qkv[:, heads * dim :], qkv[:, heads * dim :])
    assert not torch.equal(fused_qkv[:, : heads * dim], qkv[:, : heads * dim])


def paged_case(dtype, lens, num_heads=9, kv_heads=3, dim=64, page=16, seed=3):
    """A NaN-poisoned pool holding all but the last token of each sequence on scattered pages;
    this step's projections (q, k, v of each last token, not yet rotated) with their rotary
    factors; and the dense K/V and rotated q a reference attends with."""
    args, _, q, dense = drafted_case(
        dtype, lens, [1] * len(lens), num_heads, kv_heads, dim, page, seed
    )
    return args, q, dense


def reference_attention(q, dense, num_heads, kv_heads, dim):
    out = []
    for b, kv in enumerate(dense):
        qh = q[b].double().view(kv_heads, num_heads // kv_heads, dim)
        p = torch.softmax(qh @ kv[0].double().transpose(-1, -2), -1)
        out.append((p @ kv[1].double()).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_rotates_stores_and_reads_only_each_sequences_pages(dtype):
    # Lengths of one token, a whole page, past a page boundary, and long; slots past each
    # length (and unused pages) hold NaN, so reading any of them would show.
    lens = [1, 16, 17, 130, 45]
    args, q, dense = paged_case(dtype, lens)
    out = torch.ops.cadence.decode_attention(*args, 9)
    assert out.shape == q.shape and out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(
        out.double(),
        reference_attention(q, dense, 9, 3, 64),
        rtol=4 * ulps(dtype),
        atol=4 * ulps(dtype),
    )
    pool, slots = args[2], args[3]
    for b, kv in enumerate(dense):  # the new token's rotated K, and its V, are in the pool
        page, offset = divmod(int(slots[b]), 16)
        torch.testing.assert_close(
            pool[:, :, page, offset], kv[:, :, -1], rtol=ulps(dtype), atol=ulps(dtype)
        )


@pytest.mark.parametrize("page", [5, 16])
def test_decode_attention_weighs_odd_lengths_and_odd_pages_in_bfloat16(page):
    # Bfloat16 V is weighed two tokens at a time: an odd length leaves its last token alone
    # in a pair, and an odd page size pairs tokens page by page instead of across the row.
    lens = [1, 3, 31, 33, 97]
    args, q, dense = paged_case(torch.bfloat16, lens, page=page, seed=11)
    out = torch.ops.cadence.decode_attention(*args, 9)
    assert not out.isnan().any()
    torch.testing.assert_close(
        out.double(),
        reference_attention(q, dense, 9, 3, 64),
        rtol=4 * ulps(torch.bfloat16),
        atol=4 * ulps(torch.bfloat16),
    )


def test_decode_attention_takes_strided_rows_any_head_dim_and_group_size():
    args, q, dense = paged_case(torch.float32, [7, 40], num_heads=8, kv_heads=2, dim=24, page=8)
    qkv = args[0]
    wide = torch.zeros(2, qkv.shape[1] + 50)
    wide[:, : qkv.shape[1]] = qkv
    out = torch.ops.cadence.decode_attention(wide[:, : qkv.shape[1]], *args[1:], 8)
    torch.testing.assert_close(
        out.double(), reference_attention(q, dense, 8, 2, 24), rtol=1e-5, atol=1e-5
    )


def drafted_case(dtype, lens, new, num_heads=9, kv_heads=3, dim=64, page=16, seed=5):
    """paged_case with `new[b]` rows for request b (its last sampled token then its drafted
    ones): the pool holds each sequence's first lens[b] - new[b] tokens, and `dense` all of
    them, the new ones as the kernel must store them."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page) for n in lens) + 5
    pool = torch.full((2, kv_heads, num_pages, page, dim), float("nan"), dtype=dtype)
    order = torch.randperm(num_pages, generator=g).tolist()
    max_pages = max(-(-n // page) for n in lens)
    heads, rows = num_heads + kv_heads, sum(new)
    qkv = torch.randn(rows, (heads + kv_heads) * dim, generator=g).to(dtype)
    angles = torch.rand(rows, heads, dim // 2, generator=g) * 6.3
    scales = torch.tensor([dim**-0.5] * num_heads + [1.0] * kv_heads).view(1, -1, 1)
    factors = torch.polar(scales.expand_as(angles).contiguous(), angles)
    rotated = qkv.clone()
    LayerOps().rotary_(rotated[:, : heads * dim], factors)
    table, slots, dense, starts = [], [], [], [0]
    for n, k in zip(lens, new):
        pages = [order.pop() for _ in range(-(-n // page))]
        kv = torch.randn(2, kv_heads, n, dim, generator=g).to(dtype)
        first = starts[-1]
        kv[:, :, n - k :] = (
            rotated[first : first + k, num_heads * dim :]
            .view(k, 2, kv_heads, dim)
            .permute(1, 2, 0, 3)
        )
        for i in range(n - k):
            pool[:, :, pages[i // page], i % page] = kv[:, :, i]
        table.append(pages + [pages[0]] * (max_pages - len(pages)))
        slots += [pages[i // page] * page + i % page for i in range(n - k, n)]
        dense.append(kv)
        starts.append(first + k)
    args = (
        qkv,
        torch.view_as_real(factors),
        pool,
        torch.tensor(slots),
        torch.tensor(table),
        torch.tensor(lens),
    )
    return args, torch.tensor(starts), rotated[:, : num_heads * dim], dense


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_with_drafts_attends_causally_within_each_request(dtype):
    # A verify step: requests with 1 to 12 rows (the last one's drafts cross a page boundary),
    # each row attending to the tokens up to itself; NaN past them would show.
    lens, new = [1, 5, 20, 130, 45], [1, 5, 12, 3, 1]
    args, starts, q, dense = drafted_case(dtype, lens, new)
    out = torch.ops.cadence.decode_attention(*args, 9, starts)
    assert out.shape == q.shape and not out.isnan().any()
    want = []
    for b, (n, k) in enumerate(zip(lens, new)):
        for j in range(k):
            visible = [kv[:, :, : n - k + j + 1] for kv in dense[b : b + 1]]
            want.append(
                reference_attention(q[starts[b] + j : starts[b] + j + 1], visible, 9, 3, 64)[0]
            )
    torch.testing.assert_close(
        out.double(), torch.stack(want), rtol=4 * ulps(dtype), atol=4 * ulps(dtype)
    )
    pool, slots = args[2], args[3]
    for b, (kv, k) in enumerate(zip(dense, new)):  # every new row's K and V are in the pool
        for j in range(k):
            page, offset = divmod(int(slots[starts[b] + j]), 16)
            expect = kv[:, :, lens[b] - k + j]
            torch.testing.assert_close(
                pool[:, :, page, offset], expect, rtol=ulps(dtype), atol=ulps(dtype)
            )
    # One row per request through query_starts is plain decode, bit for bit.
    plain, _, _ = paged_case(dtype, [3, 40])
    once = torch.ops.cadence.decode_attention(*[a.clone() for a in plain], 9)
    again = torch.ops.cadence.decode_attention(
        *[a.clone() for a in plain], 9, torch.tensor([0, 1, 2])
    )
    assert torch.equal(once, again)


def test_decode_attention_rows_do_not_depend_on_how_the_batch_is_split_among_threads():
    # Drafting requests first, then plain ones: the threads' runs of (request, head, row)
    # tasks are cut by work, so where they are cut moves with the batch and the thread count.
    # Each row still gets the same bits: alone, in the batch, on one thread or on several.
    dtype = torch.bfloat16
    lens, new = [70, 90, 64, 33, 50, 20, 41, 3], [8, 8, 6, 1, 1, 1, 1, 1]
    args, starts, _, _ = drafted_case(dtype, lens, new, seed=9)
    batch = torch.ops.cadence.decode_attention(*[a.clone() for a in args], 9, starts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = torch.ops.cadence.decode_attention(*[a.clone() for a in args], 9, starts)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, serial)
    qkv, factors, pool, slots, table, seq_lens = args
    for b in range(len(lens)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        alone = torch.ops.cadence.decode_attention(
            qkv[rows].clone(),
            factors[rows].contiguous(),
            pool.clone(),
            slots[rows].contiguous(),
            table[b : b + 1].contiguous(),
            seq_lens[b : b + 1].contiguous(),
            9,
            torch.tensor([0, new[b]]),
        )
        assert torch.equal(alone, batch[rows])


def test_decode_attention_rejects_bad_query_starts():
    args, starts, _, _ = drafted_case(torch.float32, [5, 20], [2, 3])
    with pytest.raises(RuntimeError, match="from 0 to the number of rows"):
        torch.ops.cadence.decode_attention(*args, 9, starts + 1)
    with pytest.raises(RuntimeError, match="between 1 and seq_len rows"):
        torch.ops.cadence.decode_attention(*args, 9, torch.tensor([0, 0, 5]))
    with pytest.raises(RuntimeError, match="one row per request"):
        torch.ops.cadence.decode_attention(*args, 9)
    with pytest.raises(RuntimeError, match="each row's position"):
        torch.ops.cadence.decode_attention(*args, 9, torch.tensor([0, 3, 5]))


def test_decode_attention_rejects_bad_tables_and_shapes():
    (qkv, factors, pool, slots, table, lens), _, _ = paged_case(torch.float32, [5, 20])
    bad = table.clone()
    bad[1, 1] = pool.shape[2]  # a page past the pool
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.cadence.decode_attention(qkv, factors, pool, slots, bad, lens, 9)
    with pytest.raises(RuntimeError, match="seq_lens out of range"):
        torch.ops.cadence.decode_attention(
            qkv, factors, pool, slots, table, torch.tensor([5, 10_000]), 9
        )
    with pytest.raises(RuntimeError, match="each row's position"):
        torch.ops.cadence.decode_attention(qkv, factors, pool, slots + 1, table, lens, 9)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.cadence.decode_attention(qkv.bfloat16(), factors, pool, slots, table, lens, 9)
    with pytest.raises(RuntimeError, match="num_heads"):
        torch.ops.cadence.decode_attention(qkv, factors, pool, slots, table, lens, 8)


@pytest.mark.parametrize("vocab", [100, 9000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_refined_logits_match_torch_and_recover_the_exact_greedy_token(dtype, vocab):
    """The LM head's rounded output as float32, every logit that can be its row's maximum
    recomputed: the float64 argmax, the same values as the torch path, in one kernel."""
    g = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(40, 64 + 9, generator=g).to(dtype)[:, 9:]  # strided rows
    weight = (torch.randn(vocab, 64, generator=g) * 3).to(
        dtype
    )  # logits of a few tens: coarse steps
    exact = hidden.double() @ weight.double().T
    rounded = torch.nn.functional.linear(hidden, weight)
    got = CpuFusedOps().refined_logits(rounded, hidden, weight)
    assert got.dtype == torch.float32 and got.shape == (40, vocab)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    if dtype == torch.bfloat16 and vocab > 1000:
        assert (
            rounded.float().argmax(-1) != exact.argmax(-1)
        ).any()  # without it, greedy picks flip
    want = LayerOps().refined_logits(rounded, hidden, weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    untouched = got == rounded.float()
    assert untouched.float().mean() > 0.9  # only the candidates near the top were recomputed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "page_size, head_dim",
    [(16, 64), (2, 16), (1, 12)],  # blocks of 4 KiB / 2 KiB, 64 / 32 bytes, 48 / 24 bytes
)
def test_copy_pages_moves_exactly_the_listed_pages_of_every_layer_and_plane(
    dtype, page_size, head_dim
):
    """copy_pages_ (a decode server copying from a prefill server's pool): every (layer, K/V,
    head) block of each listed page lands on its page and nothing else changes, whatever
    the block's size (streamed, or copied plainly when it does not fit the streamed path)
    and however the pages are spread; the same as torch's index ops."""
    gen = torch.Generator().manual_seed(page_size * 1000 + head_dim)
    shape = (2, 3, 0, page_size, head_dim)  # K/V, heads, pages, page_size, head_dim

    def pool(pages: int) -> list[torch.Tensor]:
        size = (*shape[:2], pages, *shape[3:])
        return [torch.randn(size, generator=gen).to(dtype) for _ in range(4)]

    src, dst = pool(11), pool(9)
    src_pages = torch.randperm(11, generator=gen)[:7]
    dst_pages = torch.randperm(9, generator=gen)[:7]
    expected = [d.clone() for d in dst]
    for e, s in zip(expected, src):
        e.index_copy_(2, dst_pages, s.index_select(2, src_pages))
    torch.ops.cadence.copy_pages_(src, src_pages, dst, dst_pages)
    for got, want in zip(dst, expected):
        assert torch.equal(got, want)


def test_copy_pages_refuses_pages_outside_either_pool():
    src = [torch.zeros(2, 1, 3, 4, 8)]
    dst = [torch.zeros(2, 1, 2, 4, 8)]
    with pytest.raises(RuntimeError, match="source page 3 is not in its pool"):
        torch.ops.cadence.copy_pages_(src, torch.tensor([3]), dst, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="page 2 is not in the pool"):
        torch.ops.cadence.copy_pages_(src, torch.tensor([0]), dst, torch.tensor([2]))
