"""The model's architecture, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM, Qwen2-style GQA configs)."""

    architecture: str
    """Model family: "llama" covers Llama, SmolLM2, Mistral-style and Qwen2-style configs."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Fewer than num_attention_heads means grouped-query attention."""
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Qwen2-style configs carry a bias on the q/k/v projections."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Every token id that ends generation (from the model's config and tokenizer)."""

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "qwen3", "mistral", "smollm"):
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: llama, qwen2, mistral)"
            )
        num_heads = cfg["num_attention_heads"]
        # Newer configs nest rotary settings under rope_parameters; older ones use rope_scaling.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(
                f"rope type {rope_type!r} is not supported yet (only plain rotary embeddings)"
            )
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture="llama",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
