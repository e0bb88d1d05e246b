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

The user-facing requests (`GenerateReqInput`, `EmbeddingReqInput`) live here too; their
`normalize_batch_and_arguments()` is the one place where a request is checked and turned
into per-item lists, below both the HTTP and the gRPC adapters.

Like sampling_params, this module is imported by the front process on its own: no torch,
no transformers.
"""

import re
import typing
import uuid
from typing import Any, Literal, Union

import msgspec

from cadence.sampling_params import InvalidParameter, SamplingParams, coerce_field


class _Message(msgspec.Struct, kw_only=True, tag=True, forbid_unknown_fields=True):
    """Base of every message: keyword-only fields, tagged with the class name, and unknown
    fields rejected so that a mismatch between two processes fails loudly."""


# -- user-facing requests ------------------------------------------------------------------


class GenerateReqInput(_Message, kw_only=True):
    """The native /generate body, single or batch; what both adapters build.

    Call `normalize_batch_and_arguments()` before use. Afterwards a single request keeps
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

    # Derived by normalize_batch_and_arguments(); never set by the user.
    is_single: bool = True  # answer with one object, not a list
    batch_size: int = 1  # number of items after n expansion
    parallel_sample_num: int = 1  # the n of sampling_params (same for every prompt)
    is_normalized: bool = False  # normalize_batch_and_arguments() has run

    @classmethod
    def from_json_dict(cls, d: Any) -> "GenerateReqInput":
        """Build from a decoded JSON body; `InvalidParameter` names an unknown field or a
        field of the wrong type. Call `normalize_batch_and_arguments()` next."""
        return _from_json_dict(cls, d)

    def normalize_batch_and_arguments(self) -> None:
        """Check the request and bring every per-item field to its normalized form (see the
        class docstring). Raises `InvalidParameter` naming the field. Idempotent."""
        if self.is_normalized:
            return
        is_batch, num_prompts = _check_prompts(self.text, self.input_ids)
        sampling_params = _per_item_sampling_params(self.sampling_params, num_prompts)
        n = _parallel_sample_num(sampling_params)
        per_item = {
            name: _per_item(name, getattr(self, name), num_prompts, default, check)
            for name, default, check in (
                ("return_logprob", False, _check_bool),
                ("logprob_start_len", -1, _check_start_len),
                ("top_logprobs_num", 0, _check_top_num),
                ("lora_path", None, _check_str),
            )
        }
        per_item["token_ids_logprob"] = _per_item_token_ids(self.token_ids_logprob, num_prompts)
        modalities = {
            name: _per_item_data(name, getattr(self, name), num_prompts, is_batch)
            for name in ("image_data", "audio_data", "video_data")
        }
        rids = _check_rids(self.rid, num_prompts, is_batch)
        if not is_batch and n == 1:
            # A single request keeps scalar fields.
            self.sampling_params = sampling_params[0]
            self.rid = rids[0]
            for name, values in per_item.items():
                setattr(self, name, values[0])
            self.is_single, self.batch_size = True, 1
        else:
            if n > 1:
                sampling_params = [dict(sp, n=1) for sp in sampling_params]
                rids = [f"{rid}-{j}" for rid in rids for j in range(n)]
            self.text = _expand(self.text, n, is_batch)
            self.input_ids = _expand(self.input_ids, n, is_batch)
            self.sampling_params = _repeat(sampling_params, n)
            self.rid = rids
            for name, values in per_item.items():
                setattr(self, name, _repeat(values, n))
            for name, values in modalities.items():
                setattr(self, name, None if values is None else _repeat(values, n))
            self.is_single, self.batch_size = False, num_prompts * n
        # n expansion could only clash if user rids did; checked again to be sure.
        _check_unique(rids)
        self.parallel_sample_num = n
        self.is_normalized = True

    def item(self, i: int) -> "GenerateReqInput":
        """Batch item i as a normalized single request (a copy when already single)."""
        _require_normalized(self)
        if self.is_single:
            if i not in (0, -1):
                raise IndexError(f"a single request has only item 0, not {i}")
            return msgspec.structs.replace(self)
        return GenerateReqInput(
            text=None if self.text is None else self.text[i],
            input_ids=None if self.input_ids is None else self.input_ids[i],
            sampling_params=self.sampling_params[i],
            rid=self.rid[i],
            return_logprob=self.return_logprob[i],
            logprob_start_len=self.logprob_start_len[i],
            top_logprobs_num=self.top_logprobs_num[i],
            token_ids_logprob=self.token_ids_logprob[i],
            return_text_in_logprobs=self.return_text_in_logprobs,
            stream=self.stream,
            image_data=None if self.image_data is None else self.image_data[i],
            audio_data=None if self.audio_data is None else self.audio_data[i],
            video_data=None if self.video_data is None else self.video_data[i],
            lora_path=self.lora_path[i],
            routing_key=self.routing_key,
            is_single=True,
            batch_size=1,
            parallel_sample_num=1,
            is_normalized=True,
        )

    __getitem__ = item


