"""Incremental detokenization: token ids in, text deltas out.

A delta never ends in half a multi-byte character (the tokenizer's replacement character
means "wait for the next token"), stop strings are trimmed from the final text, and a
streamed tail that may still become a stop string is held back until it is decided.
The same `Detokenizer` runs inside the detokenizer process and inside the in-process engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cadence.io_struct import BatchStrOutput, BatchTokenIDOutput

logger = logging.getLogger(__name__)

# Context tokens decoded before the unread ones, so merges and byte sequences decode right.
_CONTEXT_TOKENS = 5


@dataclass
class _State:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # start of the context window
    read_offset: int = 0  # ids before this are already turned into text
    unsent: str = ""  # decoded text not yet delivered (held back for stop strings)


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}
        self.failed: set[str] = set()  # rids that failed here and still run in the scheduler

    def _decode(self, ids: list[int], skip: bool, spaces: bool) -> str:
        # Fast tokenizers have no spaces_between_special_tokens switch; `spaces` is accepted
        # for the contract and only matters to tokenizers that support it.
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _step(self, st: _State, skip: bool, spaces: bool, final: bool) -> str:
        prefix = self._decode(st.ids[st.prefix_offset : st.read_offset], skip, spaces)
        full = self._decode(st.ids[st.prefix_offset :], skip, spaces)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix) :]
            st.prefix_offset = max(len(st.ids) - _CONTEXT_TOKENS, st.read_offset)
            st.read_offset = len(st.ids)
            return delta
        return ""

    def _stop_start(self, st: _State, text: str, stop: str, skip: bool, spaces: bool) -> int:
        """Where in `text` (which ends with the newest token's text) the matched stop string
        starts: its first occurrence reaching into the newest token. Earlier occurrences were
        ignored by the scheduler (min_new_tokens) and stay in the text."""
        window = st.ids[-(_CONTEXT_TOKENS + 1) :]
        before = self._decode(window[:-1], skip, spaces).rstrip("\ufffd")
        newest = max(len(self._decode(window, skip, spaces)) - len(before), 0)
        cut = text.find(stop, max(len(text) - newest - len(stop) + 1, 0))
        return cut if cut != -1 else text.find(stop)

    def process(self, batch: BatchTokenIDOutput) -> BatchStrOutput:
        """Text deltas for one step's token ids. A request whose text cannot be made fails
        alone: its entry becomes a final error (`origin` "detokenizer", so the front aborts
        it in the scheduler) and its later outputs are dropped until its own final one."""
        texts, reasons = [], list(batch.finished_reasons)
        for i, rid in enumerate(batch.rids):
            if rid in self.failed:
                if reasons[i] is not None:  # its end in the scheduler; the front has moved on
                    self.failed.discard(rid)
                texts.append("")
                continue
            try:
                texts.append(self._process_one(batch, i, rid))
            except Exception as e:
                logger.exception("detokenizing request %s failed; it ends with an error", rid)
                self.states.pop(rid, None)
                if reasons[i] is None:
                    self.failed.add(rid)
                reasons[i] = {
                    "type": "abort",
                    "status_code": 500,
                    "request_fault": True,
                    "origin": "detokenizer",
                    "message": f"internal error while detokenizing: {type(e).__name__}: {e}",
                }
                texts.append("")
        return BatchStrOutput(
            rids=batch.rids,
            http_worker_ipcs=batch.http_worker_ipcs,
            finished_reasons=reasons,
            output_strs=texts,
            output_ids=batch.output_ids,
            prompt_tokens=batch.prompt_tokens,
            completion_tokens=batch.completion_tokens,
            cached_tokens=batch.cached_tokens,
            logprobs=batch.logprobs,
            hidden_states=batch.hidden_states,
            spec_verify_ct=batch.spec_verify_ct,
            spec_accepted_tokens=batch.spec_accepted_tokens,
            spec_proposed_tokens=batch.spec_proposed_tokens,
            spec_acceptance_histogram=batch.spec_acceptance_histogram,
            weight_version=batch.weight_version,
        )

    def _process_one(self, batch: BatchTokenIDOutput, i: int, rid: str) -> str:
        st = self.states.setdefault(rid, _State())
        reason = batch.finished_reasons[i]
        new_ids = batch.output_ids[i]
        trim_token = (
            reason is not None
            and reason.get("type") == "stop"
            and isinstance(reason.get("matched"), int)
            and not batch.no_stop_trim[i]
            and new_ids
        )
        st.ids.extend(new_ids[:-1] if trim_token else new_ids)
        st.unsent += self._step(
            st,
            batch.skip_special_tokens[i],
            batch.spaces_between_special_tokens[i],
            final=reason is not None,
        )
        stops = batch.stop_strs[i] or []
        if reason is None:
            keep = _held_back(st.unsent, stops) if stops else 0
            out, st.unsent = st.unsent[: len(st.unsent) - keep], st.unsent[len(st.unsent) - keep :]
            return out
        out = st.unsent
        matched = reason.get("matched")
        if isinstance(matched, str) and not batch.no_stop_trim[i]:
            cut = self._stop_start(
                st,
                out,
                matched,
                batch.skip_special_tokens[i],
                batch.spaces_between_special_tokens[i],
            )
            if cut != -1:
                out = out[:cut]
        del self.states[rid]
        return out
