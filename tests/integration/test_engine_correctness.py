"""Our model against transformers' own GGUF load of the same file, and self-consistency:
batched vs one-at-a-time, chunked vs unchunked prefill, the chat template, input logprobs."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NUM_NEW = 32
GREEDY_32 = {"temperature": 0.0, "max_new_tokens": NUM_NEW, "min_new_tokens": NUM_NEW}

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:\n1.",
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from cadence.model_loader.hf_export import exported_checkpoint_dir
    from cadence.model_loader.locate import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(exported_checkpoint_dir(path), dtype=torch.float32)
    return model.eval()


def chat_prompt(engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


@pytest.fixture(scope="module")
def prompt_ids(engine):
    texts = PROMPTS + [chat_prompt(engine, "Name a fruit that is yellow.")]
    return [engine.tokenizer.encode(t, add_special_tokens=True) for t in texts]


def test_greedy_matches_transformers_token_for_token(engine, hf_model, prompt_ids):
    # min_new_tokens on both sides masks EOS for all 32 steps; the masked ids must agree.
    eos = hf_model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    assert eos <= engine.scheduler.stops.eos_ids
    ours = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY_32)
    for ids, out in zip(prompt_ids, ours):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=NUM_NEW,
                min_new_tokens=NUM_NEW,
                pad_token_id=min(eos),
            )
        expected = ref[0, len(ids) :].tolist()
        assert len(expected) == NUM_NEW
        assert out["output_ids"] == expected, engine.tokenizer.decode(ids)
        assert out["meta_info"]["completion_tokens"] == NUM_NEW
        assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_input_logprobs_match_transformers(engine, hf_model, prompt_ids):
    ids = prompt_ids[2]
    out = engine.generate(
        input_ids=ids,
        sampling_params={"temperature": 0.0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    meta = out["meta_info"]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    lps = meta["input_token_logprobs"]
    assert [t for _, t, _ in lps] == ids
    assert lps[0][0] is None  # nothing predicts the first prompt token
    expected = ref[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.tensor([v for v, _, _ in lps[1:]]) == pytest.approx(expected, abs=2e-3)
    # Top-3 at each predicted position: the same ids as transformers' best three.
    for pos, top in enumerate(meta["input_top_logprobs"][1:]):
        vals, idx = ref[pos].topk(3)
        assert [v for v, _, _ in top] == pytest.approx(vals.tolist(), abs=2e-3)
        assert [t for _, t, _ in top] == idx.tolist()
    # The first output token's logprob comes from the last prompt position.
    ((value, token, _),) = meta["output_token_logprobs"]
    assert token == int(ref[-1].argmax())
    assert value == pytest.approx(float(ref[-1, token]), abs=2e-3)


def test_batched_greedy_equals_one_at_a_time(engine, prompt_ids):
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    batched = engine.generate(input_ids=prompt_ids, sampling_params=params)
    alone = [engine.generate(input_ids=ids, sampling_params=params) for ids in prompt_ids]
    assert len({len(ids) for ids in prompt_ids}) > 1  # ragged lengths exercise the decode mask
    for b, a in zip(batched, alone):
        assert len(b["output_ids"]) == 24
        assert b["output_ids"] == a["output_ids"]
        assert b["text"] == a["text"]


def test_chat_template_answers_paris(engine):
    prompt = chat_prompt(engine, "What is the capital of France?")
    assert "<|im_start|>assistant" in prompt
    out = engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24})
    assert "Paris" in out["text"]
    assert "<|im_end|>" not in out["text"]


def test_chunked_prefill_gives_the_same_tokens(engine, small_engine, monkeypatch):
    text = (
        "Here is a short story about a lighthouse keeper who lived alone on a rocky island. "
        "Every night he climbed the stairs, lit the lamp and watched the ships pass by. "
        "He kept a logbook of every vessel, its flag, its heading and the weather, and he "
        "wrote letters to his sister on the mainland that the supply boat carried away each "
        "month. One stormy evening a small boat appeared near the rocks, and he"
    )
    ids = engine.tokenizer.encode(text)
    assert 80 < len(ids) < 150
    chunk = small_engine.args.chunked_prefill_size
    chunks = []
    runner = small_engine.scheduler.runner
    original = runner.run

    def recording(batch):
        if not batch.is_decode:
            chunks.append([len(item.token_ids) for item in batch.items])
        return original(batch)

    monkeypatch.setattr(runner, "run", recording)
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    kwargs = {"return_logprob": True, "logprob_start_len": 0}
    chunked = small_engine.generate(input_ids=ids, sampling_params=params, **kwargs)
    whole = engine.generate(input_ids=ids, sampling_params=params, **kwargs)
    # The prompt really went through in chunk-sized pieces.
    assert sum(n for step in chunks for n in step) == len(ids)
    assert max(n for step in chunks for n in step) == chunk
    assert len(chunks) == -(-len(ids) // chunk)
    assert chunked["output_ids"] == whole["output_ids"]
    # Input logprobs gathered chunk by chunk equal the one-pass ones, position by position.
    a, b = chunked["meta_info"]["input_token_logprobs"], whole["meta_info"]["input_token_logprobs"]
    assert len(a) == len(b) == len(ids)
    assert [t for _, t, _ in a] == ids
    assert [v for v, _, _ in a[1:]] == pytest.approx([v for v, _, _ in b[1:]], abs=1e-3)
    # Starting mid-prompt (inside the third chunk) gives the tail of the same list.
    start = 2 * chunk + 5
    tail = small_engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=start,
    )["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in tail] == ids[start:]
    assert [v for v, _, _ in tail] == pytest.approx([v for v, _, _ in b[start:]], abs=1e-3)


async def test_request_joining_mid_decode_matches_running_alone(engine):
    # Continuous batching: B's prefill runs while A is decoding, then both decode together.
    params_a = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    params_b = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    alone_a = engine.generate(PROMPTS[2], params_a)
    alone_b = engine.generate(PROMPTS[3], params_b)
    stream_a = engine.async_generate(PROMPTS[2], params_a, stream=True)
    ids_a = []
    async for chunk in stream_a:
        ids_a += chunk["output_ids"]
        if len(ids_a) >= 4:
            break
    joined_during = len(ids_a)
    out_b = await anext(engine.async_generate(PROMPTS[3], params_b))
    async for chunk in stream_a:
        ids_a += chunk["output_ids"]
    assert joined_during < 24 - 8  # A was still decoding for all of B's life
    assert out_b["output_ids"] == alone_b["output_ids"]
    assert ids_a == alone_a["output_ids"]
