"""Encoder models (the BERT family) from Hugging Face directories, and the pooling a model
declares in its sentence-transformers files.

`is_encoder(path)` tells an encoder directory from a decoder's (config.json's model type or
architecture), so `cadence serve --model-path <dir>` serves either without a flag.
sentence-transformers' layout: `modules.json` lists the modules in order (Transformer,
Pooling, Normalize, ...); the Pooling module's `config.json` says which pooling mode is on.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch

from cadence.layers.pooler import PoolingConfig
from cadence.models.bert import ENCODER_ARCHITECTURES, ENCODER_MODEL_TYPES, BertConfig, BertEncoder

logger = logging.getLogger(__name__)

# sentence-transformers' Pooling config keys, in the order it applies them, -> our modes.
_POOLING_KEYS = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
    ("pooling_mode_lasttoken", "last"),
)
_POOLING_NAMES = {"lasttoken": "last", "mean_sqrt_len_tokens": "mean_sqrt_len"}


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def is_encoder(path: str) -> bool:
    """Whether `path` is a Hugging Face directory of an encoder this server runs (BERT)."""
    config = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(config):
        return False
    try:
        cfg = _read_json(config)
    except (OSError, ValueError):
        return False
    archs = cfg.get("architectures") or []
    return cfg.get("model_type") in ENCODER_MODEL_TYPES or any(
        a in ENCODER_ARCHITECTURES for a in archs
    )


def read_pooling(path: str, default: PoolingConfig) -> PoolingConfig:
    """The pooling `path` declares in modules.json (its Pooling and Normalize modules), or
    `default` when it has no modules.json. Raises ValueError for a pooling mode it cannot
    serve (several modes at once, weighted mean)."""
    modules_path = os.path.join(path, "modules.json") if os.path.isdir(path) else ""
    if not modules_path or not os.path.isfile(modules_path):
        return default
    modules = _read_json(modules_path)
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    normalize = "Normalize" in kinds
    pooling = next((m for m, kind in zip(modules, kinds) if kind == "Pooling"), None)
    if pooling is None:
        return PoolingConfig(default.mode, normalize or default.normalize)
    cfg_path = os.path.join(path, pooling.get("path", ""), "config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    if isinstance(cfg.get("pooling_mode"), str):  # the mode by name, as its constructor takes it
        modes = [_POOLING_NAMES.get(cfg["pooling_mode"], cfg["pooling_mode"])]
    else:
        modes = [mode for key, mode in _POOLING_KEYS if cfg.get(key)]
    if cfg.get("pooling_mode_weightedmean_tokens"):
        raise ValueError(f"{cfg_path}: weighted-mean pooling is not supported")
    if len(modes) != 1:
        raise ValueError(
            f"{cfg_path}: exactly one pooling mode must be on (cls, mean, max, mean_sqrt_len, "
            f"lasttoken), got {modes or 'none'}"
        )
    return PoolingConfig(modes[0], normalize)


def load_encoder(path: str, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Returns (config, model) with weights in `dtype` on `device`, in eval mode; the
    projections are built by the caller (`model.build_linears`)."""
    from cadence.model_loader.loader import _iter_safetensors

    start = time.monotonic()
    config = BertConfig.from_hf_dir(path)
    with torch.device("meta"):
        model = BertEncoder(config)
    model = model.to_empty(device="cpu").to(torch.float32)
    counts: dict[str, int] = {}

    def counted(weights):
        for name, array in weights:
            kind = str(array.dtype).replace("torch.", "").upper().replace("FLOAT", "F")
            counts[kind] = counts.get(kind, 0) + 1
            yield name, array

    model.load_weights(counted(_iter_safetensors(path, progress=False)))
    model = model.to(dtype=dtype, device=device).eval()
    model.requires_grad_(False)
    served = str(dtype).replace("torch.", "")
    model.weight_types = {k: {"tensors": n, "served_as": served} for k, n in counts.items()}
    logger.info(
        "Loaded the encoder %s (%s, %d layers, %s) in %.1fs",
        os.path.basename(os.path.normpath(path)),
        config.architecture,
        config.num_hidden_layers,
        served,
        time.monotonic() - start,
    )
    return config, model
