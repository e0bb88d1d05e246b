"""PD mode's work on bodies: the bootstrap fields written into a request, and the prefill
side's input logprobs merged into the decode side's answer.

Unlike `request_meta`, which only reads a lean view and forwards the original bytes, PD mode
must write into the request: the prefill and the decode worker meet on the bootstrap
fields (SGLang's names), so the body is decoded whole, changed and encoded again. The same
encoded bytes go to both workers.

- `bootstrap_host`: the prefill worker's host, as in its URL (an IPv6 address without
  brackets); `bootstrap_port`: its KV bootstrap server's port; `bootstrap_room`: a random
  integer in [0, 2**63) naming this request's transfer.
- A batch gets one value per request in lists of equal length, as SGLang's router sends
  them: native /generate with `text` a list (or `input_ids` a list of lists),
  /v1/completions with `prompt` a list of prompts, /v1/chat/completions with `n` > 1.
- Native /generate with `return_logprob`: the prompt's logprobs are computed where the
  prompt ran, on the prefill worker, so its `meta_info.input_token_logprobs` is put in
  front of the decode answer's list (per batch item), as SGLang's router does; in a
  stream, into every event that carries that list (a /generate stream's events carry
  the lists so far, SGLang's default).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from urllib.parse import urlsplit

import msgspec

GENERATE_ROUTES = frozenset(("/generate", "/v1/completions", "/v1/chat/completions"))
ROOM_BITS = 63  # rooms are in [0, 2**63): SGLang's bootstrap_room is a non-negative int64

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class PdBodyError(ValueError):
    """A request body PD mode cannot write its fields into; the client gets 400."""


def decode_object(body: bytes) -> dict:
    """The request body as a JSON object, or PdBodyError saying what is wrong with it."""
    try:
        obj = _decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise PdBodyError(
            f"body is not valid JSON ({exc}); the router in PD mode writes the bootstrap "
            "fields into it"
        ) from None
    if not isinstance(obj, dict):
        raise PdBodyError("body must be a JSON object")
    return obj


def batch_size(route: str, obj: dict) -> int | None:
    """How many requests the body holds when the bootstrap fields must be lists, else None."""
    if route == "/generate":
        text, input_ids = obj.get("text"), obj.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            return len(input_ids)
    elif route == "/v1/completions":
        prompt = obj.get("prompt")
        # A list of token ids is one prompt; a list of strings or of id lists is a batch.
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return len(prompt)
    elif route == "/v1/chat/completions":
        n = obj.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return n
    return None


def prompt_tokens(route: str, obj: dict) -> int | None:
    """The longest prompt of the body in tokens: counted where it comes as token ids,
    estimated where it comes as text (`BYTES_PER_TOKEN`, fewer than most tokenizers' 4 or so
    for English, so that the estimate errs long); None when the body's prompt is neither
    (input embeddings, images): such a request is never prefilled locally."""
    if route == "/generate":
        if obj.get("input_embeds") is not None or obj.get("image_data") is not None:
            return None
        return _longest(obj.get("input_ids"), obj.get("text"))
    if route == "/v1/completions":
        prompt = obj.get("prompt")  # ids, a batch of id lists, a text or a batch of texts
        return _longest(prompt if _is_ids(prompt) else None, prompt)
    if route == "/v1/chat/completions":
        messages = obj.get("messages")
        if not isinstance(messages, list):
            return None
        # The tool definitions are templated into the prompt too.
        size = _text_tokens(_encoder.encode(obj["tools"]).decode()) if obj.get("tools") else 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # parts: text only, else not local
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text":
                        return None
                    size += _text_tokens(part.get("text"))
            else:
                size += _text_tokens(content)
        return size
    return None


BYTES_PER_TOKEN = 3


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], int | list)


def _text_tokens(text: object) -> int:
    if not isinstance(text, str):
        return 0
    return -(-len(text.encode("utf-8", "replace")) // BYTES_PER_TOKEN)


def _longest(ids: object, text: object) -> int | None:
    if isinstance(ids, list) and ids:
        if isinstance(ids[0], list):  # a batch of id lists
            return max(len(item) if isinstance(item, list) else 0 for item in ids)
        return len(ids)
    if isinstance(text, str):
        return _text_tokens(text)
    if isinstance(text, list) and text:
        return max(_text_tokens(item) for item in text)
    return None


def without_bootstrap(obj: dict) -> bool:
    """Drops bootstrap fields a client sent (a request prefilled where it decodes waits
    for no transfer); True when there were any."""
    found = False
    for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        found |= obj.pop(key, None) is not None
    return found


def bootstrap_host(url: str) -> str:
    """The host part of a worker's base URL."""
    return urlsplit(url).hostname or ""


