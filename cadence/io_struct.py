"""Every message that crosses a process boundary, and the one codec that carries them.

Message definitions only: typed msgspec Structs with no logic beyond construction and
validation. Each is tagged with its class name, so `decode()` — one msgpack Decoder over
the Union of all of them — yields the right type and a process can dispatch on it. No
pickle anywhere: a socket must never be a way to run code.

Who sends what:

    front ──TokenizedGenerateReqInput / TokenizedEmbeddingReqInput / control──► scheduler
    scheduler ──BatchTokenIDOutput──► detokenizer ──BatchStrOutput──► front
    scheduler ──BatchEmbeddingOutput (passed through by the detokenizer)──► front
    scheduler ──control outputs──► front

The user-facing requests (`GenerateReqInput`, `EmbeddingReqInput`) and the sampling
parameters that travel inside a tokenized request live here too. Checking them is the
front's job (`cadence.front.request_checks`, one stage below both adapters); this module
holds the shapes only.

Imported by the front process on its own: no torch, no transformers.
"""

import typing
from typing import Any, Literal, TypeGuard

import msgspec

from cadence.errors import InvalidParameter


class _Message(msgspec.Struct, kw_only=True, tag=True, forbid_unknown_fields=True):
    """Base of every message: keyword-only fields, tagged with the class name, and unknown
    fields rejected so that a mismatch between two processes fails loudly."""


# Below this temperature sampling is greedy; dividing logits by a smaller number would
# only overflow.
GREEDY_TEMPERATURE = 1e-6


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to sample one request's continuation. Defaults follow `specs/http.md`."""

    max_new_tokens: int = 128
    """Most tokens to generate (>= 0). The prompt plus this must fit the context length."""

    min_new_tokens: int = 0
    """Stop conditions (EOS, stop ids, stop strings) are ignored until this many tokens
    have been generated (0 <= min_new_tokens <= max_new_tokens)."""

    temperature: float = 1.0
    """Divides the logits (>= 0). Below 1e-6 sampling is greedy (argmax)."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to at least
    top_p, in (0, 1]. 1 keeps the whole vocabulary."""

    top_k: int = -1
    """Keep only the k most likely tokens; -1 keeps the whole vocabulary, 1 is greedy."""

    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's, in
    [0, 1]. 0 disables it."""

    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per earlier occurrence in the output, in
    [-2, 2] (OpenAI semantics)."""

    presence_penalty: float = 0.0
    """Subtracted from a token's logit if it occurred in the output at all, in [-2, 2]
    (OpenAI semantics)."""

    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens already in the prompt or
    output, in [0, 2]. 1 disables it."""

    n: int = 1
    """Number of samples of the same prompt (>= 1); the request becomes a batch of n."""

    stop: list[str] | None = None
    """Strings that end generation; the matched string is trimmed from the text unless
    `no_stop_trim`. A single string is accepted on input."""

    stop_token_ids: list[int] | None = None
    """Token ids that end generation, each in [0, vocab_size)."""

    logit_bias: dict[int, float] | None = None
    """Added to the logits of the given token ids (keys in [0, vocab_size)). JSON object
    keys are strings; they are converted to ints."""

    regex: str | None = None
    """Constrain the output to match this regular expression."""

    json_schema: str | None = None
    """Constrain the output to JSON valid under this schema (the schema as a JSON string)."""

    ebnf: str | None = None
    """Constrain the output to this EBNF grammar."""

    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (until max_new_tokens or a stop)."""

    skip_special_tokens: bool = True
    """Leave special tokens out of the returned text."""

    spaces_between_special_tokens: bool = True
    """Put a space between adjacent special tokens in the returned text."""

    no_stop_trim: bool = False
    """Keep the matched stop string or stop token in the returned text."""

    seed: int | None = None
    """Seed of this request's random generator, for reproducible sampling."""

    stop_regex: list[str] | None = None
    """Regular expressions that end generation when one matches the tail of the output text
    (the finish reason's `matched` is the pattern; the text is not trimmed). A single pattern
    is accepted on input."""

    custom_params: dict[str, Any] | None = None
    """Parameters handed to the request's custom logit processor."""

    @property
    def is_greedy(self) -> bool:
        """Whether sampling reduces to argmax (then seeds and n > 1 make no difference)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


# -- user-facing requests ------------------------------------------------------------------


class SessionParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where a request continues a session (SGLang's `session_params`)."""

    id: str  # the session, from /open_session
    rid: str | None = None  # the earlier request of the session to continue; None: see below
    # Keep only this many tokens of the earlier request's prompt + output before appending
    # the new input (None or 0: keep all).
    offset: int | None = None
    # Replace what followed `rid` in the session (a branch); with no rid, start the session over.
    replace: bool | None = None
    drop_previous_output: bool | None = None  # continue from the earlier prompt only


