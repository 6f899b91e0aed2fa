"""Data parallelism behind one server: N engine replicas, each request routed to one (vLLM's
`--data-parallel-size`, `vllm/v1/engine/core_client.py: DPLBAsyncMPClient`, `vllm/v1/engine/coordinator.py`).

vLLM runs one engine core process per data-parallel rank, each with its own devices, scheduler and KV cache, and
its front end picks an engine for every request from the load its coordinator publishes (waiting and running
queues, KV usage). `DPAsyncLLM` does the same in one process: N AsyncLLM replicas (kvjax.engine.async_llm),
replica i on devices [i·TP, (i+1)·TP) with its own block pool, each stepping in its own thread, and the
interface the server uses (`generate`, `llm_engine`, `render_metrics`, ...), so `kvjax serve
--data-parallel-size N` serves them behind one endpoint (kvjax.entrypoints.openai.api_server).

Routing (`route`):
- load, as vLLM 0.33's `get_core_engine_for_request`: score = max(requests in flight from this front end,
  waiting + running) + waiting × 6 × max(0, kv_cache_usage − 0.5), the lowest score wins, ties broken by a
  rotating start (vLLM's eng_start_index), so an idle burst spreads round-robin;
- prefix (kvjax's default, beyond vLLM's): a prompt whose first block one or more replicas may hold goes to the
  least loaded of those, unless its score exceeds the least loaded replica's by more than max_num_seqs (a full
  batch: a hit does not pay for a queue that long). "May hold" asks each replica's scheduler
  (kvjax.core.sched.first_blocks: the first blocks its pool has had) and the router's own record of where it
  sent each first block lately (`RECENT` of them), which covers requests not yet admitted. A prompt shorter
  than a block, or one no replica holds, is routed by load. routing="load" is vLLM's default behaviour.

Metrics: `render_metrics` lists every replica's series (label engine="i", as vLLM labels its DP engines) and
their sum (engine="all": counters, histograms and queue gauges added, kv_cache_usage_perc averaged).
"""
from __future__ import annotations

import collections
import dataclasses
import threading

from kvjax.engine.arg_utils import EngineArgs, LLMError
from kvjax.engine.async_llm import AsyncLLM
from kvjax.engine.llm_engine import LLMEngine
from kvjax.engine.metrics import Counter, Gauge, Histogram, cache_config_info, render_prometheus

ROUTINGS = ("prefix", "load")
RECENT = 4096  # first blocks the router remembers having sent somewhere