def inject_bootstrap(
    obj: dict, host: str, port: int | None, batch: int | None, rng: random.Random
) -> list[int]:
    """Write the bootstrap fields into `obj` (replacing any the client sent); the rooms."""
    rooms = [rng.getrandbits(ROOM_BITS) for _ in range(1 if batch is None else batch)]
    if batch is None:
        obj["bootstrap_host"], obj["bootstrap_port"], obj["bootstrap_room"] = host, port, rooms[0]
    else:
        obj["bootstrap_host"], obj["bootstrap_port"] = [host] * batch, [port] * batch
        obj["bootstrap_room"] = rooms
    return rooms


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)


def wants_input_logprobs(route: str, obj: dict) -> bool:
    """Native /generate asking for logprobs: the prefill side's input logprobs are merged."""
    if route != "/generate":
        return False
    flag = obj.get("return_logprob")
    if isinstance(flag, list):  # a batch may ask per item
        return any(f is True for f in flag)
    return flag is True


def input_logprobs(answer: bytes) -> dict[int, list]:
    """The prefill answer's `meta_info.input_token_logprobs` by batch index.

    The answer is one JSON object, a JSON list (a batch), or an event stream (the longest
    list seen per `index` wins: whether the stream carries the lists so far or only what
    is new, the prompt's logprobs are all in one event).
    """
    try:
        obj = _decoder.decode(answer)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        found: dict[int, list] = {}
        for event in _data_events(answer):
            index = event.get("index", 0)
            lp = _input_list(event)
            if isinstance(index, int) and lp is not None and len(lp) >= len(found.get(index, ())):
                found[index] = lp
        return found
    items = obj if isinstance(obj, list) else [obj]
    found = {}
    for i, item in enumerate(items):
        lp = _input_list(item)
        if lp is not None:
            found[i] = lp
    return found


def merge_answer(answer: bytes, prefill_lps: dict[int, list]) -> bytes | None:
    """The decode side's JSON answer with the prefill's input logprobs in front of its own;
    None when there is nothing to merge (relay the answer's bytes as they are)."""
    if not prefill_lps:
        return None
    try:
        obj = _decoder.decode(answer)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    items = obj if isinstance(obj, list) else [obj]
    merged = [_prepend(item, prefill_lps.get(i)) for i, item in enumerate(items)]
    return _encoder.encode(obj) if any(merged) else None


class StreamMerger:
    """Rewrites a decode event stream: each `data:` event whose JSON carries
    `meta_info.input_token_logprobs` gets the prefill's list (for its `index`) in front.

    Events are cut at blank lines whatever the chunking; every event it does not change
    (other fields, `[DONE]`, multi-line data, comments) passes byte for byte.
    """

    def __init__(self, prefill_lps: dict[int, list]) -> None:
        self.prefill_lps = prefill_lps
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        out: list[bytes] = []
        start = 0
        while True:
            end, sep = _next_separator(data, start)
            if end < 0:
                break
            out.append(self._rewrite(data[start:end], sep))
            start = end + len(sep)
        self._pending = data[start:]
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _rewrite(self, event: bytes, sep: bytes) -> bytes:
        obj = _event_json(event)
        if isinstance(obj, dict):
            index = obj.get("index", 0)
            lps = self.prefill_lps.get(index) if isinstance(index, int) else None
            if _prepend(obj, lps):
                return b"data: " + _encoder.encode(obj) + sep
        return event + sep


def _input_list(item: object) -> list | None:
    meta = item.get("meta_info") if isinstance(item, dict) else None
    lp = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return lp if isinstance(lp, list) else None


def _prepend(item: object, prefill_lp: list | None) -> bool:
    """Put `prefill_lp` in front of the item's input_token_logprobs (both must be lists)."""
    own = _input_list(item)
    if prefill_lp is None or own is None:
        return False
    item["meta_info"]["input_token_logprobs"] = prefill_lp + own  # type: ignore[index]
    return True


def _next_separator(data: bytes, start: int) -> tuple[int, bytes]:
    """Where the next event ends (the earliest blank line) and the separator found there."""
    best, best_sep = -1, b""
    for sep in (b"\n\n", b"\r\n\r\n"):
        at = data.find(sep, start)
        if at >= 0 and (best < 0 or at < best):
            best, best_sep = at, sep
    return best, best_sep


def _event_json(event: bytes) -> object:
    """The JSON of a one-line `data:` event; None for anything else."""
    if not event.startswith(b"data:") or b"\n" in event.strip():
        return None
    payload = event[5:].strip()
    if not payload.startswith((b"{", b"[")):
        return None  # [DONE] and the like
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None


def _data_events(stream: bytes) -> Iterator[dict]:
    start = 0
    while True:
        end, sep = _next_separator(stream, start)
        event = stream[start:] if end < 0 else stream[start:end]
        obj = _event_json(event.strip())
        if isinstance(obj, dict):
            yield obj
        if end < 0:
            return
        start = end + len(sep)