# The bootstrap host of a request that runs both halves on the server it reaches, even a
# prefill or decode one (SGLang's: its health checks and warm-up send it).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class GenerateReqInput(_Message, kw_only=True):
    """The native /generate body, single or batch; what both adapters build.

    `cadence.front.normalize.normalize_batch_and_arguments` checks it and brings it to its
    normalized form before use. Afterwards a single request keeps
    scalar fields (`text` a str, `rid` a str, `sampling_params` a dict, ...) and a batch
    has one list entry per item for every per-item field; `item(i)` cuts item i out.

    Parallel sampling (`n` > 1 in sampling_params) expands every prompt into n items,
    item-major: prompt 0 sample 0..n-1, then prompt 1, and so on. A single request with
    n > 1 becomes a batch (its answer is a list). Sample j of a prompt whose rid is R gets
    rid f"{R}-{j}" (R is generated when the user gave none), so every item has its own rid
    and the user's rid stays a prefix that aborts can match. The expanded items carry n=1
    in their sampling_params; `parallel_sample_num` keeps the original n.
    """

    # Fields the user must not set: normalization derives them.
    _DERIVED = ("is_single", "batch_size", "parallel_sample_num", "is_normalized")

    text: str | list[str] | None = None  # one prompt or a batch of prompts
    # list[int] (one prompt) or list[list[int]] (a batch). msgspec cannot describe a
    # union of two list types, so items are typed loosely and checked by normalization.
    input_ids: list[int | list[int]] | None = None
    # one dict for every item, or one per prompt; checked by SamplingParams in the front
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None  # request id(s); generated (uuid4 hex) when missing
    return_logprob: bool | list[bool] | None = None  # return logprobs of chosen tokens
    # where in the prompt input logprobs start; -1 (default): output logprobs only
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None  # top-k alternatives per position (0: none)
    # logprobs of these token ids at every position: list[int] for all items, or
    # list[list[int] | None] with one entry per item
    token_ids_logprob: list[int | list[int] | None] | None = None
    return_text_in_logprobs: bool = False  # add the decoded token text to each logprob
    stream: bool = False  # answer as server-sent events, one per text delta
    # Multimodal inputs, accepted by the contract; the front decides per model whether it
    # can take them. For a single request the value belongs to the prompt as is (a list
    # may be several images); for a batch it must be a list with one entry per prompt.
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    lora_path: str | list[str | None] | None = None  # adapter for all items, or one per item
    routing_key: str | None = None  # opaque key for routers that pin related requests
    # Scheduling priority (with --enable-priority-scheduling; higher runs first by default).
    priority: int | None = None
    # Final hidden states in meta_info["hidden_states"] (with --enable-return-hidden-states).
    return_hidden_states: bool | list[bool] | None = None
    # A logit processor registered by a plugin, by name (with --enable-custom-logit-processor);
    # never code: a request cannot carry something to run.
    custom_logit_processor: str | list[str | None] | None = None
    # Continue an open session (see SessionParams): one dict for every item, or one per prompt.
    session_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    # Prefill/decode disaggregation (a PD router sets them, on both servers alike): the
    # prefill server's host and bootstrap port, and the room that pairs the two halves of
    # the request; one value for every item, or one per prompt.
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None

    # Derived by normalize_batch_and_arguments(); never set by the user.
    is_single: bool = True  # answer with one object, not a list
    batch_size: int = 1  # number of items after n expansion
    parallel_sample_num: int = 1  # the n of sampling_params (same for every prompt)
    is_normalized: bool = False  # normalize_batch_and_arguments() has run


