"""The simulator's driver: the engine's scheduler stepped on a clock (kvjax.simulator).

    clock = 0
    loop:
        requests whose arrival <= clock are sent (at most max_concurrency in flight, as
        `kvjax bench serve`'s client) and added to the scheduler
        nothing to run: the clock jumps to the next arrival
        plan = scheduler.schedule()                   the engine's own scheduling
        clock += step time of the plan                a cost model, or a recorded run's times
        scheduler.update(plan, tokens)                one token per sampling request
        a token's time is the clock at its step's end; a finished request leaves

It is the engine's loop (kvjax.engine.core) without the model: one model step per plan (the
engine's device loop, steps_per_call > 1, runs several decode steps per plan; vLLM runs one),
requests added between steps, a request's time to first token from when it was sent to the end
of the step that sampled it. The tokens come from `tokens(req_id, k)` (default: fixed
pseudo-random ids per request, so its blocks hash apart from other requests'); every request
runs to its expected output length, as `kvjax bench serve` asks (ignore_eos). The metrics are
`kvjax bench serve`'s (kvjax.benchmarks.serve.calculate_metrics), on simulated seconds.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Callable, Sequence

import jax
import numpy as np

from kvjax.benchmarks.serve import RequestFuncOutput, calculate_metrics, result_dict
from kvjax.config.scheduler import SchedulerConfig
from kvjax.core.sched.scheduler import Scheduler, SchedulerError
from kvjax.errors import KvjaxError
from kvjax.simulator.cost import StepFeatures


class SimulationError(KvjaxError):
    """A workload the scheduler cannot run (a request that never fits), named by its request."""


@dataclasses.dataclass(frozen=True)
class SimStep:
    """One simulated step: when, what the scheduler put in it, what it cost."""

    start: float
    end: float
    req_ids: tuple[str, ...]
    num_scheduled: tuple[int, ...]
    preempted: tuple[str, ...]
    num_running: int  # the scheduler's queues after the step
    num_waiting: int
    free_blocks: int
    features: StepFeatures

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["features"] = dataclasses.asdict(self.features)
        return d


@dataclasses.dataclass
class SimResult:
    outputs: list[RequestFuncOutput]  # in request order
    steps: list[SimStep]
    duration: float  # simulated seconds, from 0 to the last step's end
    preemptions: int
    state: object = None  # the scheduler's pool at the end (kvjax.core.kv_cache_manager.KVCacheManager)
    recomputed_tokens: int = 0  # positions computed again after a preemption freed them (StepLog's rule)

    @property
    def recompute_tax(self) -> float:
        """Recomputed over computed tokens (kvjax.engine.stats.StepLog's recompute tax)."""
        done = sum(s.features.tokens for s in self.steps)
        return self.recomputed_tokens / done if done else 0.0

    def bench_result(self, percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> dict:
        """`kvjax bench serve`'s result dict (vLLM's keys) of the simulated requests."""
        metrics, output_lens = calculate_metrics(self.outputs, self.duration, percentiles)
        return result_dict(metrics, self.outputs, output_lens, self.duration, percentile_metrics)


@dataclasses.dataclass(frozen=True)
class DefaultTokens:
    """Token k of request req_id: a fixed pseudo-random id in [0, vocab_size)."""

    vocab_size: int

    def __call__(self, req_id: str, k: int) -> int:
        return (_id_base(req_id) + (k + 1) * 104729) % self.vocab_size

    def array(self, bases: np.ndarray, starts: np.ndarray, steps: int) -> np.ndarray:
        """i32[steps, len(bases)]: token starts[i] + j of the request whose _id_base is bases[i], at [j, i]."""
        k = np.asarray(starts, np.int64)[None, :] + np.arange(steps)[:, None]
        return ((np.asarray(bases, np.int64)[None, :] + (k + 1) * 104729) % self.vocab_size).astype(np.int32)


class _Tokens:
    """When each request's tokens were sampled and how far each request has computed, kept as
    arrays per step rather than per request (a step's rows at once)."""

    def __init__(self, ids: Sequence[str], prompt_lens: Sequence[int]):
        self.index = {rid: i for i, rid in enumerate(ids)}
        self.prompt_lens = np.asarray(prompt_lens, np.int64)
        self.bases = np.fromiter(map(_id_base, ids), np.int64, len(ids))  # DefaultTokens' per request
        self.rows: list[np.ndarray] = []  # per event batch: the requests (indices) that sampled
        self.at: list[np.ndarray] = []  # and when
        self.high = np.zeros(len(ids), np.int64)  # the most positions each request computed (StepLog's)
        self.recomputed = 0

    def of(self, req_ids: Sequence[str]) -> np.ndarray:
        return np.fromiter((self.index[r] for r in req_ids), np.int64, len(req_ids))

    def computed(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """rows computed positions starts .. ends - 1: those at or below a row's high-water mark
        are recomputed (kvjax.engine.stats.StepLog's rule)."""
        self.recomputed += int(np.maximum(0, np.minimum(ends, self.high[rows]) - starts).sum())
        self.high[rows] = np.maximum(self.high[rows], ends)

    def sampled(self, rows: np.ndarray, times) -> None:
        self.rows.append(rows)
        self.at.append(np.broadcast_to(np.asarray(times, np.float64), rows.shape))

    def times(self, n: int) -> list[np.ndarray]:
        """Each request's token times, in order."""
        rows, at = np.concatenate([np.zeros(0, np.int64)] + self.rows), np.concatenate([np.zeros(0)] + self.at)
        order = np.argsort(rows, kind="stable")  # the events are in time order; stable keeps it
        return np.split(at[order], np.searchsorted(rows[order], np.arange(1, n))) if n else []


def _id_base(req_id: str) -> int:
    return sum(map(ord, req_id)) * 7919


def _sampled(tokens: Callable[[str, int], int], record: _Tokens, plan, rows: np.ndarray, steps: int) -> np.ndarray:
    """i32[steps, B]: the token plan's request i (record row rows[i]) samples at its output position
    k + j, at [j, i], k its output so far (DefaultTokens all at once, any other `tokens` one call each)."""
    starts = plan.num_tokens - record.prompt_lens[rows]
    if isinstance(tokens, DefaultTokens):
        return tokens.array(record.bases[rows], starts, steps)
    return np.array([[tokens(rid, k + j) for rid, k in zip(plan.req_ids, starts.tolist())] for j in range(steps)],
                    np.int32).reshape(steps, plan.num_requests)


def simulate(config: SchedulerConfig, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
             arrivals: Sequence[float], step_seconds: Callable[[StepFeatures], float], *,
             max_concurrency: int | None = None, tokens: Callable[[str, int], int] | None = None,
             step_times: Sequence[float] | None = None, req_ids: Sequence[str] | None = None,
             decode_runs: bool = True, windows: Sequence[int] | None = None) -> SimResult:
    """Run the workload (request i: prompts[i], output_lens[i] tokens, arriving at arrivals[i]
    seconds, non-decreasing) through a Scheduler(config) on a clock (module docstring).
    step_seconds: the cost model; step_times: a recorded run's step durations instead, in order
    (its decisions replayed: tests/simulator); req_ids: default "0", "1", ...; decode_runs: take
    runs of decode steps in one device call (kvjax.simulator.decode) where the host loop would only
    decode; False: every step through the host loop, the reference tests/simulator compares with;
    windows: the model's sliding windows, for the features' `windowed` (default: config.windows')."""
    n = len(prompts)
    if not (len(output_lens) == len(arrivals) == n):
        raise KvjaxError(f"{n} prompts, {len(output_lens)} output lengths and {len(arrivals)} arrival times: "
                         "one of each per request")
    arrivals = np.asarray(arrivals, np.float64)
    if n and (np.any(np.diff(arrivals) < 0) or not np.isfinite(arrivals).all() or arrivals[0] < 0):
        raise KvjaxError("arrival times must be finite, >= 0 and non-decreasing")
    ids = [str(i) for i in range(n)] if req_ids is None else list(req_ids)
    tokens = tokens or DefaultTokens(1 << 15)
    windows = tuple(sorted({w for w in (config.windows if windows is None else windows) if w is not None}))
    sched = Scheduler(config)
    clock, nxt, in_flight = 0.0, 0, 0
    waiting_to_send: collections.deque[int] = collections.deque()
    held: set[int] = set()
    start = np.zeros(n)
    record = _Tokens(ids, [len(p) for p in prompts])
    steps: list[SimStep] = []
    while True:
        while nxt < n and arrivals[nxt] <= clock:
            waiting_to_send.append(nxt)
            nxt += 1
        while waiting_to_send and (max_concurrency is None or in_flight < max_concurrency):
            i = waiting_to_send.popleft()
            start[i] = clock if i in held else arrivals[i]  # held back by max_concurrency: sent as a slot frees
            sched.add_request(ids[i], list(prompts[i]), int(output_lens[i]))
            in_flight += 1
        held.update(waiting_to_send)
        if not sched.has_unfinished():
            if nxt >= n:
                break
            clock = max(clock, float(arrivals[nxt]))
            continue
        plan = sched.schedule()
        if plan.num_requests == 0:
            head = sched.waiting[0].req_id if sched.waiting else "?"
            raise SimulationError(f"nothing could be scheduled: request {head!r} does not fit the pool of "
                                  f"{config.num_blocks} blocks of {config.block_size} tokens")
        if decode_runs and step_times is None and _runs_on(plan, sched):
            # Every row taken and every request sent to the scheduler: an arrival waits for a finish.
            full = max_concurrency is None and len(sched.running) >= config.max_num_seqs
            clock, done, taken = _decode_run(sched, plan, clock, arrivals[nxt:], full, step_seconds, tokens,
                                             full or bool(sched.waiting or waiting_to_send), windows, steps, record)
            for rid in done:
                sched.forget(rid)
                in_flight -= 1
            continue
        features = StepFeatures.from_plan(plan, windows, config)
        if step_times is None:
            dt = float(step_seconds(features))
        elif len(steps) < len(step_times):
            dt = float(step_times[len(steps)])
        else:
            raise SimulationError(f"the recorded run has {len(step_times)} steps; the simulation needs more")
        if not (math.isfinite(dt) and dt >= 0):
            raise SimulationError(f"step {len(steps)}: a step time of {dt!r} s")
        t0, clock = clock, clock + dt
        rows = record.of(plan.req_ids)
        record.computed(rows, plan.seq_lens - plan.num_scheduled, plan.seq_lens)
        sampled = _sampled(tokens, record, plan, rows, 1)[0]
        finished = sched.update(plan, sampled)
        record.sampled(rows[plan.sample], clock)
        for rid in finished:
            sched.forget(rid)
            in_flight -= 1
        steps.append(SimStep(t0, clock, tuple(plan.req_ids), tuple(plan.num_scheduled.tolist()),
                             tuple(plan.preempted), len(sched.running), len(sched.waiting), sched.num_free_blocks(),
                             features))
    outputs = []
    for i, t in enumerate(record.times(n)):
        ok = len(t) > 0
        outputs.append(RequestFuncOutput(success=ok, prompt_len=len(prompts[i]), output_tokens=len(t),
                                         ttft=float(t[0] - start[i]) if ok else 0.0, itl=np.diff(t).tolist(),
                                         latency=float(t[-1] - start[i]) if ok else 0.0, start_time=float(start[i])))
    return SimResult(outputs, steps, clock, sched.num_preemptions, sched.state, record.recomputed)


RUN_STEPS = 128  # the most decode steps one `decode_run` call takes (its static loop bound)


def _runs_on(plan, sched: Scheduler) -> bool:
    """A plan whose next steps a pool-only device loop can take: every request samples (a prompt
    finished in this step decodes from the next), the step preempted nothing, the token budget holds
    every row (as schedule() gives each one token), no request has stop tokens (its finishes are
    then by length, so the steps' batches are known ahead), and the next schedule() would admit no
    one: after a decode step, whose admissions already failed with the budget the next step has
    (until a finish or an arrival, where the run stops); after a step that prefilled, only with
    nobody waiting or every batch row taken (a smaller budget may have stopped its admissions)."""
    cfg = sched.config
    return (bool(plan.sample.all()) and not plan.preempted and plan.num_requests <= cfg.max_num_batched_tokens
            and not (plan.stop_ids >= 0).any()
            and (plan.is_decode or not sched.waiting or len(sched.running) >= cfg.max_num_seqs))


def _decode_run(sched: Scheduler, plan, clock: float, pending: np.ndarray, full: bool, step_seconds, tokens,
                waiting: bool, windows: tuple, steps: list, record: _Tokens) -> tuple[float, list[str], np.ndarray]:
    """Run `plan` and the decode steps after it in one device call (kvjax.simulator.decode), at most
    RUN_STEPS: those that start before the next arrival (pending: the arrival times of the requests
    not yet sent), or with every row full (`full`: an arrival only waits) until a finish; stopping
    after a finish while requests wait or with a host tier (stop_at_finish). Records each step and
    each token's time as the host loop would. → (the clock after the last step, the finished
    request ids, in order, the steps each of plan's requests took part in)."""
    from kvjax.core.sched.transition import FINISH_REASONS
    from kvjax.simulator.decode import decode_run

    b, k = plan.num_requests, RUN_STEPS
    remaining = np.asarray(plan.remaining, np.int64)  # row i finishes (length) in step remaining[i] - 1
    stop = waiting or sched.tier is not None
    if stop:  # the loop stops after the first finish
        k = min(k, int(remaining.min()))
    # The steps' batches are known ahead: row i takes part in steps 0 .. remaining[i] - 1; the
    # plan's own step may be a prompt's last token, the others decode.
    def features(j: int, live: np.ndarray) -> StepFeatures:
        return first if j == 0 else StepFeatures.decoding(plan.seq_lens[live] + j, windows, sched.config)

    first = StepFeatures.from_plan(plan, windows, sched.config)
    ends, j, t = [], 0, clock
    arrival = math.inf if full or not len(pending) else pending[0]
    while j < k and (j == 0 or t < arrival):
        live = remaining > j
        if not live.any():
            break
        dt = float(step_seconds(features(j, live)))
        if not (math.isfinite(dt) and dt >= 0):
            raise SimulationError(f"step {len(steps) + j}: a step time of {dt!r} s")
        t += dt
        ends.append(t)
        j += 1
    # All max_num_seqs rows, padding empty: one compile. (Padding to a power of two instead made a
    # program per bucket, 1.5 s each, for ~6% less time a call on the 8×H200 workload.)
    rows = record.of(plan.req_ids)
    sampled = np.zeros((RUN_STEPS, sched.config.max_num_seqs), np.int32)
    sampled[:len(ends), :b] = _sampled(tokens, record, plan, rows, len(ends))
    state, *small = decode_run(sched.state, sched.decode_rows(plan), sampled, np.int32(len(ends)), np.bool_(stop),
                               num_steps=RUN_STEPS)
    ran, free_after, finished_at, refused = jax.device_get(small)
    if refused:
        raise SchedulerError("the block pool refused a decode step's token, free or allocation in the simulator's "
                             "device loop although its rules said it must succeed")
    ran, finished_at = int(ran), finished_at[:b]
    taken = np.minimum(finished_at + 1, ran)
    if not np.array_equal(np.minimum(remaining, ran), taken):
        raise SchedulerError(f"the device loop finished requests at steps {finished_at.tolist()}, not where their "
                             f"lengths end ({(remaining - 1).tolist()})")
    finish = np.where(finished_at < RUN_STEPS, FINISH_REASONS.index("length"), 0).astype(np.int32)
    done = sched.apply_decode_steps(plan, sampled[:ran, :b], state, finish, None if stop else taken)
    live = np.arange(ran)[:, None] < taken[None, :]  # [step, row]
    record.computed(rows, plan.seq_lens - plan.num_scheduled, plan.seq_lens + taken - 1)
    record.sampled(np.broadcast_to(rows, live.shape)[live],
                   np.broadcast_to(np.asarray(ends[:ran])[:, None], live.shape)[live])
    # The requests that arrive during a full run join the queue at the next step's start.
    queued = len(sched.waiting) + np.searchsorted(pending, np.array([clock] + ends[:ran - 1]), side="right")
    start = clock
    for j in range(ran):
        live, last = taken > j, j == ran - 1
        ids = plan.req_ids if live.all() else tuple(itertools.compress(plan.req_ids, live.tolist()))
        steps.append(SimStep(start, ends[j], ids, tuple(plan.num_scheduled.tolist()) if j == 0 else (1,) * len(ids),
                             (), len(sched.running) if last else int((finished_at > j).sum()), int(queued[j]),
                             sched.num_free_blocks() if last else int(free_after[j]), features(j, live)))
        start = ends[j]
    return ends[ran - 1], done, taken

