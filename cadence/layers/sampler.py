"""Turns a batch of logits into next tokens: penalties, bias, masks, then greedy or sampling.

Everything here is vectorized over the batch; per-request work is limited to building
small index tensors. Rows whose parameters are all defaults take the argmax fast path.

Constrained rows (a request with a grammar) get their grammar's token mask, filled per step
for those rows only and applied after every other adjustment, so nothing re-enables a token
the grammar forbids; the sampler only reads a grammar (the scheduler advances it).

Numerical safety: every parameter the edge accepts keeps the math finite. Penalties and
biases can push a logit past float32's range (a repetition penalty of 0 divides by zero,
a bias of 1e300 is +inf in float32), so adjusted logits are clamped to +-LOGIT_LIMIT
(-inf stays: it is how tokens are masked). A temperature is applied in float32 no larger
than MAX_TEMPERATURE, and top-p/min-p always keep the most likely token, so every sampled
row is a distribution with at least one token of positive probability. The caller's
logits are never changed: adjustments work on a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cadence.io_struct import SamplingParams
from cadence.plugins import logit_processors

if TYPE_CHECKING:
    from cadence.constrained.base import Grammar


@dataclass
class SamplingInput:
    """One row of the batch as the sampler sees it."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None  # set when the request carries a seed
    suppress_ids: (
        list[int] | None
    )  # token ids masked this step (EOS/stop ids before min_new_tokens)
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_logprob: bool = False
    logit_processor: str | None = None  # a plugin's processor (cadence.plugins.logit_processors)
    grammar: Grammar | None = None  # the request's constraint, at its current position


@dataclass
class SampleOutput:
    next_ids: list[int]
    logprobs: list[float] | None  # chosen token log-probability per row
    top_logprobs: list[list[tuple[float, int]]] | None  # per row, [(logprob, token id)] best first
    token_ids_logprobs: list[list[tuple[float, int]]] | None  # per row, the requested ids