class EmbeddingReqInput(_Message, kw_only=True):
    """The /encode (and /classify) body, single or batch. Normalization as for
    `GenerateReqInput`, without sampling: exactly one of text/input_ids, rids generated
    and unique, per-item lists for a batch.

    With `is_cross_encoder_request` every text item is a pair [query, document], encoded
    together as one sequence (the two segments told apart by their token type ids); a
    single pair may be given as the pair itself."""

    _DERIVED = ("is_single", "batch_size", "is_normalized")

    # One input or a batch of inputs; items are [query, document] pairs for a cross-encoder.
    text: str | list[str | list[str]] | None = None
    input_ids: list[int | list[int]] | None = None  # list[int] or list[list[int]], as above
    # BERT segment ids, shaped like input_ids (one per token); default: all 0.
    token_type_ids: list[int | list[int]] | None = None
    rid: str | list[str] | None = None  # request id(s); generated (uuid4 hex) when missing
    image_data: Any = None  # as in GenerateReqInput: one per input for a batch
    # Keep the first `dimensions` values of each embedding (renormalized when the model
    # normalizes); only for models trained for it (Matryoshka), or the model's own size.
    dimensions: int | None = None
    is_cross_encoder_request: bool = False  # text items are [query, document] pairs

    is_single: bool = True  # derived: answer with one object, not a list
    batch_size: int = 1  # derived: number of inputs
    is_normalized: bool = False  # derived: normalize_batch_and_arguments() has run


# -- front → scheduler ---------------------------------------------------------------------


class TokenizedGenerateReqInput(_Message, kw_only=True):
    """One generation request, tokenized and checked: all the scheduler needs."""

    rid: str  # unique among live requests
    input_text: str | None  # the prompt text, when the user gave text (for logs and logprob text)
    input_ids: list[int]  # prompt token ids, each in [0, vocab_size)
    sampling_params: SamplingParams  # verified against the vocabulary; n == 1
    return_logprob: bool = False  # compute logprobs of chosen tokens
    logprob_start_len: int = -1  # first prompt position with input logprobs; -1: none
    top_logprobs_num: int = 0  # top-k alternatives per position
    token_ids_logprob: list[int] | None = None  # logprobs of these ids at every position
    stream: bool = False  # the front wants every step's delta, not only the final output
    lora_path: str | None = None  # adapter to apply, if any
    http_worker_ipc: str | None = None  # ZMQ address of the front process that owns the rid
    priority: int | None = None  # scheduling priority; None: the lowest
    return_hidden_states: bool = False  # report the final hidden states of every position
    custom_logit_processor: str | None = None  # name of a registered logit processor
    # Continue an open session: the scheduler prepends the session's earlier tokens.
    session_params: SessionParams | None = None
    # Prefill/decode disaggregation: where the prefill server's bootstrap is, and the room
    # that pairs this request's halves (None: an ordinary request).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class TokenizedEmbeddingReqInput(_Message, kw_only=True):
    """One embedding request, tokenized and checked: at most the context length, and it
    needs no KV memory once its one forward pass is done."""

    rid: str  # unique among live requests
    input_text: str | None  # the input text, when the user gave text
    input_ids: list[int]  # input token ids, each in [0, vocab_size)
    token_type_ids: list[int] | None = None  # one per input id (an encoder's segments); None: 0s
    http_worker_ipc: str | None = None  # ZMQ address of the front process that owns the rid


