"""The PEFT LoRA loader alone, over tiny adapters written here: what it accepts, what it
refuses (naming the file and the field or tensor), and the fused form it keeps: scaling
folded into B, B's q/k rows in the model's rotary order, zero blocks for parts an adapter
does not target. The fused product is compared with a plain computation from the PEFT
tensors, so a wrong fold, order or block placement fails here."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from cadence.layers.lora import TARGET_MODULES
from cadence.model_loader.lora_loader import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraLoadError,
    load_adapter,
    read_adapter_config,
)
from cadence.models.config import ModelConfig
from cadence.models.llama import interleave_rotary_rows

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
)
# (out, in) of each PEFT module on CONFIG
SHAPES = {
    "q_proj": (16, 16),
    "k_proj": (8, 16),
    "v_proj": (8, 16),
    "o_proj": (16, 16),
    "gate_proj": (32, 16),
    "up_proj": (32, 16),
    "down_proj": (16, 32),
}
BLOCK = {m: "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for m in SHAPES}


def key(layer: int, module: str, half: str, form: str = "peft") -> str:
    """A tensor name as PEFT writes it (`peft`), without the wrapper (`bare`), or with the
    adapter name PEFT keeps in memory (`named`)."""
    body = f"model.layers.{layer}.{BLOCK[module]}.{module}.lora_{half}"
    if form == "bare":
        return f"{body}.weight"
    if form == "named":
        return f"base_model.model.{body}.default.weight"
    return f"base_model.model.{body}.weight"


def peft_tensors(modules, rank=4, layers=(0, 1), seed=0, form="peft") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        for module in modules:
            rows, cols = SHAPES[module]
            out[key(layer, module, "A", form)] = torch.randn(rank, cols, generator=gen)
            out[key(layer, module, "B", form)] = torch.randn(rows, rank, generator=gen)
    return out


def write_adapter(path, modules=("q_proj", "v_proj"), rank=4, tensors=None, **config) -> str:
    """A PEFT adapter directory as PEFT saves one (every default field present)."""
    os.makedirs(path, exist_ok=True)
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.05,
        "target_modules": list(modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "fan_in_fan_out": False,
        "layers_to_transform": None,
        "inference_mode": True,
        **config,
    }
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(cfg, f)
    if tensors is None:
        tensors = peft_tensors(modules, rank)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    return str(path)


def load(path, **kw):
    return load_adapter(str(path), CONFIG, torch.float32, "cpu", **kw)


def refused(path, *needles, **kw) -> str:
    """Loads `path`, expecting a refusal whose message holds every needle."""
    with pytest.raises(LoraLoadError) as err:
        load(path, **kw)
    message = str(err.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


# ---- what it accepts -------------------------------------------------------------------


@pytest.mark.parametrize("form", ["peft", "bare", "named"])
def test_every_tensor_name_form_loads_the_same_product(tmp_path, form):
    reference = write_adapter(tmp_path / "ref", tensors=peft_tensors(("q_proj", "v_proj")))
    other = write_adapter(tmp_path / form, tensors=peft_tensors(("q_proj", "v_proj"), form=form))
    _, ref = load(reference)
    info, weights = load(other)
    assert info.rank == 4 and info.target_modules == ("q_proj", "v_proj")
    for layer in range(2):
        assert set(weights.layers[layer]) == {"qkv"}
        got, want = weights.layers[layer]["qkv"], ref.layers[layer]["qkv"]
        assert all(torch.equal(g, w) for g, w in zip(got.a + got.bt, want.a + want.bt))


def test_a_real_peft_config_with_its_default_fields_is_accepted(tmp_path):
    path = write_adapter(tmp_path, modules_to_save=[], loftq_config={}, layer_replication=None)
    info = read_adapter_config(path)
    assert (info.rank, info.alpha, info.use_rslora) == (4, 8.0, False)
    assert info.scaling == 2.0


def test_lora_alpha_defaults_to_r(tmp_path):
    path = write_adapter(tmp_path)
    with open(os.path.join(path, CONFIG_FILE)) as f:
        cfg = json.load(f)
    del cfg["lora_alpha"]
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(cfg, f)
    assert read_adapter_config(path).scaling == 1.0


# ---- what it refuses, and how it says so -----------------------------------------------


def test_missing_directory(tmp_path):
    refused(tmp_path / "nowhere", str(tmp_path / "nowhere"), "no such directory")


def test_missing_config(tmp_path):
    path = write_adapter(tmp_path)
    os.remove(os.path.join(path, CONFIG_FILE))
    refused(path, os.path.join(path, CONFIG_FILE), "missing")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_config_that_is_not_a_json_object(tmp_path, text):
    path = write_adapter(tmp_path)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        f.write(text)
    refused(path, os.path.join(path, CONFIG_FILE), "JSON")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("peft_type", "LOHA", "peft_type"),
        ("use_dora", True, "use_dora"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("rank_pattern", {"q_proj": 8}, "rank_pattern"),
        ("alpha_pattern", {"q_proj": 8}, "alpha_pattern"),
        ("fan_in_fan_out", True, "fan_in_fan_out"),
        ("bias", "lora_only", "bias"),
        ("bias", "all", "bias"),
        ("lora_alpha", "16", "lora_alpha"),
    ],
)
def test_config_fields_we_cannot_serve(tmp_path, field, value, needle):
    path = write_adapter(tmp_path, **{field: value})
    refused(path, os.path.join(path, CONFIG_FILE), needle)


@pytest.mark.parametrize("rank", ["4", 0, -2, 2.0, True, None])
def test_rank_must_be_a_positive_integer(tmp_path, rank):
    path = write_adapter(tmp_path, r=rank)
    refused(path, os.path.join(path, CONFIG_FILE), "r must be a positive integer", repr(rank))


def test_rank_above_the_servers_limit(tmp_path):
    path = write_adapter(tmp_path, rank=8)
    refused(path, CONFIG_FILE, "r is 8", "--max-lora-rank 4", max_rank=4)
    assert load(path, max_rank=8)[0].rank == 8


def test_targets_outside_the_servers_modules(tmp_path):
    path = write_adapter(tmp_path, modules=("q_proj", "v_proj"))
    message = refused(path, CONFIG_FILE, "'v_proj'", "--lora-target-modules", allowed=("q_proj",))
    assert "'q_proj']" in message  # the allowed list is shown
    assert load(path, allowed=("q_proj", "v_proj", "o_proj"))[0].rank == 4


@pytest.mark.parametrize(
    "targets", [["embed_tokens"], ["q_proj", "lm_head"], "embed_tokens", 7, ["q_proj", 3], []]
)
def test_targets_we_cannot_serve(tmp_path, targets):
    path = write_adapter(tmp_path, tensors=peft_tensors(("q_proj",)), target_modules=targets)
    refused(path, os.path.join(path, CONFIG_FILE), "target_modules")


def test_targets_we_cannot_serve_are_named_with_the_supported_ones(tmp_path):
    path = write_adapter(tmp_path, tensors=peft_tensors(("q_proj",)), target_modules=["lm_head"])
    message = refused(path, "lm_head", "cannot be served")
    assert all(m in message for m in TARGET_MODULES)


def test_tensor_of_the_wrong_shape_names_the_key_and_the_shape_needed(tmp_path):
    tensors = peft_tensors(("q_proj", "v_proj"))
    bad = key(1, "v_proj", "A")
    tensors[bad] = torch.zeros(4, 12)
    path = write_adapter(tmp_path, tensors=tensors)
    refused(path, os.path.join(path, WEIGHTS_FILE), repr(bad), "[4, 12]", "needs [4, 16]")
    tensors[bad] = torch.zeros(4, 16)
    tensors[key(0, "q_proj", "B")] = torch.zeros(16, 8)  # rank 8 in an r=4 adapter
    path = write_adapter(tmp_path, tensors=tensors)
    refused(path, repr(key(0, "q_proj", "B")), "needs [16, 4]")


def test_layer_beyond_the_base_model(tmp_path):
    tensors = peft_tensors(("q_proj",), layers=(0, 2))
    path = write_adapter(tmp_path, modules=("q_proj",), tensors=tensors)
    refused(path, WEIGHTS_FILE, repr(key(2, "q_proj", "A")), "2 layers")


@pytest.mark.parametrize("drop", ["A", "B"])
def test_one_half_without_the_other(tmp_path, drop):
    tensors = peft_tensors(("q_proj", "v_proj"))
    del tensors[key(1, "v_proj", drop)]
    path = write_adapter(tmp_path, tensors=tensors)
    refused(path, WEIGHTS_FILE, "layer 1 v_proj", f"no lora_{drop} weight")


def test_tensor_for_a_module_the_config_does_not_target(tmp_path):
    tensors = peft_tensors(("q_proj", "o_proj"))
    path = write_adapter(tmp_path, modules=("q_proj",), tensors=tensors)
    refused(path, WEIGHTS_FILE, repr(key(0, "o_proj", "A")), "target_modules")


def test_tensor_that_is_not_a_lora_weight(tmp_path):
    tensors = peft_tensors(("q_proj",))
    tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(64, 16)
    path = write_adapter(tmp_path, modules=("q_proj",), tensors=tensors)
    refused(path, WEIGHTS_FILE, "embed_tokens", "not a LoRA weight")


def test_weights_file_without_lora_tensors(tmp_path):
    path = write_adapter(tmp_path, tensors={})
    refused(path, WEIGHTS_FILE, "no LoRA weights")


def test_only_a_pickled_bin_file(tmp_path):
    path = write_adapter(tmp_path)
    os.remove(os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, "adapter_model.bin"), "wb") as f:
        f.write(b"not loaded")
    refused(path, os.path.join(path, WEIGHTS_FILE), "only safetensors", "adapter_model.bin")


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_truncated_weights_file(tmp_path, keep):
    path = write_adapter(tmp_path)
    file = os.path.join(path, WEIGHTS_FILE)
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[: int(len(data) * keep)])
    refused(path, file, "not a readable safetensors file")


# ---- the fused form --------------------------------------------------------------------


def reference_delta(tensors, layer, module, x, scaling) -> torch.Tensor:
    """x's LoRA output for one PEFT module, in the model's row order (q/k interleaved)."""
    a, b = tensors[key(layer, module, "A")], tensors[key(layer, module, "B")]
    delta = (x @ a.T @ b.T) * scaling  # [tokens, out], Hugging Face's row order
    heads = {"q_proj": CONFIG.num_attention_heads, "k_proj": CONFIG.num_key_value_heads}
    if module in heads:
        delta = interleave_rotary_rows(delta.T, heads[module]).T
    return delta


def fused_reference(tensors, layer, parts, targeted, x, scaling) -> torch.Tensor:
    pieces = []
    for part in parts:
        if part in targeted:
            pieces.append(reference_delta(tensors, layer, part, x, scaling))
        else:
            pieces.append(torch.zeros(x.shape[0], SHAPES[part][0]))
    return torch.cat(pieces, dim=1)


def delta(product, x: torch.Tensor) -> torch.Tensor:
    """s (x A^T) B^T of a loaded product over its fused output's columns, in float32."""
    out = product.offsets[-1] + product.bt[-1].shape[1]
    y = torch.zeros(x.shape[0], out)
    for a, bt, offset in zip(product.a, product.bt, product.offsets):
        y[:, offset : offset + bt.shape[1]] += (x.float() @ a.float().T) @ bt.float()
    return y * product.scale


