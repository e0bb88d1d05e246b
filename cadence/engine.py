"""In-process engine: `Engine(model_path=None, **server_args)`.

The same scheduler core as the server's scheduler process runs on one background thread,
with the detokenizer; the same `EngineClient` as the server's front (a `FrontClient`) runs
on a private event loop thread. Results are exactly what `/generate` answers, and every
control message of the server works here too (flush, pause/continue, load, profile, weight
update). One default differs from the server's: the KV pool's memory is left to be committed
as it is first written (`lazy_kv_pool=True`); pass `lazy_kv_pool=False` to take it all at
start as `cadence serve` does.

The scheduler thread also loads the model. OpenMP keeps a worker team per calling thread;
once two threads own teams on a small machine, libgomp stops spin-waiting and every parallel
op pays a futex wake-up (~40 us, hundreds per decode step). Doing all tensor work on one
thread keeps one team.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from cadence.detokenizer.detokenizer import Detokenizer
from cadence.front.client import FrontClient
from cadence.front.engine_client import ModelInfo
from cadence.front.request_checks import RequestOptions
from cadence.front.tokenizer import FrontTokenizer
from cadence.hooks import finalize_server_args
from cadence.io_struct import BatchTokenIDOutput, EmbeddingReqInput, GenerateReqInput
from cadence.model_executor.parallel import RanksLost
from cadence.model_loader.locate import check_load_format, resolve_model_path
from cadence.model_loader.tokenizer_files import load_tokenizer, tokenizer_dir
from cadence.plugins import load_plugins
from cadence.scheduler.process import build_scheduler, runtime_facts
from cadence.scheduler.req import to_messages
from cadence.scheduler.scheduler import Scheduler
from cadence.server_args import ServerArgs
from cadence.serving.native_api import last_result

logger = logging.getLogger(__name__)

_STOP = object()
IDLE_WAKE_S = 0.5  # an idle scheduler thread wakes this often (s): keep-alives to other ranks


class _SchedulerThread:
    """Runs the scheduler core and the detokenizer on one thread, fed through a queue.

    A message is handled by `Scheduler.handle` (its answer, and every text output, goes to
    `deliver`); a callable is run on the scheduler (tests, admin)."""

    def __init__(self, make_scheduler: Callable[[], Scheduler], detokenizer: Detokenizer):
        self.detokenizer = detokenizer
        self.deliver: Callable[[Any], None] = lambda msg: (
            None
        )  # set before the first request arrives
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.alive = True
        self.scheduler: Scheduler | None = None
        ready: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._run, args=(make_scheduler, ready), name="cadence-scheduler", daemon=True
        )
        self.thread.start()
        error = ready.get()
        if error is not None:
            raise error

    def _run(self, make_scheduler, ready: queue.SimpleQueue) -> None:
        try:
            self.scheduler = make_scheduler()
        except BaseException as e:  # the constructor re-raises it on the caller's thread
            self.alive = False
            ready.put(e)
            return
        ready.put(None)
        try:
            self._loop()
        finally:
            self.alive = False
            self.scheduler.close()

    def _loop(self) -> None:
        scheduler = self.scheduler
        while True:
            try:
                msg = (
                    self.inbox.get(timeout=IDLE_WAKE_S)
                    if not scheduler.has_work
                    else self.inbox.get_nowait()
                )
                while True:
                    if msg is _STOP:
                        return
                    if callable(msg):
                        msg(scheduler)
                    else:
                        reply = scheduler.handle(msg)
                        if reply is not None:
                            self.deliver(reply)
                    msg = self.inbox.get_nowait()
            except queue.Empty:
                pass
            try:
                outputs = scheduler.step()
                if not scheduler.has_work:
                    scheduler.runner.keep_alive()  # other ranks, if any, hear from us
            except (Exception, RanksLost) as e:
                # The forward pass failed: every request would wait forever. Fail them all.
                logger.exception("scheduler step failed; the engine stops")
                scheduler.abort(abort_all=True, message=f"the engine failed: {e}")
                for out in scheduler.outputs:
                    out.finished_reason["status_code"] = 500
                self._emit(scheduler.outputs)
                return
            self._emit(outputs)

    def _emit(self, outputs) -> None:
        # Embeddings need no detokenizer.
        for msg in to_messages(outputs, self.scheduler.weight_version):
            self.deliver(
                self.detokenizer.process(msg) if isinstance(msg, BatchTokenIDOutput) else msg
            )

    def stop(self) -> None:
        self.inbox.put(_STOP)
        self.thread.join(timeout=10)


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any):
        load_plugins()  # front and scheduler share this process: every hook point fires here
        # Lazy unless asked (see above): the engine lives in a host program, which decides
        # what memory it may hold.
        kwargs = {"lazy_kv_pool": True, **kwargs}
        self.args = finalize_server_args(ServerArgs.from_kwargs(model_path=model_path, **kwargs))
        if self.args.dp_size > 1:
            raise ValueError(
                "dp_size: the in-process Engine is one replica; serve several with "
                "`cadence serve --dp-size N` (or `cadence launch`) and send to its port"
            )
        path = resolve_model_path(self.args.model_path)
        check_load_format(path, self.args.load_format)
        self.tokenizer = load_tokenizer(path, self.args.tokenizer_path)
        self._ranks = None  # the follower ranks' supervisor, with tp_size × pp_size > 1
        if self.args.is_parallel:
            from cadence.distributed.ranks import prepare_parallel_args, start_followers

            self.args = prepare_parallel_args(self.args)
            self._ranks = start_followers(self.args, path)
        try:
            self._worker = _SchedulerThread(
                lambda: build_scheduler(self.args, path, self.tokenizer),
                Detokenizer(self.tokenizer),
            )
        except BaseException:
            if self._ranks is not None:
                self._ranks.stop()
            raise
        self.scheduler = self._worker.scheduler
        self.info = ModelInfo.from_facts(
            path,
            self.args.tokenizer_path or path,
            self.args.served_model_names(path),
            tokenizer_dir(path, self.args.tokenizer_path),
            runtime_facts(self.scheduler),
        )
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, name="cadence-engine-loop", daemon=True
        )
        self._loop_thread.start()
        self.client = FrontClient(
            FrontTokenizer(self.tokenizer),
            self.info,
            self._send,
            max_pending=self.args.max_queued_requests + self.args.max_running_requests,
            request_timeout_s=self.args.request_timeout_s,
            options=RequestOptions.of(self.args),
        )
        self._worker.deliver = lambda msg: self.loop.call_soon_threadsafe(
            self.client.on_message, msg
        )
        self._closed = False

    def _send(self, msg) -> None:
        if not self._worker.alive:
            raise RuntimeError(
                "the engine has stopped (shut down, or a scheduler step failed; see the log)"
            )
        self._worker.inbox.put(msg)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        lora_path: str | list[str | None] | None = None,
        **kwargs: Any,
    ) -> dict | list[dict]:
        """Blocking generation; answers what `/generate` answers (a list for a batch).
        `lora_path` names a loaded LoRA adapter (by its name, as SGLang's field does) for
        every prompt, or one per prompt (None: the base model)."""
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            lora_path=lora_path,
            **kwargs,
        )

        return self._call(last_result(self.client.generate(obj)))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | None = None,
        input_ids: list[int] | None = None,
        stream: bool = False,
        lora_path: str | list[str | None] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[dict]:
        """With stream=True yields incremental chunks (text and output_ids are deltas); otherwise
        yields the one final result. Leaving the iteration early aborts the request."""
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            stream=stream,
            lora_path=lora_path,
            **kwargs,
        )
        caller = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        async def produce():
            try:
                async for chunk in self.client.generate(obj):
                    caller.call_soon_threadsafe(items.put_nowait, ("item", chunk))
                caller.call_soon_threadsafe(items.put_nowait, ("done", None))
            except BaseException as e:  # hand every failure to the caller
                caller.call_soon_threadsafe(items.put_nowait, ("error", e))

        future = asyncio.run_coroutine_threadsafe(produce(), self.loop)
        try:
            while True:
                kind, value = await items.get()
                if kind == "done":
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            future.cancel()

    # ---- embeddings, classification, scoring, reranking (docs/embeddings.md) ----------------

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        **kwargs: Any,
    ) -> dict | list[dict]:
        """Embeddings (a classifier's class logits) of an embedding model; answers what
        `/encode` answers: {"embedding", "meta_info"}, a list for a batch. `kwargs` are the
        other fields of EmbeddingReqInput (rid, dimensions, is_cross_encoder_request, ...)."""
        obj = EmbeddingReqInput(text=prompt, input_ids=input_ids, **kwargs)
        return self._call(self.client.embed(obj))

    async def async_encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        **kwargs: Any,
    ) -> dict | list[dict]:
        """`encode` from an event loop; cancelling it aborts what still runs."""
        obj = EmbeddingReqInput(text=prompt, input_ids=input_ids, **kwargs)
        future = asyncio.run_coroutine_threadsafe(self.client.embed(obj), self.loop)
        return await asyncio.wrap_future(future)

    def score(
        self,
        query: str | list[int],
        items: str | list[str] | list[list[int]],
        label_token_ids: list[int],
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """SGLang's scoring with a generation model: for each item, the probability of each
        label token right after query + item (item + query with item_first); with
        apply_softmax normalized over the labels. As /v1/score's `scores`."""
        from cadence.serving import embedding_serving

        return self._call(
            embedding_serving.score(
                self.client,
                query,
                items,
                label_token_ids,
                apply_softmax,
                item_first,
                self.args.max_embedding_batch,
            )
        )["scores"]

    def rerank(
        self,
        query: str,
        documents: list[str],
        top_n: int | None = None,
        return_documents: bool = True,
        instruct: str | None = None,
    ) -> list[dict]:
        """Documents by relevance to `query`, best first: [{"score", "index", "document"}],
        as /v1/rerank answers (a cross-encoder's score, an embedding model's cosine
        similarity, or a generation model's probability of "yes")."""
        from cadence.serving import embedding_serving

        return self._call(
            embedding_serving.rerank(
                self.client,
                query,
                documents,
                top_n,
                return_documents,
                instruct,
                self.args.max_embedding_batch,
            )
        )

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Ends request `rid` (and its n > 1 samples), or every request with abort_all."""
        if (rid is None) == (not abort_all):
            raise ValueError("give either a rid or abort_all=True")
        self.loop.call_soon_threadsafe(lambda: self.client.abort(rid, abort_all, "aborted"))

    # ---- control: the server's control messages, in process ----------------------------

    def control(self, msg, timeout: float = 600):
        """Sends a control message to the scheduler core; returns its answer (or None). The
        named methods below are the checked way to the same messages."""
        return self._call(self.client.control(msg, timeout))

    def flush_cache(self, wait_s: float = 0.0):
        """Drops the prefix cache (see `EngineClient.flush_cache`): success False while
        requests run, unless they end within `wait_s`."""
        return self._call(self.client.flush_cache(wait_s))

    def pause_generation(self, mode: str = "abort") -> None:
        self._call(self.client.pause_generation(mode))

    def continue_generation(self) -> None:
        self._call(self.client.continue_generation())

    def get_load(self):
        """The scheduler's load report (GetLoadReqOutput)."""
        [load] = self._call(self.client.get_load())
        return load

    def start_profile(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        start_step: int | None = None,
    ):
        """Starts the torch profiler, after `start_step` forward steps when given; it stops
        by itself after `num_steps` profiled steps when given, else at `stop_profile`."""
        return self._call(self.client.start_profile(output_dir, num_steps, start_step))

    def stop_profile(self):
        return self._call(self.client.stop_profile())

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ):
        return self._call(
            self.client.update_weights_from_disk(model_path, load_format, weight_version)
        )

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True):
        """SGLang's Engine.update_weight_version: the served weights' new version label."""
        return self._call(self.client.update_weight_version(new_version, abort_all_requests))

    def get_weight_version(self) -> str:
        return self._call(self.client.get_weight_version())

    def open_session(
        self,
        capacity_of_str_len: int = 0,
        session_id: str | None = None,
        streaming: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Opens a session (see `/open_session`); returns its id. Raises ValueError
        (InvalidParameter) when the session cannot be opened (its id is taken)."""
        return self._call(
            self.client.open_session(capacity_of_str_len, session_id, streaming, timeout)
        )

    def close_session(self, session_id: str) -> bool:
        """Closes a session, unpinning its KV; False when no such session was open."""
        return self._call(self.client.close_session(session_id))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False):
        """Loads a PEFT adapter (its directory) under `lora_name`; returns LoRAUpdateOutput:
        `success` False and `error_message` when it was not loaded."""
        return self._call(self.client.load_lora_adapter(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str):
        """Unloads an adapter (its memory is freed once its last request ends);
        LoRAUpdateOutput as for a load."""
        return self._call(self.client.unload_lora_adapter(lora_name))

    def list_lora_adapters(self) -> list:
        """The adapters loaded now (LoRAAdapterInfo: name, path, lora_id, rank, pinned)."""
        return self._call(self.client.list_lora_adapters())

    def run_in_scheduler(self, fn, timeout: float = 60):
        """Runs fn(scheduler) on the scheduler thread and returns its result (tests, admin)."""
        done: queue.SimpleQueue = queue.SimpleQueue()

        def call(scheduler):
            try:
                done.put((True, fn(scheduler)))
            except Exception as e:  # raised again on the caller's thread, not in the loop
                done.put((False, e))

        self._send(call)
        ok, value = done.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._worker.stop()
        if self._ranks is not None:  # ordered to stop by the scheduler's close: reaped here
            self._ranks.stop(patience_s=5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