class BatchTokenizedEmbeddingReqInput(_Message, kw_only=True):
    """The items of one embedding request, sent as one message so that the scheduler queues
    them together: sent one by one, a step that starts between two of them would split the
    request over two forward passes."""

    batch: list[TokenizedEmbeddingReqInput]


# -- scheduler → detokenizer → front -------------------------------------------------------
#
# Finish reasons are plain dicts (None while the request runs); the shapes are:
#   {"type": "stop", "matched": <token id (int) or stop string (str)>}
#   {"type": "length", "length": <number of generated tokens>}
#   {"type": "abort", "message": <why>, "status_code": <HTTP status, optional>}
# Every request gets exactly one output with a finish reason, its last; the detokenizer
# and the front drop the rid's state on it.


class Logprobs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Logprobs of one request in one output; a field is None where not requested.

    The input_* fields come once, with the request's first output, starting at
    `logprob_start_len`; the first prompt token has no logprob (nothing predicts it), hence
    `None` entries. The output_* fields are aligned with the same output's new `output_ids`.
    `*_val` are natural-log probabilities, `*_idx` the token ids they belong to.
    """

    input_token_logprobs_val: list[float | None] | None = None  # per prompt position
    input_token_logprobs_idx: list[int] | None = None  # the prompt token at that position
    # per position: the top_logprobs_num best, best first
    input_top_logprobs_val: list[list[float] | None] | None = None
    input_top_logprobs_idx: list[list[int] | None] | None = None
    # per position: the ids of token_ids_logprob
    input_token_ids_logprobs_val: list[list[float] | None] | None = None
    input_token_ids_logprobs_idx: list[list[int] | None] | None = None
    output_token_logprobs_val: list[float] | None = None  # per new output token
    output_token_logprobs_idx: list[int] | None = None
    output_top_logprobs_val: list[list[float]] | None = None  # per new token, as input_top_*
    output_top_logprobs_idx: list[list[int]] | None = None
    output_token_ids_logprobs_val: list[list[float]] | None = None  # as input_token_ids_*
    output_token_ids_logprobs_idx: list[list[int]] | None = None


class BatchTokenIDOutput(_Message, kw_only=True):
    """Scheduler → detokenizer: new tokens of some requests after one step.

    Every list has one entry per request, in the same order. `output_ids` holds only the
    tokens generated since this rid's previous output (a delta). Incremental
    detokenization state (the ids so far, the read offset where undelivered text starts
    and the surrounding offset a few tokens earlier that gives the tokenizer context for
    merges and multi-byte characters) lives in the detokenizer alone, keyed by rid, so no
    offsets cross this boundary. The token that matched a stop token id (or EOS) is part
    of `output_ids`; the detokenizer leaves it out of the text unless `no_stop_trim`.
    """

    rids: list[str]
    http_worker_ipcs: list[str | None]  # where each request's output must go
    finished_reasons: list[dict[str, Any] | None]  # None while running; shapes above
    output_ids: list[list[int]]  # new token ids since the previous output of the rid
    skip_special_tokens: list[bool]  # per-request decoding options, from SamplingParams
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    # stop strings, so the detokenizer can trim the matched one and hold back a streamed
    # tail that may still turn out to be the start of a stop string
    stop_strs: list[list[str] | None]
    prompt_tokens: list[int]  # prompt length
    completion_tokens: list[int]  # tokens generated so far (all, not the delta)
    cached_tokens: list[int]  # prompt tokens served from the prefix cache
    logprobs: list[Logprobs | None] | None = None  # None when no request in the batch asked
    # Final hidden states since the rid's previous output, per request: [positions][hidden]
    # float; None when no request in the batch asked.
    hidden_states: list[list[list[float]] | None] | None = None
    # Speculative decoding, per request (SGLang's SpeculativeDecodingMetricsMixin): verify
    # steps so far, draft tokens accepted, steps by number of draft tokens accepted. None
    # when no request in the batch drafted.
    spec_verify_ct: list[int] | None = None
    spec_accepted_tokens: list[int] | None = None
    spec_proposed_tokens: list[int] | None = None  # draft tokens verified, accepted or not
    spec_acceptance_histogram: list[list[int]] | None = None
    weight_version: str = "default"  # of the weights that made these tokens (meta_info's)


class BatchStrOutput(_Message, kw_only=True):
    """Detokenizer → front: text deltas. Lists are per request, as in BatchTokenIDOutput."""

    rids: list[str]
    http_worker_ipcs: list[str | None]  # the front process each entry belongs to
    finished_reasons: list[dict[str, Any] | None]  # None while running
    output_strs: list[str]  # new text since the previous output (stop string trimmed)
    output_ids: list[list[int]]  # new token ids since the previous output
    prompt_tokens: list[int]
    completion_tokens: list[int]  # generated so far
    cached_tokens: list[int]
    logprobs: list[Logprobs | None] | None = None  # passed through from BatchTokenIDOutput
    hidden_states: list[list[list[float]] | None] | None = None  # passed through as well
    spec_verify_ct: list[int] | None = None  # passed through as well
    spec_accepted_tokens: list[int] | None = None
    spec_proposed_tokens: list[int] | None = None
    spec_acceptance_histogram: list[list[int]] | None = None
    weight_version: str = "default"  # passed through as well


class BatchEmbeddingOutput(_Message, kw_only=True):
    """Scheduler → front (through the detokenizer, untouched): finished embeddings, all of
    one front process (the scheduler sends one message per front). For a classification
    model the vector is the class logits."""

    rids: list[str]
    http_worker_ipcs: list[str | None]
    finished_reasons: list[dict[str, Any] | None]  # always set: embeddings finish in one step
    embeddings: list[list[float] | None]  # one vector per request; None when aborted
    prompt_tokens: list[int]
    cached_tokens: list[int]


# -- control -------------------------------------------------------------------------------
#
# Every control request carries the asking front's address, so the answer reaches it when
# several front processes share one scheduler, and an id of its own (`cid`), so the answer
# finds the one caller that waits for it; the answer carries both back.


class _ControlMessage(_Message, kw_only=True):
    http_worker_ipc: str | None = None  # ZMQ address of the asking front process
    cid: str | None = None  # the control request's id (set by the front); its answer echoes it


class AbortReq(_ControlMessage, kw_only=True):
    """Abort one request or all of them."""

    # the rid to abort; the samples of an n > 1 request have rids f"{user_rid}-{j}"
    rid: str | None = None
    abort_all: bool = False  # abort every live request of every front
    message: str | None = None  # why, for the finish reason (e.g. "client disconnected")

    def __post_init__(self) -> None:
        if (self.rid is None) == (not self.abort_all):
            raise InvalidParameter(
                "rid", "rid: give either a rid or abort_all=true (not both, not neither)"
            )


class FlushCacheReqInput(_ControlMessage, kw_only=True):
    """Drop the prefix cache. Refused while requests are running."""


class FlushCacheReqOutput(_ControlMessage, kw_only=True):
    success: bool  # False when requests were running
    message: str = ""  # why it failed


PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = typing.get_args(PauseMode)


def _is_pause_mode(mode: object) -> TypeGuard[PauseMode]:
    return mode in PAUSE_MODES


def pause_mode(mode: object) -> PauseMode:
    """`mode` (as a caller gave it) as a pause mode; InvalidParameter naming `mode` when it
    is none of PAUSE_MODES."""
    if not _is_pause_mode(mode):
        raise InvalidParameter(
            "mode", f"mode must be one of abort, retract, in_place, got {mode!r}"
        )
    return mode


class OpenSessionReqInput(_ControlMessage, kw_only=True):
    """Open a session whose requests continue each other, their KV kept pinned meanwhile."""

    capacity_of_str_len: int = 0  # SGLang's capacity hint; accepted, not enforced
    session_id: str | None = None  # None: the front picks a fresh one
    streaming: bool = False  # every request appends to the session's latest one
    timeout: float | None = None  # seconds idle before the server closes it; None: the default


class OpenSessionReqOutput(_ControlMessage, kw_only=True):
    session_id: str | None
    success: bool
    message: str = ""  # why it failed


class CloseSessionReqInput(_ControlMessage, kw_only=True):
    """Close a session: its pinned KV becomes ordinary (evictable) prefix cache."""

    session_id: str


class CloseSessionReqOutput(_ControlMessage, kw_only=True):
    success: bool  # False when no such session was open
    message: str = ""


class PauseGenerationReqInput(_ControlMessage, kw_only=True):
    """Stop scheduling until ContinueGenerationReqInput."""

    # abort: end running requests; retract: put them back in the waiting queue (KV freed);
    # in_place: keep them and their KV, just stop stepping
    mode: PauseMode = "abort"

    def __post_init__(self) -> None:
        pause_mode(self.mode)


class ContinueGenerationReqInput(_ControlMessage, kw_only=True):
    """Resume scheduling after a pause."""


class GetLoadReqInput(_ControlMessage, kw_only=True):
    """Ask each scheduler (one per data-parallel rank) for its load."""


class GetLoadReqOutput(_ControlMessage, kw_only=True):
    """One data-parallel rank's load, for /get_load and /v1/loads."""

    dp_rank: int  # data-parallel rank of the answering scheduler
    num_running_reqs: int  # requests in the running batch
    num_waiting_reqs: int  # requests queued, not yet admitted
    num_used_tokens: int  # KV tokens held by live requests (evictable cache pages not counted)
    num_cached_tokens: int  # KV tokens held by the prefix cache
    max_total_num_tokens: int  # KV pool capacity in tokens
    token_usage: float  # num_used_tokens / max_total_num_tokens
    gen_throughput: float  # recent decode throughput, tokens/s
    cache_hit_rate: float  # recent fraction of prompt tokens served from the cache
    # Speculative decoding (None when off): tokens a verify step gave a request on average,
    # the sampled one included, and the share of draft tokens accepted; over recent verify
    # steps, and the first since start (SGLang's avg_spec_accept_length).
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    avg_spec_accept_length: float | None = None
    # LoRA (None without it): distinct adapters in the running batch, of --max-loras-per-batch.
    lora_slots_used: int | None = None
    lora_slots_total: int | None = None


