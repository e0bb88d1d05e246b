"""Server arguments: one frozen dataclass, whose field docstrings double as `--help` text.

Imports nothing heavy, so `cadence serve --help` answers at once.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from dataclasses import dataclass, fields
from functools import lru_cache

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None
    """A .gguf file or a Hugging Face model directory; default: the embedded SmolLM2-135M-Instruct."""
    tokenizer_path: str | None = None
    """Tokenizer to use instead of the model's own (a directory with tokenizer.json, or a .gguf)."""
    served_model_name: str | None = None
    """Model id reported by the API; default: the model path's name."""
    chat_template: str | None = None
    """A Jinja chat template file overriding the model's own."""
    host: str = "127.0.0.1"
    """Address the HTTP and gRPC servers bind."""
    port: int = 30000
    """HTTP port."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (bfloat16 where the CPU supports it, else float32), float32, bfloat16, float16."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype: auto (float32 on CPU, where small attention matmuls are much faster in float32; the model dtype elsewhere), float32, bfloat16, float16."""
    context_length: int | None = None
    """Longest sequence (prompt + output) served; default: the model's own."""
    max_running_requests: int = 64
    """Most requests decoded together in one batch."""
    max_queued_requests: int = 1024
    """Most requests waiting for a batch slot; more are refused with 429."""
    max_total_tokens: int | None = None
    """KV pool size in tokens; default: derived from --kv-cache-memory-fraction."""
    kv_cache_memory_fraction: float = 0.2
    """Share of the device's available memory given to the KV pool when --max-total-tokens is unset."""
    page_size: int = 16
    """Tokens per KV page."""
    chunked_prefill_size: int = 2048
    """Most prompt tokens prefilled in one step; longer prompts are split over steps."""
    random_seed: int | None = None
    """Seed of the server's own sampling randomness (requests with a `seed` use their own)."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>` on every route but the health checks."""
    log_level: str = "info"
    """Logging level: debug, info, warning, error."""
    skip_warmup: bool = False
    """Report healthy without running the warm-up generation first."""

    def __post_init__(self) -> None:
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {getattr(self, name)!r}")
        for name in ("port", "max_running_requests", "page_size", "chunked_prefill_size", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be ≥ 2, got {self.context_length}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must be ≥ page_size ({self.page_size}), got {self.max_total_tokens}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")

    def replace(self, **changes) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def add_cli_args(parser: argparse.ArgumentParser, cls: type = ServerArgs) -> None:
    docs = field_docs(cls)
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = docs.get(f.name, "")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
        conv = int if "int" in kind else float if "float" in kind else str
        kwargs = {"choices": DTYPES} if f.name in ("dtype", "kv_cache_dtype") else {}
        parser.add_argument(flag, type=conv, default=f.default, help=help_text, **kwargs)


def from_cli_args(ns: argparse.Namespace, cls: type = ServerArgs):
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
