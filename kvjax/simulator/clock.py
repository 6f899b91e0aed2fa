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
import math
from typing import Callable, Sequence

import numpy as np

from kvjax.benchmarks.serve import RequestFuncOutput, calculate_metrics, result_dict
from kvjax.config.scheduler import SchedulerConfig
from kvjax.core.sched.scheduler import Scheduler
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

    def bench_result(self, percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> dict:
        """`kvjax bench serve`'s result dict (vLLM's keys) of the simulated requests."""
        metrics, output_lens = calculate_metrics(self.outputs, self.duration, percentiles)
        return result_dict(metrics, self.outputs, output_lens, self.duration, percentile_metrics)


def default_tokens(vocab_size: int) -> Callable[[str, int], int]:
    """Token k of request req_id: a fixed pseudo-random id in [0, vocab_size)."""
    def token(req_id: str, k: int) -> int:
        return (sum(map(ord, req_id)) * 7919 + (k + 1) * 104729) % vocab_size
    return token


def simulate(config: SchedulerConfig, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
             arrivals: Sequence[float], step_seconds: Callable[[StepFeatures], float], *,
             max_concurrency: int | None = None, tokens: Callable[[str, int], int] | None = None,
             step_times: Sequence[float] | None = None, req_ids: Sequence[str] | None = None) -> SimResult:
    """Run the workload (request i: prompts[i], output_lens[i] tokens, arriving at arrivals[i]
    seconds, non-decreasing) through a Scheduler(config) on a clock (module docstring).
    step_seconds: the cost model; step_times: a recorded run's step durations instead, in order
    (its decisions replayed: tests/simulator); req_ids: default "0", "1", ..."""
    n = len(prompts)
    if not (len(output_lens) == len(arrivals) == n):
        raise KvjaxError(f"{n} prompts, {len(output_lens)} output lengths and {len(arrivals)} arrival times: "
                         "one of each per request")
    arrivals = np.asarray(arrivals, np.float64)
    if n and (np.any(np.diff(arrivals) < 0) or not np.isfinite(arrivals).all() or arrivals[0] < 0):
        raise KvjaxError("arrival times must be finite, >= 0 and non-decreasing")
    ids = [str(i) for i in range(n)] if req_ids is None else list(req_ids)
    tokens = tokens or default_tokens(1 << 15)
    sched = Scheduler(config)
    clock, nxt, in_flight = 0.0, 0, 0
    waiting_to_send: collections.deque[int] = collections.deque()
    held: set[int] = set()
    start = np.zeros(n)
    times: list[list[float]] = [[] for _ in range(n)]
    index = {rid: i for i, rid in enumerate(ids)}
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
        features = StepFeatures.from_plan(plan)
        if step_times is None:
            dt = float(step_seconds(features))
        elif len(steps) < len(step_times):
            dt = float(step_times[len(steps)])
        else:
            raise SimulationError(f"the recorded run has {len(step_times)} steps; the simulation needs more")
        if not (math.isfinite(dt) and dt >= 0):
            raise SimulationError(f"step {len(steps)}: a step time of {dt!r} s")
        t0, clock = clock, clock + dt
        sampled = np.array([tokens(rid, len(sched.output(rid))) for rid in plan.req_ids], np.int32)
        sampling = [rid for rid, s in zip(plan.req_ids, plan.sample) if s]
        finished = sched.update(plan, sampled)
        for rid in sampling:
            times[index[rid]].append(clock)
        for rid in finished:
            sched.forget(rid)
            in_flight -= 1
        steps.append(SimStep(t0, clock, tuple(plan.req_ids), tuple(int(x) for x in plan.num_scheduled),
                             tuple(plan.preempted), len(sched.running), len(sched.waiting), sched.num_free_blocks(),
                             features))
    outputs = []
    for i in range(n):
        t = times[i]
        outputs.append(RequestFuncOutput(success=bool(t), prompt_len=len(prompts[i]), output_tokens=len(t),
                                         ttft=t[0] - start[i] if t else 0.0, itl=list(np.diff(t)) if t else [],
                                         latency=t[-1] - start[i] if t else 0.0, start_time=float(start[i])))
    return SimResult(outputs, steps, clock, sched.num_preemptions)
