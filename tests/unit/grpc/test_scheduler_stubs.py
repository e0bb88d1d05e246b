"""The scheduler service's stubs match the wire contract SGLang's gateway speaks.

The tables below are transcribed from smg-grpc-proto 0.4.28 (the proto SMG 1.13 is built
from): a renumbered or retyped field would break the gateway silently, so it fails here.
Staleness of the checked-in stubs against proto/ is checked with the others
(test_grpc_stubs.py runs scripts/gen_grpc_stubs.py over every proto).
"""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor as F

from cadence.grpc import sglang_scheduler_pb2 as pb
from cadence.grpc import smg_common_pb2 as common

T = {
    F.TYPE_STRING: "string",
    F.TYPE_BYTES: "bytes",
    F.TYPE_BOOL: "bool",
    F.TYPE_FLOAT: "float",
    F.TYPE_DOUBLE: "double",
    F.TYPE_INT32: "int32",
    F.TYPE_UINT32: "uint32",
    F.TYPE_INT64: "int64",
    F.TYPE_UINT64: "uint64",
    F.TYPE_MESSAGE: "message",
    F.TYPE_ENUM: "enum",
}

# message -> field -> (number, type, repeated)
CONTRACT = {
    "SamplingParams": {
        "temperature": (1, "float", False),
        "top_p": (2, "float", False),
        "top_k": (3, "int32", False),
        "min_p": (4, "float", False),
        "frequency_penalty": (5, "float", False),
        "presence_penalty": (6, "float", False),
        "repetition_penalty": (7, "float", False),
        "max_new_tokens": (8, "uint32", False),
        "stop": (9, "string", True),
        "stop_token_ids": (10, "uint32", True),
        "skip_special_tokens": (11, "bool", False),
        "spaces_between_special_tokens": (12, "bool", False),
        "regex": (13, "string", False),
        "json_schema": (14, "string", False),
        "ebnf_grammar": (15, "string", False),
        "structural_tag": (16, "string", False),
        "n": (17, "uint32", False),
        "min_new_tokens": (18, "uint32", False),
        "ignore_eos": (19, "bool", False),
        "no_stop_trim": (20, "bool", False),
        "stream_interval": (21, "int32", False),
        "logit_bias": (22, "message", True),
        "custom_params": (23, "message", False),
    },
    "GenerateRequest": {
        "request_id": (1, "string", False),
        "tokenized": (2, "message", False),
        "mm_inputs": (3, "message", False),
        "sampling_params": (4, "message", False),
        "return_logprob": (5, "bool", False),
        "logprob_start_len": (6, "int32", False),
        "top_logprobs_num": (7, "int32", False),
        "token_ids_logprob": (8, "uint32", True),
        "return_hidden_states": (9, "bool", False),
        "disaggregated_params": (10, "message", False),
        "custom_logit_processor": (11, "string", False),
        "timestamp": (12, "message", False),
        "log_metrics": (13, "bool", False),
        "input_embeds": (14, "float", True),
        "lora_id": (15, "string", False),
        "data_parallel_rank": (16, "int32", False),
        "stream": (17, "bool", False),
        "require_reasoning": (18, "bool", False),
    },
    "TokenizedInput": {"original_text": (1, "string", False), "input_ids": (2, "uint32", True)},
    "GenerateResponse": {
        "request_id": (1, "string", False),
        "chunk": (2, "message", False),
        "complete": (3, "message", False),
    },
    "GenerateStreamChunk": {
        "token_ids": (1, "uint32", True),
        "prompt_tokens": (2, "uint32", False),
        "completion_tokens": (3, "uint32", False),
        "cached_tokens": (4, "uint32", False),
        "output_logprobs": (5, "message", False),
        "hidden_states": (6, "float", True),
        "input_logprobs": (7, "message", False),
        "index": (8, "uint32", False),
        "reasoning_tokens": (9, "uint32", False),
    },
    "GenerateComplete": {
        "output_ids": (1, "uint32", True),
        "finish_reason": (2, "string", False),
        "prompt_tokens": (3, "uint32", False),
        "completion_tokens": (4, "uint32", False),
        "cached_tokens": (5, "uint32", False),
        "output_logprobs": (6, "message", False),
        "all_hidden_states": (7, "message", True),
        "matched_token_id": (8, "uint32", False),
        "matched_stop_str": (9, "string", False),
        "input_logprobs": (10, "message", False),
        "index": (11, "uint32", False),
        "reasoning_tokens": (12, "uint32", False),
        "spec_accepted_tokens": (13, "uint32", False),
        "spec_draft_tokens": (14, "uint32", False),
    },
    "OutputLogProbs": {
        "token_logprobs": (1, "float", True),
        "token_ids": (2, "uint32", True),
        "top_logprobs": (3, "message", True),
        "token_ids_logprobs": (4, "message", True),
    },
    "InputLogProbs": {
        "token_logprobs": (1, "message", True),
        "token_ids": (2, "uint32", True),
        "top_logprobs": (3, "message", True),
    },
    "TopLogProbs": {"values": (1, "float", True), "token_ids": (2, "uint32", True)},
    "AbortRequest": {"request_id": (1, "string", False), "reason": (2, "string", False)},
    "AbortResponse": {"success": (1, "bool", False), "message": (2, "string", False)},
    "HealthCheckResponse": {"healthy": (1, "bool", False), "message": (2, "string", False)},
    "GetModelInfoResponse": {
        "model_path": (1, "string", False),
        "tokenizer_path": (2, "string", False),
        "is_generation": (3, "bool", False),
        "preferred_sampling_params": (4, "string", False),
        "weight_version": (5, "string", False),
        "served_model_name": (6, "string", False),
        "max_context_length": (7, "int32", False),
        "vocab_size": (8, "int32", False),
        "supports_vision": (9, "bool", False),
        "model_type": (10, "string", False),
        "eos_token_ids": (11, "int32", True),
        "pad_token_id": (12, "int32", False),
        "bos_token_id": (13, "int32", False),
        "max_req_input_len": (14, "int32", False),
        "architectures": (15, "string", True),
        "id2label_json": (16, "string", False),
        "num_labels": (17, "int32", False),
        "default_sampling_params_json": (20, "string", False),
    },
    "GetServerInfoResponse": {
        "server_args": (1, "message", False),
        "scheduler_info": (2, "message", False),
        "active_requests": (3, "int32", False),
        "is_paused": (4, "bool", False),
        "last_receive_timestamp": (5, "double", False),
        "uptime_seconds": (6, "double", False),
        "sglang_version": (7, "string", False),
        "server_type": (8, "string", False),
        "start_time": (9, "message", False),
        "max_total_num_tokens": (10, "int32", False),
    },
    "SchedulerLoad": {
        "dp_rank": (1, "int32", False),
        "num_running_reqs": (2, "int32", False),
        "num_waiting_reqs": (3, "int32", False),
        "num_total_reqs": (4, "int32", False),
        "num_used_tokens": (5, "int32", False),
        "max_total_num_tokens": (6, "int32", False),
        "token_usage": (7, "double", False),
        "gen_throughput": (8, "double", False),
        "cache_hit_rate": (9, "double", False),
        "utilization": (10, "double", False),
        "max_running_requests": (11, "int32", False),
        "memory": (12, "message", False),
        "speculative": (13, "message", False),
        "lora": (14, "message", False),
        "disaggregation": (15, "message", False),
        "queues": (16, "message", False),
        "num_waiting_uncached_tokens": (17, "int32", False),
    },
    "GetLoadsRequest": {"dp_rank": (1, "int32", False), "include": (2, "string", True)},
}
COMMON_CONTRACT = {
    "GetTokenizerChunk": {"data": (1, "bytes", False), "sha256": (2, "string", False)},
    "FlushCacheRequest": {"timeout_s": (1, "float", False)},
    "FlushCacheResponse": {"success": (1, "bool", False), "message": (2, "string", False)},
    "StartProfileRequest": {
        "output_dir": (1, "string", False),
        "start_step": (2, "int32", False),
        "num_steps": (3, "int32", False),
        "activities": (4, "string", True),
        "with_stack": (5, "bool", False),
        "record_shapes": (6, "bool", False),
        "profile_by_stage": (7, "bool", False),
    },
    "ProfileResponse": {"success": (1, "bool", False), "message": (2, "string", False)},
    "SubscribeKvEventsRequest": {
        "start_sequence_number": (1, "uint64", False),
        "load_records_before_first_batch": (2, "bool", False),
    },
}
ONEOFS = {
    ("SamplingParams", "constraint"): {"regex", "json_schema", "ebnf_grammar", "structural_tag"},
    ("GenerateResponse", "response"): {"chunk", "complete"},
    ("GenerateComplete", "matched_stop"): {"matched_token_id", "matched_stop_str"},
}
METHODS = {
    "Generate": ("GenerateRequest", "GenerateResponse", True),
    "Embed": ("EmbedRequest", "EmbedResponse", False),
    "HealthCheck": ("HealthCheckRequest", "HealthCheckResponse", False),
    "Abort": ("AbortRequest", "AbortResponse", False),
    "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False),
    "GetServerInfo": ("GetServerInfoRequest", "GetServerInfoResponse", False),
    "GetLoads": ("GetLoadsRequest", "GetLoadsResponse", False),
    "FlushCache": (
        "smg.grpc.common.FlushCacheRequest",
        "smg.grpc.common.FlushCacheResponse",
        False,
    ),
    "StartProfile": (
        "smg.grpc.common.StartProfileRequest",
        "smg.grpc.common.ProfileResponse",
        False,
    ),
    "StopProfile": ("smg.grpc.common.StopProfileRequest", "smg.grpc.common.ProfileResponse", False),
    "GetTokenizer": (
        "smg.grpc.common.GetTokenizerRequest",
        "smg.grpc.common.GetTokenizerChunk",
        True,
    ),
    "SubscribeKvEvents": (
        "smg.grpc.common.SubscribeKvEventsRequest",
        "smg.grpc.common.KvEventBatch",
        True,
    ),
    "LoadLoRAAdapter": ("LoadLoRAAdapterRequest", "LoadLoRAAdapterResponse", False),
    "UnloadLoRAAdapter": ("UnloadLoRAAdapterRequest", "UnloadLoRAAdapterResponse", False),
    "ListLoadedLoRAAdapters": (
        "ListLoadedLoRAAdaptersRequest",
        "ListLoadedLoRAAdaptersResponse",
        False,
    ),
}


