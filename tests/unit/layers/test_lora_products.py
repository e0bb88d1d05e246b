"""LoRA products over a step whose rows use different adapters, or none (`LoraBatch`): the
grouping by adapter, and y = x W^T + (x A^T) B^T on exactly the rows of each adapter,
compared row by row with a plain per-request computation."""

from __future__ import annotations

import torch

from cadence.layers.lora import LoraBatch, LoraProduct, LoraWeights

IN, OUT = 8, 12
PROJ_SHAPES = {"qkv": (OUT, IN), "o": (IN, IN)}


def adapter(seed: int, rank: int = 3, projs=("qkv",), num_layers: int = 2) -> LoraWeights:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        products = {}
        for proj in projs:
            out, inp = PROJ_SHAPES[proj]
            products[proj] = LoraProduct(
                torch.randn(rank, inp, generator=gen), torch.randn(out, rank, generator=gen)
            )
        layers.append(products)
    return LoraWeights(layers)


def base(x: torch.Tensor, proj: str = "qkv") -> torch.Tensor:
    weight = torch.randn(*PROJ_SHAPES[proj], generator=torch.Generator().manual_seed(99))
    return x @ weight.T


def reference(adapters, counts, x, layer, proj="qkv") -> torch.Tensor:
    """Each request's rows on their own: base plus its adapter's product, if any."""
    rows, start = [], 0
    for weights, count in zip(adapters, counts):
        xs = x[start : start + count]
        y = base(xs, proj)
        product = weights.layers[layer].get(proj) if weights is not None else None
        if product is not None:
            y = y + (xs @ product.a.T) @ product.b.T
        rows.append(y)
        start += count
    return torch.cat(rows)


def tokens(n: int, width: int = IN) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(n))


def test_a_step_without_adapters_has_no_lora_batch():
    assert LoraBatch.build([None, None, None], [3, 1, 2], "cpu") is None
    assert LoraBatch.build([], [], "cpu") is None


def test_one_adapter_on_every_row_needs_no_index():
    a = adapter(1)
    batch = LoraBatch.build([a, a, a], [2, 1, 4], "cpu")
    assert batch is not None
    assert len(batch.groups) == 1 and batch.groups[0][0] is a and batch.groups[0][1] is None
    x = tokens(7)
    got = batch.apply(1, "qkv", x, base(x))
    torch.testing.assert_close(got, reference([a, a, a], [2, 1, 4], x, 1))


def test_mixed_rows_get_each_their_own_adapter_or_none():
    a, b = adapter(1), adapter(2, rank=5)
    adapters, counts = [a, None, b, a], [2, 3, 1, 4]
    batch = LoraBatch.build(adapters, counts, "cpu")
    assert batch is not None
    groups = {id(w): rows.tolist() for w, rows in batch.groups}
    assert groups == {id(a): [0, 1, 6, 7, 8, 9], id(b): [5]}  # the base model's rows: none
    x = tokens(10)
    for layer in range(2):
        y = base(x)
        got = batch.apply(layer, "qkv", x, y)
        assert got is y  # written in place
        torch.testing.assert_close(got, reference(adapters, counts, x, layer))
    # rows 2..4 are the base model's, exactly
    torch.testing.assert_close(batch.apply(0, "qkv", x, base(x))[2:5], base(x)[2:5])


def test_two_adapters_that_cover_every_row_are_indexed_apart():
    a, b = adapter(1), adapter(2)
    batch = LoraBatch.build([a, b], [3, 2], "cpu")
    assert batch is not None and len(batch.groups) == 2
    assert all(rows is not None for _, rows in batch.groups)
    x = tokens(5)
    torch.testing.assert_close(batch.apply(0, "qkv", x, base(x)), reference([a, b], [3, 2], x, 0))


def test_projections_an_adapter_does_not_target_are_untouched():
    only_qkv = adapter(3, projs=("qkv",))
    both = adapter(4, projs=("qkv", "o"))
    batch = LoraBatch.build([only_qkv, both], [2, 3], "cpu")
    assert batch is not None
    x = tokens(5)
    want = base(x, "o")
    got = batch.apply(0, "o", x, want.clone())
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)  # only_qkv's rows
    torch.testing.assert_close(got, reference([only_qkv, both], [2, 3], x, 0, "o"))
    alone = LoraBatch.build([only_qkv], [5], "cpu")
    assert alone is not None
    torch.testing.assert_close(alone.apply(1, "o", x, want.clone()), want, rtol=0, atol=0)


def test_a_layer_the_adapter_skips_is_untouched():
    a = LoraWeights([{}, adapter(5).layers[1]])
    batch = LoraBatch.build([a, None], [2, 2], "cpu")
    assert batch is not None
    x = tokens(4)
    torch.testing.assert_close(batch.apply(0, "qkv", x, base(x)), base(x), rtol=0, atol=0)
    torch.testing.assert_close(
        batch.apply(1, "qkv", x, base(x)), reference([a, None], [2, 2], x, 1)
    )


def test_products_in_another_dtype_land_in_the_activations_dtype():
    a = adapter(6)
    half = LoraWeights(
        [{p: LoraProduct(w.a.bfloat16(), w.b.bfloat16()) for p, w in layer.items()}
         for layer in a.layers]
    )  # fmt: skip
    batch = LoraBatch.build([half, None], [3, 1], "cpu")
    assert batch is not None
    x = tokens(4)
    got = batch.apply(0, "qkv", x, base(x))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference([a, None], [3, 1], x, 0), rtol=0.05, atol=0.5)


def test_nbytes_counts_every_product():
    a = adapter(7, rank=2, projs=("qkv", "o"))
    per_layer = (2 * IN + OUT * 2) + (2 * IN + IN * 2)
    assert a.nbytes == 2 * per_layer * 4
    assert LoraWeights([]).nbytes == 0
