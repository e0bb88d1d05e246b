"""The OpenAPI document of the HTTP server, with a request-body schema for every route.

The routes read their bodies themselves (one decoder, one set of checks shared with gRPC),
so FastAPI cannot see what they take; this module declares it, from the same msgspec
structs the routes parse into. Schema-driven tools (client generators, fuzzers such as
Schemathesis) then know every body and every range of `docs/sampling.md`.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from cadence.config_docs import field_docs
from cadence.front.sampling_checks import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from cadence.io_struct import EmbeddingReqInput, GenerateReqInput, SamplingParams
from cadence.serving import control
from cadence.serving.embedding_protocol import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoringRequest,
)
from cadence.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from cadence.serving.responses_protocol import ResponsesRequest
from cadence.serving.speech_serving import SPEECH_SCHEMA

REF = "#/components/schemas/{name}"

# The valid values of each sampling parameter, as `check_sampling_params` enforces them
# (a unit test holds the two together).
SAMPLING_RANGES: dict[str, dict[str, Any]] = {
    "max_new_tokens": {"minimum": 0},
    "min_new_tokens": {"minimum": 0},
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "not": {"const": 0}},
    "min_p": {"minimum": 0, "maximum": 1},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"minimum": 0, "maximum": 2},
    "n": {"minimum": 1},
}

_TOKENIZE = {
    "type": "object",
    "properties": {
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
            ]
        },
        "add_special_tokens": {"type": "boolean", "default": True},
        "model": {"type": "string"},
    },
    "required": ["prompt"],
}
_DETOKENIZE = {
    "type": "object",
    "properties": {
        "tokens": {
            "anyOf": [
                {"type": "array", "items": {"type": "integer", "minimum": 0}},
                {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                },
            ]
        },
        "skip_special_tokens": {"type": "boolean", "default": True},
    },
    "required": ["tokens"],
}
_ANY_OBJECT = {
    "type": "object",
    "description": "Any JSON object (ignored); the body may also be empty.",
}
_UNREAD = {"description": "Not read: send none (any body is ignored)."}

# route -> (the body's struct or schema, whether a body is required)
BODIES: dict[str, tuple[Any, bool]] = {
    "/generate": (GenerateReqInput, True),
    "/tokenize": (_TOKENIZE, True),
    "/v1/tokenize": (_TOKENIZE, True),
    "/detokenize": (_DETOKENIZE, True),
    "/v1/detokenize": (_DETOKENIZE, True),
    "/abort_request": (control.AbortBody, True),
    "/pause_generation": (control.PauseBody, False),
    "/continue_generation": (_ANY_OBJECT, False),
    "/flush_cache": (_ANY_OBJECT, False),
    "/start_profile": (control.ProfileBody, False),
    "/stop_profile": (_ANY_OBJECT, False),
    "/update_weights_from_disk": (control.UpdateWeightsBody, True),
    "/update_weight_version": (control.UpdateWeightVersionBody, True),
    "/configure_logging": (control.ConfigureLoggingBody, False),
    "/open_session": (control.OpenSessionBody, False),
    "/close_session": (control.CloseSessionBody, True),
    "/load_lora_adapter": (control.LoadLoRABody, True),
    "/unload_lora_adapter": (control.UnloadLoRABody, True),
    "/v1/chat/completions": (ChatCompletionRequest, True),
    "/v1/completions": (CompletionRequest, True),
    "/invocations": (ChatCompletionRequest, True),
    "/v1/responses": (ResponsesRequest, True),
    "/v1/responses/{response_id}/cancel": (_UNREAD, False),
    "/encode": (EmbeddingReqInput, True),
    "/classify": (EmbeddingReqInput, True),
    "/v1/embeddings": (EmbeddingRequest, True),
    "/v1/classify": (ClassifyRequest, True),
    "/v1/score": (ScoringRequest, True),
    "/v1/rerank": (RerankRequest, True),
    "/v1/audio/speech": (SPEECH_SCHEMA, True),
}

# Fields of the structs that the server derives itself: never part of a request.
_INTERNAL_FIELDS = ("type", *GenerateReqInput._DERIVED)


def install(app: FastAPI) -> None:
    """Makes `app.openapi()` return the document with every request body declared."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi


def build(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(
        title=app.title,
        version=app.version,
        routes=app.routes,
        description="Cadence's HTTP API: SGLang's native routes and the OpenAI API.",
    )
    structs = [b for b, _ in BODIES.values() if isinstance(b, type)]
    refs, components = msgspec.json.schema_components([*structs, SamplingParams], ref_template=REF)
    _complete_components(components)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
    _declare_bodies(doc, dict(zip(structs, refs)))
    return doc


def _complete_components(components: dict[str, Any]) -> None:
    """The request structs' schemas as a client should read them: no internal fields,
    sampling params described, exactly one of text and input_ids."""
    for schema in components.values():
        _strip_internal(schema)
    _describe_sampling(components["SamplingParams"])
    generate = components["GenerateReqInput"]["properties"]
    sampling_ref = {"$ref": REF.format(name="SamplingParams")}
    generate["sampling_params"] = {
        "anyOf": [sampling_ref, {"type": "array", "items": sampling_ref}, {"type": "null"}],
        "default": None,
    }
    for name in ("GenerateReqInput", "EmbeddingReqInput"):
        components[name]["oneOf"] = [
            {
                "required": ["text"],
                "properties": {"text": {"not": {"type": "null"}}, "input_ids": {"type": "null"}},
            },
            {
                "required": ["input_ids"],
                "properties": {"input_ids": {"not": {"type": "null"}}, "text": {"type": "null"}},
            },
        ]


def _declare_bodies(doc: dict[str, Any], ref_of: dict[type, Any]) -> None:
    """Each POST route's request body (the routes read raw bodies, so FastAPI cannot)."""
    for path, (body, required) in BODIES.items():
        operation = doc["paths"].get(path, {}).get("post")
        if operation is None:
            continue
        schema = ref_of[body] if isinstance(body, type) else copy.deepcopy(body)
        operation["requestBody"] = {
            "required": required,
            "content": {"application/json": {"schema": schema}},
        }
        responses = operation.setdefault("responses", {})
        responses.setdefault("400", {"description": "Bad input: the error names the field"})
        responses.setdefault(
            "413", {"description": "The body is larger than --max-request-body-mb"}
        )


def _strip_internal(schema: dict[str, Any]) -> None:
    props = schema.get("properties", {})
    for name in _INTERNAL_FIELDS:
        props.pop(name, None)
    if "required" in schema:
        schema["required"] = [r for r in schema["required"] if r not in _INTERNAL_FIELDS]
        if not schema["required"]:
            del schema["required"]


def _describe_sampling(schema: dict[str, Any]) -> None:
    docs = field_docs(SamplingParams)
    for name, prop in schema["properties"].items():
        prop.update(SAMPLING_RANGES.get(name, {}))
        if name in docs:
            prop["description"] = docs[name]
    stop = schema["properties"]["stop"]
    stop["anyOf"] = [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS},
        {
            "type": "array",
            "maxItems": MAX_STOP_STRINGS,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS},
        },
        {"type": "null"},
    ]
    schema["properties"]["stop_token_ids"]["anyOf"][0].update(
        maxItems=MAX_STOP_TOKEN_IDS, items={"type": "integer", "minimum": 0}
    )
