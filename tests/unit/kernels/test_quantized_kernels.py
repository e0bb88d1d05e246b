"""Quantized projections (cadence/kernels/csrc/quant_*.cpp): the repacking of every GGUF type is
exact against gguf's own dequantization, and the product matches a float64 reference on odd
shapes and batch sizes, through the SIMD path this build has and through the portable loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cadence.kernels import cpu_kernels_available
from cadence.layers.quantized import QTYPES, QuantizedWeight, QuantLinear

gguf = pytest.importorskip("gguf")

if not cpu_kernels_available():
    pytest.skip(
        "Cadence's CPU kernels could not be built on this machine (see the log for why)",
        allow_module_level=True,
    )

T = gguf.GGMLQuantizationType
ops = torch.ops.cadence
# gguf quantizes these three in numpy; the k-quants it only dequantizes, so their blocks are
# built from random bytes with sane float16 factors.
QUANTIZABLE = {"Q4_0", "Q4_1", "Q8_0"}


def random_blocks(qtype: str, rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        w = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.01, 2.0, (rows, 1))
        return gguf.quants.quantize(w.astype(np.float32), T[qtype])
    block, size = gguf.GGML_QUANT_SIZES[T[qtype]]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)

    def f16(low, high):
        values = rng.uniform(low, high, (rows, k // block)).astype(np.float16)
        return values.view(np.uint8).reshape(rows, k // block, 2)

    if qtype == "Q6_K":
        raw[..., 208:210] = f16(1e-4, 1e-2)  # d
    else:
        raw[..., 0:2] = f16(1e-4, 1e-2)  # d
        raw[..., 2:4] = f16(0.0, 1e-2)  # dmin
    return raw.reshape(rows, -1)


def gguf_values(qtype: str, blocks: np.ndarray, k: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks, T[qtype]).reshape(blocks.shape[0], k).astype(np.float32)


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("rows", [1, 8, 21])
def test_repacking_is_exact_against_ggufs_dequantization(qtype, rows):
    k = 512
    blocks = random_blocks(qtype, rows, k, seed=rows)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES[qtype], k)
    got = ops.quant_dequantize(packed, QTYPES[qtype], rows, k).numpy()
    want = gguf_values(qtype, blocks, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit
    ids = torch.tensor([rows - 1, 0, rows // 2])
    picked = ops.quant_dequantize(packed, QTYPES[qtype], rows, k, ids).numpy()
    assert np.array_equal(picked.view(np.uint32), want[ids.numpy()].view(np.uint32))


def reference(x: torch.Tensor, w: np.ndarray, bias=None) -> torch.Tensor:
    out = x.double() @ torch.from_numpy(w).double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
# 5 and 8 rows: AVX-512 builds' 8-row register blocks of tile pairs (AVX2: the batched path);
# 130 rows: an AVX2 build's float32 strips; 401: three passes of the batched path
@pytest.mark.parametrize("batch", [1, 3, 5, 8, 17, 64, 130, 401])
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_quant_linear_matches_float64_on_the_dequantized_weight(qtype, batch, portable):
    # 51 rows: 7 tiles, the last one partial; the batched path takes runs of 4, 2 and 1 tiles
    rows, k = 51, 512
    blocks = random_blocks(qtype, rows, k, seed=batch)
    w = gguf_values(qtype, blocks, k)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES[qtype], k)
    x = torch.randn(batch, k, generator=torch.Generator().manual_seed(batch))
    bias = torch.randn(rows)
    fn = ops.quant_linear_portable if portable else ops.quant_linear
    got = fn(x, packed, QTYPES[qtype], rows, k, bias)
    want = reference(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (batch, rows)
    # float32 sums of float32 products: a few ulps of the terms' magnitude
    scale = (x.double().abs() @ torch.from_numpy(np.abs(w)).double().T).max()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * scale.item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_a_rows_result_does_not_depend_on_the_other_rows_of_the_call(qtype, dtype):
    """With 16-bit activations every loop sums a row in one order: a decode step of one row,
    a verify step of a request's token and its drafts, a batch and a prefill chunk give it the
    same bits, so neither speculative decoding nor a request's neighbours can move a greedy
    output where the result is rounded to bfloat16. Float32 activations keep that order in
    the 1-4 row loops only."""
    # 67 rows: 9 tiles, the last one partial (runs of 4, 2 and 1 tiles)
    rows, k = 67, 96 if qtype in QUANTIZABLE else 512
    blocks = random_blocks(qtype, rows, k, seed=5)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES[qtype], k)
    bias = torch.randn(rows)
    total = 401  # past an AVX2 build's float32 strips (128) and three passes (192 rows each)
    x = torch.randn(total, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    alone = torch.cat(
        [ops.quant_linear(x[i : i + 1], packed, QTYPES[qtype], rows, k, bias) for i in range(total)]
    )
    sizes = (2, 3, 4) if dtype == torch.float32 else (2, 3, 4, 5, 7, 8, 9, 13, 31, 127, 130, 401)
    for batch in sizes:
        for start in (0, total - batch):
            got = ops.quant_linear(x[start : start + batch], packed, QTYPES[qtype], rows, k, bias)
            assert torch.equal(got, alone[start : start + batch]), (batch, start)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("batch", [1, 2, 5, 8, 9, 33, 200])
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_bfloat16_rows_are_the_exact_product_rounded_once(qtype, batch, portable):
    """Bfloat16 activations (through the bfloat16 pair products where the CPU has them, the
    float32 loops elsewhere) sum exact products in float32 and round once to bfloat16: each
    output is one of the two bfloat16 neighbours of the exact product of the same inputs."""
    rows, k = 51, 96 if qtype in QUANTIZABLE else 512
    blocks = random_blocks(qtype, rows, k, seed=17 + batch)
    w = gguf_values(qtype, blocks, k)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES[qtype], k)
    x = torch.randn(batch, k, generator=torch.Generator().manual_seed(batch)).bfloat16()
    fn = ops.quant_linear_portable if portable else ops.quant_linear
    got = fn(x, packed, QTYPES[qtype], rows, k, None).double()
    want = reference(x.float(), w)
    # one bfloat16 step (8 significant bits) at the larger magnitude of the two, and a float32
    # rounding of the terms' magnitude for sums that cancel to near zero
    top = torch.maximum(got.abs(), want.abs()).clamp_min(1e-30)
    step = torch.exp2(torch.floor(torch.log2(top)) - 7)
    terms = x.double().abs() @ torch.from_numpy(np.abs(w)).double().T
    assert ((got - want).abs() <= step + 1e-6 * terms).all()


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_bfloat16_rows_give_float32_sums_on_request(qtype):
    """out_dtype=float32 (a bfloat16 model's logits): the float32 sums of the bfloat16 rows as
    they are, as exact as float32 rows would give, and the same bits for a row alone and in
    calls of any size."""
    rows, k = 67, 96 if qtype in QUANTIZABLE else 512
    blocks = random_blocks(qtype, rows, k, seed=9)
    w = gguf_values(qtype, blocks, k)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES[qtype], k)
    bias = torch.randn(rows)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = ops.quant_linear(x, packed, QTYPES[qtype], rows, k, bias, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (40, rows)
    scale = (x.double().abs() @ torch.from_numpy(np.abs(w)).double().T).max()
    torch.testing.assert_close(
        got.double(), reference(x.float(), w, bias), rtol=0, atol=2e-6 * scale.item()
    )
    alone = torch.cat(
        [
            ops.quant_linear(x[i : i + 1], packed, QTYPES[qtype], rows, k, bias, torch.float32)
            for i in range(len(x))
        ]
    )
    for batch in (2, 5, 8, 9, 17, 40):
        part = ops.quant_linear(x[:batch], packed, QTYPES[qtype], rows, k, bias, torch.float32)
        assert torch.equal(part, alone[:batch]), batch
    with pytest.raises(RuntimeError, match="out_dtype"):
        ops.quant_linear(x, packed, QTYPES[qtype], rows, k, bias, torch.float16)


@pytest.mark.parametrize("batch", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_bfloat16_rows_are_read_through_their_stride_and_padded_with_zeros(qtype, batch):
    """Bfloat16 rows that are a view of wider ones, and rows a few columns short of the
    weight's (the blocks' zero padding), give the bits of the same rows contiguous and padded
    with zeros, on every loop (the pair products read the rows straight, without a float32
    copy)."""
    rows, k = 51, 96 if qtype in QUANTIZABLE else 512
    blocks = random_blocks(qtype, rows, k, seed=23 + batch)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES[qtype], k)
    wide = torch.randn(batch, k + 45, generator=torch.Generator().manual_seed(batch)).bfloat16()
    view = wide[:, 7 : 7 + k]
    assert view.stride(0) == k + 45
    want = ops.quant_linear(view.contiguous(), packed, QTYPES[qtype], rows, k, None)
    assert torch.equal(ops.quant_linear(view, packed, QTYPES[qtype], rows, k, None), want)
    short = view[:, : k - 10]
    padded = torch.cat([short, torch.zeros(batch, 10, dtype=torch.bfloat16)], 1)
    got = ops.quant_linear(short, packed, QTYPES[qtype], rows, k, None)
    assert torch.equal(got, ops.quant_linear(padded, packed, QTYPES[qtype], rows, k, None))
    portable = ops.quant_linear_portable(padded, packed, QTYPES[qtype], rows, k, None)
    w = gguf_values(qtype, blocks, k)
    want = reference(padded.float(), w)
    top = torch.maximum(got.double().abs(), want.abs()).clamp_min(1e-30)
    step = torch.exp2(torch.floor(torch.log2(top)) - 7)
    terms = padded.double().abs() @ torch.from_numpy(np.abs(w)).double().T
    for result in (got, portable):
        assert ((result.double() - want).abs() <= step + 1e-6 * terms).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_one_row_through_tile_pairs_whose_second_tile_is_partial(qtype, threads):
    # 6 tiles, the last with 5 rows: AVX-512 builds take tiles two at a time
    rows, k = 45, 96 if qtype in QUANTIZABLE else 512
    blocks = random_blocks(qtype, rows, k, seed=11)
    w = gguf_values(qtype, blocks, k)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES[qtype], k)
    bias = torch.randn(rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batch in (1, 2, 4, 6, 8):
            x = torch.randn(batch, k, generator=torch.Generator().manual_seed(batch))
            got = ops.quant_linear(x, packed, QTYPES[qtype], rows, k, bias)
            scale = (x.double().abs() @ torch.from_numpy(np.abs(w)).double().T).max()
            torch.testing.assert_close(
                got.double(), reference(x, w, bias), rtol=0, atol=2e-6 * scale.item()
            )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
@pytest.mark.parametrize("rows", [523, 1291])
def test_a_prefill_chunk_over_several_weight_strips(qtype, dtype, rows):
    """Many rows go through the weight in float32 strips of 256 rows: 523 rows are three
    strips, the last one partial and not a whole number of 8-row tiles (a strip at a time,
    on every thread); 1291 rows are six, which two threads share strip by strip."""
    k, batch = 512, 150
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the strip-sharing path needs at least 2 strips per thread
    try:
        _check_strips(qtype, dtype, rows, k, batch)
    finally:
        torch.set_num_threads(threads)


def _check_strips(qtype, dtype, rows, k, batch):
    blocks = random_blocks(qtype, rows, k, seed=7)
    w = gguf_values(qtype, blocks, k)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES[qtype], k)
    x = torch.randn(batch, k, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(rows)
    got = ops.quant_linear(x.to(dtype), packed, QTYPES[qtype], rows, k, bias)
    with torch.inference_mode():  # as the engine runs it: the worker threads must be too
        inferred = ops.quant_linear(x.to(dtype), packed, QTYPES[qtype], rows, k, bias)
    assert torch.equal(inferred, got)
    assert got.dtype == dtype and got.shape == (batch, rows)
    want = reference(x.to(dtype).float(), w, bias)
    if dtype == torch.float32:
        scale = (x.double().abs() @ torch.from_numpy(np.abs(w)).double().T).max()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * scale.item())
    else:
        torch.testing.assert_close(got, want.to(dtype), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_activations_round_once_at_the_end(dtype):
    rows, k = 16, 256
    blocks = random_blocks("Q4_K", rows, k, seed=5)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES["Q4_K"], k)
    x = torch.randn(5, k).to(dtype)
    got = ops.quant_linear(x, packed, QTYPES["Q4_K"], rows, k)
    assert got.dtype == dtype
    want = reference(x, gguf_values("Q4_K", blocks, k)).to(dtype)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3, 17, 64])
@pytest.mark.parametrize("k", [45, 100, 577])  # odd K, K not a multiple of the 32-column group
def test_quantized_float_weights_on_odd_shapes(scheme, batch, k):
    from cadence.model_loader.quantize import SCHEMES, quantize_matrix

    rows = 19
    g = torch.Generator().manual_seed(k + batch)
    w = torch.randn(rows, k, generator=g)
    weight = quantize_matrix(w, SCHEMES[scheme])
    assert weight.shape == (rows, k) and weight.columns % 32 == 0
    lin = QuantLinear(weight)
    x = torch.randn(batch, k, generator=g)
    exact = weight.dequantize()  # what the kernel must multiply by
    assert exact.shape == (rows, k)
    scale = (x.abs() @ exact.abs().T).max().item()
    torch.testing.assert_close(
        lin(x).double(), x.double() @ exact.double().T, rtol=0, atol=2e-6 * scale
    )
    # The documented bound of the quantization itself, per group of 32 columns.
    padded = torch.nn.functional.pad(w, (0, weight.columns - k)).view(rows, -1, 32)
    err = torch.nn.functional.pad(exact - w, (0, weight.columns - k)).abs().view(rows, -1, 32)
    if scheme == "int8":
        bound = 0.5625 * padded.abs().amax(-1) / 127 + 2**-18
    else:
        spread = padded.amax(-1) - padded.amin(-1)
        bound = 0.5075 * spread / 15 + padded.amin(-1).abs() / 2048 + 2**-18
    assert (err.amax(-1) <= bound).all()


def test_a_fused_weight_of_several_types_and_float_rows():
    k = 256
    pieces = [
        QuantizedWeight.from_blocks("Q4_K", random_blocks("Q4_K", 24, k, 1)),
        QuantizedWeight.dense(torch.randn(5, k)),
        QuantizedWeight.from_blocks("Q6_K", random_blocks("Q6_K", 11, k, 2)),
    ]
    fused = QuantizedWeight.cat(pieces)
    assert fused.shape == (40, k) and fused.type_counts() == {"Q4_K": 1, "F32": 1, "Q6_K": 1}
    bias = torch.randn(40)
    lin = QuantLinear(fused, bias)
    x = torch.randn(3, k)
    want = x.double() @ fused.dequantize().double().T + bias.double()
    torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-4)
    assert lin(x.view(3, 1, k)).shape == (3, 1, 40)


def test_float_out_gives_float32_sums_of_bfloat16_rows_for_one_part_and_several():
    """QuantLinear.float_out (a quantized LM head): float32 results from bfloat16 rows, the
    kernel's own for one quantized part, through float32 rows for a weight of several."""
    k = 256
    one = QuantizedWeight.from_blocks("Q8_0", random_blocks("Q8_0", 40, k, 3))
    several = QuantizedWeight.cat(
        [one, QuantizedWeight.from_blocks("Q4_K", random_blocks("Q4_K", 16, k, 4))]
    )
    x = torch.randn(6, k).bfloat16()
    for weight in (one, several):
        lin = QuantLinear(weight)
        got = lin.float_out(x)
        assert got.dtype == torch.float32 and got.shape == (6, weight.shape[0])
        want = x.double() @ weight.dequantize().double().T
        scale = (x.double().abs() @ weight.dequantize().double().abs().T).max().item()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * scale)


