"""Server arguments: one frozen dataclass per concern, one flat command line.

`ServerArgs` holds a `ModelArgs`, `SchedulerArgs`, `HttpArgs`, `GrpcArgs`, `OutputArgs`,
`RuntimeArgs`, `PipelineArgs` and the request kinds' groups (`feature_args.py`:
speculative decoding, the disk tier, disaggregation, LoRA); each checks its own fields (a `ValueError` naming the field)
and documents each field with the docstring under it, which is also its flag's `--help`.
Flags stay flat (`--max-running-requests`, as SGLang spells them), and so does reading:
`args.max_running_requests` is `args.scheduler.max_running_requests`. A part of the server
that needs one concern may take just its group. Checks across groups (a gRPC port beside
the HTTP one, a pipeline with one front) are `ServerArgs`'s own.

Imports nothing heavy, so `cadence serve --help` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from cadence.config_docs import field_docs
from cadence.feature_args import (  # noqa: F401 (read from here too)
    DISAGGREGATION_BACKENDS,
    DISAGGREGATION_MODES,
    LORA_TARGET_MODULES,
    SPECULATIVE_ALGORITHMS,
    DisaggregationArgs,
    HiCacheArgs,
    LoraArgs,
    ParallelArgs,
    SpeculativeArgs,
    _at_least_one,
    parse_lora_path,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelArgs:
    """Which model is served, in which precision, under which names."""

    model_path: str | None = None
    """A .gguf file or a Hugging Face model directory; default: the embedded SmolLM2-135M-Instruct."""
    tokenizer_path: str | None = None
    """Tokenizer to use instead of the model's own (a directory with tokenizer.json, or a .gguf)."""
    served_model_name: str | None = None
    """Model id reported by the API, or several aliases separated by commas (the first is the id); default: the model path's name. Requests may name any model unless --strict-model-name."""
    strict_model_name: bool = False
    """Refuse (404) a request whose `model` is not one of the served names, instead of serving it with the one model as SGLang does."""
    chat_template: str | None = None
    """A Jinja chat template file overriding the model's own."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (bfloat16 where the CPU supports it, else float32), float32, bfloat16, float16."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype: auto (the model dtype), float32, bfloat16, float16."""
    dequantize: bool = False
    """Widen a quantized GGUF file's weights to --dtype at load, instead of serving its quantized matrices at their own precision (the default)."""
    quantization: str | None = None
    """Quantize the model's float weights at load, weight-only and group-wise: int8 (GGUF Q8_0 blocks) or int4 (Q4_1); activations keep --dtype. A GGUF file's quantized matrices keep their own types. See docs/quantization.md."""
    context_length: int | None = None
    """Longest sequence (prompt + output) served; default: the model's own."""
    disable_cuda_graph: bool = False
    """Run every decode step eagerly instead of replaying CUDA graphs captured at start (platforms with graph capture only: CUDA)."""
    cuda_graph_max_bs: int | None = None
    """Most rows (a token each) of a decode step captured in a CUDA graph; larger steps run eagerly. Default: --max-running-requests (times --speculative-num-draft-tokens with speculative decoding, whose verify steps replay the graphs a row per token), at most 256."""
    trust_remote_code: bool = False
    """Accepted for SGLang compatibility: no model's own code is ever run; architectures are Cadence's (config.json names them)."""
    weight_version: str = "default"
    """The served weights' version (SGLang's label, for reinforcement-learning loops): in every generation response's meta_info, /get_weight_version and /model_info; changed by /update_weight_version or by an /update_weights_from_disk that names one."""
    tokenizer_mode: str = "auto"
    """SGLang's flag: auto, the model's fast tokenizer (the only one served here; slow is refused at start-up)."""
    load_format: str = "auto"
    """How the weights are read (SGLang's flag): auto (by the model path), gguf (a .gguf file) or safetensors (a Hugging Face directory); one that does not match the path stops start-up, as one not served here does."""
    is_embedding: bool = False
    """Serve a decoder (the Llama family) as an embedding model: the last token's final hidden state, normalized (or the pooling its modules.json declares). Encoders (BERT) are detected from their config.json and served as embedding models without this flag."""

    def __post_init__(self) -> None:
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"{name} must be one of {', '.join(DTYPES)}, got {getattr(self, name)!r}"
                )
        if self.tokenizer_mode != "auto":
            raise ValueError(
                f"tokenizer_mode {self.tokenizer_mode!r} is not served: every model's fast "
                "tokenizer is used (tokenizer_mode auto)"
            )
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be int8 or int4, got {self.quantization!r}")
        if self.quantization is not None and self.dequantize:
            raise ValueError("quantization and dequantize contradict each other: give one")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be ≥ 1, got {self.cuda_graph_max_bs}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be ≥ 2, got {self.context_length}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(
                f"chat_template: no such file {self.chat_template!r}; give a Jinja template file"
            )

    def served_model_names(self, model_path: str) -> list[str]:
        """The names the model answers to: --served-model-name's, or the model file's name."""
        if self.served_model_name:
            names = [n.strip() for n in self.served_model_name.split(",") if n.strip()]
            if names:
                return names
        from cadence.model_loader.locate import model_name

        return [model_name(model_path)]