ARGMAX_BLOCK = 64
# Adjusted logits are clamped here: divided by the smallest sampling temperature (1e-6)
# they stay far below float32's maximum (3.4e38).
LOGIT_LIMIT = 1e30
# Hotter than this is the uniform distribution over the unmasked tokens to float32
# precision; larger values (up to 1e308 as JSON allows) would be +inf in float32.
MAX_TEMPERATURE = 1e30
# Reported logprobs of tokens that a mask ruled out (-inf) become this, as OpenAI reports
# impossible tokens: JSON has no -inf, and typed clients want a number.
LOGPROB_FLOOR = -9999.0


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [rows, vocab] logits, exactly as `torch.argmax` answers (the first of
    equal maxima; NaN counts as the maximum), through a vectorized max over blocks of 64: torch's
    CPU argmax kernel is scalar, ~5x slower at a 49k vocabulary."""
    rows, vocab = logits.shape
    width = vocab - vocab % ARGMAX_BLOCK
    if width == 0:
        return logits.argmax(-1)
    blocks = logits[:, :width].view(rows, -1, ARGMAX_BLOCK)
    best = blocks.amax(-1).argmax(-1)  # the first block holding the row's maximum
    ids = best * ARGMAX_BLOCK + blocks[torch.arange(rows, device=logits.device), best].argmax(-1)
    if width < vocab:  # the last, partial block
        tail_val, tail_id = logits[:, width:].max(-1)
        head_val = logits.gather(1, ids.unsqueeze(1)).squeeze(1)
        later = (tail_val > head_val) | (tail_val.isnan() & ~head_val.isnan())
        ids = torch.where(later, tail_id + width, ids)
    return ids


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingInput]) -> None:
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.frequency_penalty or p.presence_penalty:
            if r.output_ids:
                counts = torch.bincount(
                    torch.tensor(r.output_ids, device=logits.device), minlength=vocab
                )[:vocab].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                    logits.dtype
                )
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(r.prompt_ids) | set(r.output_ids)),
                dtype=torch.int64,
                device=logits.device,
            )
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )


def _apply_bias_and_masks(logits: torch.Tensor, rows: list[SamplingInput]) -> None:
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids = torch.tensor(
                list(r.params.logit_bias.keys()), dtype=torch.int64, device=logits.device
            )
            bias = torch.tensor(list(r.params.logit_bias.values()), dtype=torch.float64)
            logits[i, ids] += bias.clamp(-LOGIT_LIMIT, LOGIT_LIMIT).to(logits.device, logits.dtype)
        if r.suppress_ids and r.grammar is None:  # with a grammar: see _apply_grammars
            logits[i, r.suppress_ids] = float("-inf")


def follows_output(r: SamplingInput) -> bool:
    """Whether the row's logits are adjusted by what the request has output so far:
    penalties (they count it), a mask of this step (it ends at a count), a logit processor
    or a grammar (they follow it)."""
    p = r.params
    return bool(
        p.frequency_penalty
        or p.presence_penalty
        or p.repetition_penalty != 1.0
        or r.suppress_ids
        or r.logit_processor
        or r.grammar is not None
    )


def _needs_adjusting(r: SamplingInput) -> bool:
    return bool(r.params.logit_bias) or follows_output(r)


def adjust_logits(logits: torch.Tensor, rows: list[SamplingInput]) -> torch.Tensor:
    """Penalties, bias and masks applied to a copy of `logits`, clamped to +-LOGIT_LIMIT
    (NaN, which only an overflowing penalty can make, counts as masked)."""
    logits = logits.clone()
    _apply_penalties(logits, rows)
    _apply_bias_and_masks(logits, rows)
    _apply_processors(logits, rows)
    _apply_grammars(logits, rows)
    return torch.nan_to_num_(
        logits, nan=float("-inf"), posinf=LOGIT_LIMIT, neginf=float("-inf")
    ).clamp_(max=LOGIT_LIMIT)


def _apply_processors(logits: torch.Tensor, rows: list[SamplingInput]) -> None:
    """Each named processor, once, on the rows that named it (see cadence.plugins.logit_processors)."""
    for name in {r.logit_processor for r in rows if r.logit_processor}:
        index = [i for i, r in enumerate(rows) if r.logit_processor == name]
        sub = logits[index]
        out = logit_processors.load(name)(sub, [rows[i].params.custom_params for i in index])
        logits[index] = sub if out is None else out.to(logits.dtype)


def grammar_masks(rows: list[SamplingInput], index: list[int], vocab: int) -> torch.Tensor:
    """The allowed tokens of rows `index` as booleans [len(index), vocab]: each row's grammar
    fills its row of one int32 bitmask (cadence.constrained.base's layout), unpacked at once."""
    words = (vocab + 31) // 32
    bitmask = torch.full((len(index), words), -1, dtype=torch.int32)
    for j, i in enumerate(index):
        rows[i].grammar.fill_mask(bitmask, j)
    # Little-endian words: byte k of a row holds tokens 8k..8k+7, least significant bit first.
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)[:, :vocab]


def _apply_grammars(logits: torch.Tensor, rows: list[SamplingInput]) -> None:
    """Masks the tokens each constrained row's grammar forbids. Suppressed ids (EOS before
    min_new_tokens) are masked too, unless that would leave the row no token at all: the
    grammar wins, since nothing else can follow."""
    index = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not index:
        return
    allowed = grammar_masks(rows, index, logits.shape[1]).to(logits.device, non_blocking=True)
    if len(index) == len(rows):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
    for i in index:
        suppress = rows[i].suppress_ids
        if suppress:
            kept = logits[i, suppress].clone()
            logits[i, suppress] = float("-inf")
            if not torch.isfinite(logits[i]).any():
                logits[i, suppress] = kept


