# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvCacheTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_TIER_UNSPECIFIED: _ClassVar[KvCacheTier]
    KV_CACHE_TIER_DEVICE: _ClassVar[KvCacheTier]
    KV_CACHE_TIER_HOST: _ClassVar[KvCacheTier]
    KV_CACHE_TIER_DISK: _ClassVar[KvCacheTier]
    KV_CACHE_TIER_EXTERNAL: _ClassVar[KvCacheTier]

class KvCacheLocality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_LOCALITY_UNSPECIFIED: _ClassVar[KvCacheLocality]
    KV_CACHE_LOCALITY_LOCAL: _ClassVar[KvCacheLocality]
    KV_CACHE_LOCALITY_REMOTE: _ClassVar[KvCacheLocality]
KV_CACHE_TIER_UNSPECIFIED: KvCacheTier
KV_CACHE_TIER_DEVICE: KvCacheTier
KV_CACHE_TIER_HOST: KvCacheTier
KV_CACHE_TIER_DISK: KvCacheTier
KV_CACHE_TIER_EXTERNAL: KvCacheTier
KV_CACHE_LOCALITY_UNSPECIFIED: KvCacheLocality
KV_CACHE_LOCALITY_LOCAL: KvCacheLocality
KV_CACHE_LOCALITY_REMOTE: KvCacheLocality

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerChunk(_message.Message):
    __slots__ = ("data", "sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    sha256: str
    def __init__(self, data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("start_sequence_number", "load_records_before_first_batch")
    START_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    LOAD_RECORDS_BEFORE_FIRST_BATCH_FIELD_NUMBER: _ClassVar[int]
    start_sequence_number: int
    load_records_before_first_batch: bool
    def __init__(self, start_sequence_number: _Optional[int] = ..., load_records_before_first_batch: _Optional[bool] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("sequence_number", "timestamp", "events", "dp_rank", "snapshot", "load")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    dp_rank: int
    snapshot: KvSnapshotChunk
    load: EngineLoad
    def __init__(self, sequence_number: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ..., dp_rank: _Optional[int] = ..., snapshot: _Optional[_Union[KvSnapshotChunk, _Mapping]] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "waiting_uncached_tokens", "token_usage", "gen_throughput", "max_running_requests", "age_ms", "sample", "load_only", "cache_hit_rate", "num_used_tokens", "max_total_num_tokens", "memory", "queues", "speculative", "lora", "disaggregation", "active_token_usage", "engine_silence_ms", "engine_reports_steps", "prefill_pending_tokens")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    GEN_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    LOAD_ONLY_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SILENCE_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REPORTS_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    waiting_uncached_tokens: int
    token_usage: float
    gen_throughput: float
    max_running_requests: int
    age_ms: int
    sample: int
    load_only: bool
    cache_hit_rate: float
    num_used_tokens: int
    max_total_num_tokens: int
    memory: EngineMemory
    queues: EngineQueues
    speculative: EngineSpeculative
    lora: EngineLora
    disaggregation: EngineDisaggregation
    active_token_usage: float
    engine_silence_ms: int
    engine_reports_steps: bool
    prefill_pending_tokens: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., waiting_uncached_tokens: _Optional[int] = ..., token_usage: _Optional[float] = ..., gen_throughput: _Optional[float] = ..., max_running_requests: _Optional[int] = ..., age_ms: _Optional[int] = ..., sample: _Optional[int] = ..., load_only: _Optional[bool] = ..., cache_hit_rate: _Optional[float] = ..., num_used_tokens: _Optional[int] = ..., max_total_num_tokens: _Optional[int] = ..., memory: _Optional[_Union[EngineMemory, _Mapping]] = ..., queues: _Optional[_Union[EngineQueues, _Mapping]] = ..., speculative: _Optional[_Union[EngineSpeculative, _Mapping]] = ..., lora: _Optional[_Union[EngineLora, _Mapping]] = ..., disaggregation: _Optional[_Union[EngineDisaggregation, _Mapping]] = ..., active_token_usage: _Optional[float] = ..., engine_silence_ms: _Optional[int] = ..., engine_reports_steps: _Optional[bool] = ..., prefill_pending_tokens: _Optional[int] = ...) -> None: ...

class EngineMemory(_message.Message):
    __slots__ = ("weight_gb", "kv_cache_gb", "graph_gb", "token_capacity")
    WEIGHT_GB_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GB_FIELD_NUMBER: _ClassVar[int]
    GRAPH_GB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    weight_gb: float
    kv_cache_gb: float
    graph_gb: float
    token_capacity: int
    def __init__(self, weight_gb: _Optional[float] = ..., kv_cache_gb: _Optional[float] = ..., graph_gb: _Optional[float] = ..., token_capacity: _Optional[int] = ...) -> None: ...

class EngineQueues(_message.Message):
    __slots__ = ("waiting", "grammar", "paused", "retracted")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RETRACTED_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    grammar: int
    paused: int
    retracted: int
    def __init__(self, waiting: _Optional[int] = ..., grammar: _Optional[int] = ..., paused: _Optional[int] = ..., retracted: _Optional[int] = ...) -> None: ...

class EngineSpeculative(_message.Message):
    __slots__ = ("accept_length", "accept_rate")
    ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_RATE_FIELD_NUMBER: _ClassVar[int]
    accept_length: float
    accept_rate: float
    def __init__(self, accept_length: _Optional[float] = ..., accept_rate: _Optional[float] = ...) -> None: ...

class EngineLora(_message.Message):
    __slots__ = ("slots_used", "slots_total", "utilization")
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    slots_used: int
    slots_total: int
    utilization: float
    def __init__(self, slots_used: _Optional[int] = ..., slots_total: _Optional[int] = ..., utilization: _Optional[float] = ...) -> None: ...

class EngineDisaggregation(_message.Message):
    __slots__ = ("mode", "prefill_prealloc_queue_reqs", "prefill_inflight_queue_reqs", "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs", "decode_retracted_queue_reqs", "kv_transfer_speed_gb_s", "kv_transfer_latency_ms")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PREALLOC_QUEUE_REQS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INFLIGHT_QUEUE_REQS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PREALLOC_QUEUE_REQS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TRANSFER_QUEUE_REQS_FIELD_NUMBER: _ClassVar[int]
    DECODE_RETRACTED_QUEUE_REQS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SPEED_GB_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    prefill_prealloc_queue_reqs: int
    prefill_inflight_queue_reqs: int
    decode_prealloc_queue_reqs: int
    decode_transfer_queue_reqs: int
    decode_retracted_queue_reqs: int
    kv_transfer_speed_gb_s: float
    kv_transfer_latency_ms: float
    def __init__(self, mode: _Optional[str] = ..., prefill_prealloc_queue_reqs: _Optional[int] = ..., prefill_inflight_queue_reqs: _Optional[int] = ..., decode_prealloc_queue_reqs: _Optional[int] = ..., decode_transfer_queue_reqs: _Optional[int] = ..., decode_retracted_queue_reqs: _Optional[int] = ..., kv_transfer_speed_gb_s: _Optional[float] = ..., kv_transfer_latency_ms: _Optional[float] = ...) -> None: ...

class KvSnapshotChunk(_message.Message):
    __slots__ = ("index", "count", "blocks", "unknown_before")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_BEFORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    blocks: int
    unknown_before: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., blocks: _Optional[int] = ..., unknown_before: _Optional[int] = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("event_id", "stored", "removed", "cleared")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    stored: KvBlocksStored
    removed: KvBlocksRemoved
    cleared: KvCacheCleared
    def __init__(self, event_id: _Optional[int] = ..., stored: _Optional[_Union[KvBlocksStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KvCacheCleared, _Mapping]] = ...) -> None: ...

class KvBlocksStored(_message.Message):
    __slots__ = ("blocks", "parent_block_hash", "tier", "medium", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership", "session_id", "lora_name", "cache_salt")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    parent_block_hash: int
    tier: KvCacheTier
    medium: str
    group_idx: int
    kv_cache_spec_kind: str
    kv_cache_spec_sliding_window: int
    locality: KvCacheLocality
    ownership: str
    session_id: str
    lora_name: str
    cache_salt: str
    def __init__(self, blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ..., parent_block_hash: _Optional[int] = ..., tier: _Optional[_Union[KvCacheTier, str]] = ..., medium: _Optional[str] = ..., group_idx: _Optional[int] = ..., kv_cache_spec_kind: _Optional[str] = ..., kv_cache_spec_sliding_window: _Optional[int] = ..., locality: _Optional[_Union[KvCacheLocality, str]] = ..., ownership: _Optional[str] = ..., session_id: _Optional[str] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class KvBlockExtraKey(_message.Message):
    __slots__ = ("text", "blob", "number", "multimodal")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    text: str
    blob: bytes
    number: int
    multimodal: KvMultimodalKey
    def __init__(self, text: _Optional[str] = ..., blob: _Optional[bytes] = ..., number: _Optional[int] = ..., multimodal: _Optional[_Union[KvMultimodalKey, _Mapping]] = ...) -> None: ...

class KvMultimodalKey(_message.Message):
    __slots__ = ("identifier", "offset")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("block_hash", "token_ids", "block_size", "lora_id", "cache_level", "extra_keys")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_id: int
    cache_level: int
    extra_keys: _containers.RepeatedCompositeFieldContainer[KvBlockExtraKey]
    def __init__(self, block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_id: _Optional[int] = ..., cache_level: _Optional[int] = ..., extra_keys: _Optional[_Iterable[_Union[KvBlockExtraKey, _Mapping]]] = ...) -> None: ...

class KvBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes", "cache_level", "tier", "medium", "group_idx", "locality", "ownership")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    cache_level: int
    tier: KvCacheTier
    medium: str
    group_idx: int
    locality: KvCacheLocality
    ownership: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., cache_level: _Optional[int] = ..., tier: _Optional[_Union[KvCacheTier, str]] = ..., medium: _Optional[str] = ..., group_idx: _Optional[int] = ..., locality: _Optional[_Union[KvCacheLocality, str]] = ..., ownership: _Optional[str] = ...) -> None: ...

class KvCacheCleared(_message.Message):
    __slots__ = ("ownership",)
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    ownership: str
    def __init__(self, ownership: _Optional[str] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("success", "message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("output_dir", "start_step", "num_steps", "activities", "with_stack", "record_shapes", "profile_by_stage")
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVITIES_FIELD_NUMBER: _ClassVar[int]
    WITH_STACK_FIELD_NUMBER: _ClassVar[int]
    RECORD_SHAPES_FIELD_NUMBER: _ClassVar[int]
    PROFILE_BY_STAGE_FIELD_NUMBER: _ClassVar[int]
    output_dir: str
    start_step: int
    num_steps: int
    activities: _containers.RepeatedScalarFieldContainer[str]
    with_stack: bool
    record_shapes: bool
    profile_by_stage: bool
    def __init__(self, output_dir: _Optional[str] = ..., start_step: _Optional[int] = ..., num_steps: _Optional[int] = ..., activities: _Optional[_Iterable[str]] = ..., with_stack: _Optional[bool] = ..., record_shapes: _Optional[bool] = ..., profile_by_stage: _Optional[bool] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("success", "message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
