"""A Hugging Face model directory (config.json + safetensors + tokenizer.json) serves the same
model as the GGUF file it came from.

The directory is made from transformers' own load of the embedded GGUF file (its config,
its state dict in Hugging Face names and half-split rotary layout, its tokenizer.json and
chat template), not from anything our loader produced.
"""

from __future__ import annotations

import os

import pytest

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
PARAMS = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf_dir():
    """The default GGUF exported as a Hugging Face checkpoint (config.json, model.safetensors,
    the tokenizer files), as transformers de-quantizes it."""
    from cadence.model_loader.hf_export import exported_checkpoint_dir
    from cadence.model_loader.locate import default_model_path

    return exported_checkpoint_dir(default_model_path())


def test_hf_directory_generates_what_the_gguf_generates(engine, hf_dir):
    from cadence import Engine

    assert os.path.exists(os.path.join(hf_dir, "config.json"))
    assert any(f.endswith(".safetensors") for f in os.listdir(hf_dir))
    hf_engine = Engine(model_path=hf_dir, dtype="float32", max_total_tokens=4096)
    try:
        assert hf_engine.info.served_model_name == os.path.basename(hf_dir)
        ours = [r["output_ids"] for r in hf_engine.generate(PROMPTS, PARAMS)]
        ref = [r["output_ids"] for r in engine.generate(PROMPTS, PARAMS)]
        assert ours == ref
        assert all(len(ids) == PARAMS["max_new_tokens"] for ids in ours)
        chat = hf_engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert "Paris" in hf_engine.generate(chat, {"temperature": 0, "max_new_tokens": 24})["text"]
    finally:
        hf_engine.shutdown()


def test_missing_model_path_is_a_clear_error(tmp_path):
    from cadence import Engine

    with pytest.raises(ValueError, match="does not exist"):
        Engine(model_path=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        Engine(model_path=str(tmp_path / "empty"))
