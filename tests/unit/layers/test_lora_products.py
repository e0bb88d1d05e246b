"""LoRA products over a step whose rows use different adapters, or none (`LoraBatch`): the
grouping by adapter, and y = x W^T + (x A^T) B^T on exactly the rows of each adapter and the
columns of each part, compared row by row with a plain per-request computation, through
torch's ops (`LayerOps`) and Cadence's segmented CPU kernel (`CpuFusedOps.lora_products_`)."""

from __future__ import annotations

import pytest
import torch

from cadence.kernels import cpu_kernels_available
from cadence.layers.layer_ops import CpuFusedOps, LayerOps
from cadence.layers.lora import LoraBatch, LoraProduct, LoraWeights

IN, WIDE = 8, 20
# proj -> (in, the parts' output widths): a fused qkv of three parts, a single-part o, and a
# wide input (down's) whose columns span several of the kernel's column blocks.
PROJS = {"qkv": (IN, (6, 3, 3)), "o": (IN, (IN,)), "down": (WIDE, (300,))}

OPS = [pytest.param(LayerOps(), id="torch")]
if cpu_kernels_available():
    OPS.append(pytest.param(CpuFusedOps(), id="kernel"))


@pytest.fixture(params=OPS)
def ops(request):
    return request.param


def product(
    proj: str, rank: int, gen, skip: tuple[int, ...] = (), dtype=torch.float32
) -> LoraProduct:
    inp, outs = PROJS[proj]
    offsets = tuple(sum(outs[:i]) for i in range(len(outs)))
    a = tuple(
        torch.zeros(0, inp) if p in skip else torch.randn(rank, inp, generator=gen)
        for p in range(len(outs))
    )
    bt = tuple(
        torch.zeros(0, out) if p in skip else torch.randn(rank, out, generator=gen)
        for p, out in enumerate(outs)
    )
    scale = 0.5 + rank / 4  # each adapter its own
    return LoraProduct(
        tuple(t.to(dtype) for t in a), tuple(t.to(dtype) for t in bt), offsets, scale
    )


def adapter(
    seed: int, rank: int = 3, projs=("qkv",), num_layers: int = 2, skip=(), dtype=torch.float32
) -> LoraWeights:
    gen = torch.Generator().manual_seed(seed)
    return LoraWeights(
        [{proj: product(proj, rank, gen, skip, dtype) for proj in projs} for _ in range(num_layers)]
    )


def base(x: torch.Tensor, proj: str = "qkv") -> torch.Tensor:
    inp, outs = PROJS[proj]
    weight = torch.randn(sum(outs), inp, generator=torch.Generator().manual_seed(99))
    return x @ weight.T


def reference(adapters, counts, x, layer, proj="qkv") -> torch.Tensor:
    """Each request's rows on their own: base plus its adapter's product, if any, computed
    part by part in float64."""
    rows, start = [], 0
    for weights, count in zip(adapters, counts):
        xs = x[start : start + count]
        y = base(xs, proj).double()
        prod = weights.layers[layer].get(proj) if weights is not None else None
        if prod is not None:
            for a, bt, offset in zip(prod.a, prod.bt, prod.offsets):
                low = (xs.double() @ a.double().T) * prod.scale
                y[:, offset : offset + bt.shape[1]] += low @ bt.double()
        rows.append(y)
        start += count
    return torch.cat(rows).to(x.dtype)


def tokens(n: int, width: int = IN) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(n))


def test_a_step_without_adapters_has_no_lora_batch():
    assert LoraBatch.build([None, None, None], [3, 1, 2], "cpu") is None
    assert LoraBatch.build([], [], "cpu") is None


def test_one_adapter_on_every_row_is_one_group(ops):
    a = adapter(1)
    batch = LoraBatch.build([a, a, a], [2, 1, 4], "cpu")
    assert batch is not None
    assert batch.adapters == [a] and batch.starts == [0, 7]
    assert batch.rows.tolist() == list(range(7))
    x = tokens(7)
    got = batch.apply(1, "qkv", x, base(x), ops)
    torch.testing.assert_close(got, reference([a, a, a], [2, 1, 4], x, 1))


