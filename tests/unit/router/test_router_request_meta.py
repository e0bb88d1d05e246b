"""What the router reads from request bodies: model, stream, capabilities, prompt prefix."""

from __future__ import annotations

import json

import pytest

from cadence.router.request_meta import MAX_PARSE_BYTES, MAX_PREFIX_CHARS, parse_route_meta

CHAT = "/v1/chat/completions"


def meta(path: str, body: dict | bytes):
    return parse_route_meta(path, body if isinstance(body, bytes) else json.dumps(body).encode())


def test_chat_model_stream_and_prefix():
    m = meta(
        CHAT,
        {
            "model": "m",
            "stream": True,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ],
        },
    )
    assert m.model == "m" and m.is_stream
    assert m.capabilities == {"chat", "streaming"}
    assert m.prefix_text == "Be brief.\nHi"


@pytest.mark.parametrize(
    ("part", "capability"),
    [
        ({"type": "image_url", "image_url": {"url": "data:,"}}, "image_input"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio_input"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "video_input"),
    ],
)
def test_content_parts_require_input_capabilities(part, capability):
    m = meta(CHAT, {"messages": [{"role": "user", "content": [part]}]})
    assert m.capabilities == {"chat", capability}


def test_audio_output_and_native_generate_media():
    assert (
        "audio_output" in meta(CHAT, {"modalities": ["text", "audio"], "messages": []}).capabilities
    )
    m = meta("/generate", {"text": "hello", "image_data": "b64", "audio_data": None})
    assert m.capabilities == {"completion", "image_input"} and m.prefix_text == "hello"


@pytest.mark.parametrize(
    ("path", "capabilities"),
    [
        ("/v1/completions", {"completion"}),
        ("/v1/embeddings", {"embedding"}),
        ("/v1/audio/speech", {"speech"}),
        ("/v1/rerank", set()),
        ("/v1/score", set()),
    ],
)
def test_route_implies_capabilities(path, capabilities):
    assert meta(path, {"model": "x"}).capabilities == capabilities


def test_prompt_forms_give_a_prefix():
    assert meta("/v1/completions", {"prompt": "abc"}).prefix_text == "abc"
    assert meta("/v1/completions", {"prompt": ["first", "second"]}).prefix_text == "first"
    assert meta("/generate", {"input_ids": [1, 2, 3]}).prefix_text == "1 2 3"
    assert meta("/generate", {"input_ids": [[4, 5], [6]]}).prefix_text == "4 5"
    long = meta("/v1/completions", {"prompt": "z" * (MAX_PREFIX_CHARS * 2)})
    assert len(long.prefix_text) == MAX_PREFIX_CHARS


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'{"messages": "oops"}',
        b'{"messages": [{"content": 5}]}',
        b'{"model": 7, "stream": "yes"}',
        b'{"model": "m\xff", "messages": []}',  # invalid UTF-8 inside a string
        b'{"messages": [{"content": "caf\xc3"}]}',  # truncated UTF-8 sequence
        b"\xff\xfe{\x00}\x00",  # UTF-16 with a byte order mark
        b'{"model": "\\ud800"}',  # an escaped lone surrogate
        b'{"model": "m", "x": '
        + b"[" * 100000
        + b"]" * 100000
        + b"}",  # past msgspec's depth limit
        b'{"stream": true, "model": "m", "messages": [{"content": "a"}]',
    ],  # cut short
)
def test_unreadable_bodies_route_on_the_path_alone(body):
    m = parse_route_meta(CHAT, body)
    assert m.capabilities == {"chat"} and not m.is_stream
    assert m.prefix_text == "" or m.model is None


def test_huge_bodies_are_not_parsed():
    body = b'{"model": "m", "prompt": "' + b"x" * MAX_PARSE_BYTES + b'"}'
    m = parse_route_meta("/v1/completions", body)
    assert m.model is None and m.prefix_text == "" and m.capabilities == {"completion"}
