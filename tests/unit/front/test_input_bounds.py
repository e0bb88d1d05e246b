"""Size bounds checked before work: /tokenize and /detokenize (their texts, ids and item
counts), chats (messages and their text), long prompts given as ids, list-valued sampling
parameters; large tokenizer work on the tokenizer's own threads, and the memory it freed
handed back. A tokenizer that counts its calls shows that a refused request was never
tokenized."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cadence.errors import InvalidParameter
from cadence.front import heap
from cadence.front.client import FrontClient
from cadence.front.engine_client import ModelInfo
from cadence.front.request_checks import (
    MAX_TOKENIZER_ITEMS,
    RequestOptions,
    check_detokenize_size,
    check_message_count,
    check_prompt_chars,
    check_tokenize_size,
)
from cadence.front.sampling_checks import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    parse_sampling_params,
)
from cadence.front.tokenizer import OFF_LOOP_TOKENIZE_CHARS, RELEASE_AFTER_SIZE, FrontTokenizer
from cadence.io_struct import GenerateReqInput
from cadence.serving import native_api

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer (a `tokenizers` backend), one token per character."""
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(ALPHABET)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    hf.chat_template = TEMPLATE
    return hf


class CountingTokenizer(FrontTokenizer):
    """Counts the texts and id lists that reach the tokenizer, and the threads that ran them."""

    def __init__(self, hf):
        super().__init__(hf)
        self.num_encoded = self.num_decoded = self.num_rendered = 0
        self.threads: set[str] = set()
        inner_encode, inner_decode = self._encode_batch, self.backend.decode_batch

        def encode_batch(texts, **kwargs):
            self.num_encoded += len(texts)
            self.threads.add(threading.current_thread().name)
            return inner_encode(texts, **kwargs)

        def decode_batch(id_lists, **kwargs):
            self.num_decoded += len(id_lists)
            self.threads.add(threading.current_thread().name)
            return inner_decode(id_lists, **kwargs)

        self._encode_batch = encode_batch
        self.backend = SimpleNamespace(
            encode=self.backend.encode, encode_batch=encode_batch, decode_batch=decode_batch
        )

    def decode(self, ids, skip_special_tokens=True):
        self.num_decoded += 1
        return super().decode(ids, skip_special_tokens)

    def apply_chat_template(self, messages, **kwargs):
        self.num_rendered += 1
        self.threads.add(threading.current_thread().name)
        return super().apply_chat_template(messages, **kwargs)


def make_state(max_chars=1000, max_ids=500, context_len=64):
    info = ModelInfo(
        model_path="/m",
        tokenizer_path=None,
        served_model_name="m",
        context_len=context_len,
        vocab_size=len(ALPHABET) + 1,
        max_total_tokens=4096,
    )
    tokenizer = CountingTokenizer(char_tokenizer())
    options = RequestOptions(max_tokenize_chars=max_chars, max_detokenize_tokens=max_ids)
    client = FrontClient(tokenizer, info, lambda msg: None, max_pending=16, options=options)
    args = SimpleNamespace(max_tokenize_chars=max_chars, max_detokenize_tokens=max_ids)
    return SimpleNamespace(client=client, args=args, chat_template=None), tokenizer


def refused(coro, param: str, words: str) -> InvalidParameter:
    with pytest.raises(InvalidParameter) as e:
        asyncio.run(coro)
    assert e.value.param == param and words in str(e.value), str(e.value)
    return e.value


# ---- the bounds themselves -------------------------------------------------------------------


def test_tokenize_bounds_count_the_texts_and_their_characters():
    check_tokenize_size("prompt", ["a" * 10] * 10, 100)  # exactly at the limit
    with pytest.raises(InvalidParameter, match="101 characters.*at most 100.*max-tokenize-chars"):
        check_tokenize_size("prompt", ["a" * 10] * 10 + ["b"], 100)
    with pytest.raises(InvalidParameter, match=f"at most {MAX_TOKENIZER_ITEMS}"):
        check_tokenize_size("prompt", [""] * (MAX_TOKENIZER_ITEMS + 1), 10**9)


def test_detokenize_bounds_count_the_lists_and_their_ids():
    check_detokenize_size("tokens", [[1] * 5] * 4, 20)
    with pytest.raises(InvalidParameter, match="21 token ids.*at most 20.*max-detokenize-tokens"):
        check_detokenize_size("tokens", [[1] * 5] * 4 + [[1]], 20)
    with pytest.raises(InvalidParameter, match=f"at most {MAX_TOKENIZER_ITEMS}"):
        check_detokenize_size("tokens", [[]] * (MAX_TOKENIZER_ITEMS + 1), 10**9)


def test_a_chat_cannot_have_more_messages_than_the_context_has_tokens():
    info = SimpleNamespace(context_len=8)
    check_message_count("messages", 8, info)
    with pytest.raises(InvalidParameter, match="9 messages.*context length \\(8\\)"):
        check_message_count("messages", 9, info)


def test_a_prompt_longer_than_the_context_can_hold_in_any_case_is_refused():
    info, tokenizer = SimpleNamespace(context_len=10), SimpleNamespace(max_token_chars=3)
    check_prompt_chars("messages", 60, info, tokenizer)  # 10 tokens x 3 characters x 2
    with pytest.raises(InvalidParameter, match="61 characters"):
        check_prompt_chars("messages", 61, info, tokenizer)


# ---- /tokenize and /detokenize: refused before the tokenizer runs ----------------------------


