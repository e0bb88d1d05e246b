"""Normalization of a user's request: check its shape, count its items, expand n > 1, and
turn every per-item field into one list entry per item. Part of the front's one checking
stage (`cadence.front.request_checks`); the structs themselves are in `cadence.io_struct`.

After `normalize_batch_and_arguments(obj)` a single request keeps scalar fields (`text` a
str, `rid` a str, `sampling_params` a dict, ...) and a batch has one list entry per item
for every per-item field; `item(obj, i)` cuts item i out as a normalized single request.
The field types of the structs cover both forms (and what a user may send); `one` and
`one_or_none` read a normalized single request's field at the type it has there.

Parallel sampling (`n` > 1 in sampling_params) expands every prompt into n items,
item-major: prompt 0 sample 0..n-1, then prompt 1, and so on. A single request with n > 1
becomes a batch (its answer is a list). Sample j of a prompt whose rid is R gets rid
f"{R}-{j}" (R is generated when the user gave none), so every item has its own rid and the
user's rid stays a prefix that aborts can match. The expanded items carry n=1 in their
sampling_params; `parallel_sample_num` keeps the original n.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, TypeVar, overload

import msgspec

from cadence.errors import InvalidParameter, readable
from cadence.front.sampling_checks import coerce_field
from cadence.io_struct import EmbeddingReqInput, GenerateReqInput, SessionParams

logger = logging.getLogger(__name__)

Request = GenerateReqInput | EmbeddingReqInput
T = TypeVar("T")


def normalize_batch_and_arguments(obj: Request, max_items: int | None = None) -> None:
    """Check the request and bring every per-item field to its normalized form (see the
    module docstring). A request of more than `max_items` items (prompts x n) is refused
    before any item is built. Raises `InvalidParameter` naming the field. Idempotent."""
    if isinstance(obj, GenerateReqInput):
        _normalize_generate(obj, max_items)
    else:
        _normalize_embedding(obj, max_items)


@overload
def item(obj: GenerateReqInput, i: int) -> GenerateReqInput: ...
@overload
def item(obj: EmbeddingReqInput, i: int) -> EmbeddingReqInput: ...
def item(obj: Request, i: int) -> Request:
    """Batch item i as a normalized single request (a copy when already single)."""
    if isinstance(obj, GenerateReqInput):
        return _generate_item(obj, i)
    return _embedding_item(obj, i)


@overload
def items(obj: GenerateReqInput) -> list[GenerateReqInput]: ...
@overload
def items(obj: EmbeddingReqInput) -> list[EmbeddingReqInput]: ...
def items(obj: Request) -> list[GenerateReqInput] | list[EmbeddingReqInput]:
    """Every item of a normalized request, as single requests (the request itself when single)."""
    if isinstance(obj, GenerateReqInput):
        return [obj] if obj.is_single else [_generate_item(obj, i) for i in range(obj.batch_size)]
    return [obj] if obj.is_single else [_embedding_item(obj, i) for i in range(obj.batch_size)]


def one(value: object, kind: type[T]) -> T:
    """A per-item field of a normalized single request: the one item's value, a `kind`
    (`rid` a str, `input_ids` a list, ...). A TypeError means the request was not normalized
    (a bug of the caller, not the user's)."""
    if not isinstance(value, kind):
        raise TypeError(
            f"a normalized single request holds a {kind.__name__} here, "
            f"not a {type(value).__name__}: normalize it first"
        )
    return value


def one_or_none(value: object, kind: type[T]) -> T | None:
    """`one`, for a field that may be left out (None)."""
    return None if value is None else one(value, kind)


def _normalize_generate(obj: GenerateReqInput, max_items: int | None) -> None:
    if obj.is_normalized:
        return
    is_batch, num_prompts = _check_prompts(obj.text, obj.input_ids)
    sampling_params = _per_item_sampling_params(obj.sampling_params, num_prompts)
    n = _parallel_sample_num(sampling_params)
    _check_num_items(num_prompts, n, max_items, "text" if obj.text is not None else "input_ids")
    per_item = _per_item_fields(obj, num_prompts)
    modalities = {
        name: _per_item_data(name, getattr(obj, name), num_prompts, is_batch)
        for name in ("image_data", "audio_data", "video_data")
    }
    rids = _check_rids(obj.rid, num_prompts, is_batch)
    if not is_batch and n == 1:
        # A single request keeps scalar fields.
        obj.sampling_params = sampling_params[0]
        obj.rid = rids[0]
        for name, values in per_item.items():
            setattr(obj, name, values[0])
        obj.is_single, obj.batch_size = True, 1
    else:
        if n > 1:
            sampling_params = [dict(sp, n=1) for sp in sampling_params]
            rids = [f"{rid}-{j}" for rid in rids for j in range(n)]
        obj.rid = rids
        _expand_batch(obj, n, is_batch, sampling_params, {**per_item, **modalities})
        obj.is_single, obj.batch_size = False, num_prompts * n
    # n expansion could only clash if user rids did; checked again to be sure.
    _check_unique(rids)
    obj.parallel_sample_num = n
    obj.is_normalized = True


def _per_item_fields(obj: GenerateReqInput, num_prompts: int) -> dict[str, list]:
    """The per-prompt fields (logprobs, LoRA, hidden states, sessions, ...) checked, one
    entry per prompt."""
    per_item = {
        name: _per_item(name, getattr(obj, name), num_prompts, default, check)
        for name, default, check in (
            ("return_logprob", False, _check_bool),
            ("logprob_start_len", -1, _check_start_len),
            ("top_logprobs_num", 0, _check_top_num),
            ("lora_path", None, _check_str),
            ("return_hidden_states", False, _check_bool),
            ("custom_logit_processor", None, _check_str),
            ("session_params", None, _check_session_params),
            ("bootstrap_host", None, _check_str),
            ("bootstrap_port", None, _check_port),
            ("bootstrap_room", None, _check_room),
        )
    }
    if obj.priority is not None and (
        type(obj.priority) is not int or not -(2**63) <= obj.priority < 2**63
    ):
        raise InvalidParameter(
            "priority", f"priority must be a signed 64-bit integer, got {obj.priority!r}"
        )
    per_item["token_ids_logprob"] = _per_item_token_ids(obj.token_ids_logprob, num_prompts)
    return per_item


def _expand_batch(
    obj: GenerateReqInput,
    n: int,
    is_batch: bool,
    sampling_params: list[dict[str, Any]],
    per_item: dict,
) -> None:
    """Every per-prompt field (the prompts, their `sampling_params`, `per_item`) as one
    entry per item, each prompt's n samples together; `obj.rid` is per item already."""
    obj.text = _expand(obj.text, n, is_batch)
    obj.input_ids = _expand(obj.input_ids, n, is_batch)
    obj.sampling_params = _repeat(sampling_params, n)
    for name, values in per_item.items():
        setattr(obj, name, None if values is None else _repeat(values, n))


def _generate_item(obj: GenerateReqInput, i: int) -> GenerateReqInput:
    """Batch item i as a normalized single request (a copy when already single)."""
    _require_normalized(obj)
    if obj.is_single:
        if i not in (0, -1):
            raise IndexError(f"a single request has only item 0, not {i}")
        return msgspec.structs.replace(obj)
    return GenerateReqInput(
        text=_entry(obj.text, i),
        input_ids=_entry(obj.input_ids, i),
        sampling_params=_entry(obj.sampling_params, i),
        rid=_entry(obj.rid, i),
        return_logprob=_entry(obj.return_logprob, i),
        logprob_start_len=_entry(obj.logprob_start_len, i),
        top_logprobs_num=_entry(obj.top_logprobs_num, i),
        token_ids_logprob=_entry(obj.token_ids_logprob, i),
        return_text_in_logprobs=obj.return_text_in_logprobs,
        stream=obj.stream,
        image_data=_entry(obj.image_data, i),
        audio_data=_entry(obj.audio_data, i),
        video_data=_entry(obj.video_data, i),
        lora_path=_entry(obj.lora_path, i),
        routing_key=obj.routing_key,
        priority=obj.priority,
        return_hidden_states=_entry(obj.return_hidden_states, i),
        custom_logit_processor=_entry(obj.custom_logit_processor, i),
        session_params=_entry(obj.session_params, i),
        bootstrap_host=_entry(obj.bootstrap_host, i),
        bootstrap_port=_entry(obj.bootstrap_port, i),
        bootstrap_room=_entry(obj.bootstrap_room, i),
        is_single=True,
        batch_size=1,
        parallel_sample_num=1,
        is_normalized=True,
    )


def _normalize_embedding(obj: EmbeddingReqInput, max_items: int | None) -> None:
    if obj.is_normalized:
        return
    if obj.is_cross_encoder_request and obj.text is not None:
        is_batch, num_inputs = _check_pairs(obj)
    else:
        is_batch, num_inputs = _check_prompts(obj.text, obj.input_ids)
    _check_num_items(num_inputs, 1, max_items, "text" if obj.text is not None else "input_ids")
    rids = _check_rids(obj.rid, num_inputs, is_batch)
    image_data = _per_item_data("image_data", obj.image_data, num_inputs, is_batch)
    _check_token_type_ids(obj, is_batch)
    if obj.dimensions is not None:
        _check_int("dimensions", "dimensions", obj.dimensions, 1, "")
    if is_batch:
        obj.image_data = image_data
    obj.rid = rids if is_batch else rids[0]
    obj.is_single, obj.batch_size = not is_batch, num_inputs
    obj.is_normalized = True


def _check_pairs(obj: EmbeddingReqInput) -> tuple[bool, int]:
    """A cross-encoder's text: a list of [query, document] pairs, or one pair."""
    text: Any = obj.text  # as the user sent it, checked here
    if isinstance(text, list) and len(text) == 2 and all(isinstance(t, str) for t in text):
        obj.text = text = [list(text)]
        is_batch = False
    else:
        is_batch = True
    if not isinstance(text, list) or not text:
        raise InvalidParameter(
            "text", "text must be a [query, document] pair or a non-empty list of such pairs"
        )
    for i, pair in enumerate(text):
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not all(isinstance(t, str) and t for t in pair)
        ):
            raise InvalidParameter(
                "text", f"text[{i}] must be a pair of non-empty strings [query, document]"
            )
    if not is_batch:
        obj.text = text[0]
    return is_batch, len(text)