class ProfileReq(_ControlMessage, kw_only=True):
    """Start or stop the torch profiler in the scheduler."""

    action: Literal["start", "stop"]
    output_dir: str | None = None  # where traces go; None: the server's default
    num_steps: int | None = None  # stop by itself after this many forward steps
    start_step: int | None = None  # start only after this many forward steps (None, 0: now)

    def __post_init__(self) -> None:
        if self.action not in ("start", "stop"):
            raise InvalidParameter("action", f"action must be start or stop, got {self.action!r}")


class ProfileReqOutput(_ControlMessage, kw_only=True):
    success: bool
    message: str = ""  # why it failed, or where the trace went


class UpdateWeightFromDiskReqInput(_ControlMessage, kw_only=True):
    """Reload weights in place from a checkpoint of the same architecture."""

    model_path: str  # a GGUF file or a Hugging Face directory
    load_format: str | None = None  # None: guess from the path
    weight_version: str | None = None  # the new weights' version (None: the version stays)


class UpdateWeightFromDiskReqOutput(_ControlMessage, kw_only=True):
    success: bool
    message: str = ""  # why it failed


class UpdateWeightVersionReqInput(_ControlMessage, kw_only=True):
    """Relabel the weights being served (SGLang's /update_weight_version), after an update
    the trainer made some other way; by default every live request is aborted first, so
    that none ends under a version it did not start with."""

    new_version: str
    abort_all_requests: bool = True


