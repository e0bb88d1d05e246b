"""The checked-in stubs match the proto, and the proto matches the wire contract.

The contract table below is transcribed from specs/grpc.md (names, numbers, types,
`optional`); a renumbered or retyped field breaks every client generated from SGLang's
proto, so it fails here before anything is served.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor as F

REPO = Path(__file__).resolve().parents[3]


def _gen_script():
    spec = importlib.util.spec_from_file_location(
        "gen_grpc_stubs", REPO / "scripts" / "gen_grpc_stubs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_stubs_match_the_proto():
    pytest.importorskip(
        "grpc_tools", reason="grpcio-tools (a test dependency) regenerates the stubs to compare"
    )
    problems = _gen_script().stale_stubs()
    assert not problems, "\n".join(problems) + "\nrun: python scripts/gen_grpc_stubs.py"


def test_stubs_import_without_protoc():
    from cadence.grpc import sglang_pb2, sglang_pb2_grpc

    assert sglang_pb2.DESCRIPTOR.name == "sglang/runtime/v1/sglang.proto"
    assert hasattr(sglang_pb2_grpc, "SglangServiceStub")


S, I32, I64, FL, B, BY, MSG, MAP = (
    "string",
    "int32",
    "int64",
    "float",
    "bool",
    "bytes",
    "message",
    "map",
)
OPT, REP = "optional", "repeated"
# each field: (number, type, label), label "" for a plain proto3 singular field

CONTRACT: dict[str, dict[str, tuple]] = {
    "SamplingParams": {
        "temperature": (1, FL, OPT),
        "top_p": (2, FL, OPT),
        "top_k": (3, I32, OPT),
        "min_p": (4, FL, OPT),
        "frequency_penalty": (5, FL, OPT),
        "presence_penalty": (6, FL, OPT),
        "repetition_penalty": (7, FL, OPT),
        "max_new_tokens": (8, I32, OPT),
        "min_new_tokens": (9, I32, OPT),
        "stop": (10, S, REP),
        "stop_token_ids": (11, I32, REP),
        "ignore_eos": (12, B, OPT),
        "n": (13, I32, OPT),
        "json_schema": (14, S, OPT),
        "regex": (15, S, OPT),
        "ebnf": (100, S, OPT),  # Cadence's own (numbers from 100 up), documented in the proto
    },
    "DisaggregatedParams": {
        "bootstrap_host": (1, S, ""),
        "bootstrap_port": (2, I32, ""),
        "bootstrap_room": (3, I64, ""),
    },
    "TextGenerateRequest": {
        "text": (1, S, ""),
        "sampling_params": (2, MSG, OPT),
        "stream": (3, B, OPT),
        "return_logprob": (4, B, OPT),
        "top_logprobs_num": (5, I32, OPT),
        "logprob_start_len": (6, I32, OPT),
        "return_text_in_logprobs": (7, B, OPT),
        "rid": (8, S, OPT),
        "lora_path": (9, S, OPT),
        "routing_key": (10, S, OPT),
        "routed_dp_rank": (11, I32, OPT),
        "trace_headers": (12, MAP, ""),
        "session_id": (13, S, OPT),
        "disaggregated_params": (14, MSG, OPT),
    },
    "TextGenerateResponse": {"text": (1, S, ""), "meta_info": (2, MAP, ""), "finished": (3, B, "")},
    "GenerateRequest": {
        "input_ids": (1, I32, REP),
        "sampling_params": (2, MSG, OPT),
        "stream": (3, B, OPT),
        "return_logprob": (4, B, OPT),
        "top_logprobs_num": (5, I32, OPT),
        "logprob_start_len": (6, I32, OPT),
        "rid": (7, S, OPT),
        "lora_path": (8, S, OPT),
        "routing_key": (9, S, OPT),
        "routed_dp_rank": (10, I32, OPT),
        "trace_headers": (11, MAP, ""),
        "session_id": (12, S, OPT),
        "disaggregated_params": (13, MSG, OPT),
    },
    "GenerateResponse": {
        "output_ids": (1, I32, REP),
        "meta_info": (2, MAP, ""),
        "finished": (3, B, ""),
    },
    "TextEmbedRequest": {
        "text": (1, S, ""),
        "rid": (2, S, OPT),
        "routing_key": (3, S, OPT),
        "trace_headers": (4, MAP, ""),
    },
    "TextEmbedResponse": {"embedding": (1, FL, REP), "meta_info": (2, MAP, "")},
    "EmbedResponse": {"embedding": (1, FL, REP), "meta_info": (2, MAP, "")},
    "ClassifyResponse": {"embedding": (1, FL, REP), "meta_info": (2, MAP, "")},
    "EmbedRequest": {
        "input_ids": (1, I32, REP),
        "rid": (2, S, OPT),
        "routing_key": (3, S, OPT),
        "trace_headers": (4, MAP, ""),
    },
    "ClassifyRequest": {
        "text": (1, S, ""),
        "input_ids": (2, I32, REP),
        "rid": (3, S, OPT),
        "routing_key": (4, S, OPT),
        "trace_headers": (5, MAP, ""),
    },
    "TokenizeRequest": {"text": (1, S, ""), "add_special_tokens": (2, B, OPT)},
    "TokenizeResponse": {
        "tokens": (1, I32, REP),
        "count": (2, I32, ""),
        "max_model_len": (3, I32, ""),
        "input_text": (4, S, ""),
    },
    "DetokenizeRequest": {"tokens": (1, I32, REP)},
    "DetokenizeResponse": {"text": (1, S, "")},
    "HealthCheckRequest": {},
    "HealthCheckResponse": {"healthy": (1, B, "")},
    "GetModelInfoRequest": {},
    "GetModelInfoResponse": {"model_path": (1, S, ""), "json_info": (2, S, "")},
    "GetServerInfoRequest": {},
    "GetServerInfoResponse": {"json_info": (1, S, "")},
    "ListModelsRequest": {},
    "ListModelsResponse": {"models": (1, MSG, REP)},
    "ModelCard": {
        "id": (1, S, ""),
        "root": (2, S, ""),
        "parent": (3, S, OPT),
        "max_model_len": (4, I32, OPT),
        "capabilities": (100, S, REP),  # Cadence's own
    },
    "GetLoadRequest": {"dp_rank": (1, I32, OPT)},
    "GetLoadResponse": {"json_info": (1, S, "")},
    "AbortRequest": {"rid": (1, S, ""), "abort_all": (2, B, "")},
    "AbortResponse": {"success": (1, B, "")},
    "FlushCacheRequest": {},
    "FlushCacheResponse": {"success": (1, B, ""), "message": (2, S, "")},
    "PauseGenerationRequest": {"mode": (1, S, "")},
    "PauseGenerationResponse": {"message": (1, S, "")},
    "ContinueGenerationRequest": {},
    "ContinueGenerationResponse": {"message": (1, S, "")},
    "OpenAIRequest": {"json_body": (1, BY, ""), "trace_headers": (2, MAP, "")},
    "OpenAIStreamChunk": {"json_chunk": (1, BY, ""), "finished": (2, B, "")},
    "OpenAIResponse": {"json_body": (1, BY, ""), "status_code": (2, I32, "")},
    "StartProfileRequest": {"output_dir": (1, S, OPT)},
    "StartProfileResponse": {"message": (1, S, "")},
    "StopProfileRequest": {},
    "StopProfileResponse": {"message": (1, S, "")},
    "UpdateWeightsRequest": {"model_path": (1, S, ""), "load_format": (2, S, OPT)},
    "UpdateWeightsResponse": {"success": (1, B, ""), "message": (2, S, "")},
    # Cadence's own speech messages (field numbers 200-299; docs/grpc.md).
    "SpeechRequest": {
        "input": (200, S, ""),
        "model": (201, S, ""),
        "voice": (202, S, OPT),
        "response_format": (203, S, OPT),
        "speed": (204, FL, OPT),
    },
    "SpeechChunk": {"audio": (200, BY, ""), "finished": (201, B, ""), "content_type": (202, S, "")},
}

METHODS = {
    "TextGenerate": ("TextGenerateRequest", "TextGenerateResponse", True),
    "Generate": ("GenerateRequest", "GenerateResponse", True),
    "TextEmbed": ("TextEmbedRequest", "TextEmbedResponse", False),
    "Embed": ("EmbedRequest", "EmbedResponse", False),
    "Classify": ("ClassifyRequest", "ClassifyResponse", False),
    "Tokenize": ("TokenizeRequest", "TokenizeResponse", False),
    "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False),
    "HealthCheck": ("HealthCheckRequest", "HealthCheckResponse", False),
    "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False),
    "GetServerInfo": ("GetServerInfoRequest", "GetServerInfoResponse", False),
    "ListModels": ("ListModelsRequest", "ListModelsResponse", False),
    "GetLoad": ("GetLoadRequest", "GetLoadResponse", False),
    "Abort": ("AbortRequest", "AbortResponse", False),
    "FlushCache": ("FlushCacheRequest", "FlushCacheResponse", False),
    "PauseGeneration": ("PauseGenerationRequest", "PauseGenerationResponse", False),
    "ContinueGeneration": ("ContinueGenerationRequest", "ContinueGenerationResponse", False),
    "ChatComplete": ("OpenAIRequest", "OpenAIStreamChunk", True),
    "Complete": ("OpenAIRequest", "OpenAIStreamChunk", True),
    "OpenAIEmbed": ("OpenAIRequest", "OpenAIResponse", False),
    "OpenAIClassify": ("OpenAIRequest", "OpenAIResponse", False),
    "Score": ("OpenAIRequest", "OpenAIResponse", False),
    "Rerank": ("OpenAIRequest", "OpenAIResponse", False),
    "StartProfile": ("StartProfileRequest", "StartProfileResponse", False),
    "StopProfile": ("StopProfileRequest", "StopProfileResponse", False),
    "UpdateWeightsFromDisk": ("UpdateWeightsRequest", "UpdateWeightsResponse", False),
    "SynthesizeSpeech": ("SpeechRequest", "SpeechChunk", True),
}

_TYPES = {
    F.TYPE_STRING: S,
    F.TYPE_INT32: I32,
    F.TYPE_INT64: I64,
    F.TYPE_FLOAT: FL,
    F.TYPE_BOOL: B,
    F.TYPE_BYTES: BY,
    F.TYPE_MESSAGE: MSG,
}


def _describe(field) -> tuple:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return field.number, MAP, ""
    # proto3 `optional` puts the field alone in a synthetic oneof
    label = REP if field.is_repeated else OPT if field.containing_oneof is not None else ""
    return field.number, _TYPES[field.type], label


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_message_matches_the_contract(name):
    from cadence.grpc import sglang_pb2

    desc = sglang_pb2.DESCRIPTOR.message_types_by_name[name]
    assert desc.full_name == f"sglang.runtime.v1.{name}"
    assert {f.name: _describe(f) for f in desc.fields} == CONTRACT[name]


def test_maps_are_string_to_string():
    from cadence.grpc import sglang_pb2

    for name in CONTRACT:
        for field in sglang_pb2.DESCRIPTOR.message_types_by_name[name].fields:
            if _describe(field)[1] == MAP:
                key, value = field.message_type.fields
                assert (key.type, value.type) == (F.TYPE_STRING, F.TYPE_STRING), (
                    f"{name}.{field.name}"
                )


def test_service_methods_match_the_contract():
    from cadence.grpc import sglang_pb2

    service = sglang_pb2.DESCRIPTOR.services_by_name["SglangService"]
    assert service.full_name == "sglang.runtime.v1.SglangService"
    got = {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods
    }
    assert got == METHODS
    assert not any(m.client_streaming for m in service.methods)
