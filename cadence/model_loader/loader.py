"""Build a ready model from a path: architecture, weights (GGUF, kept quantized unless asked
otherwise, or safetensors, optionally quantized at load), dtype."""

from __future__ import annotations

import glob
import logging
import os
import time

import numpy as np
import torch

from cadence.model_loader import gguf_loader
from cadence.model_loader.locate import is_gguf
from cadence.model_loader.quantize import quantize_floats
from cadence.models.config import ModelConfig

logger = logging.getLogger(__name__)


def load_config(path: str) -> ModelConfig:
    return gguf_loader.read_config(path) if is_gguf(path) else ModelConfig.from_hf_dir(path)


def _iter_safetensors(path: str, progress: bool):
    from safetensors.numpy import load_file
    from tqdm import tqdm

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model_path {path!r} has no *.safetensors files")
    for file in tqdm(files, desc="Loading safetensors", unit="file", disable=not progress):
        try:
            arrays = load_file(file)
        except TypeError:  # bfloat16 has no numpy dtype: fall back to torch tensors
            from safetensors.torch import load_file as load_torch

            arrays = load_torch(file)
        for name, array in arrays.items():
            # Where ml_dtypes is installed (it comes with JAX), numpy has a bfloat16 that
            # torch cannot take: read the same bits as torch's bfloat16.
            if isinstance(array, np.ndarray) and array.dtype.name == "bfloat16":
                array = torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
            yield name, array


def load_model(
    path: str,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    progress: bool = True,
    *,
    quantization: str | None = None,
    dequantize: bool = False,
    shard=None,
):
    """Returns (config, model) with weights in `dtype` on `device`, in eval mode.

    With `shard` (a `cadence.distributed.layout.ModelShard`), the model is that rank's share:
    tensors of other pipeline stages are not read; of a GGUF file's quantized matrices only
    this rank's blocks are copied out, and of any other tensor only its rows or columns kept.

    A GGUF file's quantized matrices stay quantized (`QuantizedWeight`s; the platform's
    `make_linear` decides how they run) unless `dequantize`; `quantization` ("int8", "int4")
    quantizes the float matrices of any model at load. `model.weight_types` reports, per
    type in the file, how many tensors it has and what they are served as.
    """
    from cadence.models.llama import LlamaForCausalLM

    start = time.monotonic()
    served: dict[str, dict] = {}
    reader = gguf_loader._reader(path) if is_gguf(path) else None
    config = gguf_loader.read_config(path, reader) if reader else ModelConfig.from_hf_dir(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, shard)
    if reader is not None:
        weights = gguf_loader.iter_weights(
            path,
            config,
            reader,
            progress=progress,
            keep_quantized=not dequantize,
            served=served,
            wanted=model.wants_weight,
            shard_of=model.shard_of,
        )
    else:
        weights = _count_float(_iter_safetensors(path, progress), served)
    if quantization is not None:
        weights = quantize_floats(weights, quantization, served)
    model = _materialize(model).to(torch.float32)
    model.load_weights(weights)
    reader = weights = None  # the file's mapping goes with the reader
    model = model.to(dtype=dtype, device=device).eval()
    model.requires_grad_(False)
    model.weight_types = _served_types(served, dtype)
    logger.info(
        "Loaded %s (%d layers, %s) in %.1fs; weights: %s",
        os.path.basename(path),
        config.num_hidden_layers,
        str(dtype).replace("torch.", ""),
        time.monotonic() - start,
        describe_weight_types(model.weight_types),
    )
    return config, model


def _materialize(model: torch.nn.Module) -> torch.nn.Module:
    """`model.to_empty(device="cpu")` for a model built on the meta device: uninitialized host
    tensors in place of its meta ones (tied ones stay tied), made with torch.empty, whose
    meta-tensor twin `empty_like` goes through torch's Python reference implementation and
    imports sympy and torch.fx on the way (about a second of CPU at every start)."""
    made: dict[int, torch.Tensor] = {}

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            empty = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            if isinstance(t, torch.nn.Parameter):
                empty = torch.nn.Parameter(empty, requires_grad=t.requires_grad)
            made[id(t)] = empty
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    table[name] = real(tensor)
    return model


def _count_float(weights, served: dict[str, dict]):
    for name, array in weights:
        kind = str(array.dtype).replace("torch.", "").upper().replace("FLOAT", "F")
        entry = served.setdefault(kind, {"tensors": 0, "served_as": "float"})
        entry["tensors"] += 1
        yield name, array


def _served_types(served: dict[str, dict], dtype: torch.dtype) -> dict[str, dict]:
    name = str(dtype).replace("torch.", "")
    return {
        kind: {**entry, "served_as": name if entry["served_as"] == "float" else entry["served_as"]}
        for kind, entry in served.items()
    }


def describe_weight_types(weight_types: dict[str, dict]) -> str:
    """ "Q4_1 x210 as Q4_1, F32 x61 as float32": each file type, its count, what it is served as."""
    return ", ".join(
        f"{kind} x{entry['tensors']} as {entry['served_as']}"
        for kind, entry in weight_types.items()
    )


def served_weight_types(model) -> dict[str, dict]:
    """`model.weight_types` corrected for the projections the platform built: where it widened
    quantized weights (no kernel for them), those types are served as float32."""
    from cadence.layers.quantized import DequantizedLinear

    types = dict(getattr(model, "weight_types", {}))
    if not hasattr(model, "lm_head_linear"):  # an encoder: its weights are served as loaded
        return types
    linears = [model.lm_head_linear] + [
        getattr(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")
    ]
    if any(isinstance(linear, DequantizedLinear) for linear in linears):
        from cadence.layers.quantized import QTYPES as quantized

        types = {
            kind: {**entry, "served_as": "float32"} if entry["served_as"] in quantized else entry
            for kind, entry in types.items()
        }
    return types
