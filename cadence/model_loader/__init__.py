"""Model loading: locate the model, read its config, weights and tokenizer."""

from cadence.model_loader.locate import default_model_path, resolve_model_path
from cadence.models.config import ModelConfig

__all__ = ["ModelConfig", "default_model_path", "resolve_model_path"]
