"""/v1/completions through the official openai client (sync and async) against the shared
launched server, including the proof that /generate and /v1/completions produce the same
greedy tokens for the same request."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"


def test_generate_and_completions_give_the_same_greedy_tokens(client, server, model):
    with server.client() as http:
        # From an empty prefix cache both times, so both prefill exactly the same way.
        assert http.post("/flush_cache").status_code == 200
        native = http.post(
            "/generate",
            json={
                "text": PROMPT,
                "sampling_params": {"temperature": 0, "max_new_tokens": 12},
                "return_logprob": True,
                "return_text_in_logprobs": True,
            },
        ).json()
        assert http.post("/flush_cache").status_code == 200
    out = client.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=12, logprobs=0
    )
    choice = out.choices[0]
    assert choice.text == native["text"]
    assert choice.logprobs.tokens == [
        text for _, _, text in native["meta_info"]["output_token_logprobs"]
    ]
    assert choice.logprobs.token_logprobs == pytest.approx(
        [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]], abs=1e-4
    )
    assert (
        out.usage.completion_tokens
        == len(native["output_ids"])
        == native["meta_info"]["completion_tokens"]
    )
    assert out.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert (
        choice.finish_reason == "length"
        and out.object == "text_completion"
        and out.id.startswith("cmpl-")
    )


async def test_stream_with_usage_matches_the_whole_answer(aclient, client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=8)
    stream = await aclient.completions.create(
        model=model,
        prompt=PROMPT,
        temperature=0,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    choice_chunks = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choice_chunks) == whole.choices[0].text
    assert [c.finish_reason for c in choice_chunks] == [None] * (len(choice_chunks) - 1) + [
        "length"
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_echo_with_logprobs_returns_the_prompt_first(client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=3, echo=True, logprobs=2
    )
    choice, usage = out.choices[0], out.usage
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert "".join(lp.tokens[: usage.prompt_tokens]) == PROMPT
    assert "".join(lp.tokens) == choice.text
    # Nothing predicts the first prompt token; every later token has a logprob and alternatives.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(alts) <= 2 for alts in lp.top_logprobs[1:])
    assert [choice.text[o : o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens


async def test_prompt_list_with_n_2(aclient, server, model):
    prompts = [PROMPT, "Once upon a time"]
    out = await aclient.completions.create(
        model=model, prompt=prompts, n=2, temperature=0.8, seed=5, max_tokens=4
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    counts = httpx.post(server.url + "/tokenize", json={"prompt": prompts}).json()["count"]
    assert out.usage.prompt_tokens == sum(counts)  # each prompt once, however many samples
    assert out.usage.completion_tokens == 16 and all(
        c.finish_reason == "length" for c in out.choices
    )


async def test_token_id_prompt_and_stream_n_2(aclient, server, model):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    stream = await aclient.completions.create(
        model=model, prompt=ids, n=2, temperature=0.8, seed=9, max_tokens=3, stream=True, echo=True
    )
    texts = {0: "", 1: ""}
    finished = set()
    async for chunk in stream:
        for c in chunk.choices:
            assert c.index not in finished, "a chunk after the choice finished"
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert all(t.startswith(PROMPT) and len(t) > len(PROMPT) for t in texts.values())


def test_echo_of_a_token_id_prompt_keeps_its_special_tokens(client, server, model):
    """vLLM echoes a token-id prompt as its text with the special tokens in it."""
    text = "<|im_start|>user\nHi<|im_end|>\n"
    ids = httpx.post(
        server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}
    ).json()["tokens"]
    assert len(ids) < len(text) // 2  # <|im_start|> and <|im_end|> are one special token each
    out = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=2, echo=True)
    assert out.choices[0].text.startswith(text) and len(out.choices[0].text) > len(text)
    stream = client.completions.create(
        model=model, prompt=ids, temperature=0, max_tokens=2, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == out.choices[0].text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, model):
    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPT, temperature=0, max_tokens=5, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages), usages
    assert all(u.completion_tokens > 0 for u in usages)  # vLLM's test asks every chunk
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[-1] == 5
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].usage.completion_tokens == 5
    assert chunks[-1].choices == []


def test_stop_sequence(client, model):
    text = (
        client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12)
        .choices[0]
        .text
    )
    word = text.split()[1]
    out = client.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=12, stop=[word]
    )
    assert (
        out.choices[0].text == text[: text.index(word)] and out.choices[0].finish_reason == "stop"
    )


async def test_same_seed_same_text(aclient, model):
    async def sample():
        out = await aclient.completions.create(
            model=model, prompt=PROMPT, temperature=1.0, seed=42, max_tokens=8
        )
        return out.choices[0].text

    assert await sample() == await sample()
