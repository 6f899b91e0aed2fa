"""`AsyncLLM`: requests from any number of coroutines, streamed back (vLLM V1's `vllm/v1/engine/async_llm.py`).

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="small-gqa"))
    params = SamplingParams(max_tokens=32, output_kind=RequestOutputKind.DELTA)
    async for out in engine.generate("The key to happiness is", params, request_id="1"):
        print(out.outputs[0].text, end="")
    engine.shutdown()

One `LLMEngine` (kvjax.engine.llm_engine) runs in a thread of its own, the role vLLM's engine-core
process plays: it takes the requests and aborts that arrived since its last step, runs one
engine step, and hands each RequestOutput to the coroutine that asked for it, through that
coroutine's event loop (`call_soon_threadsafe`). Requests from several coroutines therefore run
in the same steps, batched by the scheduler as any other requests are. `generate` checks its
request in the caller's coroutine first (an LLMError, vLLM's validation error, raises there and
nothing is queued), then yields the request's outputs as its output_kind says (CUMULATIVE by
default, DELTA, or FINAL_ONLY) until the one that is finished. A caller that stops iterating
(its task is cancelled, a client disconnects, the generator is closed) aborts its request: the
engine frees its blocks before its next step. If a step raises, the engine is dead: every
waiting request gets `EngineDeadError`, and so does any later one (vLLM's). `shutdown()`
stops the thread.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncGenerator, Iterable

from kvjax.config.engine import EngineConfig
from kvjax.distributed.runtime import TICK_S
from kvjax.engine.arg_utils import AsyncEngineArgs, EngineArgs, LLMError
from kvjax.engine.llm_engine import LLMEngine
from kvjax.engine.lockstep import LockstepEngine
from kvjax.engine.outputs import RequestOutput
from kvjax.engine.sampling import SamplingParams
from kvjax.errors import KvjaxError


class EngineDeadError(RuntimeError):
    """The engine's thread stopped (a step raised, or shutdown()): no request can run any more."""