class DPAsyncLLM:
    """See the module docstring."""

    def __init__(self, engine_args: EngineArgs, routing: str = "prefix"):
        import jax

        from kvjax.models.hub import load_model

        if routing not in ROUTINGS:
            raise LLMError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        config = engine_args.create_engine_config()
        n, tp = config.parallel_config.data_parallel_size, config.tensor_parallel_size
        devices = jax.local_devices()
        if len(devices) < n * tp:
            hint = " (on CPU: jax.config.update('jax_num_cpu_devices', N) before JAX starts)" \
                if devices[0].platform == "cpu" else ""
            raise LLMError(f"data_parallel_size={n} × tensor_parallel_size={tp} needs {n * tp} devices, "
                           f"{len(devices)} here{hint}")
        model = load_model(config.model, config=config.model_config, attn_impl=config.attention_backend,
                           seed=config.seed, progress=engine_args.use_tqdm_on_load)  # one host copy of the weights
        self.replicas = []
        for i in range(n):
            llm_engine = LLMEngine(config, model=model, devices=devices[i * tp:(i + 1) * tp])
            metrics = llm_engine.engine.metrics
            metrics.engine_index = i  # vLLM labels each DP engine's series with its index
            metrics.log_metrics_info(cache_config_info(llm_engine.vllm_config))
            self.replicas.append(AsyncLLM(llm_engine=llm_engine))
        self.routing, self.vllm_config = routing, self.replicas[0].vllm_config
        self.block_size, self.max_num_seqs = self.vllm_config.block_size, self.vllm_config.max_num_seqs
        self._lock = threading.Lock()
        self._inflight = [0] * n  # requests routed to each replica and not finished
        self._start = 0  # vLLM's eng_start_index: where the next scan for the least loaded begins
        self._recent: collections.OrderedDict = collections.OrderedDict()  # first block → replica
        self.routed = [0] * n  # requests each replica was given (a benchmark reads the split)

    # ------------------------------------------------------------------ routing
    def load(self, i: int) -> float:
        """vLLM's load score of replica i (module docstring)."""
        m = self.replicas[i].llm_engine.engine.metrics
        waiting, running = m.gauge("vllm:num_requests_waiting"), m.gauge("vllm:num_requests_running")
        usage = m.gauge("vllm:kv_cache_usage_perc")
        return max(self._inflight[i], waiting + running) + waiting * 6.0 * max(0.0, usage - 0.5)

    def route(self, prompt_ids) -> int:
        """The replica a request with these prompt tokens goes to (module docstring); counts it in flight."""
        n = len(self.replicas)
        with self._lock:
            loads = [self.load(i) for i in range(n)]
            order = [(self._start + k) % n for k in range(n)]
            best = min(order, key=lambda i: loads[i])  # the first of the lowest, scanning from the rotating start
            self._start = (self._start + 1) % n
            key = tuple(int(t) for t in prompt_ids[:self.block_size]) if len(prompt_ids) >= self.block_size else None
            if self.routing == "prefix" and key is not None:
                holders = [i for i in order if self._recent.get(key) == i
                           or self.replicas[i].llm_engine.engine.scheduler.first_blocks.may_hold(prompt_ids)]
                if holders:
                    held = min(holders, key=lambda i: loads[i])
                    if loads[held] <= loads[best] + self.max_num_seqs:
                        best = held
            if key is not None:
                self._recent[key] = best
                self._recent.move_to_end(key)
                if len(self._recent) > RECENT:
                    self._recent.popitem(last=False)
            self._inflight[best] += 1
            self.routed[best] += 1
            return best

    def _done(self, i: int) -> None:
        with self._lock:
            self._inflight[i] -= 1

    # ------------------------------------------------------------------ AsyncLLM's surface
    async def generate(self, prompt, sampling_params, request_id: str, **kwargs):
        """AsyncLLM.generate on the replica `route` picks for the prompt's tokens."""
        _, ids = self.replicas[0].llm_engine.process_prompt(prompt)
        i = self.route(ids)
        try:
            async for out in self.replicas[i].generate(prompt, sampling_params, request_id, **kwargs):
                yield out
        finally:
            self._done(i)

    @property
    def llm_engine(self) -> LLMEngine:
        """Replica 0's engine: every replica has the same config, tokenizer and rules (requests are checked on it)."""
        return self.replicas[0].llm_engine

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    async def get_default_sampling_params(self):
        return self.llm_engine.get_default_sampling_params()

    async def check_health(self) -> None:
        for replica in self.replicas:
            await replica.check_health()

    async def abort(self, request_id, internal: bool = False) -> None:
        for replica in self.replicas:  # an id not in a replica is ignored there, as vLLM ignores it
            await replica.abort(request_id)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        done = [await r.reset_prefix_cache(reset_running_requests, reset_connector) for r in self.replicas]
        return all(done)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def shutdown(self, timeout: float | None = None) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def errored(self) -> bool:
        return any(r.errored for r in self.replicas)

    def render_metrics(self) -> str:
        """Every replica's Prometheus series and their sum (module docstring)."""
        snaps = [r.llm_engine.engine.metrics.snapshot() for r in self.replicas]
        created = min(r.llm_engine.engine.metrics._created for r in self.replicas)
        return render_prometheus([*snaps, summed(snaps)], created)


def serving_engine(engine_args: EngineArgs, routing: str = "prefix"):
    """What `kvjax serve` serves: one AsyncLLM, or with data_parallel_size > 1 a DPAsyncLLM routing by `routing`."""
    if engine_args.data_parallel_size > 1:
        return DPAsyncLLM(engine_args, routing)
    return AsyncLLM.from_engine_args(engine_args)


def summed(snapshots: list[list]) -> list:
    """The replicas' metrics added up, labelled engine="all" (module docstring); cache_config_info left out."""
    out = []
    for same in zip(*snapshots):
        first = same[0]
        labels = {**first.labels, "engine": "all"}
        if isinstance(first, Histogram):
            buckets = {le: sum(m.buckets[le] for m in same) for le in first.buckets}
            out.append(dataclasses.replace(first, labels=labels, count=sum(m.count for m in same),
                                           sum=sum(m.sum for m in same), buckets=buckets))
        elif isinstance(first, Counter):
            out.append(dataclasses.replace(first, labels=labels, value=sum(m.value for m in same)))
        elif isinstance(first, Gauge) and "engine" in first.labels and first.name != "vllm:cache_config_info":
            total = sum(m.value for m in same)
            value = total / len(same) if first.name == "vllm:kv_cache_usage_perc" else total
            out.append(dataclasses.replace(first, labels=labels, value=value))
    return out


__all__ = ["DPAsyncLLM", "ROUTINGS", "serving_engine", "summed"]