@dataclass(frozen=True)
class SchedulerArgs:
    """How the scheduler batches, caches and admits: the KV pool and its policies."""

    max_running_requests: int = 64
    """Most requests decoded together in one batch."""
    max_queued_requests: int = 1024
    """Most requests waiting for a batch slot; more are refused with 429."""
    stream_interval: int = 1
    """Streamed requests get an output every this many tokens (the first token and the last output are sent at once); a client that reads slower than tokens arrive gets what waits merged into one message anyway."""
    max_total_tokens: int | None = None
    """KV pool size in tokens; default: derived from --kv-cache-memory-fraction."""
    kv_cache_memory_fraction: float = 0.2
    """Share of the device's available memory given to the KV pool when --max-total-tokens is unset."""
    mem_fraction_static: float | None = None
    """SGLang's sizing instead of --kv-cache-memory-fraction: the weights and the KV pool together take this share of the device memory available when the server starts (the pool gets what the weights leave of it). --max-total-tokens still caps the pool."""
    lazy_kv_pool: bool = False
    """Leave the KV pool's memory to the OS to commit page by page as requests first write it. By default `cadence serve` writes every page at start and runs two throwaway prefill steps of --chunked-prefill-size tokens, so that resident memory at idle is what the server holds under full load (the in-process Engine is lazy unless given lazy_kv_pool=False). /server_info reports the pool's size (kv_pool_bytes)."""
    page_size: int = 16
    """Tokens per KV page."""
    chunked_prefill_size: int = 2048
    """Most prompt tokens prefilled in one step; longer prompts are split over steps. -1: no chunking (each prompt is prefilled whole, in a step of up to --max-prefill-tokens or the context length, whichever is larger)."""
    max_prefill_tokens: int = 16384
    """Most prompt tokens one prefill step takes, all its requests together; with chunked prefill the step takes the smaller of this and --chunked-prefill-size."""
    disable_radix_cache: bool = False
    """Keep no prefix cache: every request prefills its whole prompt (sessions then pin nothing)."""
    schedule_policy: str | None = None
    """Order of admission among waiting requests: lpm (longest cached prefix first; the default with the prefix cache) or fcfs (arrival order; the default without it)."""
    session_timeout_s: float | None = 600.0
    """Seconds a session (/open_session) may stay idle before the server closes it and unpins its KV; a session may ask for its own timeout. 0: never."""
    random_seed: int | None = None
    """Seed of the server's own sampling randomness (requests with a `seed` use their own)."""
    enable_priority_scheduling: bool = False
    """Admit waiting requests by their `priority` (higher first) instead of in arrival order; equal priorities stay in arrival order."""
    schedule_low_priority_values_first: bool = False
    """With --enable-priority-scheduling: lower `priority` values run first."""
    disable_overlap_schedule: bool = False
    """Run each step's scheduling after the previous step's forward pass has finished, instead of preparing the next step while the device computes (platforms that compute asynchronously only: CUDA)."""
    enable_custom_logit_processor: bool = False
    """Let requests name a logit processor registered by a plugin (`custom_logit_processor`); never code from the request."""
    enable_return_hidden_states: bool = False
    """Let requests ask for the final hidden states of their positions (`return_hidden_states`)."""

    def __post_init__(self) -> None:
        _at_least_one(
            self, "max_running_requests", "max_queued_requests", "stream_interval", "page_size"
        )
        _at_least_one(self, "max_prefill_tokens")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError(
                f"chunked_prefill_size must be ≥ 1, or -1 for no chunking, "
                f"got {self.chunked_prefill_size}"
            )
        for name in ("kv_cache_memory_fraction", "mem_fraction_static"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens must be ≥ page_size ({self.page_size}), got {self.max_total_tokens}"
            )
        if self.schedule_policy not in (None, "lpm", "fcfs"):
            raise ValueError(f"schedule_policy must be lpm or fcfs, got {self.schedule_policy!r}")
        if self.session_timeout_s is not None and self.session_timeout_s < 0:
            raise ValueError(f"session_timeout_s must be ≥ 0, got {self.session_timeout_s}")

    @property
    def effective_schedule_policy(self) -> str:
        if self.schedule_policy is not None:
            return self.schedule_policy
        return "fcfs" if self.disable_radix_cache else "lpm"

    @property
    def effective_session_timeout_s(self) -> float | None:
        return self.session_timeout_s or None

    def prefill_token_budget(self, context_len: int) -> int:
        """Prompt tokens one prefill step computes at most, all its requests together: the
        smaller of --chunked-prefill-size and --max-prefill-tokens; without chunking, enough
        for any prompt the context holds (SGLang's max of --max-prefill-tokens and the
        context length)."""
        if self.chunked_prefill_size == -1:
            return max(self.max_prefill_tokens, context_len)
        return min(self.chunked_prefill_size, self.max_prefill_tokens)


