"""A step's logits to its results: prompt logprobs, sampled tokens, and the draft tokens a
verify step accepts (speculative decoding), exactly as steps without drafts would sample."""

from __future__ import annotations

import dataclasses

import torch

from cadence.layers.sampler import SamplingInput, follows_output, sample
from cadence.model_executor.runner import BatchItem, ItemResult


def results_of(items: list[BatchItem], logits: torch.Tensor | None) -> list[ItemResult]:
    """Each item's result of a step from its logits rows (item by item: its prompt logprob
    rows, then its sampling row and one row per draft token): prompt logprobs, the sampled
    token, and the accepted draft tokens with the token after them (`ItemResult.more`)."""
    results = [ItemResult() for _ in items]
    offset = 0
    sampled, rows = [], []
    drafted: list[tuple[int, int]] = []  # (item, its first sampling row) with drafts
    for i, item in enumerate(items):
        num_rows = len(item.logprob_rows)
        if num_rows:
            try:
                _input_logprobs(results[i], item, logits[offset : offset + num_rows])
            except Exception as e:
                results[i].error, results[i].error_stage = e, "computing its prompt logprobs"
        offset += num_rows
        if item.sampling is not None:
            if results[i].error is None:
                sampled.append(i)
                rows.append(offset)
                if item.num_draft:
                    drafted.append((i, offset))
            offset += 1 + item.num_draft
    if drafted and all(_stands_alone(items[i].sampling) for i, _ in drafted):
        _sample_with_drafts(results, items, sampled, rows, logits)
        return results
    if sampled:
        _sample_into(
            results,
            sampled,
            [items[i].sampling for i in sampled],
            logits if rows == list(range(len(logits))) else logits[rows],
        )
    if drafted:
        _verify_drafts(results, items, drafted, logits)
    return results


def _sample_into(
    results: list[ItemResult], indices: list[int], inputs: list[SamplingInput], logits: torch.Tensor
) -> None:
    """Samples row j of `logits` for result indices[j]. When the batch fails, each row is
    sampled alone, so only the rows that fail by themselves fail."""
    try:
        outs = [(sample(logits, inputs), indices)]
    except Exception:
        outs = []
        for j, (i, row) in enumerate(zip(indices, inputs)):
            try:
                outs.append((sample(logits[j : j + 1], [row]), [i]))
            except Exception as e:
                results[i].error, results[i].error_stage = e, "sampling its next token"
    for out, where in outs:
        for j, i in enumerate(where):
            r = results[i]
            r.next_id = out.next_ids[j]
            if out.logprobs is not None:
                r.logprob = out.logprobs[j]
                r.top_logprobs = out.top_logprobs[j]
                r.token_ids_logprobs = out.token_ids_logprobs[j]


def _stands_alone(row: SamplingInput) -> bool:
    """Whether a row samples the same whatever tokens the step accepted before it: nothing
    adjusts its logits by the output (`follows_output`), and no seed (its stream is drawn
    token by token)."""
    return not follows_output(row) and row.generator is None


def _sample_with_drafts(
    results: list[ItemResult],
    items: list[BatchItem],
    sampled: list[int],
    rows: list[int],
    logits: torch.Tensor,
) -> None:
    """`_verify_drafts` in one sampling call, for drafts whose rows stand alone: every row
    of every item is sampled at once (one read back from the device, not one per depth),
    then each item keeps its sampled tokens while the one before equals its draft token:
    what sampling depth by depth would keep, and what a step without drafts would sample."""
    indices, inputs, picked, extra = [], [], [], []
    for i, row in zip(sampled, rows):
        item = items[i]
        indices.append(i)
        picked.append(row)
        for d in range(item.num_draft):
            indices.append(len(results) + len(extra))
            extra.append(ItemResult())
            picked.append(row + 1 + d)
        inputs.extend([item.sampling] * (1 + item.num_draft))
    targets = results + extra
    _sample_into(
        targets, indices, inputs, logits if picked == list(range(len(logits))) else logits[picked]
    )
    more = iter(extra)
    for i in sampled:
        item, result = items[i], results[i]
        going = result.error is None
        for d in range(item.num_draft):
            row = next(more)
            going = going and row.error is None and _last(result).next_id == item.token_ids[1 + d]
            if going:
                result.more.append(row)


def _verify_drafts(
    results: list[ItemResult],
    items: list[BatchItem],
    drafted: list[tuple[int, int]],
    logits: torch.Tensor,
) -> None:
    """Accepts each item's draft tokens while they are what it samples: where the token
    sampled at row j equals draft token j, row j + 1 (computed after that token) is sampled
    next, with the accepted tokens as part of the output (penalties, a seed's stream), as a
    step without drafts would have sampled it; the first token that differs (or the token
    after the last draft) ends the item's step. What each request outputs is therefore
    exactly what it would without speculation; drafts only decide how many tokens a step
    gives. Rows of all items at the same depth are sampled together."""
    advanced: dict[int, int] = {}  # item -> tokens its grammar accepted here (undone at the end)
    try:
        _verify_rows(results, items, drafted, logits, advanced)
    finally:
        for i, n in advanced.items():
            items[i].sampling.grammar.rollback(n)


def _verify_rows(results, items, drafted, logits, advanced: dict[int, int]) -> None:
    """`_verify_drafts`' rows, depth by depth. A request with a grammar samples row j + 1 with
    its grammar advanced through the accepted draft tokens before it (`advanced` counts them)."""
    depth = 0
    active = drafted
    while active:
        going = [
            (i, row)
            for i, row in active
            if _last(results[i]).next_id == items[i].token_ids[1 + depth]
            and _advance(items[i], items[i].token_ids[1 + depth], advanced, i)
        ]
        if not going:
            return
        depth += 1
        inputs = []
        for i, _ in going:
            base = items[i].sampling
            taken = [results[i].next_id, *(m.next_id for m in results[i].more)]
            inputs.append(dataclasses.replace(base, output_ids=[*base.output_ids, *taken]))
        found = [ItemResult() for _ in going]
        _sample_into(found, list(range(len(going))), inputs, logits[[r + depth for _, r in going]])
        active = []
        for (i, row), result in zip(going, found):
            if result.error is not None:
                continue  # the tokens before stand; the next step samples this one again
            results[i].more.append(result)
            if depth < items[i].num_draft:
                active.append((i, row))


def _advance(item: BatchItem, token: int, advanced: dict[int, int], i: int) -> bool:
    """Moves the item's grammar (if any) past accepted draft token `token`; False when the
    grammar refuses it (the draft stops there)."""
    grammar = item.sampling.grammar
    if grammar is None:
        return True
    if grammar.is_terminated() or not grammar.accept(token):
        return False
    advanced[i] = advanced.get(i, 0) + 1
    return True


def _last(result: ItemResult) -> ItemResult:
    return result.more[-1] if result.more else result


def _input_logprobs(result: ItemResult, item: BatchItem, logits: torch.Tensor) -> None:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(item.logprob_targets, device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    result.input_logprobs = list(zip(chosen, item.logprob_targets))
    ids = item.token_ids_logprob
    for row in logprobs:
        top = row.topk(item.top_logprobs_num) if item.top_logprobs_num else None
        result.input_top.append(list(zip(top.values.tolist(), top.indices.tolist())) if top else [])
        result.input_given.append(list(zip(row[ids].tolist(), ids)) if ids else [])