def test_adjacent_parts_of_one_type_run_as_one_part():
    k = 128
    q, kk, v = (random_blocks("Q4_1", rows, k, seed) for rows, seed in ((24, 5), (13, 6), (13, 7)))
    pieces = [QuantizedWeight.from_blocks("Q4_1", b) for b in (q, kk, v)]
    pieces.append(QuantizedWeight.from_blocks("Q8_0", random_blocks("Q8_0", 9, k, 8)))
    fused = QuantizedWeight.cat(pieces)
    lin = QuantLinear(fused)
    assert [(qtype, rows) for qtype, _, rows in lin.parts] == [
        (QTYPES["Q4_1"], 50),
        (QTYPES["Q8_0"], 9),
    ]
    for batch in (1, 6, 130):  # the one-row, batched and prefill paths
        x = torch.randn(batch, k)
        want = x.double() @ fused.dequantize().double().T
        scale = (x.double().abs() @ fused.dequantize().double().abs().T).max().item()
        torch.testing.assert_close(lin(x).double(), want, rtol=0, atol=2e-6 * scale)


def test_rows_reorder_block_by_block_and_a_changed_kind_is_refused():
    k = 64
    weight = QuantizedWeight.from_blocks("Q8_0", random_blocks("Q8_0", 6, k, 3))
    order = np.array([5, 0, 3, 1, 2, 4])
    torch.testing.assert_close(
        weight[order].dequantize(), weight.dequantize()[order], rtol=0, atol=0
    )
    weight.parts[0].data = torch.zeros(6, 3 * 18, dtype=torch.uint8)  # Q4_0-sized rows now
    with pytest.raises(ValueError, match="changed kind"):
        QuantLinear(weight)


