"""When a request's newest token ends it: EOS, a stop token id, a stop string, its length.

A small collaborator of the scheduler: generation must stop at once (no token generated
for nobody), so the check runs in the scheduler on every sampled token; the detokenizer
later trims the matched stop string from the text.
"""

from __future__ import annotations

import functools
from typing import Any

import regex

from cadence.constrained import grammar_key
from cadence.scheduler.req import Req

# Stop regexes look at the text of this many newest tokens, each search for at most this long.
STOP_REGEX_TAIL_TOKENS = 64
STOP_REGEX_TIMEOUT_S = 0.05


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


def dead_end_reason(req: Req) -> dict[str, Any]:
    """The request's constraint allows no next token (a schema with no finite value that
    the edge could not see, e.g. a $ref cycle reached after a few tokens): the client's
    own constraint is at fault, a 400 naming it."""
    key = grammar_key(req.params)
    field = key.field if key is not None else "json_schema"
    return {
        "type": "abort",
        "status_code": 400,
        "param": field,
        "message": f"{field}: the constraint allows no token after {len(req.output_ids)} "
        "tokens of output: it admits no complete value (does a $ref refer to itself "
        "with nothing else to match?)",
    }


class StopChecker:
    def __init__(self, tokenizer, eos_ids: set[int], context_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_len = context_len

    def suppressed_ids(self, req: Req) -> list[int] | None:
        """Tokens masked this step: the ones that would stop the request before min_new_tokens."""
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens:
            return None
        return list((set() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids or ()))

    def check(self, req: Req, token: int) -> dict[str, Any] | None:
        """The finish reason if `token` (just appended to req.output_ids) ends `req`, else None."""
        p = req.params
        num_out = len(req.output_ids)
        if num_out >= p.min_new_tokens:
            if not p.ignore_eos and token in self.eos_ids:
                return {"type": "stop", "matched": token}
            if p.stop_token_ids and token in p.stop_token_ids:
                return {"type": "stop", "matched": token}
            if p.stop:
                matched = self._match_stop_string(req)
                if matched is not None:
                    return {"type": "stop", "matched": matched}
            if p.stop_regex:
                matched = self._match_stop_regex(req)
                if matched is not None:
                    return {"type": "stop", "matched": matched}
        if num_out >= p.max_new_tokens or req.seq_len >= self.context_len:
            return {"type": "length", "length": num_out}
        return None

    def _match_stop_regex(self, req: Req) -> str | None:
        """The first pattern that matches the tail of the output text (as SGLang: the last
        STOP_REGEX_TAIL_TOKENS tokens). Each search has a time limit, so a pattern that
        backtracks without end fails its own request instead of stalling the batch."""
        tail = self.tokenizer.decode(
            req.output_ids[-STOP_REGEX_TAIL_TOKENS:], skip_special_tokens=False
        )
        for pattern in req.params.stop_regex or ():
            if _compiled(pattern).search(tail, timeout=STOP_REGEX_TIMEOUT_S) is not None:
                return pattern
        return None

    def _match_stop_string(self, req: Req) -> str | None:
        # A byte-level token decodes to at least one byte, so this many tokens cover any stop
        # string, even one of multi-byte characters.
        stops = req.params.stop or ()
        longest = max(len(s.encode("utf-8")) for s in stops)
        window = req.output_ids[-(longest + 1) :]
        tail = self.tokenizer.decode(window, skip_special_tokens=False)
        before = self.tokenizer.decode(window[:-1], skip_special_tokens=False).rstrip("\ufffd")
        for stop in stops:
            # Only an occurrence reaching into the newest token counts: an earlier one was
            # ignored under min_new_tokens and must not end the request now.
            if tail.find(stop, max(len(before) - len(stop) + 1, 0)) != -1:
                return stop
        return None
