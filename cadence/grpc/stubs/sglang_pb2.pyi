from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos", "n", "json_schema", "regex", "ebnf")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    max_new_tokens: int
    min_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    n: int
    json_schema: str
    regex: str
    ebnf: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ...) -> None: ...

class DisaggregatedParams(_message.Message):
    __slots__ = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    BOOTSTRAP_HOST_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    def __init__(self, bootstrap_host: _Optional[str] = ..., bootstrap_port: _Optional[int] = ..., bootstrap_room: _Optional[int] = ...) -> None: ...

class TextGenerateRequest(_message.Message):
    __slots__ = ("text", "sampling_params", "stream", "return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs", "rid", "lora_path", "routing_key", "routed_dp_rank", "trace_headers", "session_id", "disaggregated_params")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_IN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    ROUTED_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    text: str
    sampling_params: SamplingParams
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    return_text_in_logprobs: bool
    rid: str
    lora_path: str
    routing_key: str
    routed_dp_rank: int
    trace_headers: _containers.ScalarMap[str, str]
    session_id: str
    disaggregated_params: DisaggregatedParams
    def __init__(self, text: _Optional[str] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[bool] = ..., return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., logprob_start_len: _Optional[int] = ..., return_text_in_logprobs: _Optional[bool] = ..., rid: _Optional[str] = ..., lora_path: _Optional[str] = ..., routing_key: _Optional[str] = ..., routed_dp_rank: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., session_id: _Optional[str] = ..., disaggregated_params: _Optional[_Union[DisaggregatedParams, _Mapping]] = ...) -> None: ...

