"""Checks of one request's sampling parameters: names, types and the ranges of `specs/http.md`.

Part of the front's one checking stage (`cadence.front.request_checks`). Two steps turn
user input into a trusted `SamplingParams` (the struct lives in `cadence.io_struct`), and
both raise `InvalidParameter` whose message starts with the offending field's name:

- `parse_sampling_params(d)` checks names and types (JSON gives us strings, floats and
  booleans where numbers are expected) and normalizes representations;
- `check_sampling_params(p, vocab_size)` checks every range of the spec table. It needs the
  vocabulary size, which only the front knows after loading the tokenizer, hence a
  separate step.

Imports nothing heavy: the front process and the CLI import it on their own.
"""

import difflib
import json
import math
import numbers
import operator
from collections.abc import Callable
from typing import Any, NoReturn

import regex

from cadence.errors import InvalidParameter
from cadence.io_struct import SamplingParams
from cadence.json_limits import TooDeep, check_depth
from cadence.server_args import json_object_arg

# Stop conditions are checked on every step of a request (the detokenizer compares each
# stop string's prefixes with the text's tail), so their number and size are bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
# Stop regexes are searched on the tail of the output text at every step, as SGLang bounds them.
MAX_STOP_REGEXES = 32
MAX_STOP_REGEX_CHARS = 256
# No vocabulary in use has more tokens than this (Gemma's: 262,144): a logit_bias with more
# entries names a token that does not exist. Each entry costs microseconds to check.
MAX_LOGIT_BIAS_ENTRIES = 1 << 18

# Every integer crosses ZMQ as msgpack, which cannot carry more than 64 bits; a larger
# value must be refused here rather than crash the encoder in the front process.
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def parse_sampling_params(d: object) -> SamplingParams:
    """Build from a user's dict (e.g. the `sampling_params` object of /generate); anything
    else the user sent in its place is refused.

    Unknown names and wrong types raise `InvalidParameter`; a None value means the
    default. Ranges are not checked here: call `check_sampling_params()` next.
    """
    if d is None:
        return SamplingParams()
    if not isinstance(d, dict):
        raise InvalidParameter(
            "sampling_params",
            f"sampling_params must be an object, got {_describe(d)}",
        )
    kwargs = {}
    for name, value in d.items():
        value = coerce_field(name, value)
        if value is not None:
            kwargs[name] = value
    return SamplingParams(**kwargs)


def preferred_sampling_params(text: str | None) -> dict[str, Any] | None:
    """--preferred-sampling-params: the JSON object of sampling parameters that fill what a
    request leaves out (None without the flag). Its names, types and ranges pass the same
    checks as a request's; a fault is a ValueError naming the flag."""
    if text is None:
        return None
    value = json_object_arg("preferred_sampling_params", text)
    try:
        check_sampling_params(parse_sampling_params(value))
    except (ValueError, InvalidParameter) as e:
        raise ValueError(f"preferred_sampling_params: {e}") from None
    return {name: v for name, v in value.items() if v is not None}


def with_preferred(given: object, preferred: dict[str, Any] | None) -> object:
    """A request's sampling parameters over the server's preferred ones: a name the request
    leaves out, or gives as null, takes the preferred value. Anything but an object is
    returned as it came, for `parse_sampling_params` to refuse."""
    if not preferred or not (given is None or isinstance(given, dict)):
        return given
    return {**preferred, **{k: v for k, v in (given or {}).items() if v is not None}}


def check_sampling_params(p: SamplingParams, vocab_size: int | None = None) -> None:
    """Check every range of the spec table; raise `InvalidParameter` on the first fault.

    Types are re-checked too, so parameters built directly in Python (not through
    `parse_sampling_params`) get the same errors; representations are normalized on the
    way (a single stop string becomes a list, string logit_bias keys become ints).
    With `vocab_size`, token ids must lie in [0, vocab_size).
    """
    _normalize_types(p)
    _check_lengths(p)
    _check_distributions(p)
    _check_penalties(p)
    _check_stops(p, vocab_size)
    _check_stop_regex(p)
    _check_constraints(p)


def _normalize_types(p: SamplingParams) -> None:
    for name in p.__struct_fields__:
        value = getattr(p, name)
        if value is None and name in _OPTIONAL_FIELDS:
            continue
        if value is None:
            raise InvalidParameter(name, f"{name} must not be null")
        setattr(p, name, coerce_field(name, value))


def _check_lengths(p: SamplingParams) -> None:
    if p.max_new_tokens < 0:
        _fail("max_new_tokens", ">= 0", p.max_new_tokens)
    if p.min_new_tokens < 0:
        _fail("min_new_tokens", ">= 0", p.min_new_tokens)
    if p.min_new_tokens > p.max_new_tokens:
        raise InvalidParameter(
            "min_new_tokens",
            f"min_new_tokens must be <= max_new_tokens ({p.max_new_tokens}), "
            f"got {p.min_new_tokens}; lower min_new_tokens or raise max_new_tokens",
        )
    if p.n < 1:
        _fail("n", ">= 1", p.n)