@pytest.mark.parametrize(("rslora", "scaling"), [(False, 12 / 4), (True, 12 / math.sqrt(4))])
def test_fused_products_match_the_peft_computation(tmp_path, rslora, scaling):
    modules = TARGET_MODULES
    tensors = peft_tensors(modules, seed=3)
    path = write_adapter(tmp_path, modules=modules, tensors=tensors, lora_alpha=12,
                         use_rslora=rslora)  # fmt: skip
    info, weights = load(path)
    assert info.scaling == pytest.approx(scaling)
    fused = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
             "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for layer in range(2):
        assert set(weights.layers[layer]) == set(fused)
        for proj, parts in fused.items():
            product = weights.layers[layer][proj]
            x = torch.randn(5, product.a[0].shape[1], generator=gen)
            want = fused_reference(tensors, layer, parts, modules, x, scaling)
            got = delta(product, x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_q_and_k_rows_are_interleaved_not_left_in_peft_order(tmp_path):
    tensors = peft_tensors(("q_proj", "k_proj"), seed=5)
    path = write_adapter(tmp_path, modules=("q_proj", "k_proj"), tensors=tensors)
    _, weights = load(path)
    product = weights.layers[0]["qkv"]
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    got = delta(product, x)
    plain = torch.cat([(x @ tensors[key(0, m, "A")].T @ tensors[key(0, m, "B")].T) * 2.0
                       for m in ("q_proj", "k_proj")], dim=1)  # fmt: skip
    assert not torch.allclose(got[:, :24], plain)  # the order matters with these shapes
    want = fused_reference(tensors, 0, ("q_proj", "k_proj", "v_proj"), ("q_proj", "k_proj"), x, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_parts_not_targeted_are_empty_and_projections_not_targeted_are_absent(tmp_path):
    tensors = peft_tensors(("q_proj", "v_proj", "up_proj"), rank=2)
    path = write_adapter(tmp_path, modules=("q_proj", "v_proj", "up_proj"), rank=2,
                         tensors=tensors)  # fmt: skip
    _, weights = load(path)
    for layer in weights.layers:
        assert set(layer) == {"qkv", "gate_up"}
        qkv, gate_up = layer["qkv"], layer["gate_up"]
        assert [tuple(a.shape) for a in qkv.a] == [(2, 16), (0, 16), (2, 16)]  # q, k, v
        assert [tuple(bt.shape) for bt in qkv.bt] == [(2, 16), (0, 8), (2, 8)]
        assert qkv.offsets == (0, 16, 24)  # q | k | v columns
        assert [tuple(a.shape) for a in gate_up.a] == [(0, 16), (2, 16)]
        assert [tuple(bt.shape) for bt in gate_up.bt] == [(0, 32), (2, 32)]
        assert gate_up.offsets == (0, 32)


def test_a_layer_without_tensors_has_no_products(tmp_path):
    tensors = peft_tensors(("q_proj", "v_proj"), layers=(1,))
    path = write_adapter(tmp_path, tensors=tensors, layers_to_transform=[1])
    _, weights = load(path)
    assert weights.layers[0] == {} and set(weights.layers[1]) == {"qkv"}


@pytest.mark.parametrize("form", ["all-linear", "all"])
def test_all_linear_targets_every_module(tmp_path, form):
    path = write_adapter(tmp_path, tensors=peft_tensors(TARGET_MODULES), target_modules=form)
    info, weights = load(path)
    assert info.target_modules == TARGET_MODULES
    assert set(weights.layers[0]) == {"qkv", "o", "gate_up", "down"}


def test_regex_target_modules_over_module_names(tmp_path):
    tensors = peft_tensors(("q_proj", "v_proj"))
    path = write_adapter(tmp_path, tensors=tensors, target_modules="(q|v)_proj")
    info, _ = load(path)
    assert info.target_modules == ("q_proj", "v_proj")


def test_regex_target_modules_written_for_full_module_paths(tmp_path):
    tensors = peft_tensors(("q_proj", "v_proj"))
    regex = r".*\.(q_proj|v_proj)"  # PEFT: re.fullmatch(regex, "model.layers.0.self_attn.q_proj")
    path = write_adapter(tmp_path, tensors=tensors, target_modules=regex)
    info, _ = load(path)
    assert info.target_modules == ("q_proj", "v_proj")


def test_weights_land_in_the_dtype_asked_for(tmp_path):
    path = write_adapter(tmp_path)
    _, weights = load_adapter(path, CONFIG, torch.bfloat16, "cpu")
    product = weights.layers[0]["qkv"]
    tensors = product.a + product.bt
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
    assert weights.nbytes == sum(
        t.numel() * 2 for layer in weights.layers for p in layer.values() for t in p.a + p.bt
    )


@pytest.mark.parametrize(
    ("saved", "kept"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_the_files_precision_is_kept_exactly(tmp_path, saved, kept):
    tensors = {k: v.to(saved) for k, v in peft_tensors(("q_proj", "v_proj"), seed=4).items()}
    path = write_adapter(tmp_path, tensors=tensors)
    info, weights = load_adapter(path, CONFIG, None, "cpu")
    q_a = weights.layers[1]["qkv"].a[0]
    assert q_a.dtype == kept
    assert torch.equal(q_a.to(saved), tensors[key(1, "q_proj", "A")])  # not rounded again
    assert weights.layers[1]["qkv"].scale == info.scaling  # beside the weights, not folded in


def test_integer_weights_are_refused(tmp_path):
    tensors = {k: v.to(torch.int8) for k, v in peft_tensors(("q_proj", "v_proj")).items()}
    refused(write_adapter(tmp_path, tensors=tensors), "torch.int8", "float32, bfloat16 or float16")
