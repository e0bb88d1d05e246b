"""The default GGUF (Q4_1 projections, a Q8_0 embedding table and LM head) served quantized:
its greedy continuations are the dequantized float32 model's, it still answers Paris, and it
reports what each tensor type is served as."""

from __future__ import annotations

import pytest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "In 1969, the first humans",
    "The best way to learn a language is",
    "import numpy as np\n",
    "The mitochondria is",
    "A haiku about autumn:\n",
    "The quick brown fox",
    "To make a cup of tea, first",
    "The largest planet in the solar system",
    "SELECT name FROM users WHERE",
    "Photosynthesis converts",
    "My favourite book is",
    "The theory of relativity states",
    "Dear hiring manager,",
    "The recipe calls for two cups of",
    "Machine learning is",
]
NEW = 32
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}


def served_types(engine) -> dict:
    return engine.run_in_scheduler(lambda s: s.runner.model.weight_types)


def test_the_default_gguf_is_served_at_its_own_types(engine, dequantized_engine):
    assert served_types(engine) == {
        "Q8_0": {"tensors": 1, "served_as": "Q8_0"},
        "F32": {"tensors": 61, "served_as": "float32"},
        "Q4_1": {"tensors": 210, "served_as": "Q4_1"},
    }
    widened = served_types(dequantized_engine)
    assert widened["Q4_1"]["served_as"] == "float32", (
        "dequantize=True did not reach the loader: ModelRunner must pass args.dequantize and "
        "args.quantization to load_model"
    )


def test_greedy_continuations_match_the_dequantized_float32_model(engine, dequantized_engine):
    quantized = [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)]
    reference = [r["output_ids"] for r in dequantized_engine.generate(PROMPTS, GREEDY)]
    assert all(len(ids) == NEW for ids in quantized + reference)
    # Tokens up to each continuation's first difference (after it, the texts differ anyway).
    agreed = 0
    for ours, ref in zip(quantized, reference):
        agreed += next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), NEW)
    assert agreed >= 0.9 * NEW * len(PROMPTS), f"{agreed} of {NEW * len(PROMPTS)} tokens agree"


def test_quantized_chat_answers_paris(engine, assert_engine_idle):
    question = "What is the capital of France? Answer in one sentence."
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    out = engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24})
    assert "Paris" in out["text"], out["text"]
    assert_engine_idle(engine)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    """The default model as a Hugging Face directory of float32 safetensors (written from
    gguf's dequantization of the file, its tokenizer and config alongside)."""
    import json
    import os
    import shutil

    import torch
    from safetensors.torch import save_file

    from cadence.model_loader import gguf_loader, tokenizer_files
    from cadence.model_loader.locate import default_model_path

    path = default_model_path()
    config = gguf_loader.read_config(path)
    out = tmp_path_factory.mktemp("smollm2-float")
    state = {
        name: torch.from_numpy(array.copy()).contiguous()
        for name, array in gguf_loader.iter_weights(path, config, progress=False)
    }
    save_file(state, str(out / "model.safetensors"))
    hf_config = {
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
    }
    (out / "config.json").write_text(json.dumps(hf_config))
    tokenizer = tokenizer_files.converted_tokenizer_dir(path)
    for name in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, name), out / name)
    return str(out)


@pytest.mark.parametrize("scheme,qtype", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_quantization_at_load_serves_float_weights_quantized(float_dir, scheme, qtype):
    from cadence import Engine

    e = Engine(model_path=float_dir, dtype="float32", quantization=scheme, max_total_tokens=1024)
    try:
        types = served_types(e)
        assert types.get(f"F32 -> {qtype}", {}).get("tensors") == 211, types  # 210 + embeddings
        question = "What is the capital of France? Answer in one sentence."
        prompt = e.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        assert "Paris" in e.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24})["text"]
    finally:
        e.shutdown()
