"""What a generation run reports: its `Summary`, and the per-call bookkeeping that fills it.

A Summary holds what an inference engineer looks at after a run of `kvjax.engine.core.Engine`
(and of `kvjax.LLM.generate`, whose outputs carry it as `.summary`): requests, prompt and
generated tokens, prefix-cache lookups and hits, prefill and decode throughput, step
latencies, device calls, compile time, blocks in use per step and preemptions. Device calls
during which JAX traced or compiled anything are left out of the rates and latencies; the
compile time is read from JAX's own monitoring events.

What the scheduler did in a step reaches `RunStats` and `StepLog` as that step's
`SchedulerStats` (kvjax.core.sched.stats, made by `Scheduler.make_stats`, as vLLM's loggers
get it): neither reads the scheduler's queues or requests.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Summary:
    """What an inference engineer looks at after a run. Rates and latencies leave out the device
    calls during which JAX traced or compiled anything (a first call runs several times slower
    even after its compile time is subtracted); a rate with no such call left is NaN (None in
    to_json). Run the workload twice on one Engine to time every step."""

    requests: int
    failed: int  # refused with an error (kvjax decode's requests refused before the run; 0 from the engine)
    prompt_tokens: int  # of the requests that ran
    prefix_queried_tokens: int  # tokens looked up in the prefix cache, over all admissions
    prefix_hit_tokens: int
    prefix_hit_rate: float  # hit / queried
    generated_tokens: int
    prefill_tokens: int  # tokens computed for prompts and for recomputation after preemption
    decode_tokens: int  # tokens computed for generated tokens, one per request per step
    prefill_tokens_per_s: float  # prefill tokens / time of the steps that had any
    decode_tokens_per_s: float  # decode tokens / time of decode-only steps
    step_latency_p50_ms: float  # per token step, scheduling included; a call of n steps counts as n steps
    step_latency_p99_ms: float
    steps: int
    device_calls: int
    untimed_calls: int  # calls left out of the rates and latencies because they compiled
    compile_s: float  # tracing + lowering + XLA compile time during the run (every jit, pool ops included)
    wall_s: float
    peak_blocks_used: int
    usable_blocks: int
    preemptions: int
    blocks_in_use: tuple[int, ...]  # per step: blocks out of the free queue while it ran
    ttft_p50_ms: float = float("nan")  # time to first token from the start of the run, over requests that ran
    ttft_p99_ms: float = float("nan")
    # The host offload tier (kvjax.kv_offload.host_pages); zeros and None without one.
    host_blocks: int = 0  # its capacity in blocks
    host_memory_kind: str | None = None  # "pinned_host" or "numpy"
    host_hit_tokens: int = 0  # prompt tokens loaded from it instead of prefilled (within prefix_hit_tokens)
    host_bytes_stored: int = 0  # device -> host
    host_bytes_loaded: int = 0  # host -> device
    host_blocks_in_use: int = 0  # at the end of the run

    def to_json(self) -> dict:
        """A JSON-safe dict: tuples as lists, NaN (a rate with no timed step) as None."""
        def fix(v):
            return list(v) if isinstance(v, tuple) else None if isinstance(v, float) and v != v else v

        return {k: fix(v) for k, v in dataclasses.asdict(self).items()}


COMPILE_S = [0.0]  # seconds JAX spent tracing, lowering and compiling in this process


def _count_compile(name: str, seconds: float, **kwargs) -> None:
    if name.startswith("/jax/core/compile/"):
        COMPILE_S[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class RunStats:
    """Per-step bookkeeping over a run of `kvjax.engine.core.Engine` steps (`Engine.generate`, or
    `begin_run` .. `end_run`), turned into its Summary at the end: what the scheduler did is summed
    over the steps' SchedulerStats; the host tier's byte counters run over the engine's life, so a
    run's are differences from its start."""

    def __init__(self, engine):
        host = engine.host_pages
        self.usable = engine.usable_blocks
        self.start = time.perf_counter()
        self.preemptions = self.host_hits = self.host_in_use = 0  # summed (the last) over the run's SchedulerStats
        self.stored, self.loaded = (host.bytes_stored, host.bytes_loaded) if host is not None else (0, 0)
        self.latencies: list[float] = []
        self.blocks: list[int] = []
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_timed = [0, 0.0]  # tokens, seconds of the steps with prefill tokens
        self.decode_timed = [0, 0.0]  # tokens, seconds of the decode-only steps
        self.calls = self.untimed_calls = 0
        self.queried = self.hits = 0
        self.results = []  # the RequestResults of the requests added during the run (Engine.add_request)
        self._compile_start = self._compile_mark = COMPILE_S[0]

    def observe(self, engine, plan, t0: float, t1: float, steps: int, stats) -> None:
        """One engine step (Engine.step): plan ran as `steps` model steps in t1 - t0 seconds; stats:
        the scheduler's SchedulerStats of it (blocks in use after each model step, the prefix-cache
        lookups of the requests it admitted, again after a preemption too, preemptions, host hits)."""
        lookups = stats.prefix_cache_stats
        self.queried += lookups.queries + lookups.preempted_queries
        self.hits += lookups.hits + lookups.preempted_hits
        self.preemptions += stats.num_preempted_reqs
        self.host_hits += stats.host_hit_tokens
        self.host_in_use = stats.host_blocks_in_use
        prefill, decode = scheduled_tokens(plan, steps)
        compiled, self._compile_mark = COMPILE_S[0] > self._compile_mark, COMPILE_S[0]
        self.calls += 1
        self.blocks += stats.blocks_in_use
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        if compiled:
            self.untimed_calls += 1
            return
        self.latencies += [(t1 - t0) / steps] * steps
        timed = self.prefill_timed if prefill else self.decode_timed
        timed[0] += prefill or decode
        timed[1] += t1 - t0

    def summary(self, engine) -> Summary:
        """The run's Summary over the requests added during it (kvjax.engine.outputs.RequestResult)."""
        host, results = engine.host_pages, self.results
        lat = np.asarray(self.latencies or [np.nan]) * 1e3
        ttft = np.asarray([r.ttft_s for r in results if r.ttft_s is not None] or [np.nan]) * 1e3
        rate = lambda t: t[0] / t[1] if t[1] > 0 else float("nan")  # noqa: E731
        tier = {} if host is None else dict(
            host_blocks=host.num_slots, host_memory_kind=host.memory_kind,
            host_hit_tokens=self.host_hits,
            host_bytes_stored=host.bytes_stored - self.stored, host_bytes_loaded=host.bytes_loaded - self.loaded,
            host_blocks_in_use=self.host_in_use)
        return Summary(
            requests=len(results), failed=0, prompt_tokens=sum(r.prompt_tokens for r in results),
            prefix_queried_tokens=self.queried, prefix_hit_tokens=self.hits,
            prefix_hit_rate=self.hits / self.queried if self.queried else 0.0,
            generated_tokens=sum(len(r.output) for r in results), prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens, prefill_tokens_per_s=rate(self.prefill_timed),
            decode_tokens_per_s=rate(self.decode_timed), step_latency_p50_ms=float(np.percentile(lat, 50)),
            step_latency_p99_ms=float(np.percentile(lat, 99)), steps=len(self.blocks), device_calls=self.calls,
            untimed_calls=self.untimed_calls,
            compile_s=COMPILE_S[0] - self._compile_start, wall_s=time.perf_counter() - self.start,
            peak_blocks_used=max(self.blocks, default=0), usable_blocks=self.usable,
            preemptions=self.preemptions, blocks_in_use=tuple(self.blocks),
            ttft_p50_ms=float(np.percentile(ttft, 50)), ttft_p99_ms=float(np.percentile(ttft, 99)), **tier)