def _fields(desc) -> dict[str, tuple]:
    return {f.name: (f.number, T[f.type], f.is_repeated) for f in desc.fields}


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_scheduler_message_matches_the_contract(name):
    desc = pb.DESCRIPTOR.message_types_by_name[name]
    assert desc.full_name == f"sglang.grpc.scheduler.{name}"
    assert _fields(desc) == CONTRACT[name]


@pytest.mark.parametrize("name", sorted(COMMON_CONTRACT))
def test_common_message_matches_the_contract(name):
    desc = common.DESCRIPTOR.message_types_by_name[name]
    assert desc.full_name == f"smg.grpc.common.{name}"
    assert _fields(desc) == COMMON_CONTRACT[name]


def test_oneofs_group_the_same_fields():
    for (message, oneof), fields in ONEOFS.items():
        desc = pb.DESCRIPTOR.message_types_by_name[message].oneofs_by_name[oneof]
        assert {f.name for f in desc.fields} == fields


def test_optional_scalars_have_presence():
    assert pb.SamplingParams.DESCRIPTOR.fields_by_name["max_new_tokens"].has_presence
    assert pb.GenerateRequest.DESCRIPTOR.fields_by_name["data_parallel_rank"].has_presence
    assert not pb.SamplingParams.DESCRIPTOR.fields_by_name["temperature"].has_presence


def test_service_methods_match_the_contract():
    service = pb.DESCRIPTOR.services_by_name["SglangScheduler"]
    assert service.full_name == "sglang.grpc.scheduler.SglangScheduler"

    def name(desc):
        return desc.name if desc.file is pb.DESCRIPTOR else desc.full_name

    got = {
        m.name: (name(m.input_type), name(m.output_type), m.server_streaming)
        for m in service.methods
    }
    assert got == METHODS
    assert not any(m.client_streaming for m in service.methods)


def test_descriptor_file_names_do_not_collide_with_the_upstream_package():
    # smg_grpc_proto registers sglang_scheduler.proto and common.proto: ours are other files
    assert pb.DESCRIPTOR.name == "sglang/grpc/scheduler/sglang_scheduler.proto"
    assert common.DESCRIPTOR.name == "smg/grpc/common/common.proto"
    assert [d.name for d in pb.DESCRIPTOR.dependencies] == [
        "google/protobuf/struct.proto",
        "google/protobuf/timestamp.proto",
        "smg/grpc/common/common.proto",
    ]
