"""LoRA adapters in PEFT's format: `adapter_config.json` and `adapter_model.safetensors`.

An adapter is checked against the base model and the server's LoRA limits before anything
is kept: a refusal names the file and the field (or tensor) and says what would be accepted.
What is kept is the form the layers apply (`cadence.layers.lora`): per layer and fused
projection, each part's A and B^T (empty for a part not targeted), B's q and k rows put in
the model's interleaved rotary order (as the base weights are: `interleave_rotary_rows`),
and the scaling (lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA) beside them. The
weights are not changed otherwise: kept at the file's precision (`dtype=None`), an adapter is
served exactly as it was saved.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from cadence.layers.lora import FUSED_PARTS, TARGET_MODULES, LoraProduct, LoraWeights
from cadence.models.config import ModelConfig
from cadence.models.llama import interleave_rotary_rows

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)
_UNSUPPORTED = {  # adapter_config.json field -> why, when it is set to something we cannot serve
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "adapters that replace whole modules (modules_to_save) are not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "fan_in_fan_out": "fan_in_fan_out weights (Conv1D models) are not supported",
}


class LoraLoadError(ValueError):
    """An adapter that cannot be served: the message names the file and the field."""


@dataclass(frozen=True)
class AdapterInfo:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # PEFT module names, of TARGET_MODULES

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(path: str, max_rank: int | None = None,
                        allowed: tuple[str, ...] | None = None) -> AdapterInfo:  # fmt: skip
    """Checks `path`/adapter_config.json; `max_rank` and `allowed` (target modules) are the
    server's limits, None for none."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoraLoadError(f"LoRA adapter {path!r}: no such directory")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoraLoadError(f"{file}: missing (a PEFT adapter directory has one)") from None
    except (OSError, ValueError) as e:
        raise LoraLoadError(f"{file}: not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraLoadError(f"{file}: not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraLoadError(f"{file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for field, why in _UNSUPPORTED.items():
        if cfg.get(field):
            raise LoraLoadError(f"{file}: {field}: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoraLoadError(f"{file}: bias: {cfg['bias']!r} is not supported (only 'none')")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise LoraLoadError(f"{file}: r must be a positive integer, got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise LoraLoadError(f"{file}: r is {rank}, above this server's --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraLoadError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    targets = _target_modules(file, cfg.get("target_modules"))
    if allowed is not None:
        extra = [m for m in targets if m not in allowed]
        if extra:
            raise LoraLoadError(
                f"{file}: target_modules {extra} are outside this server's "
                f"--lora-target-modules {list(allowed)}"
            )
    return AdapterInfo(rank, float(alpha), bool(cfg.get("use_rslora", False)), targets)


def _target_modules(file: str, value) -> tuple[str, ...]:
    if value in ("all-linear", "all"):
        return TARGET_MODULES
    if isinstance(value, str):  # PEFT: a regex the whole module path must match
        names = tuple(m for m in TARGET_MODULES if _full_match(value, m))
    elif isinstance(value, list) and all(isinstance(m, str) for m in value):
        names = tuple(value)
    else:
        raise LoraLoadError(f"{file}: target_modules must be a list of module names")
    unknown = [m for m in names if m not in TARGET_MODULES]
    if unknown or not names:
        raise LoraLoadError(
            f"{file}: target_modules {unknown or value!r} cannot be served "
            f"(supported: {', '.join(TARGET_MODULES)})"
        )
    return names


def _full_match(pattern: str, module: str) -> bool:
    """Whether PEFT would target `module` of a Llama layer with the regex `pattern`."""
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    try:
        return any(
            re.fullmatch(pattern, path) is not None
            for path in (module, f"model.layers.0.{block}.{module}")
        )
    except re.error:
        return False


def load_adapter(
    path: str,
    config: ModelConfig,
    dtype: torch.dtype | None,
    device: torch.device | str = "cpu",
    max_rank: int | None = None,
    allowed: tuple[str, ...] | None = None,
) -> tuple[AdapterInfo, LoraWeights]:
    """Reads and checks the adapter at `path` for a base model of `config`. Its weights are
    kept in `dtype`, or with None at the file's precision: bfloat16 when every tensor is,
    float32 otherwise (float16 and float32 both fit it exactly)."""
    info = read_adapter_config(path, max_rank, allowed)
    tensors = _read_tensors(path, config, info)
    if dtype is None:
        saved = {t.dtype for pairs in tensors.values() for pair in pairs.values() for t in pair}
        dtype = torch.bfloat16 if saved == {torch.bfloat16} else torch.float32
    layers: list[dict[str, LoraProduct]] = []
    for layer_id in range(config.num_hidden_layers):
        products = {}
        for proj, parts in FUSED_PARTS.items():
            product = _fuse(config, info, tensors.get(layer_id, {}), proj, parts)
            if product is not None:
                a, bt, offsets = product
                products[proj] = LoraProduct(
                    tuple(t.to(device=device, dtype=dtype).contiguous() for t in a),
                    tuple(t.to(device=device, dtype=dtype).contiguous() for t in bt),
                    offsets,
                    info.scaling,
                )
        layers.append(products)
    return info, LoraWeights(layers)


def _shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every targetable module."""
    h, q, kv, inter = config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def _read_tensors(path: str, config: ModelConfig, info: AdapterInfo):
    """{layer: {module: (A, B)}} as float32, every shape checked."""
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        found = ", ".join(sorted(os.listdir(path)))
        raise LoraLoadError(
            f"{file}: missing (only safetensors weights are loaded; the directory has {found})"
        )
    shapes = _shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise LoraLoadError(f"{file}: tensor {key!r} is not a LoRA weight we can serve")
                layer_id, module, half = int(m.group(1)), m.group(2), m.group(3)
                if module not in info.target_modules:
                    raise LoraLoadError(f"{file}: tensor {key!r} is for {module}, "
                                        "which target_modules does not name")  # fmt: skip
                if layer_id >= config.num_hidden_layers:
                    raise LoraLoadError(
                        f"{file}: tensor {key!r}: the base model has "
                        f"{config.num_hidden_layers} layers"
                    )
                out, inp = shapes[module]
                want = (info.rank, inp) if half == "A" else (out, info.rank)
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != want:
                    raise LoraLoadError(
                        f"{file}: tensor {key!r} has shape {list(tensor.shape)}; "
                        f"r={info.rank} on this base model needs {list(want)}"
                    )
                if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise LoraLoadError(
                        f"{file}: tensor {key!r} is {tensor.dtype}; LoRA weights are "
                        "float32, bfloat16 or float16"
                    )
                halves.setdefault((layer_id, module), {})[half] = tensor
    except LoraLoadError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise LoraLoadError(f"{file}: not a readable safetensors file: {e}") from None
    tensors: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer_id, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoraLoadError(f"{file}: layer {layer_id} {module} has no {missing} weight")
        tensors.setdefault(layer_id, {})[module] = (pair["A"], pair["B"])
    if not tensors:
        raise LoraLoadError(f"{file}: holds no LoRA weights")
    return tensors


def _fuse(config: ModelConfig, info: AdapterInfo, modules: dict, proj: str, parts):
    """Per part of one fused projection: A [r, in], B^T [r, out_p] (q and k rows in the
    rotary order), [0, ...] for a part not targeted, and the parts' first output columns;
    None when the adapter targets none of its parts in this layer."""
    present = next((p for p in parts if p in modules), None)
    if present is None:
        return None
    shapes = _shapes(config)
    a, bt, offsets = [], [], []
    column = 0
    for part in parts:
        out, inp = shapes[part]
        offsets.append(column)
        column += out
        if part not in modules:
            a.append(torch.zeros(0, inp, dtype=modules[present][0].dtype))
            bt.append(torch.zeros(0, out, dtype=modules[present][0].dtype))
            continue
        part_b = modules[part][1]
        if part == "q_proj":
            part_b = interleave_rotary_rows(part_b, config.num_attention_heads)
        elif part == "k_proj":
            part_b = interleave_rotary_rows(part_b, config.num_key_value_heads)
        a.append(modules[part][0])
        bt.append(part_b.T)
    return a, bt, tuple(offsets)
