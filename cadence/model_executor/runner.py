"""What the scheduler asks of a model runner: run one scheduled batch, get tokens back.

The scheduler decides who runs, which tokens and which KV pages (through its KV manager,
`mem_cache/kv_manager.py`); the runner turns a `ScheduleBatch` into one forward pass,
samples, computes logprobs, and answers one `ItemResult` per request. It never schedules and
never allocates.
A test runner with no weights implements the same ABC (tests/unit/scheduler).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from cadence.layers.sampler import SamplingInput

# (natural-log probability, token id) pairs, as every logprob list carries them.
TokenLogprob = tuple[float | None, int]


@dataclass
class BatchItem:
    """One request's share of a step."""

    rid: str
    uid: int  # unique per request object, never reused (a rid may be, after its request ended)
    token_ids: list[int]  # tokens whose K/V this step computes, at positions start, start + 1, ...
    start: int  # position of token_ids[0]; K/V of positions < start are already in `pages`
    pages: list[int]  # the request's KV pages in position order, covering start + len(token_ids)
    # Prompt logprobs: offsets in token_ids whose logits give the logprob of the token after
    # them; `logprob_targets` are those following tokens.
    logprob_rows: list[int] = field(default_factory=list)
    logprob_targets: list[int] = field(default_factory=list)
    top_logprobs_num: int = 0  # alternatives per prompt position
    token_ids_logprob: list[int] | None = None  # ids whose logprobs are reported at each position
    # Sample the next token from the last row (None: a prefill chunk that is not the last).
    sampling: SamplingInput | None = None
    return_hidden_states: bool = False  # report the final hidden state of every row
    # Speculative decoding: the last `num_draft` of token_ids are drafted, not yet verified.
    # The runner samples at the row before each draft token in turn and goes on only while
    # the token sampled there is the draft token (`ItemResult.more`).
    num_draft: int = 0
    # Overlap scheduling: the input token is the one the previous launch sampled at this row
    # (not known on the host yet; token_ids[0] is a placeholder). None: token_ids[0] itself.
    future_row: int | None = None
    # The LoRA adapter its tokens run with (cadence.layers.lora.LoraWeights); None: the base.
    lora: Any = None


@dataclass
class ScheduleBatch:
    """One forward step: a prefill (extend) of chunks, or a decode of one token each (and
    the drafted tokens of the requests that have some: a verify step)."""

    is_decode: bool
    items: list[BatchItem]
    new_pages: list[int] = field(
        default_factory=list
    )  # handed out for this step; never written yet

    @property
    def num_tokens(self) -> int:
        return sum(len(item.token_ids) for item in self.items)


@dataclass
class ItemResult:
    """What a step produced for one request (aligned with the batch's items)."""

    next_id: int | None = None  # the sampled token; None when not sampled or failed
    logprob: float | None = None  # of next_id, when the request asked for logprobs
    top_logprobs: list[TokenLogprob] | None = None
    token_ids_logprobs: list[TokenLogprob] | None = None
    # Prompt logprobs of `logprob_rows`, in order: (logprob, target id), and per row its
    # top alternatives and the logprobs of token_ids_logprob.
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_top: list[list[TokenLogprob]] = field(default_factory=list)
    input_given: list[list[TokenLogprob]] = field(default_factory=list)
    hidden_states: list[list[float]] | None = None  # per row, when asked: [rows][hidden]
    error: BaseException | None = None  # this request failed alone; the others are valid
    error_stage: str = ""  # what it was doing, for the error message
    # Speculative decoding: the tokens sampled after next_id in this step, one per draft
    # token accepted (next_id equal to the first draft token gives the second, ...); each
    # with its logprobs, as next_id's.
    more: list[ItemResult] = field(default_factory=list)


