"""Speculative decoding in the scheduler (`--speculative-algorithm NGRAM`): which running
requests draft this step and how much, and what a verify step did for each.

A decode step gives each request with a draft its last token and the drafted ones (one
forward over all of them, KV written for each); the runner samples row by row and accepts
draft tokens while they are what the request samples (model_runner `_verify_drafts`), so the
output is exactly the one without speculation. The KV of the rejected tokens stays in pages
the request already had reserved (a draft never goes past what admission promised it) and is
overwritten as the request goes on; `num_computed` counts only verified tokens, so neither
the prefix cache nor a later step ever reads a rejected token's KV.

Requests that do not draft: those with a grammar, a logit processor, hidden states or a
min_new_tokens still to reach (their sampling depends on state the row-by-row verifier does
not advance), and those whose drafts have been failing (`DraftPace` backs off). A step
verifies at most `budget` drafted tokens in all, so long drafts never make one step much
larger than a prefill chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cadence.model_executor.runner import ItemResult
from cadence.scheduler.ngram import DraftPace, NgramConfig, NgramDrafter
from cadence.scheduler.req import Req
from cadence.server_args import ServerArgs

RECENT_VERIFIES = 1024  # request-steps the load report's gauges are over


@dataclass
class SpecStats:
    """Verify counters since start and over the last RECENT_VERIFIES request-steps, for the
    load report (/metrics gauges, /server_info, gRPC GetLoads)."""

    verify_steps: int = 0  # request-steps that verified a draft
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    recent: deque[tuple[int, int]] = field(
        default_factory=lambda: deque(maxlen=RECENT_VERIFIES)
    )  # (proposed, accepted) per request-step

    def add(self, proposed: int, accepted: int) -> None:
        self.verify_steps += 1
        self.proposed += proposed
        self.accepted += accepted
        self.recent.append((proposed, accepted))


def _length(steps: int, accepted: int) -> float:
    """Tokens a verify step gave on average: the accepted drafts and the sampled token."""
    return (accepted + steps) / steps if steps else 0.0


def ngram_config(args: ServerArgs) -> NgramConfig:
    return NgramConfig(
        num_draft_tokens=args.speculative_num_draft_tokens,
        min_match_window=args.speculative_ngram_min_match_window_size,
        max_match_window=args.speculative_ngram_max_match_window_size,
        max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
        match_type=args.speculative_ngram_match_type,
        branch_length=args.speculative_ngram_branch_length,
        capacity=args.speculative_ngram_capacity,
    )


class Speculation:
    """The scheduler's speculative decoding; see the module docstring."""

    def __init__(self, args: ServerArgs, context_len: int):
        self.config = ngram_config(args)
        self.drafter = NgramDrafter(self.config)
        self.context_len = context_len
        self.budget = max(args.chunked_prefill_size, self.config.max_draft)
        self.stats = SpecStats()

    def drafts(self, reqs: list[Req], suppressed) -> list[list[int]]:
        """This step's draft of each request (mostly []), within the step's budget."""
        left = self.budget
        out: list[list[int]] = []
        for req in reqs:
            draft: list[int] = []
            if left > 0 and self._may_draft(req, suppressed):
                pace = req.spec_pace
                if pace is None:
                    pace = req.spec_pace = DraftPace(self.config.max_draft)
                if pace.drafting():
                    room = req.total_tokens_needed(self.context_len) - req.seq_len
                    draft = self.drafter.draft(req.fill_ids, min(pace.length, room, left))
                    left -= len(draft)
            out.append(draft)
        return out

    @staticmethod
    def _may_draft(req: Req, suppressed) -> bool:
        return (
            req.grammar is None
            and req.logit_processor is None
            and not req.return_hidden_states
            and suppressed(req) is None
        )

    def verified(self, req: Req, num_draft: int, result: ItemResult) -> None:
        """A verify step's outcome for `req`: counters, histogram, its pace."""
        accepted = len(result.more)
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += accepted
        req.spec_proposed_tokens += num_draft
        histogram = req.spec_acceptance_histogram
        histogram.extend([0] * (accepted + 1 - len(histogram)))
        histogram[accepted] += 1
        if req.spec_pace is not None:
            req.spec_pace.update(num_draft, accepted, self.config.max_draft)
        self.stats.add(num_draft, accepted)

    def load_figures(self) -> tuple[float, float, float]:
        """The load report's spec_accept_length, spec_accept_rate (both over recent verify
        steps) and avg_spec_accept_length (since start); see GetLoadReqOutput."""
        stats = self.stats
        proposed = sum(p for p, _ in stats.recent)
        accepted = sum(a for _, a in stats.recent)
        return (
            _length(len(stats.recent), accepted),
            accepted / proposed if proposed else 0.0,
            _length(stats.verify_steps, stats.accepted),
        )

    def finished(self, req: Req) -> None:
        """A request ended well: its output joins the shared n-gram store."""
        if req.output_ids:
            self.drafter.remember(req.fill_ids, len(req.input_ids))

    def flush(self) -> None:
        self.drafter.clear()
