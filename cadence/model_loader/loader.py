"""Build a ready model from a path: architecture, weights (dequantized GGUF or safetensors), dtype."""

from __future__ import annotations

import glob
import logging
import os
import time

import torch

from cadence.model_loader import gguf_loader
from cadence.model_loader.locate import is_gguf
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
        yield from arrays.items()


def load_model(
    path: str, dtype: torch.dtype, device: str | torch.device = "cpu", progress: bool = True
):
    """Returns (config, model) with weights in `dtype` on `device`, in eval mode."""
    from cadence.models.llama import LlamaForCausalLM

    start = time.monotonic()
    if is_gguf(path):
        reader = gguf_loader._reader(path)
        config = gguf_loader.read_config(path, reader)
        weights = gguf_loader.iter_weights(path, config, reader, progress=progress)
    else:
        config = ModelConfig.from_hf_dir(path)
        weights = _iter_safetensors(path, progress)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.float32)
    model.load_weights(weights)
    model = model.to(dtype=dtype, device=device).eval()
    model.requires_grad_(False)
    logger.info(
        "Loaded %s (%d layers, %s) in %.1fs",
        os.path.basename(path),
        config.num_hidden_layers,
        str(dtype).replace("torch.", ""),
        time.monotonic() - start,
    )
    return config, model


def tokenizer_dir(path: str, tokenizer_path: str | None = None) -> str:
    """A local directory holding the model's tokenizer files (tokenizer.json, its config and
    chat template): the model's own, or the converted one of a GGUF file."""
    source = tokenizer_path or path
    return gguf_loader.converted_tokenizer_dir(source) if is_gguf(source) else source


def load_tokenizer(path: str, tokenizer_path: str | None = None):
    """The model's own tokenizer (with its chat template) as a transformers fast tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(path, tokenizer_path))
