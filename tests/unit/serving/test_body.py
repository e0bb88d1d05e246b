"""One body parser: every route and the gRPC pass-through read a body through
`serving.body`, so a body that is not an object, or lacks a required field, or has a field
of the wrong type, is refused in the same words wherever it was sent."""

from __future__ import annotations

import asyncio

import pytest

from cadence.errors import InvalidParameter
from cadence.io_struct import GenerateReqInput
from cadence.serving import control, embedding_protocol, native_api, openai_protocol
from cadence.serving.body import parse_body, parse_struct
from cadence.serving.errors import decode_json
from cadence.serving.responses_protocol import parse_request as parse_responses_request
from cadence.serving.speech_serving import speech_params

# Raw bodies (the OpenAI-style routes and the gRPC pass-through), and bodies the HTTP
# route decoded first (/generate, /tokenize, the control routes, speech).
PARSERS = {
    "chat": lambda b: openai_protocol.parse_request(openai_protocol.ChatCompletionRequest, b),
    "embeddings": lambda b: embedding_protocol.parse(embedding_protocol.EmbeddingRequest, b),
    "responses": parse_responses_request,
    "control": lambda b: control.parse(control.PauseBody, decode_json(b)),
    "generate": lambda b: native_api.generate_input(decode_json(b)),
    "speech": lambda b: speech_params(decode_json(b), 100),
    "tokenize": lambda b: asyncio.run(native_api.tokenize_body(None, decode_json(b))),
}


@pytest.mark.parametrize("route", sorted(PARSERS))
@pytest.mark.parametrize(
    "body,kind", [(b"[1]", "an array"), (b'"x"', "a string"), (b"3", "a number"), (b"null", "null")]
)
def test_a_body_that_is_not_an_object_is_refused_in_one_wording(route, body, kind):
    with pytest.raises(InvalidParameter) as e:
        PARSERS[route](body)
    assert str(e.value) == f"the request body must be a JSON object, got {kind}"
    assert e.value.param is None


def test_raw_bodies_are_decoded_with_the_bounds_and_objects_are_taken_as_they_are():
    req = parse_body(GenerateReqInput, b'{"text": "hi", "unknown": 1}')
    assert req.text == "hi"
    assert parse_body(GenerateReqInput, {"text": "hi"}).text == "hi"
    with pytest.raises(InvalidParameter, match="not valid JSON"):
        parse_body(GenerateReqInput, b"{")
    with pytest.raises(InvalidParameter, match="nested too deep"):
        parse_body(GenerateReqInput, b'{"text": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")


def test_required_fields_and_types_are_named():
    with pytest.raises(InvalidParameter) as e:
        parse_struct(GenerateReqInput, {"rid": "r"}, {"text": "text is required"})
    assert (e.value.param, str(e.value)) == ("text", "text is required")
    with pytest.raises(InvalidParameter) as e:
        parse_struct(GenerateReqInput, {"text": "hi", "return_logprob": "yes"})
    assert e.value.param == "return_logprob"


def test_fields_a_struct_derives_itself_cannot_be_given():
    req = parse_struct(GenerateReqInput, {"text": "hi", "is_single": False, "batch_size": 9})
    assert not req.is_normalized and req.batch_size != 9