class AsyncLLM:
    """See the module docstring."""

    def __init__(self, vllm_config: EngineConfig | None = None, *, llm_engine: LLMEngine | None = None):
        """vllm_config: the resolved config (its engine is built here); or an LLMEngine already built."""
        self.llm_engine = llm_engine if llm_engine is not None else LLMEngine(vllm_config)
        self.vllm_config = self.llm_engine.vllm_config
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", ...), ("abort", ids), ("stop",)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvjax-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_) -> "AsyncLLM":
        return cls(llm_engine=LLMEngine.from_engine_args(engine_args))

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, **_) -> "AsyncLLM":
        return cls(vllm_config)

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *,
                       prompt_text: str | None = None, priority: int = 0,
                       **_ignored) -> AsyncGenerator[RequestOutput, None]:
        """Add one request (vLLM's prompt forms) and yield its RequestOutputs until it finishes.
        A bad request raises LLMError before anything is queued; leaving the loop early (or being
        cancelled) aborts it."""
        loop = asyncio.get_running_loop()
        stream = self._open(request_id, prompt, sampling_params, priority, prompt_text, loop)
        finished = False
        try:
            while not finished:
                out = stream.get_nowait() if not stream.empty() else await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._close(request_id)
            if not finished:  # cancelled, closed early, or the engine died: free its blocks
                self._inbox.put(("abort", [request_id]))

    async def add_request(self, request_id: str, prompt, params: SamplingParams, *, priority: int = 0,
                          prompt_text: str | None = None) -> asyncio.Queue:
        """vLLM's add_request: queue the request and return the asyncio.Queue its outputs arrive in
        (`generate` is the usual way in)."""
        return self._open(request_id, prompt, params, priority, prompt_text, asyncio.get_running_loop())

    def _open(self, request_id, prompt, params, priority, prompt_text, loop) -> asyncio.Queue:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        if not isinstance(request_id, str):
            raise LLMError(f"request_id must be a string, got {type(request_id).__name__}")
        engine = self.llm_engine
        text, ids = engine.process_prompt(prompt)  # the caller's checks: only valid requests reach the engine
        params = engine.check_request(ids, params)
        stream: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:
            if request_id in self._streams:
                raise LLMError(f"request id {request_id!r} is already in use by an unfinished request")
            self._streams[request_id] = (loop, stream)
        self._inbox.put(("add", request_id, ids, params, priority, prompt_text if prompt_text is not None else text))
        return stream

    def _close(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """End these requests (vLLM's): their blocks return to the pool before the next step, and
        their streams end with a finished output (finish_reason "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._inbox.put(("abort", ids))

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.llm_engine
        try:
            while True:
                block = not engine.has_unfinished_requests()
                if block:  # the last request finished or was aborted: vLLM's gauges read an idle engine
                    engine.engine.metrics.record_idle()
                command = self._wait() if block else self._next_command()
                while command is not None:
                    if command[0] == "stop":
                        raise EngineDeadError("the engine was shut down")
                    self._apply(command)
                    command = self._next_command()
                for out in engine.step():
                    self._deliver(out)
        except BaseException as e:  # noqa: BLE001 (the engine is dead: every stream must hear why)
            self._dead = e if isinstance(e, EngineDeadError) else EngineDeadError(f"{type(e).__name__}: {e}")
            self._dead.__cause__ = None if isinstance(e, EngineDeadError) else e
            with self._streams_lock:
                streams, self._streams = list(self._streams.items()), {}
            for _, (loop, stream) in streams:
                _put(loop, stream, self._dead)

    def _wait(self):
        """The next command, waiting for it; rank 0 of a multi-process job steps anyway (None) after
        kvjax.distributed.runtime.TICK_S idle, so that the other ranks' loss shows (kvjax.engine.lockstep)."""
        if not isinstance(self.llm_engine.engine, LockstepEngine):
            return self._inbox.get()
        try:
            return self._inbox.get(timeout=TICK_S)
        except queue.Empty:
            return None

    def _next_command(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, command) -> None:
        engine = self.llm_engine
        if command[0] == "abort":
            for out in engine.abort_request(command[1]):
                self._deliver(out)
            return
        if command[0] == "call":  # a question for the engine between two steps
            _, fn, loop, future = command
            try:
                result = fn()
            except KvjaxError as e:
                loop.call_soon_threadsafe(future.set_exception, e)
            else:
                loop.call_soon_threadsafe(future.set_result, result)
            return
        _, request_id, ids, params, priority, text = command
        with self._streams_lock:
            if request_id not in self._streams:  # its caller left before the engine saw it
                return
        try:
            engine.add_request(request_id, {"prompt_token_ids": ids}, params, priority=priority, prompt_text=text,
                               checked=True)
        except KvjaxError as e:  # refused by the engine itself (checked in the caller, so not expected)
            with self._streams_lock:
                loop, stream = self._streams.pop(request_id)
            _put(loop, stream, e)

    def _deliver(self, out: RequestOutput) -> None:
        with self._streams_lock:
            target = self._streams.get(out.request_id)
            if target is not None and out.finished:
                self._streams.pop(out.request_id)
        if target is not None:
            _put(*target, out)

    # ------------------------------------------------------------------ the rest of vLLM's surface
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine thread; unfinished requests end with EngineDeadError."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    def __del__(self):
        thread = getattr(self, "_thread", None)
        if thread is not None and thread.is_alive():
            self._inbox.put(("stop",))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None and "shut down" not in str(self._dead)

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def get_num_unfinished_requests(self) -> int:
        with self._streams_lock:
            return len(self._streams)

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    async def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.get_default_sampling_params()

    async def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Asked of the engine thread between two steps (vLLM's)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("call", lambda: self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector),
                         loop, future))
        return await future

    async def call_between_steps(self, fn):
        """fn() run by the engine thread between two steps, where no step holds or donates the engine's arrays
        (the live pool page's snapshots, kvjax.engine.pool_snapshot): its result, or its exception raised here,
        never in the engine thread. Waits for the step in flight; EngineDeadError once the engine is dead."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")

        def guarded():
            try:
                return True, fn()
            except Exception as e:  # noqa: BLE001 (the caller's error, not the engine's: handed back to it)
                return False, e

        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("call", guarded, loop, future))
        ok, value = await future
        if not ok:
            raise value
        return value

    def get_metrics(self):
        return self.llm_engine.get_metrics()

    def render_metrics(self) -> str:
        """The engine's metrics in Prometheus text (the server's /metrics)."""
        return self.llm_engine.engine.metrics.render_prometheus()


def _put(loop: asyncio.AbstractEventLoop, stream: asyncio.Queue, item) -> None:
    """Hand an output (or an error) to a stream in its event loop's thread."""
    try:
        loop.call_soon_threadsafe(stream.put_nowait, item)
    except RuntimeError:  # its loop has closed: nobody is listening any more
        pass


__all__ = ["AsyncEngineArgs", "AsyncLLM", "EngineDeadError"]