def test_mixed_rows_get_each_their_own_adapter_or_none(ops):
    a, b = adapter(1), adapter(2, rank=5)
    adapters, counts = [a, None, b, a], [2, 3, 1, 4]
    batch = LoraBatch.build(adapters, counts, "cpu")
    assert batch is not None
    groups = {
        id(w): batch.rows[batch.starts[g] : batch.starts[g + 1]].tolist()
        for g, w in enumerate(batch.adapters)
    }
    assert groups == {id(a): [0, 1, 6, 7, 8, 9], id(b): [5]}  # the base model's rows: none
    x = tokens(10)
    for layer in range(2):
        y = base(x)
        got = batch.apply(layer, "qkv", x, y, ops)
        assert got is y  # written in place
        torch.testing.assert_close(got, reference(adapters, counts, x, layer))
    # rows 2..4 are the base model's, exactly
    got = batch.apply(0, "qkv", x, base(x), ops)
    torch.testing.assert_close(got[2:5], base(x)[2:5], rtol=0, atol=0)


def test_two_adapters_that_cover_every_row_are_indexed_apart(ops):
    a, b = adapter(1), adapter(2)
    batch = LoraBatch.build([a, b], [3, 2], "cpu")
    assert batch is not None and len(batch.adapters) == 2
    x = tokens(5)
    got = batch.apply(0, "qkv", x, base(x), ops)
    torch.testing.assert_close(got, reference([a, b], [3, 2], x, 0))


def test_parts_an_adapter_does_not_target_keep_their_columns(ops):
    only_v = adapter(8, skip=(0, 1))  # q and k not targeted
    full = adapter(9, rank=4)
    batch = LoraBatch.build([only_v, full], [3, 2], "cpu")
    assert batch is not None
    x = tokens(5)
    want = base(x)
    got = batch.apply(0, "qkv", x, want.clone(), ops)
    torch.testing.assert_close(got[:3, :9], want[:3, :9], rtol=0, atol=0)  # q|k of only_v
    torch.testing.assert_close(got, reference([only_v, full], [3, 2], x, 0))


def test_projections_an_adapter_does_not_target_are_untouched(ops):
    only_qkv = adapter(3, projs=("qkv",))
    both = adapter(4, projs=("qkv", "o"))
    batch = LoraBatch.build([only_qkv, both], [2, 3], "cpu")
    assert batch is not None
    x = tokens(5)
    want = base(x, "o")
    got = batch.apply(0, "o", x, want.clone(), ops)
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)  # only_qkv's rows
    torch.testing.assert_close(got, reference([only_qkv, both], [2, 3], x, 0, "o"))
    alone = LoraBatch.build([only_qkv], [5], "cpu")
    assert alone is not None
    torch.testing.assert_close(alone.apply(1, "o", x, want.clone(), ops), want, rtol=0, atol=0)


def test_a_layer_the_adapter_skips_is_untouched(ops):
    a = LoraWeights([{}, adapter(5).layers[1]])
    batch = LoraBatch.build([a, None], [2, 2], "cpu")
    assert batch is not None
    x = tokens(4)
    torch.testing.assert_close(batch.apply(0, "qkv", x, base(x), ops), base(x), rtol=0, atol=0)
    torch.testing.assert_close(
        batch.apply(1, "qkv", x, base(x), ops), reference([a, None], [2, 2], x, 1)
    )


@pytest.mark.parametrize("rows", [1, 8, 37])
def test_wide_products_over_many_rows_and_adapters(ops, rows):
    """Enough rows and columns that the kernel splits its work over threads and blocks."""
    adapters = [adapter(20 + i, rank=16, projs=("down",)) for i in range(5)]
    names = [adapters[i % 5] if i % 6 != 5 else None for i in range(rows)]
    batch = LoraBatch.build(names, [1] * rows, "cpu")
    assert batch is not None
    x = tokens(rows, WIDE)
    got = batch.apply(1, "down", x, base(x, "down"), ops)
    torch.testing.assert_close(
        got, reference(names, [1] * rows, x, 1, "down"), rtol=1e-4, atol=1e-4
    )