# Entries first looked at by top-k/top-p/min-p filtering, from each row's most likely on.
FILTER_FIRST_CANDIDATES = 256


def _filter_probs(
    probs: torch.Tensor, rows: list[SamplingInput]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Applies top-k, top-p and min-p. Returns (probs, index) — the kept candidates of each row
    from its most likely on, and their vocabulary ids — or (probs, None) when nothing filters.

    Only the first candidates are ranked (`topk`): 256, four times more while some row's
    filters could still keep an entry past them. Sorting the whole vocabulary cost ~2 ms per
    row of 49,152 (70 ms for a batch of 32); a nucleus is nearly always far smaller."""
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if all(k < 1 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0 for m in min_p):
        return probs, None
    vocab = probs.shape[1]
    dev = probs.device
    k = torch.tensor([kk if kk >= 1 else vocab for kk in top_k], device=dev).unsqueeze(1)
    p = torch.tensor(top_p, dtype=probs.dtype, device=dev).unsqueeze(1)
    m = torch.tensor(min_p, dtype=probs.dtype, device=dev).unsqueeze(1)
    n = min(vocab, max(FILTER_FIRST_CANDIDATES, *(kk for kk in top_k if kk >= 1), 1))
    while True:
        sorted_probs, idx = probs.topk(n, dim=-1)  # each row's n most likely, in order
        if n == vocab:
            break
        # An entry past the first n is dropped by top-k (k <= n), by top-p (the first n
        # already reach p) or by min-p (the n-th is already below it, and later ones are not larger).
        last = sorted_probs[:, -1:]
        done = (
            (k <= n) | (sorted_probs.sum(-1, keepdim=True) >= p) | (last < m * sorted_probs[:, :1])
        )
        if bool(done.all()):
            break
        n = min(vocab, 4 * n)
    ranks = torch.arange(n, device=dev).unsqueeze(0)
    drop = ranks >= k
    cum_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= cum_before >= p
    drop |= sorted_probs < m * sorted_probs[:, :1]
    # The best token always stays (a top_p that rounds to 0 in float32 would drop it too).
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return sorted_probs / sorted_probs.sum(-1, keepdim=True), idx


def skip_draws(generator: torch.Generator, num_tokens: int) -> None:
    """Advances a seeded request's generator past `num_tokens` sampled tokens (one uniform
    number each, as `_sample` draws them): a decode server continues the stream where the
    prefill server, which sampled the first token, left it."""
    torch.rand(num_tokens, dtype=torch.float64, generator=generator)


def _sample(probs: torch.Tensor, rows: list[SamplingInput]) -> torch.Tensor:
    """One token per row, drawn with its row's probabilities (which need not sum to 1).

    By the inverse of each row's cumulative distribution, from one uniform number per row
    (the row's own generator for a seeded request): `torch.multinomial` and the exponential
    race draw a random number per vocabulary entry, ~0.8 ms per row of 49,152 on this
    project's CPUs (25 ms for a batch of 32), against ~40 us here. The sums run in float64,
    so a token's chance is its probability to ~1e-12, and a token of probability 0 is never
    drawn (its interval is empty)."""
    cdf = probs.double().cumsum_(dim=-1)
    u = torch.empty(probs.shape[0], 1, dtype=torch.float64)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        u.uniform_()
    else:
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64)
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=r.generator)
    u = u.to(cdf.device, non_blocking=True)  # drawn on the host: a seed's stream is the host's
    total = cdf[:, -1:]
    # u in [0, total) (the product may round up to total): the first entry whose cumulative
    # sum exceeds u is then always one of positive probability.
    u = torch.minimum(u.mul_(total), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def _logprob_info(logits: torch.Tensor, next_ids: torch.Tensor, rows: list[SamplingInput]):
    wanted = [i for i, r in enumerate(rows) if r.return_logprob]
    if not wanted:
        return None, None, None
    logprobs = torch.log_softmax(logits[wanted], dim=-1).clamp_(min=LOGPROB_FLOOR)
    chosen = [0.0] * len(rows)
    tops: list[list[tuple[float, int]]] = [[] for _ in rows]
    given: list[list[tuple[float, int]]] = [[] for _ in rows]
    for j, i in enumerate(wanted):
        r = rows[i]
        chosen[i] = float(logprobs[j, next_ids[i]])
        if r.top_logprobs_num > 0:
            vals, ids = logprobs[j].topk(r.top_logprobs_num)
            tops[i] = list(zip(vals.tolist(), ids.tolist()))
        if r.token_ids_logprob:
            given[i] = list(zip(logprobs[j, r.token_ids_logprob].tolist(), r.token_ids_logprob))
    return chosen, tops, given


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingInput]) -> SampleOutput:
    """logits: [batch, vocab] float32, left unchanged. Log-probabilities are reported from the
    distribution after penalties, bias and masks but before temperature and filtering.

    Runs in inference mode: the forward pass hands over inference tensors, which refuse
    in-place updates (bias, masks, penalties) outside it."""
    if any(_needs_adjusting(r) for r in rows):
        logits = adjust_logits(logits, rows)
    next_ids = argmax(logits)
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if sampled:
        sub_rows = [rows[i] for i in sampled]
        temps = torch.tensor(
            [min(r.params.temperature, MAX_TEMPERATURE) for r in sub_rows],
            dtype=logits.dtype,
            device=logits.device,
        ).unsqueeze(1)
        probs = torch.softmax(logits[sampled] / temps, dim=-1)
        probs, sort_idx = _filter_probs(probs, sub_rows)
        picked = _sample(probs, sub_rows)
        if sort_idx is not None:
            picked = sort_idx.gather(1, picked.unsqueeze(1)).squeeze(1)
        next_ids[sampled] = picked
    chosen, tops, given = _logprob_info(logits, next_ids, rows)
    return SampleOutput(next_ids.tolist(), chosen, tops, given)


def samples_on_device(row: SamplingInput) -> bool:
    """Whether `sample_on_device` takes this row: greedy or plain temperature sampling, drawn
    from the device's own random numbers; nothing read back to the host on the way (no
    adjustment, no filter, no logprobs, no seed, whose stream is the host generator's)."""
    p = row.params
    return not (
        _needs_adjusting(row)
        or row.return_logprob
        or row.generator is not None
        or p.top_k >= 1
        or p.top_p < 1.0
        or p.min_p > 0
    )


@torch.inference_mode()
def sample_on_device(logits: torch.Tensor, rows: list[SamplingInput]) -> torch.Tensor:
    """The next token of each row, as a tensor on the logits' device, queued without waiting
    for it: every row must pass `samples_on_device`. Greedy rows take the argmax (as
    `sample`); sampled rows invert their distribution's cumulative sums at a uniform number
    drawn on the device, as `sample` does at one drawn on the host. Whatever the host adds
    travels in one asynchronous copy (a blocking one would wait for the steps queued before)."""
    next_ids = argmax(logits)
    if all(r.params.is_greedy for r in rows):
        return next_ids
    # Every row is drawn (a greedy row at temperature 1, then overwritten): no row indexing.
    temps = [
        1.0 if r.params.is_greedy else min(r.params.temperature, MAX_TEMPERATURE) for r in rows
    ]
    greedy = [float(r.params.is_greedy) for r in rows]
    host = torch.tensor([temps, greedy], dtype=logits.dtype)
    if logits.device.type != "cpu":
        host = host.pin_memory()
    temps_t, greedy_t = host.to(logits.device, non_blocking=True)
    probs = torch.softmax(logits / temps_t.unsqueeze(1), dim=-1)
    cdf = probs.double().cumsum_(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(len(rows), 1, dtype=torch.float64, device=logits.device).mul_(total)
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return torch.where(greedy_t.bool(), next_ids, drawn)