def test_an_oversize_tokenize_is_refused_before_tokenizing():
    state, tok = make_state(max_chars=1000)
    refused(native_api.tokenize_body(state, {"prompt": "a" * 1001}), "prompt", "1001 characters")
    refused(native_api.tokenize_body(state, {"prompt": ["a" * 600] * 2}), "prompt", "1200")
    many = {"prompt": [""] * (MAX_TOKENIZER_ITEMS + 1)}
    refused(native_api.tokenize_body(state, many), "prompt", f"at most {MAX_TOKENIZER_ITEMS}")
    refused(native_api.tokenize_body(state, {"prompt": ["a", 5]}), "prompt", "list of strings")
    assert tok.num_encoded == 0
    out = asyncio.run(native_api.tokenize_body(state, {"prompt": "a" * 1000}))
    assert out["count"] == 1000 and tok.num_encoded == 1


def test_a_prompt_list_is_tokenized_in_one_call():
    state, tok = make_state()
    out = asyncio.run(native_api.tokenize_body(state, {"prompt": ["ab", "c", "hello world"]}))
    assert out["tokens"] == [[1, 2], [3], [8, 5, 12, 12, 15, 27, 23, 15, 18, 12, 4]]
    assert out["count"] == [2, 1, 11] and tok.num_encoded == 3


def test_an_oversize_chat_is_refused_before_it_is_rendered():
    state, tok = make_state(max_chars=100, context_len=8)
    msg = {"role": "user", "content": "hi"}
    refused(native_api.tokenize_body(state, {"messages": [msg] * 9}), "messages", "9 messages")
    long = [{"role": "user", "content": "a" * 101}]
    refused(native_api.tokenize_body(state, {"messages": long}), "messages", "101 characters")
    assert tok.num_rendered == 0 and tok.num_encoded == 0
    out = asyncio.run(native_api.tokenize_body(state, {"messages": [msg] * 2}))
    assert out["count"] == len("<user>hi<user>hi")


def test_an_oversize_detokenize_is_refused_before_decoding():
    state, tok = make_state(max_ids=500)
    refused(native_api.detokenize_body(state, {"tokens": [1] * 501}), "tokens", "501 token ids")
    refused(native_api.detokenize_body(state, {"tokens": [[1] * 300] * 2}), "tokens", "600")
    many = {"tokens": [[1]] * (MAX_TOKENIZER_ITEMS + 1)}
    refused(native_api.detokenize_body(state, many), "tokens", f"at most {MAX_TOKENIZER_ITEMS}")
    for bad in ([1, True], [1, 2.0], [1, "2"], [[1], 2], "12", 7):
        refused(native_api.detokenize_body(state, {"tokens": bad}), "tokens", "token ids")
    refused(native_api.detokenize_body(state, {"tokens": [1, 99]}), "tokens", "vocabulary")
    assert tok.num_decoded == 0
    out = asyncio.run(native_api.detokenize_body(state, {"tokens": [[8, 5], [1] * 498]}))
    assert out["text"] == ["he", "a" * 498]


# ---- large work off the event loop, its memory handed back --------------------------------------


def test_large_work_runs_on_the_tokenizers_threads_and_then_releases_memory(monkeypatch):
    released = []
    monkeypatch.setattr(heap, "release_memory", lambda: released.append(1))
    monkeypatch.setattr(heap, "_TRIM", lambda: None)
    state, tok = make_state(max_chars=10**7, max_ids=10**7)
    text = "hello world " * (RELEASE_AFTER_SIZE // 12 + 1)

    async def run():
        ids = await state.client.tokenize_batch([text])
        [back] = await state.client.detokenize_batch(ids)
        small = await state.client.tokenize_batch(["ab"])
        assert tok.heap.is_pending and not released  # not while the answer is still held
        await asyncio.sleep(tok.heap.delay_s + 0.5)
        return ids, back, small

    [ids], back, small = asyncio.run(run())
    assert len(ids) == len(text) and ids[:6] == [8, 5, 12, 12, 15, 27]  # "hello "
    assert back == text and small == [[1, 2]]
    assert {t for t in tok.threads if t != threading.current_thread().name}, tok.threads
    assert all(t.startswith("cadence-tokenize") or t == "MainThread" for t in tok.threads)
    # Two large jobs within a second: one release, after both.
    assert released == [1] and tok.heap.num_releases == 1


def test_a_long_chat_renders_off_the_event_loop():
    _, tok = make_state()
    messages = [{"role": "user", "content": "a"}] * 300 + [{"role": "user", "content": "b"}]
    text = asyncio.run(tok.render_chat_async(messages))
    assert text == "<user>a" * 300 + "<user>b"
    assert any(t.startswith("cadence-tokenize") for t in tok.threads), tok.threads
    assert OFF_LOOP_TOKENIZE_CHARS > 301  # it went by the number of messages


def test_release_memory_trims_the_heap_on_glibc():
    import platform

    expected = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert heap.release_memory() is expected


# ---- prompts given as ids, list-valued sampling parameters ---------------------------------------


def test_prompt_ids_longer_than_the_context_are_refused_before_they_are_scanned():
    state, _ = make_state(context_len=64)
    checker = state.client.tm.checker
    for ids in ([1] * 64, [[1, 2], [1] * 100]):
        with pytest.raises(InvalidParameter, match="at least the context length") as e:
            # "x" is no token id: scanning the ids would fail with another message.
            asyncio.run(checker.check_generate(GenerateReqInput(input_ids=ids + ["x"]), None))
        assert e.value.param == "input_ids"


@pytest.mark.parametrize(
    "name,value",
    [
        ("stop_token_ids", ["x"] * (MAX_STOP_TOKEN_IDS + 1)),
        ("stop", [5] * 65),
        ("logit_bias", {str(-i): "x" for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}),
    ],
)
def test_list_parameters_are_counted_before_their_entries_are_read(name, value):
    with pytest.raises(InvalidParameter, match=f"{name} has {len(value)}") as e:
        parse_sampling_params({name: value})  # every entry is of the wrong type
    assert e.value.param == name
