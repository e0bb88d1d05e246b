"""In-process engine: `Engine(model_path=None, **server_args)`.

The scheduler and detokenizer run on one background thread; the `TokenizerManager` runs on
a private event loop thread. Results are exactly what `/generate` answers.

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
from typing import Any, AsyncIterator

from cadence.detokenizer import Detokenizer
from cadence.hooks import finalize_server_args
from cadence.io_struct import AbortReq, GenerateReqInput, TokenizedGenerateReqInput
from cadence.model_loader.loader import load_tokenizer
from cadence.model_loader.locate import model_name, resolve_model_path
from cadence.plugins import load_plugins
from cadence.scheduler.req import req_from_tokenized, to_batch_output
from cadence.scheduler.scheduler import Scheduler
from cadence.server_args import ServerArgs
from cadence.tokenizer_manager import ModelInfo, TokenizerManager

logger = logging.getLogger(__name__)


class _SchedulerThread:
    """Runs the scheduler loop and the detokenizer on one thread, fed through a queue."""

    def __init__(self, make_scheduler, detokenizer: Detokenizer):
        self.detokenizer = detokenizer
        self.deliver = None  # set before the first request arrives
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.alive = True
        self.scheduler: Scheduler | None = None
        ready: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, args=(make_scheduler, ready),
                                       name="cadence-scheduler", daemon=True)
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
        self._loop()

    def _handle(self, msg) -> bool:
        if msg is None:
            return False
        if isinstance(msg, TokenizedGenerateReqInput):
            try:
                self.scheduler.add_request(req_from_tokenized(msg))
            except Exception as e:  # this request fails; the engine goes on
                self.scheduler.fail(req_from_tokenized(msg), e, "being admitted")
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid, msg.abort_all, msg.message or "aborted")
        elif callable(msg):
            msg(self.scheduler)
        return True

    def _loop(self) -> None:
        running = True
        while running:
            try:
                msg = self.inbox.get(timeout=None if not self.scheduler.has_work else 0) \
                    if not self.scheduler.has_work else self.inbox.get_nowait()
                running = self._handle(msg)
                while running:
                    running = self._handle(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if not running:
                break
            if not self.alive:
                break
            try:
                outputs = self.scheduler.step()
            except Exception as e:
                # A broken step would leave every caller waiting forever: fail them all instead.
                logger.exception("scheduler step failed; the engine stops")
                self.scheduler.abort(abort_all=True, message=f"the engine failed: {e}")
                for req in self.scheduler.outputs:
                    if req.finished_reason is not None:
                        req.finished_reason["status_code"] = 500
                outputs, self.scheduler.outputs = self.scheduler.outputs, []
                running = False
            if outputs:
                self.deliver(self.detokenizer.process(to_batch_output(outputs)))
        self.alive = False

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=10)


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any):
        load_plugins()  # front and scheduler share this process: every hook point fires here
        self.args = finalize_server_args(ServerArgs.from_kwargs(model_path=model_path, **kwargs))
        path = resolve_model_path(self.args.model_path)
        self.tokenizer = load_tokenizer(path, self.args.tokenizer_path)
        self._worker = _SchedulerThread(lambda: Scheduler(self.args, path, self.tokenizer), Detokenizer(self.tokenizer))
        self.scheduler = self._worker.scheduler
        runner = self.scheduler.runner
        self.info = ModelInfo(
            model_path=path, tokenizer_path=self.args.tokenizer_path or path,
            served_model_name=self.args.served_model_name or model_name(path),
            context_len=runner.context_len, vocab_size=runner.config.vocab_size,
            max_total_tokens=runner.max_total_tokens,
        )
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="cadence-engine-loop", daemon=True)
        self._loop_thread.start()
        self.tokenizer_manager = TokenizerManager(self.tokenizer, self.info, self._send,
                                                  max_pending=self.args.max_queued_requests + self.args.max_running_requests,
                                                  request_timeout_s=self.args.request_timeout_s)
        self._worker.deliver = lambda out: self.loop.call_soon_threadsafe(self.tokenizer_manager.handle_output, out)
        self._closed = False

    def _send(self, msg) -> None:
        if not self._worker.alive:
            raise RuntimeError("the engine has stopped (shut down, or a scheduler step failed; see the log)")
        self._worker.inbox.put(msg)

    def _make_obj(self, prompt, sampling_params, input_ids=None, **kwargs) -> GenerateReqInput:
        return GenerateReqInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params, **kwargs)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, **kwargs: Any) -> dict | list[dict]:
        """Blocking generation; answers what `/generate` answers (a list for a batch)."""
        obj = self._make_obj(prompt, sampling_params, input_ids, **kwargs)

        async def run():
            result = None
            async for result in self.tokenizer_manager.generate_request(obj):
                pass
            return result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | None = None,
                             input_ids: list[int] | None = None, stream: bool = False,
                             **kwargs: Any) -> AsyncIterator[dict]:
        """With stream=True yields incremental chunks (text and output_ids are deltas); otherwise
        yields the one final result. Leaving the iteration early aborts the request."""
        obj = self._make_obj(prompt, sampling_params, input_ids, stream=stream, **kwargs)
        caller = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        async def produce():
            try:
                async for chunk in self.tokenizer_manager.generate_request(obj):
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

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Ends request `rid` (and its n > 1 samples), or every request with abort_all."""
        if (rid is None) == (not abort_all):
            raise ValueError("give either a rid or abort_all=True")
        self.loop.call_soon_threadsafe(lambda: self.tokenizer_manager.abort_request(rid, abort_all=abort_all))

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
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