class EmbeddingReqInput(_Message, kw_only=True):
    """The /encode (and /classify) body, single or batch. Normalization as for
    `GenerateReqInput`, without sampling: exactly one of text/input_ids, rids generated
    and unique, per-item lists for a batch."""

    _DERIVED = ("is_single", "batch_size", "is_normalized")

    text: str | list[str] | None = None  # one input or a batch of inputs
    input_ids: list[int | list[int]] | None = None  # list[int] or list[list[int]], as above
    rid: str | list[str] | None = None  # request id(s); generated (uuid4 hex) when missing
    image_data: Any = None  # as in GenerateReqInput: one per input for a batch

    is_single: bool = True  # derived: answer with one object, not a list
    batch_size: int = 1  # derived: number of inputs
    is_normalized: bool = False  # derived: normalize_batch_and_arguments() has run

    @classmethod
    def from_json_dict(cls, d: Any) -> "EmbeddingReqInput":
        """Build from a decoded JSON body; `InvalidParameter` names an unknown field or a
        field of the wrong type."""
        return _from_json_dict(cls, d)

    def normalize_batch_and_arguments(self) -> None:
        """Check the inputs, generate missing rids, check their uniqueness. Idempotent."""
        if self.is_normalized:
            return
        is_batch, num_inputs = _check_prompts(self.text, self.input_ids)
        rids = _check_rids(self.rid, num_inputs, is_batch)
        image_data = _per_item_data("image_data", self.image_data, num_inputs, is_batch)
        if is_batch:
            self.image_data = image_data
        self.rid = rids if is_batch else rids[0]
        self.is_single, self.batch_size = not is_batch, num_inputs
        self.is_normalized = True

    def item(self, i: int) -> "EmbeddingReqInput":
        """Batch item i as a normalized single request (a copy when already single)."""
        _require_normalized(self)
        if self.is_single:
            if i not in (0, -1):
                raise IndexError(f"a single request has only item 0, not {i}")
            return msgspec.structs.replace(self)
        return EmbeddingReqInput(
            text=None if self.text is None else self.text[i],
            input_ids=None if self.input_ids is None else self.input_ids[i],
            rid=self.rid[i],
            image_data=None if self.image_data is None else self.image_data[i],
            is_single=True,
            batch_size=1,
            is_normalized=True,
        )

    __getitem__ = item


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


class TokenizedEmbeddingReqInput(_Message, kw_only=True):
    """One embedding request, tokenized and checked."""

    rid: str  # unique among live requests
    input_text: str | None  # the input text, when the user gave text
    input_ids: list[int]  # input token ids, each in [0, vocab_size)
    http_worker_ipc: str | None = None  # ZMQ address of the front process that owns the rid


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


class BatchEmbeddingOutput(_Message, kw_only=True):
    """Scheduler → front (through the detokenizer, untouched): finished embeddings."""

    rids: list[str]
    http_worker_ipcs: list[str | None]
    finished_reasons: list[dict[str, Any] | None]  # always set: embeddings finish in one step
    embeddings: list[list[float] | None]  # one vector per request; None when aborted
    prompt_tokens: list[int]
    cached_tokens: list[int]


# -- control -------------------------------------------------------------------------------
#
# Every control request carries the asking front's address, so the answer reaches it when
# several front processes share one scheduler; the answer carries it back.


class _ControlMessage(_Message, kw_only=True):
    http_worker_ipc: str | None = None  # ZMQ address of the asking front process


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


class PauseGenerationReqInput(_ControlMessage, kw_only=True):
    """Stop scheduling until ContinueGenerationReqInput."""

    # abort: end running requests; retract: put them back in the waiting queue (KV freed);
    # in_place: keep them and their KV, just stop stepping
    mode: PauseMode = "abort"

    def __post_init__(self) -> None:
        if self.mode not in typing.get_args(PauseMode):
            raise InvalidParameter(
                "mode", f"mode must be one of abort, retract, in_place, got {self.mode!r}"
            )


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


class ProfileReq(_ControlMessage, kw_only=True):
    """Start or stop the torch profiler in the scheduler."""

    action: Literal["start", "stop"]
    output_dir: str | None = None  # where traces go; None: the server's default
    num_steps: int | None = None  # stop by itself after this many forward steps

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


class UpdateWeightFromDiskReqOutput(_ControlMessage, kw_only=True):
    success: bool
    message: str = ""  # why it failed


# -- the codec -----------------------------------------------------------------------------

