"""A request's share of a forward step, as the runner takes it: the tokens it computes, the
KV pages they go into (grown from its reservation now), what it samples with."""

from __future__ import annotations

from collections.abc import Callable

from cadence.layers.sampler import SamplingInput, samples_on_device
from cadence.mem_cache.kv_manager import KVManager
from cadence.model_executor.runner import BatchItem, ScheduleBatch
from cadence.scheduler.req import Req


def extend_item(kv: KVManager, req: Req, n: int, new_pages: list[int]) -> BatchItem:
    """The next `n` tokens of `req`'s prompt (or, retracted, of its prompt and output); the
    pages it takes for them are added to `new_pages`."""
    start = req.num_computed
    new_pages.extend(kv.grow(req.admitted_kv, start + n))
    item = BatchItem(
        req.rid,
        req.uid,
        req.fill_ids[start : start + n],
        start,
        req.pages,
        top_logprobs_num=req.top_logprobs_num,
        token_ids_logprob=req.token_ids_logprob,
        return_hidden_states=req.return_hidden_states,
        lora=_weights(req),
    )
    if req.wants_input_logprobs:
        # Rows whose logits give the logprob of the following prompt token.
        first = max(req.logprob_start_len, 1) - 1
        last = min(start + n - 1, len(req.input_ids) - 2)
        item.logprob_rows = [p - start for p in range(max(start, first), last + 1)]
        item.logprob_targets = req.input_ids[max(start, first) + 1 : last + 2]
    return item


def decode_item(
    kv: KVManager, req: Req, new_pages: list[int], draft: list[int] | None = None
) -> BatchItem:
    """`req`'s newest token, whose K/V this step computes before sampling the next one, and
    the tokens drafted after it (speculative decoding: their K/V too, to be verified)."""
    draft = draft or []
    new_pages.extend(kv.grow(req.admitted_kv, req.seq_len + len(draft)))
    return BatchItem(
        req.rid,
        req.uid,
        [req.output_ids[-1], *draft],
        req.seq_len - 1,
        req.pages,
        return_hidden_states=req.return_hidden_states,
        num_draft=len(draft),
        lora=_weights(req),
    )


def ahead_batch(
    kv: KVManager, reqs: list[Req], context_len: int
) -> tuple[ScheduleBatch, list[Req]] | None:
    """Overlap scheduling: the decode step after the one in flight, built before that one's
    tokens are known. `reqs` are the in-flight step's requests, row by row; each that goes
    on decodes the token that step samples for it (`BatchItem.future_row`) at position
    seq_len (that token is not in its output yet). A request that the token in flight ends
    by length is left out; one that it ends otherwise (EOS, a stop string) runs one wasted
    row, whose result the scheduler drops. None when some request cannot be decoded ahead:
    its sampling reads the host (`samples_on_device`), depends on the previous token
    (min_new_tokens' suppressed ids, a grammar), or it reports hidden states."""
    rows = []
    for row, req in enumerate(reqs):
        if req.is_finished:
            continue
        p = req.params
        num_out = len(req.output_ids) + 1  # with the token in flight
        if num_out >= p.max_new_tokens or req.seq_len + 1 >= context_len:
            continue  # the token in flight is its last
        if num_out < p.min_new_tokens or req.return_hidden_states or req.grammar is not None:
            return None
        sampling = sampling_input(req, None)
        if not samples_on_device(sampling):
            return None
        rows.append((row, req, sampling))
    if not rows:
        return None
    new_pages: list[int] = []
    items = []
    for row, req, sampling in rows:
        new_pages.extend(kv.grow(req.admitted_kv, req.seq_len + 1))
        item = BatchItem(
            req.rid, req.uid, [0], req.seq_len, req.pages, future_row=row, lora=_weights(req)
        )
        item.sampling = sampling
        items.append(item)
    batch = ScheduleBatch(is_decode=True, items=items, new_pages=new_pages)
    return batch, [req for _, req, _ in rows]


def _weights(req: Req):
    """The LoRA weights `req` runs with; None for the base model."""
    return None if req.lora is None else req.lora.weights


def prepare_sampling(
    batch: ScheduleBatch,
    reqs: list[Req],
    suppressed_ids: Callable[[Req], list[int] | None],
) -> list[tuple[Req, Exception]]:
    """The sampling input of every item that samples this step: a decode, or the last chunk
    of a prefill (unless the request wants no new token at all). A request whose input
    cannot be built leaves `batch` and `reqs`; returns those, each with its error."""
    failed = []
    for i in reversed(range(len(reqs))):
        item, req = batch.items[i], reqs[i]
        done = item.start + len(item.token_ids) == len(req.fill_ids)
        if not (batch.is_decode or done) or req.params.max_new_tokens == 0:
            continue
        try:
            item.sampling = sampling_input(req, suppressed_ids(req))
        except Exception as e:
            failed.append((req, e))
            del batch.items[i], reqs[i]
    return failed


def sampling_input(req: Req, suppressed_ids: list[int] | None) -> SamplingInput:
    """How `req` samples its next token (`suppressed_ids`: masked under min_new_tokens)."""
    return SamplingInput(
        req.params,
        req.input_ids,
        req.output_ids,
        req.generator,
        suppressed_ids,
        req.top_logprobs_num,
        req.token_ids_logprob,
        req.return_logprob,
        req.logit_processor,
        req.grammar,
    )