def scheduled_tokens(plan, steps: int) -> tuple[int, int]:
    """(prefill, decode) tokens a step computed: prefill the scheduled tokens of the requests in
    prefill (prompts, chunks, recomputation), decode one per other request per model step."""
    prefill = np.flatnonzero(plan.prefill)
    decode = plan.num_requests - len(prefill)
    return int(plan.num_scheduled[prefill].sum()), decode * steps if plan.is_decode else decode


def causal_pairs(num_scheduled, seq_lens) -> int:
    """Causal query-key pairs of a step: Σ n·L − n(n − 1)/2 for n new tokens ending at position L
    (each new token sees its own position and the ones before it)."""
    n, lens = np.asarray(num_scheduled, np.int64), np.asarray(seq_lens, np.int64)
    return int(np.sum(n * lens - n * (n - 1) // 2))


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """The scheduler's view of one engine step (`StepLog`). Times are time.perf_counter seconds."""

    start: float
    end: float
    steps: int  # model steps in the call (a decode plan's device loop runs up to steps_per_call)
    num_scheduled: int  # requests the step computed tokens for
    num_running: int  # the scheduler's queues after the step
    num_waiting: int
    num_preempted: int  # requests preempted while planning it
    blocks_in_use: int  # the most blocks out of the free queue during it
    tokens_held: int  # positions in the cache after it, of the requests it ran and those still running
    prefill_tokens: int  # computed for prompts and recomputation (scheduled_tokens)
    decode_tokens: int
    recomputed_tokens: int  # within prefill_tokens: positions a preempted request had computed before
    compiled: bool  # JAX traced or compiled during it (its time is not the step's own)
    preempted: tuple[str, ...] = ()  # the requests it preempted
    scheduled: tuple[tuple[str, int], ...] = ()  # (request id, tokens computed) in the plan's order
    context_tokens: int = 0  # Σ the plan's seq_lens: positions its attention reads
    attention_pairs: int = 0  # Σ n·L − n(n − 1)/2: causal query-key pairs (kvjax.simulator.cost)
    shape: tuple[bool, int, int] = (False, 0, 0)  # its first model step's compiled shape (kvjax.engine.steps.step_shape)


class StepLog:
    """Every engine step's StepRecord, in order (set `Engine.step_log = StepLog()`; the engine
    thread appends). Recomputed tokens: for each request, the highest position it has had
    computed (its high-water mark, kept here); a step that computes positions below it after a
    preemption freed them recomputes them (positions found in the prefix cache or loaded from the
    host tier are not computed, so not counted). recompute tax = recomputed / (prefill + decode).
    Tail waste after a step: blocks_in_use × block size − tokens_held (prefix caching off: with it,
    shared and cached blocks are counted once and tokens_held counts each request's own)."""

    def __init__(self):
        self.records: list[StepRecord] = []
        self._high: dict[str, int] = {}  # request id → positions computed at most (seq_len reached)
        self._held: dict[str, int] = {}  # request id → positions in the cache after its last step
        self._running: set[str] = set()  # the requests running after the last step (from the plans and stats)
        self._compile_mark = COMPILE_S[0]

    def observe(self, engine, plan, t0: float, t1: float, steps: int, stats) -> None:
        """One engine step (Engine.step): its plan, `steps` model steps in t1 - t0 seconds, and its
        SchedulerStats (queues, blocks in use, the requests preempted and finished since the last)."""
        from kvjax.engine.steps import step_shape

        recomputed = 0
        for i, rid in enumerate(plan.req_ids):
            start, end = int(plan.seq_lens[i] - plan.num_scheduled[i]), int(plan.seq_lens[i])
            high = self._high.get(rid, 0)
            recomputed += max(0, min(end, high) - start)
            self._held[rid] = end + (steps - 1 if plan.is_decode else 0)
            self._high[rid] = max(high, self._held[rid])
        prefill, decode = scheduled_tokens(plan, steps)
        gone = set(stats.preempted_req_ids) | stats.finished_req_ids  # no longer holding cache positions
        self._running = (self._running | set(plan.req_ids)) - gone
        compiled, self._compile_mark = COMPILE_S[0] > self._compile_mark, COMPILE_S[0]
        self.records.append(StepRecord(
            start=t0, end=t1, steps=steps, num_scheduled=plan.num_requests, num_running=stats.num_running_reqs,
            num_waiting=stats.num_waiting_reqs, num_preempted=stats.num_preempted_reqs,
            blocks_in_use=max(stats.blocks_in_use),
            tokens_held=sum(self._held.get(r, 0) for r in self._running | set(plan.req_ids)),
            prefill_tokens=prefill, decode_tokens=decode, recomputed_tokens=recomputed, compiled=compiled,
            preempted=tuple(plan.preempted),
            scheduled=tuple((rid, int(n)) for rid, n in zip(plan.req_ids, plan.num_scheduled)),
            context_tokens=int(np.sum(plan.seq_lens, dtype=np.int64)),
            attention_pairs=causal_pairs(plan.num_scheduled, plan.seq_lens),
            shape=step_shape(plan, engine.scheduler_config)))
        for rid in stats.finished_req_ids & self._high.keys():  # finished: forget its marks
            del self._high[rid], self._held[rid]

    def to_json(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.records]
