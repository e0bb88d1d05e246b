"""Speculative decoding in the scheduler (`--speculative-algorithm NGRAM`): which running
requests draft this step and how much, and what a verify step did for each.

A decode step gives each request with a draft its last token and the drafted ones (one
forward over all of them, KV written for each); the runner samples the rows and accepts
draft tokens while they are what the request samples, so the output is exactly the one
without speculation. Rows whose sampling does not follow the tokens accepted before them
(no penalty, seed, grammar or processor) are sampled all at once, one read back from the
device (step_results `_sample_with_drafts`); the others depth by depth (`_verify_drafts`).
The KV of the rejected tokens stays in pages the request already had reserved (a draft
never goes past what admission promised it) and is overwritten as the request goes on;
`num_computed` counts only verified tokens, so neither the prefix cache nor a later step
ever reads a rejected token's KV.

A request with a grammar drafts when its grammar can roll back: its draft is cut at the
first token the grammar forbids (`grammar_allowed`), and the verifier advances the grammar
through each accepted token before it samples the next row, then steps it back for the
scheduler to accept them as usual. Requests that do not draft: those with a grammar that
cannot roll back, a logit processor, hidden states or a min_new_tokens still to reach
(their sampling depends on state the row-by-row verifier does not advance), and those whose
drafts have been failing (`DraftPace` backs off). A step
verifies at most `budget` drafted tokens in all, so long drafts never make one step much
larger than a prefill chunk.

With overlap scheduling (a GPU), a step the drafter left without drafts may fly, and
undrafted steps go ahead of it before the drafter looks again: 2, doubling each time it
finds nothing again, up to `STEPS_AHEAD`; a step with drafts starts the count over.
Stretches where nothing is worth verifying (ordinary chat, a busy batch) keep most of the
overlap's speed, and a request that starts copying is drafted for within a few steps.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from cadence.model_executor.runner import ItemResult
from cadence.scheduler.ngram import DraftPace, NgramConfig, NgramDrafter
from cadence.scheduler.req import Req
from cadence.server_args import ServerArgs

RECENT_VERIFIES = 1024  # request-steps the load report's gauges are over
EXPLORE_STEPS = 8  # verify steps timed before a plain step may be preferred to verifying
EXPLORE_EVERY = 32  # plain steps in a row (with drafts found) before one verifies anyway
# Overlap scheduling: the most decode steps that go ahead (undrafted: the tokens before are
# not on the host yet) after a step without drafts, before the drafter looks again. The run
# starts at one and doubles each time the drafter finds nothing again.
STEPS_AHEAD = 8
COST_SAMPLES = 128  # recent steps of each kind the step-cost lines are fit over
YIELD_WEIGHT = 0.1  # weight of the latest step in the running tokens/s of its kind and size
# Until steps of different sizes are timed: an extra token costs this share of a step.
DEFAULT_TOKEN_COST = 0.25


def _line(samples: deque[tuple[int, float]]) -> tuple[float, float] | None:
    """(a, m) of seconds = a + m * tokens over `samples`; None until two sizes were seen."""
    if len({n for n, _ in samples}) < 2:
        return None
    k = len(samples)  # least squares in closed form (a few times faster than np.polyfit here)
    n_mean = sum(n for n, _ in samples) / k
    t_mean = sum(t for _, t in samples) / k
    snn = sum((n - n_mean) ** 2 for n, _ in samples)
    snt = sum((n - n_mean) * (t - t_mean) for n, t in samples)
    m = snt / snn
    a = t_mean - m * n_mean
    m = max(m, 1e-6)
    return max(a, m), m


class StepCost:
    """Seconds of a plain decode step and of a verify step, each as a + m * tokens, fit over
    recent steps of its kind: what one more draft token costs here (a few percent of a step
    where weights are read once for all rows, a large share where compute bounds it), and
    what verifying at all costs over a plain step (the verify path may be slower per step)."""

    def __init__(self) -> None:
        self.plain: deque[tuple[int, float]] = deque(maxlen=COST_SAMPLES)
        self.verify: deque[tuple[int, float]] = deque(maxlen=COST_SAMPLES)
        self._lines: dict[str, tuple[float, float] | None] = {}  # fits since the last step
        self.plain_streak = 0  # plain steps since the last verify step
        self._last_verify: tuple[int, float] | None = None  # not recorded yet (see observe)
        # Tokens per second the steps of each kind gave, by batch size (running averages).
        self.yields: dict[bool, dict[int, float]] = {False: {}, True: {}}

    def observe(
        self, tokens: int, seconds: float, verified: bool, batch: int = 0, emitted: int = 0
    ) -> None:
        """A decode step's size and time (and, for `verify_pays`, its batch and the tokens it
        gave). A plain step right after a verify step pays for it (a backend that restarts
        its decode state): what it takes beyond a plain step is counted to the verify step,
        and it is not a plain sample itself."""
        self._lines.clear()
        if batch and emitted and seconds > 0:
            rates = self.yields[verified]
            rate, old = emitted / seconds, rates.get(batch)
            rates[batch] = rate if old is None else old + YIELD_WEIGHT * (rate - old)
        last, self._last_verify = self._last_verify, None
        if verified:
            if last is not None:
                self.verify.append(last)
            self._last_verify = (tokens, seconds)
            self.plain_streak = 0
            return
        self.plain_streak += 1
        if last is None:
            self.plain.append((tokens, seconds))
            return
        extra = max(0.0, seconds - self.plain_seconds(tokens)) if self.plain else 0.0
        self.verify.append((last[0], last[1] + extra))

    @property
    def exploring(self) -> bool:
        """Verify whatever the estimates say: too few verify steps timed yet, or none for a
        while (the batch, the context and so the costs have moved since)."""
        return len(self.verify) < EXPLORE_STEPS or self.plain_streak >= EXPLORE_EVERY

    def verify_pays(self, batch: int) -> bool:
        """False once verify steps of this batch size have given fewer tokens per second
        than plain ones: the estimates behind a verify (the acceptance, the line of its
        cost) are then wrong here, and what was measured wins."""
        verify, plain = self.yields[True].get(batch), self.yields[False].get(batch)
        return verify is None or plain is None or verify > plain

    def _fit(self, kind: str) -> tuple[float, float] | None:
        """`_line` of the plain or verify samples, fit once per step."""
        if kind not in self._lines:
            self._lines[kind] = _line(self.plain if kind == "plain" else self.verify)
        return self._lines[kind]

    def plain_seconds(self, tokens: int) -> float:
        line = self._fit("plain")
        if line is not None:
            return line[0] + line[1] * tokens
        if self.plain:
            return sum(t for _, t in self.plain) / len(self.plain)
        return 1.0 + DEFAULT_TOKEN_COST * tokens  # in units of a step: only ratios matter

    def verify_line(self, batch: int) -> tuple[float, float]:
        """(a, m) of a verify step; until measured, a plain step's with the default cost of
        an extra token."""
        line = self._fit("verify")
        if line is not None:
            return line
        base = self.plain_seconds(batch)
        m = DEFAULT_TOKEN_COST * base / max(batch, 1)
        return base - m * batch, m


@dataclass
class SpecStats:
    """Verify counters since start and over the last RECENT_VERIFIES request-steps (with
    their running sums, read on every drafting step), for the allocator's prior and the
    load report (/metrics gauges, /server_info, gRPC GetLoads)."""

    verify_steps: int = 0  # request-steps that verified a draft, since start
    accepted: int = 0  # draft tokens accepted, since start
    recent: deque[tuple[int, int]] = field(
        default_factory=lambda: deque(maxlen=RECENT_VERIFIES)
    )  # (proposed, accepted) per request-step
    recent_proposed: int = 0
    recent_accepted: int = 0

    @property
    def prior(self) -> float:
        """The chance a draft token is accepted, over recent verify steps (0.6 before any):
        what a request's own record starts from."""
        if not self.recent_proposed:
            return 0.6
        return self.recent_accepted / self.recent_proposed

    def add(self, proposed: int, accepted: int) -> None:
        self.verify_steps += 1
        self.accepted += accepted
        if len(self.recent) == self.recent.maxlen:
            gone_proposed, gone_accepted = self.recent[0]
            self.recent_proposed -= gone_proposed
            self.recent_accepted -= gone_accepted
        self.recent.append((proposed, accepted))
        self.recent_proposed += proposed
        self.recent_accepted += accepted


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
        self.budget = max(args.prefill_token_budget(context_len), self.config.max_draft)
        self.stats = SpecStats()
        self.cost = StepCost()
        self.steps_ahead = 0  # since the drafter last looked
        self.ahead_limit = 1  # steps that may go ahead before it looks again

    def looked(self, drafted: bool) -> None:
        """The drafter looked at a step: found drafts worth verifying (the step runs now), or
        none (the step may fly, and the run of steps ahead of it doubles, up to STEPS_AHEAD)."""
        self.steps_ahead = 0
        self.ahead_limit = 1 if drafted else min(STEPS_AHEAD, 2 * self.ahead_limit)

    def may_step_ahead(self) -> bool:
        """Whether one more decode step may go ahead of the one in flight: a few, while the
        drafter finds nothing worth verifying, then a step that drafts again."""
        self.steps_ahead += 1
        return self.steps_ahead <= self.ahead_limit

    def drafts(self, reqs: list[Req], suppressed) -> list[list[int]]:
        """This step's draft of each request (mostly []): each drafts what matches, then
        `_allocate` keeps the draft tokens worth verifying."""
        found: list[list[int]] = []
        for req in reqs:
            draft: list[int] = []
            if self._may_draft(req, suppressed):
                pace = req.spec_pace
                if pace is None:
                    pace = req.spec_pace = DraftPace(self.config.max_draft)
                room = req.total_tokens_needed(self.context_len) - req.seq_len
                if pace.drafting():
                    draft = self.drafter.draft(req.fill_ids, min(pace.length, room))
                    if draft and req.grammar is not None:
                        draft = grammar_allowed(req.grammar, draft)
                elif not pace.shadow:  # backing off: look anyway, and follow what it finds
                    pace.follow(self.drafter.draft(req.fill_ids, min(pace.length, room)))
            found.append(draft)
        if not any(found):
            return found
        keep = self._allocate(reqs, found)
        for i, draft in enumerate(found):
            if draft and i not in keep:
                reqs[i].spec_pace.follow(draft)
        return [draft[: keep.get(i, 0)] for i, draft in enumerate(found)]

    @staticmethod
    def sampled(req: Req, token: int) -> None:
        """`req` sampled `token` in a step without a draft of its own."""
        if req.spec_pace is not None:
            req.spec_pace.sampled(token)

    def _allocate(self, reqs: list[Req], found: list[list[int]]) -> dict[int, int]:
        """How many of its draft tokens each request verifies. A verify step's time is
        a + m per token (`StepCost`); the j-th draft token of a request whose tokens are
        accepted with probability p adds p^j expected tokens for m more seconds. Tokens are
        taken best first while they raise the step's expected tokens per second, within the
        budget; then the step verifies only if that beats a plain decode step. So long drafts
        on a busy batch (where extra tokens cost the most) are cut to their likely part, and
        drafts too unlikely to pay for the verify are dropped."""
        batch = len(reqs)
        a, m = self.cost.verify_line(batch)
        prior = self.stats.prior
        tokens, seconds = float(batch), a + m * batch
        heap = []
        for i, draft in enumerate(found):
            if draft:
                p = reqs[i].spec_pace.accept_prob(prior)
                heap.append((-p, i, 1, p))
        heapq.heapify(heap)
        likeliest = heap[0][1] if heap else None
        keep: dict[int, int] = {}
        budget = self.budget
        while heap and budget > 0:
            negative, i, depth, p = heapq.heappop(heap)
            gain = -negative
            if gain * seconds <= m * tokens:  # no better than the step as it stands
                break
            keep[i], tokens, seconds, budget = depth, tokens + gain, seconds + m, budget - 1
            if depth < len(found[i]):
                heapq.heappush(heap, (-gain * p, i, depth + 1, p))
        if self.cost.exploring:
            if not keep and likeliest is not None:
                # Verify the likeliest draft whatever the estimates say: where they keep
                # nothing, no verify step would ever come to correct them.
                keep = {likeliest: min(len(found[likeliest]), self.budget)}
            return keep
        plain_rate = batch / self.cost.plain_seconds(batch)
        if tokens / seconds <= plain_rate or not self.cost.verify_pays(batch):
            return {}
        return keep

    @staticmethod
    def _may_draft(req: Req, suppressed) -> bool:
        return (
            (req.grammar is None or req.grammar.supports_rollback)
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
        proposed, accepted = stats.recent_proposed, stats.recent_accepted
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


def grammar_allowed(grammar, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` that `grammar` allows from where it is (a forbidden
    token ends the draft; so does the grammar's end); the grammar is left where it was."""
    taken = 0
    for token in draft:
        if grammar.is_terminated() or not grammar.accept(token):
            break
        taken += 1
    grammar.rollback(taken)
    return draft[:taken]