def _check_token_type_ids(obj: EmbeddingReqInput, is_batch: bool) -> None:
    """token_type_ids go with input_ids, one per id, each >= 0 (the model bounds them)."""
    types = obj.token_type_ids
    if types is None:
        return
    if obj.input_ids is None:
        raise InvalidParameter("token_type_ids", "token_type_ids go with input_ids, not text")
    # As the user sent them; checked here.
    rows: list[Any] = types if is_batch else [types]
    ids: list[Any] = obj.input_ids if is_batch else [obj.input_ids]
    if not isinstance(types, list) or len(rows) != len(ids):
        raise InvalidParameter(
            "token_type_ids", "token_type_ids must have the shape of input_ids (one per token)"
        )
    for i, (row, item) in enumerate(zip(rows, ids)):
        if not isinstance(row, list) or len(row) != len(item):
            raise InvalidParameter(
                "token_type_ids",
                f"token_type_ids[{i}] must have one entry per input id ({len(item)})",
            )
        _check_token_ids("token_type_ids", f"token_type_ids[{i}]", row)


def _embedding_item(obj: EmbeddingReqInput, i: int) -> EmbeddingReqInput:
    """Batch item i as a normalized single request (a copy when already single)."""
    _require_normalized(obj)
    if obj.is_single:
        if i not in (0, -1):
            raise IndexError(f"a single request has only item 0, not {i}")
        return msgspec.structs.replace(obj)
    return EmbeddingReqInput(
        text=_entry(obj.text, i),
        input_ids=_entry(obj.input_ids, i),
        token_type_ids=_entry(obj.token_type_ids, i),
        rid=_entry(obj.rid, i),
        image_data=_entry(obj.image_data, i),
        dimensions=obj.dimensions,
        is_cross_encoder_request=obj.is_cross_encoder_request,
        is_single=True,
        batch_size=1,
        is_normalized=True,
    )