@pytest.mark.skipif(not cpu_kernels_available(), reason="Cadence's CPU kernels are not built here")
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [5, 16])
def test_a_row_gets_the_same_sums_in_any_batch(weights, rank):
    """The kernel's product of a row does not depend on the rows that share its adapter:
    alone, or at any place in a group of 70 (past the kernel's blocks of rows), it comes out
    bit for bit the same, so a request's output does not depend on the batch it is served
    in. (torch's matmuls make no such promise.)"""
    ops = CpuFusedOps()
    a = adapter(40 + rank, rank=rank, projs=("down",), dtype=weights)
    x = tokens(70, WIDE)
    y = base(x, "down")
    alone = [
        LoraBatch.build([a], [1], "cpu").apply(1, "down", x[i : i + 1], y[i : i + 1].clone(), ops)
        for i in (0, 33, 69)
    ]
    together = LoraBatch.build([a], [70], "cpu").apply(1, "down", x, y.clone(), ops)
    for row, want in zip((0, 33, 69), alone):
        torch.testing.assert_close(together[row : row + 1], want, rtol=0, atol=0)
    torch.testing.assert_close(together, reference([a], [70], x, 1, "down"), rtol=1e-4, atol=1e-4)


def test_a_batch_of_the_same_adapters_reuses_the_gathered_arguments(ops):
    """`build` with a cache: one gathering of each projection's arguments per group
    composition, whatever the rows; another composition gathers its own."""
    a, b = adapter(50), adapter(51, rank=5)
    cache: dict = {}
    x = tokens(3)
    first = LoraBatch.build([a, b, None], [1, 1, 1], "cpu", cache)
    assert first is not None
    want = first.apply(0, "qkv", x, base(x), ops)
    again = LoraBatch.build([a, None, b], [1, 1, 1], "cpu", cache)  # other rows, same groups
    assert again is not None and again.args is first.args and (0, "qkv") in again.args
    x2 = x[[0, 2, 1]]
    torch.testing.assert_close(again.apply(0, "qkv", x2, base(x2), ops), want[[0, 2, 1]])
    other = LoraBatch.build([b, a], [1, 1], "cpu", cache)  # b's group first: another key
    assert other is not None and other.args is not first.args and len(cache) == 2
    assert first.apply(1, "o", x, base(x, "o"), ops).equal(base(x, "o"))  # not targeted
    assert first.args[(1, "o")] is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_activations_take_float32_products(ops, dtype):
    a = adapter(6)
    batch = LoraBatch.build([a, None], [3, 1], "cpu")
    assert batch is not None
    x = tokens(4)
    got = batch.apply(0, "qkv", x.to(dtype), base(x).to(dtype), ops)
    assert got.dtype == dtype
    want = reference([a, None], [3, 1], x, 0)
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.1)
    torch.testing.assert_close(got[3], base(x)[3].to(dtype), rtol=0, atol=0)  # the base row


def test_bfloat16_adapters_mix_with_float32_ones(ops):
    """An adapter saved in bfloat16 is served at that precision, summed in float32."""
    half, full = adapter(30, rank=8, dtype=torch.bfloat16), adapter(31, rank=4)
    batch = LoraBatch.build([half, None, full], [3, 1, 2], "cpu")
    assert batch is not None
    x = tokens(6)
    got = batch.apply(1, "qkv", x, base(x), ops)
    torch.testing.assert_close(
        got, reference([half, None, full], [3, 1, 2], x, 1), rtol=1e-4, atol=1e-4
    )


def test_nbytes_counts_every_product():
    a = adapter(7, rank=2, projs=("qkv", "o"))
    per_layer = (3 * 2 * IN + 2 * 12) + (2 * IN + 2 * IN)
    assert a.nbytes == 2 * per_layer * 4
    assert LoraWeights([]).nbytes == 0


