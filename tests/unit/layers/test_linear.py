"""Projections behind `Platform.make_linear`: the packed CPU kernel computes what F.linear
computes, falls back where it has no kernel, and a model built on packed projections
releases the parameters it no longer reads and can adopt new weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cadence.layers.linear import Linear, MkldnnPackedLinear, pack_or_plain, refine_top_logits
from cadence.models.config import ModelConfig
from cadence.models.llama import LlamaForCausalLM
from cadence.platforms.cpu import CpuPlatform
from cadence.platforms.interface import Platform

needs_mkldnn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
# oneDNN packs bfloat16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT.
HAS_PACKED_BF16 = (
    torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)
needs_packed_bf16 = pytest.mark.skipif(
    not HAS_PACKED_BF16, reason="this CPU has no packed bfloat16 kernel"
)


def tiny_config(**kw) -> ModelConfig:
    base = dict(
        architecture="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return ModelConfig(**{**base, **kw})


def random_model(config: ModelConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model.requires_grad_(False)


@needs_mkldnn
@pytest.mark.parametrize(
    "dtype,tol", [pytest.param(torch.bfloat16, 0.0, marks=needs_packed_bf16), (torch.float32, 1e-5)]
)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_linear_matches_f_linear(dtype, tol, rows):
    torch.manual_seed(rows)
    w = torch.randn(96, 40, dtype=dtype)
    b = torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 40, dtype=dtype)
    lin = pack_or_plain(w, b)
    assert isinstance(lin, MkldnnPackedLinear) and not lin.holds_weight
    assert (lin.out_features, lin.in_features) == (96, 40)

    def check(x):
        got, want = lin(x), F.linear(x, w, b)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(
            got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=0
        )
        return got

    got = check(x)
    check(torch.randn(40, rows, dtype=dtype).t())  # non-contiguous rows
    check(torch.randn(2, rows, 40, dtype=dtype))  # 3-D
    # The packed copy is independent of the tensor it came from.
    w.zero_()
    torch.testing.assert_close(lin(x), got, atol=0, rtol=0)


def test_pack_or_plain_never_fails_on_a_dtype_without_a_packed_kernel():
    w, x = torch.randn(16, 8, dtype=torch.float16), torch.randn(3, 8, dtype=torch.float16)
    lin = pack_or_plain(w)  # packed where the CPU has float16 kernels, plain otherwise
    torch.testing.assert_close(lin(x), F.linear(x, w))


def test_base_platform_projects_through_the_weight_as_loaded():
    w = torch.randn(4, 3)
    lin = Platform().make_linear(w)
    assert type(lin) is Linear and lin.weight is w and lin.holds_weight


@needs_mkldnn
def test_cpu_platform_packs_unless_told_not_to(monkeypatch):
    w = torch.randn(8, 4, dtype=torch.bfloat16 if HAS_PACKED_BF16 else torch.float32)
    assert isinstance(CpuPlatform().make_linear(w), MkldnnPackedLinear)
    monkeypatch.setenv("CADENCE_CPU_PACKED_LINEAR", "0")
    assert type(CpuPlatform().make_linear(w)) is Linear


@needs_mkldnn
@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_releases_weights_and_adopts_new_ones(tied):
    """Same logits as the plain model; released parameters; a weight swap through the runner's
    `adopt_weights` serves the new weights."""
    from cadence.model_executor.model_runner import ModelRunner
    from cadence.server_args import ServerArgs

    config = tiny_config(tie_word_embeddings=tied)
    hidden = torch.randn(3, config.hidden_size)

    def logits_of(model, make_linear):
        model.build_linears(make_linear)
        layer = model.layers[0]
        x = layer.gate_up(hidden)
        return model.compute_logits(hidden), x

    plain = random_model(config, 0)
    want_logits, want_x = logits_of(plain, Linear)
    packed = random_model(config, 0)
    got_logits, got_x = logits_of(packed, pack_or_plain)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_x, want_x, atol=1e-5, rtol=1e-5)
    # Projection weights are released; the embedding table and the LM head weight stay.
    assert packed.layers[0].qkv_proj.numel() == 0 and packed.layers[1].down_proj.numel() == 0
    assert packed.embed_tokens.shape == (config.vocab_size, config.hidden_size)
    assert packed.lm_head_weight.shape == (config.vocab_size, config.hidden_size)

    runner = ModelRunner.__new__(ModelRunner)  # only what adopt_weights reads
    runner.config, runner.model, runner.platform = config, packed, CpuPlatform()
    runner.graphs = None
    runner.args = ServerArgs(lazy_kv_pool=True)  # no throwaway steps: there is no KV pool
    reference = random_model(config, 1)
    reference.build_linears(Linear)
    new_logits = reference.compute_logits(hidden)
    runner.adopt_weights(config, random_model(config, 1))
    torch.testing.assert_close(packed.compute_logits(hidden), new_logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(new_logits, want_logits)

    with pytest.raises(ValueError, match="intermediate_size"):
        runner.adopt_weights(
            tiny_config(tie_word_embeddings=tied, intermediate_size=64),
            random_model(tiny_config(tie_word_embeddings=tied, intermediate_size=64), 2),
        )
    torch.testing.assert_close(
        packed.compute_logits(hidden), new_logits, atol=1e-5, rtol=1e-5
    )  # unchanged


@pytest.mark.parametrize("vocab", [50, 640, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_refined_top_logits_give_the_exact_greedy_token(dtype, vocab):
    """Large logits rounded to a low-precision output tie near the top; after refinement the
    row's argmax is the float64 argmax, and every refined value is the exact logit."""
    torch.manual_seed(vocab)
    hidden = torch.randn(256, 64).to(dtype)
    weight = (torch.randn(vocab, 64) * 3).to(dtype)  # logits of a few tens: coarse steps
    exact = hidden.double() @ weight.double().T
    rounded = F.linear(hidden, weight).float()
    if dtype == torch.bfloat16:
        assert (rounded.argmax(-1) != exact.argmax(-1)).any()  # the rounding does flip greedy picks
    refined = refine_top_logits(rounded.clone(), hidden, weight)
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))
    changed = refined != rounded
    torch.testing.assert_close(refined[changed].double(), exact[changed], rtol=1e-5, atol=1e-4)
    top = exact.max(-1).values
    assert torch.allclose(refined.max(-1).values.double(), top, rtol=1e-5, atol=1e-4)