class TextGenerateResponse(_message.Message):
    __slots__ = ("text", "meta_info", "finished")
    class MetaInfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    META_INFO_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    text: str
    meta_info: _containers.ScalarMap[str, str]
    finished: bool
    def __init__(self, text: _Optional[str] = ..., meta_info: _Optional[_Mapping[str, str]] = ..., finished: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("input_ids", "sampling_params", "stream", "return_logprob", "top_logprobs_num", "logprob_start_len", "rid", "lora_path", "routing_key", "routed_dp_rank", "trace_headers", "session_id", "disaggregated_params")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    ROUTED_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    rid: str
    lora_path: str
    routing_key: str
    routed_dp_rank: int
    trace_headers: _containers.ScalarMap[str, str]
    session_id: str
    disaggregated_params: DisaggregatedParams
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[bool] = ..., return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., logprob_start_len: _Optional[int] = ..., rid: _Optional[str] = ..., lora_path: _Optional[str] = ..., routing_key: _Optional[str] = ..., routed_dp_rank: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., session_id: _Optional[str] = ..., disaggregated_params: _Optional[_Union[DisaggregatedParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("output_ids", "meta_info", "finished")
    class MetaInfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    META_INFO_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    meta_info: _containers.ScalarMap[str, str]
    finished: bool
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., meta_info: _Optional[_Mapping[str, str]] = ..., finished: _Optional[bool] = ...) -> None: ...

class TextEmbedRequest(_message.Message):
    __slots__ = ("text", "rid", "routing_key", "trace_headers")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    text: str
    rid: str
    routing_key: str
    trace_headers: _containers.ScalarMap[str, str]
    def __init__(self, text: _Optional[str] = ..., rid: _Optional[str] = ..., routing_key: _Optional[str] = ..., trace_headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TextEmbedResponse(_message.Message):
    __slots__ = ("embedding", "meta_info")
    class MetaInfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    META_INFO_FIELD_NUMBER: _ClassVar[int]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    meta_info: _containers.ScalarMap[str, str]
    def __init__(self, embedding: _Optional[_Iterable[float]] = ..., meta_info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("input_ids", "rid", "routing_key", "trace_headers")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    rid: str
    routing_key: str
    trace_headers: _containers.ScalarMap[str, str]
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., rid: _Optional[str] = ..., routing_key: _Optional[str] = ..., trace_headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embedding", "meta_info")
    class MetaInfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    META_INFO_FIELD_NUMBER: _ClassVar[int]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    meta_info: _containers.ScalarMap[str, str]
    def __init__(self, embedding: _Optional[_Iterable[float]] = ..., meta_info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("text", "input_ids", "rid", "routing_key", "trace_headers")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    text: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    rid: str
    routing_key: str
    trace_headers: _containers.ScalarMap[str, str]
    def __init__(self, text: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., rid: _Optional[str] = ..., routing_key: _Optional[str] = ..., trace_headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("embedding", "meta_info")
    class MetaInfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    META_INFO_FIELD_NUMBER: _ClassVar[int]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    meta_info: _containers.ScalarMap[str, str]
    def __init__(self, embedding: _Optional[_Iterable[float]] = ..., meta_info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "count", "max_model_len", "input_text")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    INPUT_TEXT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    count: int
    max_model_len: int
    input_text: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., max_model_len: _Optional[int] = ..., input_text: _Optional[str] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class HealthCheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthCheckResponse(_message.Message):
    __slots__ = ("healthy",)
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    def __init__(self, healthy: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_path", "json_info")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    JSON_INFO_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    json_info: str
    def __init__(self, model_path: _Optional[str] = ..., json_info: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("json_info",)
    JSON_INFO_FIELD_NUMBER: _ClassVar[int]
    json_info: str
    def __init__(self, json_info: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "root", "parent", "max_model_len", "capabilities")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    id: str
    root: str
    parent: str
    max_model_len: int
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., root: _Optional[str] = ..., parent: _Optional[str] = ..., max_model_len: _Optional[int] = ..., capabilities: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("dp_rank",)
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    def __init__(self, dp_rank: _Optional[int] = ...) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("json_info",)
    JSON_INFO_FIELD_NUMBER: _ClassVar[int]
    json_info: str
    def __init__(self, json_info: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rid", "abort_all")
    RID_FIELD_NUMBER: _ClassVar[int]
    ABORT_ALL_FIELD_NUMBER: _ClassVar[int]
    rid: str
    abort_all: bool
    def __init__(self, rid: _Optional[str] = ..., abort_all: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("success",)
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    def __init__(self, success: _Optional[bool] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("success", "message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class ContinueGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContinueGenerationResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class OpenAIRequest(_message.Message):
    __slots__ = ("json_body", "trace_headers")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JSON_BODY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    json_body: bytes
    trace_headers: _containers.ScalarMap[str, str]
    def __init__(self, json_body: _Optional[bytes] = ..., trace_headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class OpenAIStreamChunk(_message.Message):
    __slots__ = ("json_chunk", "finished")
    JSON_CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    json_chunk: bytes
    finished: bool
    def __init__(self, json_chunk: _Optional[bytes] = ..., finished: _Optional[bool] = ...) -> None: ...

class OpenAIResponse(_message.Message):
    __slots__ = ("json_body", "status_code")
    JSON_BODY_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    json_body: bytes
    status_code: int
    def __init__(self, json_body: _Optional[bytes] = ..., status_code: _Optional[int] = ...) -> None: ...

class SpeechRequest(_message.Message):
    __slots__ = ("input", "model", "voice", "response_format", "speed")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    input: str
    model: str
    voice: str
    response_format: str
    speed: float
    def __init__(self, input: _Optional[str] = ..., model: _Optional[str] = ..., voice: _Optional[str] = ..., response_format: _Optional[str] = ..., speed: _Optional[float] = ...) -> None: ...

class SpeechChunk(_message.Message):
    __slots__ = ("audio", "finished", "content_type")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    finished: bool
    content_type: str
    def __init__(self, audio: _Optional[bytes] = ..., finished: _Optional[bool] = ..., content_type: _Optional[str] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("output_dir",)
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    output_dir: str
    def __init__(self, output_dir: _Optional[str] = ...) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("model_path", "load_format")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    load_format: str
    def __init__(self, model_path: _Optional[str] = ..., load_format: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("success", "message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
