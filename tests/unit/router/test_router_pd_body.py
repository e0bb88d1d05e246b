"""PD mode's body work: bootstrap fields, batch sizes, logprob merging, event rewriting."""

from __future__ import annotations

import json
import random

import pytest

from cadence.router import pd_body


def test_bodies_that_are_not_json_objects_are_refused_with_the_reason():
    assert pd_body.decode_object(b'{"text": "x"}') == {"text": "x"}
    for raw, reason in (
        (b"{oops", "not valid JSON"),
        (b'"text"', "JSON object"),
        (b"\xff", "JSON"),
    ):
        with pytest.raises(pd_body.PdBodyError, match=reason):
            pd_body.decode_object(raw)


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://127.0.0.1:30000", "127.0.0.1"),
        ("https://prefill-0.svc:8443/prefix", "prefill-0.svc"),
        ("http://[::1]:30000", "::1"),
    ],
)
def test_bootstrap_host_is_the_host_of_the_url(url, host):
    assert pd_body.bootstrap_host(url) == host


def test_single_requests_get_scalars_and_batches_get_lists():
    rng = random.Random(0)
    single: dict = {"text": "x", "bootstrap_room": 3}
    rooms = pd_body.inject_bootstrap(single, "h", 8998, None, rng)
    assert single["bootstrap_host"] == "h" and single["bootstrap_port"] == 8998
    assert single["bootstrap_room"] == rooms[0] != 3
    batch: dict = {"text": ["a", "b", "c"]}
    rooms = pd_body.inject_bootstrap(batch, "h", None, 3, rng)
    assert batch["bootstrap_host"] == ["h"] * 3 and batch["bootstrap_port"] == [None] * 3
    assert batch["bootstrap_room"] == rooms and len(set(rooms)) == 3
    many = [pd_body.inject_bootstrap({}, "h", 1, None, rng)[0] for _ in range(1000)]
    assert all(0 <= r < 2**63 for r in many) and len(set(many)) == 1000
    assert max(many) > 2**62  # the whole range is used


@pytest.mark.parametrize(
    ("route", "body", "size"),
    [
        ("/generate", {"text": "a"}, None),
        ("/generate", {"text": ["a", "b"]}, 2),
        ("/generate", {"input_ids": [1, 2]}, None),
        ("/generate", {"input_ids": [[1], [2], [3]]}, 3),
        ("/v1/completions", {"prompt": "a"}, None),
        ("/v1/completions", {"prompt": [5, 6]}, None),
        ("/v1/completions", {"prompt": [[5], [6]]}, 2),
        ("/v1/completions", {"prompt": ["a", "b", "c"]}, 3),
        ("/v1/chat/completions", {"n": 2}, 2),
        ("/v1/chat/completions", {"n": True}, None),
        ("/v1/chat/completions", {}, None),
    ],
)
def test_batch_size_follows_the_route(route, body, size):
    assert pd_body.batch_size(route, body) == size


def test_only_native_generate_with_return_logprob_wants_a_merge():
    assert pd_body.wants_input_logprobs("/generate", {"return_logprob": True})
    assert pd_body.wants_input_logprobs("/generate", {"return_logprob": [False, True]})
    assert not pd_body.wants_input_logprobs("/generate", {"return_logprob": False})
    assert not pd_body.wants_input_logprobs("/v1/completions", {"logprobs": 2})


def _answer(lps) -> dict:
    return {"text": "t", "meta_info": {"input_token_logprobs": lps, "id": "r"}}


def test_merge_puts_prefill_logprobs_in_front_per_item():
    prefill = json.dumps([_answer([[-1, 1]]), _answer([[-2, 2]])]).encode()
    by_index = pd_body.input_logprobs(prefill)
    assert by_index == {0: [[-1, 1]], 1: [[-2, 2]]}
    merged = pd_body.merge_answer(json.dumps([_answer([[-3, 3]]), _answer([])]).encode(), by_index)
    assert [m["meta_info"]["input_token_logprobs"] for m in json.loads(merged)] == [
        [[-1, 1], [-3, 3]],
        [[-2, 2]],
    ]
    single = pd_body.merge_answer(json.dumps(_answer([[-3, 3]])).encode(), {0: [[-1, 1]]})
    assert json.loads(single)["meta_info"] == {
        "input_token_logprobs": [[-1, 1], [-3, 3]],
        "id": "r",
    }