@dataclass
class EmbedItem:
    """One embedding request's share of an embedding step: its whole input, in one pass."""

    rid: str
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # an encoder's segment ids; None: all 0
    # KV pages covering token_ids, for a runner with `embed_needs_kv` (a decoder writes its
    # K/V while attending); the scheduler frees them as soon as the step is done.
    pages: list[int] = field(default_factory=list)


@dataclass
class Launched:
    """A step handed to the device (`Runner.launch`). `results` is set when the runner
    computed it at once; otherwise `Runner.finish` waits for them."""

    batch: ScheduleBatch
    results: list[ItemResult] | None = None
    pending: Any = None  # the runner's own record of what it waits for


class Runner(ABC):
    """A model runner as the scheduler sees it."""

    lora: Any = None  # its LoRA adapters (model_executor.lora_manager.LoraManager), if served

    context_len: int  # longest sequence served (prompt + output)
    eos_token_ids: tuple[int, ...]  # the model's end-of-sequence tokens
    is_generation: bool = True  # serves generation (run); False: embeddings only (embed)
    embed_needs_kv: bool = False  # `embed` needs KV pages for its items (see EmbedItem)
    kv_pool_bytes: int = 0  # host or device memory of the K/V tensors (an encoder has none)
    is_kv_pool_committed: bool = False  # that memory was all written at start (--lazy-kv-pool)
    # How many disjoint groups of the running requests a decode keeps in flight at once
    # (pipeline stages: while one group's step is on a later stage, the next group's runs on
    # the first). 1: a decode step takes every running request.
    decode_lanes: int = 1

    @abstractmethod
    def run(self, batch: ScheduleBatch) -> list[ItemResult]:
        """Run one step. A failure of the forward pass itself (shared by every request of the
        batch) raises; a failure of one request's sampling or logprobs is reported in its
        `ItemResult.error` and the other results stay valid."""

    def launch(self, batch: ScheduleBatch) -> Launched:
        """Starts one step and returns before its results are known where the device computes
        asynchronously: a decode whose every item samples on the device (greedy or plain
        temperature), with the overlap schedule on. The next launch may then name this one's
        rows as its items' input tokens (`BatchItem.future_row`), so the scheduler prepares
        step N+1 while the device runs step N. Otherwise (the default) it runs the step now."""
        return Launched(batch, self.run(batch))

    def finish(self, launched: Launched) -> list[ItemResult]:
        """The results of a launched step, waiting for the device if they are not in yet.
        Launched steps finish in the order they were launched."""
        assert launched.results is not None
        return launched.results

    def embed(self, items: list[EmbedItem]) -> list[list[float]]:
        """One forward pass over whole inputs: each item's embedding (a classifier's class
        logits), in order. Raises when the pass fails (the scheduler then retries the items
        one by one, so that only a request that fails alone fails)."""
        raise NotImplementedError("this runner serves no embeddings")

    def embedding_facts(self) -> dict:
        """What the front must know of an embedding model (ModelInfo): its dimension,
        pooling, class names, ... Empty for a generation model."""
        return {}

    def release_decode_state(self) -> None:
        """The running batch has emptied: drop whatever was kept for it between steps."""

    def make_generator(self, seed: int) -> Any:
        """A random generator for a request with a seed (opaque to the scheduler)."""
        return None

    def skip_draws(self, generator: Any, num_tokens: int) -> None:
        """Advances `generator` (from `make_generator`) past `num_tokens` tokens sampled
        elsewhere (a disaggregated request's first token, sampled by the prefill server)."""

    def load_weights(self, model_path: str, load_format: str | None) -> str:
        """Serve new weights of the same architecture in place; returns the path loaded.
        Raises, changing nothing, when they cannot be served."""
        raise NotImplementedError("this runner cannot load weights")

    def profiler_activities(self) -> list:
        """What the torch profiler records here (CPU, and the device's own activity)."""
        return []

    def keep_alive(self) -> None:
        """Called while the scheduler idles: a runner with other ranks tells them it lives."""

    def close(self) -> None:
        """The scheduler is stopping: let go of other ranks and devices."""
