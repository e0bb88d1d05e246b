"""A GGUF file as a Hugging Face checkpoint directory: config.json, model.safetensors (the
weights de-quantized to float32) and the tokenizer files.

transformers reads a GGUF file in pure Python: 20-odd seconds for a 135M model on two
cores, each time. The export is made once per file version and cached beside the converted
tokenizers, with the same locking, so that any later reader (a reference forward pass, a
server started on a directory) loads it in a fraction of a second.
"""

from __future__ import annotations

import os
import shutil

from cadence.model_loader.tokenizer_files import cached_conversion, converted_tokenizer_dir

WEIGHTS_FILE = "model.safetensors"


def exported_checkpoint_dir(path: str) -> str:
    """The cached Hugging Face checkpoint of the GGUF file `path`, made on first use."""
    return cached_conversion(
        "checkpoints", "the GGUF weights to a Hugging Face checkpoint", path, WEIGHTS_FILE, _export
    )


def _export(path: str, directory: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    # transformers will not re-serialize a GGUF-loaded model: write the two halves of an
    # export, config.json and the weights (a tied output head is the embedding's).
    model.config.save_pretrained(directory)
    tied = model.config.tie_word_embeddings
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer = converted_tokenizer_dir(path)
    for name in os.listdir(tokenizer):
        shutil.copy2(os.path.join(tokenizer, name), directory)