class UpdateWeightVersionReqOutput(_ControlMessage, kw_only=True):
    success: bool
    message: str = ""
    new_version: str = ""


class GetWeightVersionReqInput(_ControlMessage, kw_only=True):
    """Ask the scheduler which version of the weights it serves."""


class GetWeightVersionReqOutput(_ControlMessage, kw_only=True):
    weight_version: str = ""
    success: bool = True
    message: str = ""


class LoadLoRAAdapterReqInput(_ControlMessage, kw_only=True):
    """Load a PEFT adapter while serving (SGLang's /load_lora_adapter body)."""

    lora_name: str  # what requests name it by (lora_path, model="base:name")
    lora_path: str  # its directory: adapter_config.json + adapter_model.safetensors
    pinned: bool = False  # never evicted to make room for another


class UnloadLoRAAdapterReqInput(_ControlMessage, kw_only=True):
    """Unload an adapter: new requests may no longer name it; its memory is freed once the
    last request using it ends."""

    lora_name: str


class GetLoRAAdaptersReqInput(_ControlMessage, kw_only=True):
    """The adapters loaded now (a front that does not know a requested name asks)."""


class LoRAAdapterInfo(msgspec.Struct, kw_only=True):
    name: str
    path: str
    lora_id: str  # a stable id of (name, path): SGLang's scheduler service names adapters by it
    rank: int
    pinned: bool = False