@pytest.mark.skipif(not cpu_kernels_available(), reason="Cadence's CPU kernels are not built")
def test_the_kernel_refuses_what_does_not_fit():
    def op(y, x, rows, starts, a, bt, offsets, scales=(2.0,)):
        torch.ops.cadence.lora_products_(y, x, rows, starts, list(scales), a, bt, offsets)

    x, y, rows = torch.randn(2, IN), torch.zeros(2, 6), torch.tensor([0, 1])
    a, bt = [torch.randn(2, IN)], [torch.randn(2, 6)]
    with pytest.raises(RuntimeError, match="does not fit"):
        op(y, x, rows, [0, 2], a, [torch.randn(2, 7)], [0])  # wider than y
    with pytest.raises(RuntimeError, match="does not fit"):
        op(y, x, rows, [0, 2], [torch.randn(2, IN + 1)], bt, [0])  # A's width is not x's
    with pytest.raises(RuntimeError, match="row 5 is not in x"):
        op(y, x, torch.tensor([0, 5]), [0, 2], a, bt, [0])
    with pytest.raises(RuntimeError, match="starts"):
        op(y, x, rows, [0, 1], a, bt, [0])
    with pytest.raises(RuntimeError, match="one scale per group"):
        op(y, x, rows, [0, 2], a, bt, [0], scales=(1.0, 1.0))
    with pytest.raises(RuntimeError, match="must be matrices"):
        op(y, x, rows, [0, 2], [torch.randn(IN)], bt, [0])  # a vector is not skipped silently
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(y, x, rows, [0, 2], [a[0].double()], bt, [0])
    with pytest.raises(RuntimeError, match="one dtype"):
        op(y, x, rows, [0, 2], a, [bt[0].bfloat16()], [0])
    op(y, x, rows, [0, 2], a, bt, [0])
    torch.testing.assert_close(y, 2.0 * (x @ a[0].T) @ bt[0])


@pytest.mark.skipif(not cpu_kernels_available(), reason="Cadence's CPU kernels are not built")
def test_a_table_of_the_parts_gives_the_lists_products_and_is_checked():
    """`lora_table` checks a projection's parts once (what `lora_products_` refuses, it
    refuses); `lora_products_table_` then gives the same sums bit for bit, and still refuses
    a step the table does not fit."""
    ops = torch.ops.cadence
    gen = torch.Generator().manual_seed(5)
    widths, offsets = (IN, 3, 3), [0, IN, IN + 3]  # a fused projection of three parts

    def part(width, dtype=torch.float32):
        return torch.randn(4, IN, generator=gen).to(dtype), torch.randn(4, width, generator=gen).to(
            dtype
        )

    first = [part(w) for w in widths]  # group 0: float32, every part
    second = [
        part(widths[0], torch.bfloat16),
        (torch.zeros(0, IN), torch.zeros(0, 0)),
        part(widths[2]),
    ]
    a = [pa for pa, _ in first + second]  # group 1: bfloat16 first part, the second not targeted
    bt = [pb for _, pb in first + second]
    x, rows = torch.randn(5, IN, generator=gen), torch.tensor([4, 0, 2, 1, 3])
    starts, scales = [0, 3, 5], [1.5, 0.5]
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.lora_table(a[:2] + [a[2].bfloat16()] + a[3:], bt, offsets)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.lora_table(a[:1] + [torch.randn(4, IN + 1)] + a[2:], bt, offsets)
    table = ops.lora_table(a, bt, offsets)
    assert table.shape[0] == 5  # the empty part has no row
    want, got = torch.zeros(5, IN + 6), torch.zeros(5, IN + 6)
    ops.lora_products_(want, x, rows, starts, scales, a, bt, offsets)
    ops.lora_products_table_(got, x, rows, starts, scales, table)
    assert got.equal(want) and want.abs().sum() > 0
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.lora_products_table_(
            torch.zeros(5, IN + 5), x, rows, starts, scales, table
        )  # y too narrow
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.lora_products_table_(got, torch.randn(5, IN + 1), rows, starts, scales, table)
    with pytest.raises(RuntimeError, match="does not fit"):  # one group: b's parts have none
        ops.lora_products_table_(got, x, rows, [0, 5], [1.0], table)
    with pytest.raises(RuntimeError, match="must come from lora_table"):
        ops.lora_products_table_(got, x, rows, starts, scales, table.int())