@dataclass(frozen=True)
class HttpArgs:
    """The HTTP server and the front's bounds on what one request may carry."""

    host: str = "127.0.0.1"
    """Address the HTTP and gRPC servers bind."""
    port: int = 30000
    """HTTP port."""
    api_workers: int = 1
    """Front processes serving HTTP and gRPC on the same ports, all feeding one scheduler (each with its own tokenizer and event loop). The HTTP socket is bound once and shared; gRPC ports are shared with SO_REUSEPORT."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>` on every route but the health checks."""
    enable_metrics: bool = False
    """Accepted for SGLang compatibility: GET /metrics (Prometheus text format) is always served."""
    enable_cache_report: bool = False
    """Accepted for SGLang compatibility: chat and completion responses always report their prompt's cached tokens (usage.prompt_tokens_details.cached_tokens)."""
    incremental_streaming_output: bool = False
    """Stream /generate as deltas (each event only the new text and ids) instead of SGLang's default, where every event carries the text and output ids so far."""
    max_request_body_mb: float = 32.0
    """Largest HTTP request body, in MiB; a larger one gets 413 before it is read whole."""
    max_tokenize_chars: int = 4 * 1024 * 1024
    """Most characters one /tokenize request or gRPC Tokenize call may carry, its prompts (or rendered messages) together; more get a 400 before anything is tokenized. The default is about a million tokens of English text."""
    max_detokenize_tokens: int = 1024 * 1024
    """Most token ids one /detokenize request or gRPC Detokenize call may carry, its lists together; more get a 400 before anything is decoded."""
    request_timeout_s: float | None = None
    """Server-side deadline of every generation request, in seconds: past it the request is aborted (finish reason abort) and what it generated so far is returned. Default: none."""
    max_embedding_batch: int = 1024
    """Most inputs one embedding, classification, score or rerank request may carry; more get a 400."""
    max_speech_chars: int = 4096
    """Longest `input` /v1/audio/speech (and the SynthesizeSpeech RPC) accepts, in characters; a longer one gets a 400 naming the field (docs/speech.md)."""
    log_requests: bool = False
    """Log every generation request when it arrives and when it ends (rid, lengths, finish reason, latency; more with --log-requests-level), at INFO on the `cadence.requests` logger."""
    log_requests_level: int = 2
    """Detail of --log-requests, SGLang's levels: 0 metadata, 1 and sampling parameters, 2 and the prompt and output cut to 2048 characters, 3 and the prompt and output whole."""
    allow_auto_truncate: bool = False
    """Cut a prompt too long for the context (or the KV pool) to its first tokens instead of refusing it with a 400: a generation keeps room for one new token and its max_new_tokens is lowered to what the context leaves; an embedding input keeps what the model takes. Each cut is logged."""
    log_level_http: str | None = None
    """Logging level of the HTTP server, uvicorn (SGLang's flag): debug, info, warning or error; at info or debug every HTTP request also gets an access-log line. Default: warning, without access lines."""
    uvicorn_access_log_exclude_prefixes: tuple[str, ...] = ()
    """Paths whose requests get no access-log line (SGLang's flag), e.g. /health /metrics: a probe every second would fill the log."""
    preferred_sampling_params: str | None = None
    """Default sampling parameters, as a JSON object (e.g. '{"temperature": 0.6, "top_p": 0.9}'), for every generation request that leaves them out; what a request gives wins. /model_info and GetModelInfo report it."""

    def __post_init__(self) -> None:
        _at_least_one(self, "port", "api_workers", "max_tokenize_chars", "max_detokenize_tokens")
        _at_least_one(self, "max_embedding_batch", "max_speech_chars")
        if self.preferred_sampling_params is not None:
            json_object_arg("preferred_sampling_params", self.preferred_sampling_params)
        object.__setattr__(  # a list from the command line or a caller: kept as a tuple
            self,
            "uvicorn_access_log_exclude_prefixes",
            tuple(self.uvicorn_access_log_exclude_prefixes),
        )
        if self.log_level_http not in (None, "debug", "info", "warning", "error", "critical"):
            raise ValueError(
                f"log_level_http must be debug, info, warning or error, got {self.log_level_http!r}"
            )
        if self.log_requests_level not in (0, 1, 2, 3):
            raise ValueError(
                f"log_requests_level must be 0, 1, 2 or 3, got {self.log_requests_level}"
            )
        if not 0 < self.max_request_body_mb <= 4096:
            raise ValueError(
                f"max_request_body_mb must be in (0, 4096], got {self.max_request_body_mb}"
            )
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s}")
        if self.api_key is not None:
            if not self.api_key:
                raise ValueError("api_key must not be empty")
            try:
                self.api_key.encode("latin-1")
            except UnicodeEncodeError:
                raise ValueError(
                    "api_key must be Latin-1 text (HTTP headers carry nothing else); "
                    "choose a key of ASCII characters"
                ) from None

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * 1024 * 1024)