class LoRAUpdateOutput(_ControlMessage, kw_only=True):
    """The answer to a load, an unload or a listing (SGLang's LoRAUpdateOutput and more)."""

    success: bool
    error_message: str = ""
    loaded_adapters: list[LoRAAdapterInfo] = msgspec.field(default_factory=list)


# -- the codec -----------------------------------------------------------------------------

Message = (
    GenerateReqInput
    | EmbeddingReqInput
    | TokenizedGenerateReqInput
    | TokenizedEmbeddingReqInput
    | BatchTokenizedEmbeddingReqInput
    | BatchTokenIDOutput
    | BatchStrOutput
    | BatchEmbeddingOutput
    | AbortReq
    | FlushCacheReqInput
    | FlushCacheReqOutput
    | PauseGenerationReqInput
    | ContinueGenerationReqInput
    | GetLoadReqInput
    | GetLoadReqOutput
    | ProfileReq
    | ProfileReqOutput
    | UpdateWeightFromDiskReqInput
    | UpdateWeightFromDiskReqOutput
    | UpdateWeightVersionReqInput
    | UpdateWeightVersionReqOutput
    | GetWeightVersionReqInput
    | GetWeightVersionReqOutput
    | OpenSessionReqInput
    | OpenSessionReqOutput
    | CloseSessionReqInput
    | CloseSessionReqOutput
    | LoadLoRAAdapterReqInput
    | UnloadLoRAAdapterReqInput
    | GetLoRAAdaptersReqInput
    | LoRAUpdateOutput
)
MESSAGE_TYPES: tuple[type, ...] = typing.get_args(Message)

# Control requests whose sender waits for an answer, and the type of that answer.
REPLY_TYPES: dict[type, type] = {
    FlushCacheReqInput: FlushCacheReqOutput,
    GetLoadReqInput: GetLoadReqOutput,
    ProfileReq: ProfileReqOutput,
    UpdateWeightFromDiskReqInput: UpdateWeightFromDiskReqOutput,
    UpdateWeightVersionReqInput: UpdateWeightVersionReqOutput,
    GetWeightVersionReqInput: GetWeightVersionReqOutput,
    OpenSessionReqInput: OpenSessionReqOutput,
    CloseSessionReqInput: CloseSessionReqOutput,
    LoadLoRAAdapterReqInput: LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput: LoRAUpdateOutput,
    GetLoRAAdaptersReqInput: LoRAUpdateOutput,
}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Serialize a message for a ZMQ socket."""
    if not isinstance(msg, MESSAGE_TYPES):
        # Anything else would encode but fail to decode on the far side, far from the bug.
        raise TypeError(f"not a message type: {type(msg).__name__}")
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Deserialize a message; raises msgspec.DecodeError (a ValidationError for a
    well-formed but wrong message) on anything that is not one."""
    return _decoder.decode(data)