def _check_num_items(num_prompts: int, n: int, max_items: int | None, prompt_field: str) -> None:
    if max_items is not None and num_prompts * n > max_items:
        raise InvalidParameter(
            "n" if n > 1 else prompt_field,
            f"the request has {num_prompts} prompt(s) x n={n} = {num_prompts * n} items; "
            f"this server takes at most {max_items} in flight",
        )


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
            default if v is None else check(param, f"{param}[{i}]", v) for i, v in enumerate(value)
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
                "rid",
                f"rid must be a list of {num} strings for a batch of {num} prompts, got one string",
            )
        rids = [rid]
    elif isinstance(rid, list):
        if len(rid) != num:
            raise InvalidParameter(
                "rid",
                f"rid has {len(rid)} entries but the request has {num} prompt(s): "
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


def duplicate_rid_message(rid: str) -> str:
    """The error of a rid that a live request already holds, in SGLang's words."""
    return (
        f"rid: Duplicate request ID {rid!r}: a live request already uses it; "
        "give each request its own rid"
    )


def _check_unique(rids: list[str]) -> None:
    seen = set()
    for r in rids:
        if r in seen:
            raise InvalidParameter(
                "rid",
                f"rid: Duplicate request ID {r!r} within the request: every request in a "
                "batch needs its own rid",
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


def _check_port(param: str, label: str, value: Any) -> int:
    if type(value) is not int or not 0 < value < 65536:
        raise InvalidParameter(param, f"{label} must be a port number (1-65535), got {value!r}")
    return value


def _check_room(param: str, label: str, value: Any) -> int:
    if type(value) is not int or not 0 <= value < 2**63:
        raise InvalidParameter(
            param, f"{label} must be an integer in [0, 2**63) (a PD router picks it), got {value!r}"
        )
    return value


def _check_str(param: str, label: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidParameter(param, f"{label} must be a string, got {value!r}")
    return value


def _check_dict(param: str, label: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise InvalidParameter(param, f"{label} must be an object, got {type(value).__name__}")
    return value


def _check_session_params(param: str, label: str, value: Any) -> dict:
    """A dict that makes a `SessionParams` (kept as a dict: the request stays JSON-shaped)."""
    try:
        msgspec.convert(_check_dict(param, label, value), SessionParams)
    except msgspec.ValidationError as e:
        raise InvalidParameter(param, f"{label}: {readable(e)}") from None
    return value


def _expand(prompts: Any, n: int, is_batch: bool) -> list | None:
    """Prompts (text or ids) as a list with n copies of each, item-major."""
    if prompts is None:
        return None
    return _repeat(prompts if is_batch else [prompts], n)


def _entry(values: Any, i: int) -> Any:
    """Entry i of a per-item field of a normalized batch (None for a field left out): one
    entry per item, each of the type that item's field has once cut out."""
    if values is None:
        return None
    if not isinstance(values, list):
        raise TypeError(f"a normalized batch holds a list here, not a {type(values).__name__}")
    return values[i]


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