Message = Union[
    GenerateReqInput,
    EmbeddingReqInput,
    TokenizedGenerateReqInput,
    TokenizedEmbeddingReqInput,
    BatchTokenIDOutput,
    BatchStrOutput,
    BatchEmbeddingOutput,
    AbortReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    PauseGenerationReqInput,
    ContinueGenerationReqInput,
    GetLoadReqInput,
    GetLoadReqOutput,
    ProfileReq,
    ProfileReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
]
MESSAGE_TYPES: tuple[type, ...] = typing.get_args(Message)

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


# -- normalization helpers -----------------------------------------------------------------


def _from_json_dict(cls: type, d: Any) -> Any:
    if not isinstance(d, dict):
        raise InvalidParameter(
            None, f"the request body must be a JSON object, got {type(d).__name__}"
        )
    known = [f for f in cls.__struct_fields__ if f not in cls._DERIVED]
    for key in d:
        if key not in known:
            raise InvalidParameter(
                str(key), f"unknown field {key!r}; valid fields are: {', '.join(known)}"
            )
    try:
        return msgspec.convert(d, cls)
    except msgspec.ValidationError as e:
        raise _readable(e) from None


def _readable(error: msgspec.ValidationError) -> InvalidParameter:
    # msgspec says "Expected `int`, got `str` - at `$.top_logprobs_num[1]`".
    text = str(error)
    match = re.search(r" - at `\$\.([A-Za-z_]\w*)(.*)`$", text)
    if match is None:
        return InvalidParameter(None, text)
    field, rest = match.group(1), match.group(2)
    problem = text[: match.start()].replace("`", "")
    problem = problem[:1].lower() + problem[1:]
    return InvalidParameter(field, f"{field}{rest} has the wrong type: {problem}")


def _check_prompts(text: Any, input_ids: Any) -> tuple[bool, int]:
    """Check that exactly one of text/input_ids is given; return (is_batch, num_prompts)."""
    if text is None and input_ids is None:
        raise InvalidParameter("text", "text or input_ids is required: give exactly one of them")
    if text is not None and input_ids is not None:
        raise InvalidParameter(
            "text", "text and input_ids are mutually exclusive: give exactly one of them"
        )
    if text is not None:
        return _check_text(text)
    return _check_input_ids(input_ids)


def _check_text(text: Any) -> tuple[bool, int]:
    if isinstance(text, str):
        if not text:
            raise InvalidParameter("text", "text must not be empty")
        return False, 1
    if not isinstance(text, list):
        raise InvalidParameter(
            "text", f"text must be a string or a list of strings, got {type(text).__name__}"
        )
    if not text:
        raise InvalidParameter("text", "text must not be empty: a batch needs at least one prompt")
    for i, prompt in enumerate(text):
        if not isinstance(prompt, str):
            raise InvalidParameter(
                "text", f"text[{i}] must be a string, got {type(prompt).__name__}"
            )
        if not prompt:
            raise InvalidParameter("text", f"text[{i}] must not be empty")
    return True, len(text)


def _check_input_ids(input_ids: Any) -> tuple[bool, int]:
    if not isinstance(input_ids, list):
        raise InvalidParameter(
            "input_ids",
            "input_ids must be a list of token ids or a list of such lists, "
            f"got {type(input_ids).__name__}",
        )
    if not input_ids:
        raise InvalidParameter("input_ids", "input_ids must not be empty")
    if all(isinstance(ids, list) for ids in input_ids):
        for i, ids in enumerate(input_ids):
            _check_token_ids("input_ids", f"input_ids[{i}]", ids)
        return True, len(input_ids)
    if any(isinstance(ids, list) for ids in input_ids):
        raise InvalidParameter(
            "input_ids", "input_ids must be a list of token ids or a list of such lists, not a mix"
        )
    _check_token_ids("input_ids", "input_ids", input_ids)
    return False, 1


def _check_token_ids(param: str, label: str, ids: list) -> None:
    if not ids:
        raise InvalidParameter(param, f"{label} must not be empty")
    # Fast path first: prompts can be long. The vocabulary bound is the front's check.
    if all(type(t) is int for t in ids) and min(ids) >= 0:
        return
    for j, t in enumerate(ids):
        if type(t) is not int or t < 0:
            raise InvalidParameter(
                param, f"{label}[{j}] must be a token id (an integer >= 0), got {t!r}"
            )


def _per_item_sampling_params(value: Any, num: int) -> list[dict[str, Any]]:
    items = _per_item("sampling_params", value, num, None, _check_dict)
    # Copies: one item's later changes (n=1, defaults filled in) must not leak into others.
    return [{} if sp is None else dict(sp) for sp in items]