def test_kernel_refuses_mismatched_shapes():
    blocks = random_blocks("Q4_0", 8, 64, 4)
    packed = ops.quant_repack(torch.from_numpy(blocks), QTYPES["Q4_0"], 64)
    with pytest.raises(RuntimeError, match="columns"):
        ops.quant_linear(torch.randn(2, 128), packed, QTYPES["Q4_0"], 8, 64)
    with pytest.raises(RuntimeError, match="does not hold"):
        ops.quant_linear(torch.randn(2, 64), packed, QTYPES["Q4_0"], 9, 64)
    with pytest.raises(RuntimeError, match="not supported"):
        ops.quant_repack(torch.from_numpy(blocks), 6, 64)  # Q5_0


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_loads_and_projects_quantized_weights_without_knowing_their_type(tied):
    """Every matrix handed over as a QuantizedWeight (mixed types): the model fuses and reorders
    their rows, projects through the CPU platform's QuantLinear, releases the blocks, and
    computes what the same model loaded with the dequantized values computes."""
    from cadence.model_loader.quantize import quantize_matrix
    from cadence.models.config import ModelConfig
    from cadence.models.llama import LlamaForCausalLM
    from cadence.platforms.cpu import CpuPlatform

    config = ModelConfig(
        architecture="llama",
        vocab_size=80,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    g = torch.Generator().manual_seed(7)
    shapes = {"model.embed_tokens.weight": (80, 64), "model.norm.weight": (64,)}
    if not tied:
        shapes["lm_head.weight"] = (80, 64)
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
            p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
            p + "mlp.gate_proj.weight": (96, 64), p + "mlp.up_proj.weight": (96, 64),
            p + "mlp.down_proj.weight": (64, 96), p + "input_layernorm.weight": (64,),
            p + "post_attention_layernorm.weight": (64,),
        })  # fmt: skip
    floats = {n: torch.randn(*s, generator=g) * 0.2 for n, s in shapes.items()}
    kinds = ["Q8_0", "Q4_1", "Q4_0"]
    quantized = {
        n: quantize_matrix(w, kinds[i % 3]) if w.dim() == 2 else w
        for i, (n, w) in enumerate(floats.items())
    }
    dequantized = {
        n: w.dequantize() if isinstance(w, QuantizedWeight) else w for n, w in quantized.items()
    }

    def build(weights):
        model = LlamaForCausalLM(config)
        model.load_weights(weights.items())
        model.build_linears(CpuPlatform().make_linear)
        return model.requires_grad_(False)

    ours, ref = build(quantized), build(dequantized)
    qkv = ours.layers[0].qkv
    assert isinstance(qkv, QuantLinear) and len(set(qkv.qtypes)) == 3  # one part per type
    assert all(p.numel() == 0 for p in ours.layers[1].gate_up_proj.parts)  # blocks released
    hidden = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(
        ours.compute_logits(hidden), ref.compute_logits(hidden), rtol=1e-5, atol=1e-5
    )
    inputs = {
        "qkv": hidden,
        "o": hidden,
        "gate_up": hidden,
        "down": torch.randn(3, 96, generator=g),
    }
    for name, x in inputs.items():
        got, want = getattr(ours.layers[1], name)(x), getattr(ref.layers[1], name)(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 79, 5])
    torch.testing.assert_close(
        ours.embed_tokens.embedding(ids, torch.float32), ref.embed_tokens[ids], rtol=0, atol=0
    )
    assert (
        all(p.numel() == 0 for p in ours.embed_tokens.parts) == tied
    )  # tied: rows from the LM head's tiles