def json_object_arg(name: str, text: str) -> dict[str, Any]:
    """The JSON object an argument `name` holds; a ValueError naming it when it is not one."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class GrpcArgs:
    """The gRPC server: its port, TLS, keepalive and flow bounds."""

    grpc_port: int | None = None
    """gRPC port (the native sglang.runtime.v1.SglangService); default: --port + 10000."""
    disable_grpc: bool = False
    """Serve HTTP only; the gRPC port is then not bound."""
    grpc_tls_cert: str | None = None
    """PEM certificate chain of the gRPC server; with --grpc-tls-key, gRPC speaks TLS only."""
    grpc_tls_key: str | None = None
    """PEM private key matching --grpc-tls-cert."""
    grpc_tls_client_ca: str | None = None
    """PEM CA bundle for mutual TLS: gRPC clients must present a certificate it signed."""
    grpc_keepalive_time_s: float = 60.0
    """Seconds between the server's keepalive pings on an idle gRPC connection."""
    grpc_keepalive_timeout_s: float = 20.0
    """Seconds the server waits for a keepalive ping's answer before closing the connection."""
    grpc_min_ping_interval_s: float = 5.0
    """Shortest interval between client pings the gRPC server accepts, even with no call or no data in flight (e.g. during a long prefill); faster pings count as abuse (too_many_pings)."""
    grpc_max_message_mb: int = 16
    """Largest gRPC message a client may send, in MiB: a larger one is refused with RESOURCE_EXHAUSTED before it is decoded (a 1M-token input_ids takes about 3 MiB). The server's own messages may be up to 256 MiB, or this if larger."""
    grpc_max_concurrent_requests: int | None = None
    """Most gRPC generation calls in flight (generate, embed, OpenAI pass-through); more get RESOURCE_EXHAUSTED. Default: --max-running-requests + --max-queued-requests."""
    grpc_stream_buffer: int = 256
    """Most output tokens (OpenAI pass-through streams: chunks) a gRPC stream may hold back while its client does not read; beyond that the call ends with RESOURCE_EXHAUSTED and its request is aborted."""

    def __post_init__(self) -> None:
        if self.grpc_port is not None and not 1 <= self.grpc_port <= 65535:
            raise ValueError(f"grpc_port must be in [1, 65535], got {self.grpc_port}")
        if (self.grpc_tls_cert is None) != (self.grpc_tls_key is None):
            raise ValueError("grpc_tls_cert and grpc_tls_key go together: give both or neither")
        if self.grpc_tls_client_ca is not None and self.grpc_tls_cert is None:
            raise ValueError("grpc_tls_client_ca (mutual TLS) needs grpc_tls_cert and grpc_tls_key")
        for name in (
            "grpc_keepalive_time_s",
            "grpc_keepalive_timeout_s",
            "grpc_min_ping_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 1 <= self.grpc_max_message_mb <= 2047:
            raise ValueError(
                f"grpc_max_message_mb must be in [1, 2047] (gRPC's limit is 2 GiB), "
                f"got {self.grpc_max_message_mb}"
            )
        if self.grpc_max_concurrent_requests is not None and self.grpc_max_concurrent_requests < 1:
            raise ValueError(
                f"grpc_max_concurrent_requests must be ≥ 1, got {self.grpc_max_concurrent_requests}"
            )
        _at_least_one(self, "grpc_stream_buffer")


@dataclass(frozen=True)
class OutputArgs:
    """Structured output, tool calling and reasoning (docs/structured_output.md)."""

    grammar_backend: str = "xgrammar"
    """Engine of constrained decoding (json_schema, regex, ebnf, response_format, forced tool calls): xgrammar, or none to refuse constraints with a 400."""
    constrained_json_any_whitespace: bool = False
    """Let JSON-schema constraints allow any whitespace between JSON tokens instead of the compact form of json.dumps (small models tend to emit whitespace without end when allowed)."""
    tool_call_parser: str | None = None
    """How tool calls are found in the model's text when tool_choice is auto: hermes (alias qwen, qwen25: <tool_call>{...}</tool_call>) or llama3 (a JSON object {"name", "parameters"}, after <|python_tag|> or alone). Without it, tool_choice auto answers with text; required and named choices work either way."""
    reasoning_parser: str | None = None
    """Split <think>...</think> out of chat answers into reasoning_content: deepseek-r1 (the answer starts inside the reasoning, the template opened it) or qwen3 (reasoning only inside an explicit <think>)."""

    def __post_init__(self) -> None:
        from cadence.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

        if self.grammar_backend not in ("xgrammar", "none"):
            raise ValueError(
                f"grammar_backend must be xgrammar or none, got {self.grammar_backend!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )


@dataclass(frozen=True)
class RuntimeArgs:
    """The server's life: logging, warm-up, the watchdog, profiles."""

    log_level: str = "info"
    """Logging level: debug, info, warning, error."""
    device: str | None = None
    """The platform to serve on (SGLang's flag): cpu, cuda, or an installed platform plugin's name; the same as CADENCE_PLATFORM, which it sets for the server's processes. Default: the one found (docs/plugins.md)."""
    skip_warmup: bool = False
    """Report healthy without running the warm-up generation first, nor the throwaway full-size prefill steps that take a step's working memory at start (the KV pool is still committed)."""
    decode_log_interval: int = 40
    """Log the decode batch every this many decode steps, at INFO, as SGLang does: running requests, KV tokens held and the pool's usage, generation throughput, waiting requests. 0: never."""
    watchdog_timeout: float = 30.0
    """Seconds the scheduler or detokenizer may go without making progress before the server reports itself unhealthy, fails waiting requests with 503 and exits non-zero (so an orchestrator restarts it)."""
    kv_events_config: str | None = None
    """Publish KV-cache events (pages stored and removed by the prefix cache) for cache-aware routers: a JSON object as SGLang takes it, e.g. {"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "", "replay_endpoint": null, "buffer_steps": 10000}; the gRPC scheduler service's SubscribeKvEvents streams them too."""
    profile_dir: str | None = None
    """Directory the torch profiler writes traces under (a request may only name a subdirectory); default: profiles/ under the server's state directory (CADENCE_STATE_DIR, default ~/.local/state/cadence)."""

    def __post_init__(self) -> None:
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(
                f"log_level must be debug, info, warning or error, got {self.log_level!r}"
            )
        if self.decode_log_interval < 0:
            raise ValueError(
                f"decode_log_interval must be ≥ 0 (0: no log), got {self.decode_log_interval}"
            )
        if self.watchdog_timeout <= 0:
            raise ValueError(f"watchdog_timeout must be > 0 seconds, got {self.watchdog_timeout}")
        if self.kv_events_config is not None:
            from cadence.mem_cache.kv_events import KVEventsConfig

            KVEventsConfig.parse(self.kv_events_config)  # ValueError names the field

    @property
    def effective_profile_dir(self) -> str:
        if self.profile_dir is not None:
            return os.path.abspath(self.profile_dir)
        from cadence import envs

        return os.path.join(envs.state_dir(), "profiles")


@dataclass(frozen=True)
class PipelineArgs:
    """A stage pipeline served next to the model (docs/pipeline.md)."""

    pipeline: str | None = None
    """A stage pipeline the front process starts and coordinates next to the model: the path of a YAML declaration, or the name of one shipped with Cadence (cadence/pipeline/pipelines/NAME.yaml). The server is ready once every stage is; /health answers 503 while a stage process is down."""
    pipeline_restart_stages: bool = False
    """Restart a --pipeline stage process that dies (its requests in flight fail with 503 meanwhile); without it, a stage's death stops the server with exit code 1."""

    def __post_init__(self) -> None:
        if self.pipeline is None:
            if self.pipeline_restart_stages:
                raise ValueError("pipeline_restart_stages needs --pipeline")
            return
        from cadence.pipeline.config import resolve_pipeline_path

        resolve_pipeline_path(self.pipeline)  # a missing file is an error now, not after loading

    @property
    def pipeline_path(self) -> str | None:
        """--pipeline as a YAML file's path (a shipped name resolved); None without it."""
        if self.pipeline is None:
            return None
        from cadence.pipeline.config import resolve_pipeline_path

        return resolve_pipeline_path(self.pipeline)


GROUPS: dict[str, type] = {
    "model": ModelArgs,
    "scheduler": SchedulerArgs,
    "http": HttpArgs,
    "grpc": GrpcArgs,
    "output": OutputArgs,
    "runtime": RuntimeArgs,
    "stages": PipelineArgs,
    "speculative": SpeculativeArgs,
    "lora": LoraArgs,
    "hicache": HiCacheArgs,
    "disaggregation": DisaggregationArgs,
    "parallel": ParallelArgs,
}
# Methods of a group that ServerArgs reads flat, as it reads fields and properties.
_FLAT_METHODS = ("served_model_names", "prefill_token_budget")
# flat field (and property) name -> the group that holds it
_GROUP_OF: dict[str, str] = {
    name: group
    for group, cls in GROUPS.items()
    for name in [f.name for f in fields(cls)]
    + [n for n, v in vars(cls).items() if isinstance(v, property) or n in _FLAT_METHODS]
}


class _FlatDefaults(type):
    """`ServerArgs.<argument>` reads the argument's default, as on a flat dataclass (what a
    platform plugin compares with: `args.page_size == ServerArgs.page_size`)."""

    def __getattr__(cls, name: str) -> Any:
        group = _GROUP_OF.get(name)
        if group is None or name.startswith("__"):
            raise AttributeError(f"ServerArgs has no argument {name!r}")
        default = getattr(GROUPS[group], name, dataclasses.MISSING)
        if default is dataclasses.MISSING or isinstance(default, property):
            raise AttributeError(f"the argument {name!r} has no class-level default")
        return default


class ServerArgs(metaclass=_FlatDefaults):
    """Every argument of a server, grouped by concern (see the module docstring).

    Built from flat keyword arguments (`ServerArgs(max_total_tokens=4096)`), frozen, equal
    by value, picklable (children receive it), read flat or by group."""

    model: ModelArgs
    scheduler: SchedulerArgs
    http: HttpArgs
    grpc: GrpcArgs
    output: OutputArgs
    runtime: RuntimeArgs
    stages: PipelineArgs
    speculative: SpeculativeArgs
    lora: LoraArgs
    hicache: HiCacheArgs
    disaggregation: DisaggregationArgs
    parallel: ParallelArgs
    GROUPS: ClassVar[dict[str, type]] = GROUPS

    def __init__(self, **flat: Any) -> None:
        unknown = sorted(set(flat) - set(self.field_names()))
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        for group, cls in GROUPS.items():
            names = {f.name for f in fields(cls)}
            object.__setattr__(self, group, cls(**{k: v for k, v in flat.items() if k in names}))
        self._check_across_groups()

    def _check_across_groups(self) -> None:
        if not self.disable_grpc and self.grpc_port is None and self.port + 10000 > 65535:
            raise ValueError(
                f"grpc_port defaults to port + 10000 = {self.port + 10000}, which is not a port; "
                "give --grpc-port or --disable-grpc"
            )
        if not self.disable_grpc and self.effective_grpc_port == self.port:
            raise ValueError(f"grpc_port must differ from port ({self.port})")
        if self.disaggregation_mode != "null":
            for name, on in (
                ("speculative_algorithm", self.speculative_algorithm is not None),
                ("is_embedding", self.is_embedding),
            ):
                if on:
                    raise ValueError(
                        f"disaggregation_mode {self.disaggregation_mode}: {name} is not served "
                        "by a disaggregated server; run it on a server with --disaggregation-mode "
                        "null"
                    )
        if self.is_parallel:
            for name, on in (
                ("enable_lora", self.enable_lora),
                ("disaggregation_mode", self.disaggregation_mode != "null"),
                # The disk tier saves and restores rank 0's pool only.
                ("enable_hierarchical_cache", self.enable_hierarchical_cache),
            ):
                if on:
                    raise ValueError(
                        f"{name} is not served with tp_size × pp_size > 1 yet; serve it with "
                        "--tp-size 1 --pp-size 1"
                    )
        if self.pipeline is not None and self.api_workers > 1:
            raise ValueError(
                "pipeline: one front process owns a pipeline's coordinator; "
                "give --api-workers 1 with --pipeline"
            )

    # ---- flat reading -------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        group = _GROUP_OF.get(name)
        if group is None or name.startswith("__"):
            raise AttributeError(f"ServerArgs has no argument {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        """Every argument's (flat) name, in flag order."""
        return [f.name for group in GROUPS.values() for f in fields(group)]

    def to_dict(self) -> dict[str, Any]:
        """Every argument by its flat name (what /server_info reports)."""
        return {name: getattr(self, name) for name in self.field_names()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ServerArgs) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, group) for group in GROUPS))

    def __repr__(self) -> str:
        changed = [
            f"{name}={value!r}"
            for name, value in self.to_dict().items()
            if value != _DEFAULTS.get(name)
        ]
        return f"ServerArgs({', '.join(changed)})"

    def __reduce__(self):
        # The groups pickle as they are (already checked): a child does not check again.
        return (_from_groups, tuple(getattr(self, group) for group in GROUPS))

    # ---- derived values -----------------------------------------------------------------

    @property
    def effective_grpc_port(self) -> int:
        """The port gRPC binds (meaningless with disable_grpc)."""
        return self.grpc_port if self.grpc_port is not None else self.port + 10000

    @property
    def effective_grpc_max_concurrent_requests(self) -> int:
        if self.grpc_max_concurrent_requests is not None:
            return self.grpc_max_concurrent_requests
        return self.max_running_requests + self.max_queued_requests

    def replace(self, **changes: Any) -> ServerArgs:
        return ServerArgs(**{**self.to_dict(), **changes})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(str(e)) from None