def test_nothing_to_merge_leaves_the_answer_alone():
    answer = json.dumps({"text": "t", "meta_info": {}}).encode()
    assert pd_body.merge_answer(answer, {0: [[-1, 1]]}) is None  # decode has no list
    assert pd_body.merge_answer(json.dumps(_answer([])).encode(), {}) is None
    assert pd_body.merge_answer(b"\x1f\x8b compressed", {0: [1]}) is None
    assert pd_body.input_logprobs(b"not json, no events") == {}


def test_prefill_logprobs_are_read_from_a_stream_per_index():
    events = [
        {"index": 0, "meta_info": {"input_token_logprobs": [[-1, 1]]}},
        {"index": 1, "meta_info": {"input_token_logprobs": [[-2, 2], [-3, 3]]}},
        {"index": 1, "meta_info": {"input_token_logprobs": []}},  # incremental: nothing new
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    assert pd_body.input_logprobs(stream + b"data: [DONE]\n\n") == {
        0: [[-1, 1]],
        1: [[-2, 2], [-3, 3]],
    }


def test_stream_merger_rewrites_whole_events_whatever_the_chunking():
    events = [
        b'data: {"text":"a","meta_info":{"input_token_logprobs":[[-9,9]]}}\n\n',
        b": a comment\n\n",
        b'data: {"text":"b","meta_info":{}}\r\n\r\n',
        b"data: [DONE]\n\n",
    ]
    raw = b"".join(events)
    for size in (1, 5, 64, len(raw)):
        merger = pd_body.StreamMerger({0: [[-1, 1]]})
        out = b"".join(merger.feed(raw[i : i + size]) for i in range(0, len(raw), size))
        out += merger.flush()
        first, rest = out.split(b"\n\n", 1)
        assert json.loads(first.removeprefix(b"data: "))["meta_info"] == {
            "input_token_logprobs": [[-1, 1], [-9, 9]]
        }
        assert rest == b"".join(events[1:])  # untouched events pass byte for byte


def test_an_unfinished_event_is_flushed_as_it_is():
    merger = pd_body.StreamMerger({0: [[-1, 1]]})
    assert merger.feed(b'data: {"text": "cut') == b""
    assert merger.flush() == b'data: {"text": "cut'


def test_prompt_tokens_counts_ids_and_estimates_text_erring_long():
    """--pd-local-prefill-max-tokens reads the prompt's size: ids are counted, text is
    estimated at 3 bytes a token (longer than most tokenizers make it), a batch by its
    longest prompt; a prompt of embeddings or images has no size (never local)."""
    count = pd_body.prompt_tokens
    assert count("/generate", {"input_ids": [1, 2, 3]}) == 3
    assert count("/generate", {"input_ids": [[1], [1, 2, 3, 4]]}) == 4
    assert count("/generate", {"text": "abcdefg"}) == 3  # 7 bytes
    assert count("/generate", {"text": ["ab", "é" * 6]}) == 4  # 12 bytes
    assert count("/generate", {"input_embeds": [[0.0]]}) is None
    assert count("/generate", {"text": "hi", "image_data": "x.png"}) is None
    assert count("/v1/completions", {"prompt": "abcdef"}) == 2
    assert count("/v1/completions", {"prompt": [5, 6, 7, 8, 9]}) == 5
    assert count("/v1/completions", {"prompt": ["a", "abcdefghi"]}) == 3
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": "abcdef"}]
    assert count("/v1/chat/completions", {"messages": messages}) == 3
    parts = [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]
    assert count("/v1/chat/completions", {"messages": parts}) == 1
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
    assert count("/v1/chat/completions", {"messages": image}) is None
    assert count("/v1/chat/completions", {"messages": "not a list"}) is None
    tools = [{"type": "function", "function": {"name": "f" * 40}}]  # 84 bytes of JSON
    assert count("/v1/chat/completions", {"messages": messages, "tools": tools}) == 3 + 28


def test_a_locally_prefilled_request_loses_the_bootstrap_fields_a_client_sent():
    obj = {"text": "hi", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}
    assert pd_body.without_bootstrap(obj) is True
    assert obj == {"text": "hi"}
    assert pd_body.without_bootstrap(obj) is False