def _check_distributions(p: SamplingParams) -> None:
    if p.temperature < 0:
        _fail("temperature", ">= 0 (0 means greedy)", p.temperature)
    if not 0 < p.top_p <= 1:
        _fail("top_p", "in (0, 1]", p.top_p)
    if p.top_k != -1 and p.top_k < 1:
        _fail("top_k", "-1 (whole vocabulary) or >= 1", p.top_k)
    if not 0 <= p.min_p <= 1:
        _fail("min_p", "in [0, 1]", p.min_p)


def _check_penalties(p: SamplingParams) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(p, name)
        if not -2 <= value <= 2:
            _fail(name, "in [-2, 2]", value)
    if not 0 <= p.repetition_penalty <= 2:
        _fail("repetition_penalty", "in [0, 2] (1 disables it)", p.repetition_penalty)


def _check_stops(p: SamplingParams, vocab_size: int | None) -> None:
    stop = p.stop or []
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidParameter(
            "stop", f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    for i, s in enumerate(stop):
        if not s:
            raise InvalidParameter(
                "stop", f"stop[{i}] must not be empty: an empty string matches anywhere"
            )
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidParameter(
                "stop",
                f"stop[{i}] has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} are allowed",
            )
    stop_token_ids = p.stop_token_ids or []
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidParameter(
            "stop_token_ids",
            f"stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
        )
    valid = ">= 0" if vocab_size is None else f"in [0, {vocab_size})"
    for i, token_id in enumerate(stop_token_ids):
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise InvalidParameter(
                "stop_token_ids",
                f"stop_token_ids[{i}] must be a token id {valid}, got {token_id}",
            )
    for token_id in p.logit_bias or ():
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise InvalidParameter(
                "logit_bias",
                f"logit_bias keys must be token ids {valid}, got {token_id}",
            )


def _check_stop_regex(p: SamplingParams) -> None:
    patterns = p.stop_regex or ()
    if len(patterns) > MAX_STOP_REGEXES:
        raise InvalidParameter(
            "stop_regex", f"stop_regex has {len(patterns)} patterns; at most {MAX_STOP_REGEXES}"
        )
    for i, pattern in enumerate(patterns):
        if not pattern or len(pattern) > MAX_STOP_REGEX_CHARS:
            raise InvalidParameter(
                "stop_regex",
                f"stop_regex[{i}] must have 1 to {MAX_STOP_REGEX_CHARS} characters, "
                f"got {len(pattern)}",
            )
        try:
            regex.compile(pattern)
        except regex.error as e:
            raise InvalidParameter(
                "stop_regex", f"stop_regex[{i}] is not a valid regular expression: {e}"
            ) from None


def _check_constraints(p: SamplingParams) -> None:
    given = [name for name in ("regex", "json_schema", "ebnf") if getattr(p, name)]
    if len(given) > 1:
        raise InvalidParameter(
            given[1],
            f"{given[1]} cannot be combined with {given[0]}: give at most one of "
            "regex, json_schema and ebnf",
        )
    if p.json_schema is not None:
        try:
            check_depth(p.json_schema)
            json.loads(p.json_schema)
        except TooDeep as e:
            raise InvalidParameter("json_schema", f"json_schema is nested too deep: {e}") from None
        except (ValueError, RecursionError) as e:
            raise InvalidParameter(
                "json_schema", f"json_schema must be a schema encoded as a JSON string: {e}"
            ) from None


# -- field coercion ------------------------------------------------------------------------
#
# One function per kind of field. Each returns the value in its canonical form or raises
# InvalidParameter; `label` is what the message calls the value (e.g. "stop_token_ids[3]"),
# `param` the top-level field it belongs to.


def _as_int(param: str, value: Any, label: str | None = None) -> int:
    label = label or param
    # bool is an int subclass in Python, but `true` for a count is a client bug.
    if isinstance(value, bool):
        raise InvalidParameter(param, f"{label} must be an integer, got a boolean ({value})")
    if isinstance(value, float):
        # JSON encoders in some languages write every number as a float; 128.0 is fine.
        if not value.is_integer():
            raise InvalidParameter(param, f"{label} must be an integer, got {_fmt(value)}")
        result = int(value)
    else:
        try:
            result = operator.index(value)  # int and int-like (e.g. numpy integers)
        except TypeError:
            raise InvalidParameter(
                param, f"{label} must be an integer, got {_describe(value)}"
            ) from None
    if not _INT64_MIN <= result <= _INT64_MAX:
        raise InvalidParameter(param, f"{label} must fit in a signed 64-bit integer, got {result}")
    return result


def _as_float(param: str, value: Any, label: str | None = None) -> float:
    label = label or param
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidParameter(param, f"{label} must be a number, got {_describe(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise InvalidParameter(param, f"{label} must be a finite number, got {result}")
    return result


def _as_bool(param: str, value: Any) -> bool:
    # No truthiness: "false" (a string) would otherwise mean True.
    if not isinstance(value, bool):
        raise InvalidParameter(param, f"{param} must be true or false, got {_describe(value)}")
    return value


def _as_str(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidParameter(param, f"{param} must be a string, got {_describe(value)}")
    return value


def _as_stop(param: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise InvalidParameter(
            param, f"{param} must be a string or a list of strings, got {_describe(value)}"
        )
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise InvalidParameter(param, f"{param}[{i}] must be a string, got {_describe(s)}")
    return list(value)


def _as_token_ids(param: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise InvalidParameter(
            param, f"{param} must be a list of token ids, got {_describe(value)}"
        )
    return [_as_int(param, t, f"{param}[{i}]") for i, t in enumerate(value)]


def _as_params(param: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidParameter(param, f"{param} must be an object, got {_describe(value)}")
    return value


def _as_logit_bias(param: str, value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise InvalidParameter(
            param, f"{param} must be an object mapping token ids to biases, got {_describe(value)}"
        )
    result = {}
    for key, bias in value.items():
        if isinstance(key, str):
            # JSON object keys are always strings.
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidParameter(
                    param, f"{param} keys must be token ids (integers), got {key!r}"
                ) from None
        else:
            token_id = _as_int(param, key, f"{param} key")
        result[token_id] = _as_float(param, bias, f"{param}[{token_id}]")
    return result


_COERCERS: dict[str, Callable[[str, Any], Any]] = {
    "max_new_tokens": _as_int,
    "min_new_tokens": _as_int,
    "temperature": _as_float,
    "top_p": _as_float,
    "top_k": _as_int,
    "min_p": _as_float,
    "frequency_penalty": _as_float,
    "presence_penalty": _as_float,
    "repetition_penalty": _as_float,
    "n": _as_int,
    "stop": _as_stop,
    "stop_token_ids": _as_token_ids,
    "logit_bias": _as_logit_bias,
    "regex": _as_str,
    "json_schema": _as_str,
    "ebnf": _as_str,
    "ignore_eos": _as_bool,
    "skip_special_tokens": _as_bool,
    "spaces_between_special_tokens": _as_bool,
    "no_stop_trim": _as_bool,
    "seed": _as_int,
    "stop_regex": _as_stop,
    "custom_params": _as_params,
}

# SGLang sampling parameters this server accepts and does not use (the client's request is
# served as if they were absent); any other unknown name is a 400 that suggests a known one.
IGNORED_SGLANG_PARAMS = frozenset({"stream_interval"})

# Fields whose default is None: None is a value for them, not a missing one.
_OPTIONAL_FIELDS = frozenset(
    name
    for name, default in zip(
        SamplingParams.__struct_fields__[-len(SamplingParams.__struct_defaults__) :],
        SamplingParams.__struct_defaults__,
    )
    if default is None
)

# A new field must get a coercer: from_dict and verify would reject it otherwise.
if set(_COERCERS) != set(SamplingParams.__struct_fields__):
    raise RuntimeError("sampling_params: _COERCERS does not match SamplingParams' fields")


def coerce_field(name: str, value: Any) -> Any:
    """Check one sampling parameter's name and type; return it in canonical form.

    None passes through (it means "default"). Raises `InvalidParameter` for an unknown
    name (suggesting the closest known one) or a wrong type. Ranges are `verify()`'s job.
    """
    coercer = _COERCERS.get(name)
    if coercer is None:
        if name in IGNORED_SGLANG_PARAMS:
            return None
        raise InvalidParameter(name, _unknown_message(name))
    if value is None:
        return None
    _check_count(name, value)
    return coercer(name, value)


# The most entries of each list or object parameter, checked before any entry is read.
_MAX_ENTRIES = {
    "stop": (MAX_STOP_STRINGS, "strings"),
    "stop_regex": (MAX_STOP_REGEXES, "patterns"),
    "stop_token_ids": (MAX_STOP_TOKEN_IDS, "ids"),
    "logit_bias": (MAX_LOGIT_BIAS_ENTRIES, "entries"),
}


def _check_count(name: str, value: Any) -> None:
    limit = _MAX_ENTRIES.get(name)
    if limit is not None and isinstance(value, list | tuple | dict) and len(value) > limit[0]:
        raise InvalidParameter(
            name, f"{name} has {len(value)} {limit[1]}; at most {limit[0]} are allowed"
        )


def _unknown_message(name: Any) -> str:
    message = f"unknown sampling parameter {name!r}"
    close = difflib.get_close_matches(str(name), list(_COERCERS), n=1)
    if close:
        message += f"; did you mean {close[0]!r}?"
    return message


def _fail(param: str, valid: str, value: Any) -> NoReturn:
    raise InvalidParameter(param, f"{param} must be {valid}, got {_fmt(value)}")


def _fmt(value: Any) -> str:
    # 0.0 reads better as "0", but never round: 2.0000001 must not print as "2".
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _describe(value: Any) -> str:
    """Name a wrongly typed value for an error message, e.g. "a string ('0.7')"."""
    kinds = {str: "a string", list: "a list", dict: "an object", type(None): "null"}
    kind = kinds.get(type(value), f"a {type(value).__name__}")
    if value is None:
        return kind
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{kind} ({text})"