def _parallel_sample_num(sampling_params: list[dict[str, Any]]) -> int:
    values = set()
    for sp in sampling_params:
        n = coerce_field("n", sp.get("n"))
        n = 1 if n is None else n
        if n < 1:
            raise InvalidParameter("n", f"n must be >= 1, got {n}")
        values.add(n)
    if len(values) > 1:
        raise InvalidParameter(
            "n", f"n must be the same for every item of a batch, got {sorted(values)}"
        )
    return values.pop()


def _per_item(param: str, value: Any, num: int, default: Any, check) -> list:
    """A scalar (or None) applies to every item; a list must have one entry per item."""
    if value is None:
        return [default] * num
    if isinstance(value, list):
        if len(value) != num:
            raise InvalidParameter(
                param,
                f"{param} has {len(value)} entries but the request has {num} prompt(s): "
                "give one per prompt, or a single value for all",
            )
        return [
            default if v is None else check(param, f"{param}[{i}]", v)
            for i, v in enumerate(value)
        ]
    return [check(param, param, value)] * num


def _per_item_token_ids(value: Any, num: int) -> list[list[int] | None]:
    # A flat list of ids applies to every item; a list of lists (or None) is per item.
    if value is None:
        return [None] * num
    if not isinstance(value, list):
        raise InvalidParameter(
            "token_ids_logprob",
            f"token_ids_logprob must be a list of token ids, got {type(value).__name__}",
        )
    if not value:
        return [None] * num
    if all(v is None or isinstance(v, list) for v in value):
        items = _per_item("token_ids_logprob", value, num, None, lambda p, label, v: v)
        for i, ids in enumerate(items):
            if ids:
                _check_token_ids("token_ids_logprob", f"token_ids_logprob[{i}]", ids)
        return [ids or None for ids in items]
    _check_token_ids("token_ids_logprob", "token_ids_logprob", value)
    return [list(value) for _ in range(num)]


def _per_item_data(param: str, value: Any, num: int, is_batch: bool) -> list | None:
    if value is None:
        return None
    if not is_batch:
        return [value]
    if not isinstance(value, list) or len(value) != num:
        raise InvalidParameter(
            param, f"{param} must be a list with one entry per prompt ({num}) for a batch"
        )
    return value


def _check_rids(rid: Any, num: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(num)]
    if isinstance(rid, str):
        if is_batch:
            raise InvalidParameter(
                "rid", f"rid must be a list of {num} strings for a batch of {num} prompts, "
                "got one string",
            )
        rids = [rid]
    elif isinstance(rid, list):
        if len(rid) != num:
            raise InvalidParameter(
                "rid", f"rid has {len(rid)} entries but the request has {num} prompt(s): "
                "give one per prompt",
            )
        rids = rid
    else:
        raise InvalidParameter(
            "rid", f"rid must be a string or a list of strings, got {type(rid).__name__}"
        )
    for i, r in enumerate(rids):
        if not isinstance(r, str) or not r:
            raise InvalidParameter("rid", f"rid[{i}] must be a non-empty string, got {r!r}")
    _check_unique(rids)
    return list(rids)


def _check_unique(rids: list[str]) -> None:
    seen = set()
    for r in rids:
        if r in seen:
            raise InvalidParameter(
                "rid", f"rid {r!r} is duplicated: every request in a batch needs its own rid"
            )
        seen.add(r)


def _check_bool(param: str, label: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidParameter(param, f"{label} must be true or false, got {value!r}")
    return value


def _check_int(param: str, label: str, value: Any, minimum: int, meaning: str) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidParameter(
            param, f"{label} must be an integer >= {minimum}{meaning}, got {value!r}"
        )
    return value


def _check_start_len(param: str, label: str, value: Any) -> int:
    return _check_int(param, label, value, -1, " (-1: output logprobs only)")


def _check_top_num(param: str, label: str, value: Any) -> int:
    return _check_int(param, label, value, 0, "")


def _check_str(param: str, label: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidParameter(param, f"{label} must be a string, got {value!r}")
    return value


def _check_dict(param: str, label: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise InvalidParameter(param, f"{label} must be an object, got {type(value).__name__}")
    return value


def _expand(prompts: Any, n: int, is_batch: bool) -> list | None:
    """Prompts (text or ids) as a list with n copies of each, item-major."""
    if prompts is None:
        return None
    return _repeat(prompts if is_batch else [prompts], n)


def _repeat(values: list, n: int) -> list:
    """Each value n times, item-major. Lists and dicts are copied: the samples of a prompt
    are separate requests, and changing one (e.g. filling in defaults) must not touch the
    others."""
    if n == 1:
        return values
    return [
        list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
        for v in values
        for _ in range(n)
    ]


def _require_normalized(req: Any) -> None:
    if not req.is_normalized:
        raise RuntimeError("call normalize_batch_and_arguments() before item()")