def _from_groups(*groups: Any) -> ServerArgs:
    args = object.__new__(ServerArgs)
    for name, value in zip(GROUPS, groups):
        object.__setattr__(args, name, value)
    return args


_DEFAULTS: dict[str, Any] = {f.name: f.default for group in GROUPS.values() for f in fields(group)}


# SGLang's long spellings of a few flags, accepted beside ours.
SGLANG_ALIASES = {
    "tp_size": ("--tensor-parallel-size",),
    "pp_size": ("--pipeline-parallel-size",),
    "dp_size": ("--data-parallel-size",),
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flat flag per argument, every group's, with its docstring as help."""
    for group in GROUPS.values():
        docs = field_docs(group)
        section = parser.add_argument_group((group.__doc__ or group.__name__).split("\n")[0])
        for f in fields(group):
            flag = "--" + f.name.replace("_", "-")
            help_text = docs.get(f.name, "")
            if f.type in ("bool", bool):
                section.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
            conv = int if "int" in kind else float if "float" in kind else str
            kwargs: dict[str, Any] = {}
            if f.name in ("dtype", "kv_cache_dtype"):
                kwargs = {"choices": DTYPES}
            elif f.name == "schedule_policy":
                kwargs = {"choices": ("lpm", "fcfs")}
            elif f.name in ("lora_paths", "lora_target_modules"):
                kwargs = {"nargs": "*"}
            elif f.name == "uvicorn_access_log_exclude_prefixes":
                kwargs = {"nargs": "*", "metavar": "PREFIX"}
            elif f.name == "lora_eviction_policy":
                kwargs = {"choices": ("lru", "fifo")}
            elif f.name == "disaggregation_mode":
                kwargs = {"choices": DISAGGREGATION_MODES}
            elif f.name == "disaggregation_transfer_backend":
                kwargs = {"choices": DISAGGREGATION_BACKENDS}
            elif f.name == "hicache_write_policy":
                kwargs = {"choices": ("write_through", "write_back", "write_through_selective")}
            flags = [flag, *SGLANG_ALIASES.get(f.name, ())]
            section.add_argument(*flags, type=conv, default=f.default, help=help_text, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """`cadence serve`'s command line (`cadence launch` builds on it)."""
    parser = argparse.ArgumentParser(
        prog="cadence serve", description="Serve a model over HTTP and gRPC."
    )
    add_cli_args(parser)
    return parser


def from_cli_args(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**{name: getattr(ns, name) for name in ServerArgs.field_names()})
