"""LoRA adapters for the default model (SmolLM2-135M's shapes) in PEFT's format, written
when the LoRA server is launched: random A and B, so that each changes the answer. Their
agreement with PEFT itself is tests/integration/test_lora.py's; here they only have to be
real adapters the server loads, mixes and swaps."""

from __future__ import annotations

import json
import os
import tempfile

from e2e_server import SESSION_TAG

LORA_DIR = os.path.join(tempfile.gettempdir(), f"cadence-e2e-lora-{SESSION_TAG}")
# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, 30 layers.
SHAPES = {  # module -> (out, in)
    "q_proj": (576, 576),
    "k_proj": (192, 576),
    "v_proj": (192, 576),
    "o_proj": (576, 576),
    "gate_proj": (1536, 576),
    "up_proj": (1536, 576),
    "down_proj": (576, 1536),
}
NUM_LAYERS = 30
# name -> (target modules, rank, seed)
ADAPTERS = {
    "french": (list(SHAPES), 8, 1),
    "sql": (["q_proj", "v_proj", "down_proj"], 4, 2),
    "extra": (["gate_proj", "up_proj", "o_proj"], 16, 3),
}


def write_adapter(name: str) -> str:
    """Writes adapter `name` under LORA_DIR (once); returns its directory."""
    import torch
    from safetensors.torch import save_file

    path = os.path.join(LORA_DIR, name)
    if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
        return path
    targets, rank, seed = ADAPTERS[name]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module in targets:
            out, inp = SHAPES[module]
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.1
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def lora_env() -> dict[str, str]:
    """Called as the LoRA server is launched: its adapters must exist by then."""
    for name in ADAPTERS:
        write_adapter(name)
    return {}
