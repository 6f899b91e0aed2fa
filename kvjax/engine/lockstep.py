"""The engine core on every rank of a multi-process job: rank 0 says what happens, every rank runs it in lockstep.

vLLM's multi-node tensor parallelism keeps one scheduler, in the engine core on the head node, and broadcasts
each step's SchedulerOutput to the workers (`vllm/v1/executor/multiproc_executor.py`: the rpc broadcast queue).
kvjax cannot split it that way: its scheduler's block pool lives on the devices, replicated over the mesh, and the
decode loop runs the scheduler's allocation inside the same jitted program as the model (kvjax.engine.steps), so
every process must run the scheduler's device functions in the same order on the same inputs. So every rank runs
the whole engine (kvjax.engine.core.Engine, deterministic: the same requests in the same order give the same
plans, the same pool and, from the same replicated logits and keys, the same tokens), and only its inputs come
from rank 0:

- rank 0's engine (`LockstepEngine` with `leader` True) records every request added (its token ids, its
  SamplingParams, seed included, and priority), every abort and every prefix-cache reset, and at the start of
  each step broadcasts them (kvjax.distributed.channel.send); the others apply them in the same order before
  the same step. Request numbers, hence unseeded requests' random streams, follow from that order.
- before any step runs, every rank fingerprints its plan (`plan_fingerprint`: requests, rows, tokens, block
  tables, lengths) and the ranks compare (channel.agree): a rank whose scheduler diverged ends the job with one
  error before the mismatched step, never a hang in mismatched collectives.
- outputs come back on every rank; rank 0's front end (LLM, kvjax decode, the server) is the one that reads
  them.
- rank 0 announces each engine it builds (`announce`: its resolved EngineConfig) and the job's end
  (`EXIT`, at exit); ranks > 0 run `run_follower`: build the engine announced, step it as rank 0 says, return
  at the end. The model is loaded on every rank from the same name or folder (the files must be on every host).
- an idle leader steps anyway every kvjax.distributed.runtime.TICK_S (kvjax.engine.async_llm), so that a dead
  rank is noticed while no request runs.

Per step that is one small broadcast (the commands' length, and their bytes when there are any) and one
all-gather of 8 bytes per rank. A single-process engine is kvjax.engine.core.Engine itself, untouched.
"""
from __future__ import annotations

import hashlib

import numpy as np

from kvjax.core.sched.output import StepPlan
from kvjax.core.sched.scheduler import Scheduler
from kvjax.distributed import channel, runtime
from kvjax.engine.core import Engine
from kvjax.errors import KvjaxError
from kvjax.utils.atomic import atomic, lock_of

EXIT = ("exit",)
_PLAN_FIELDS = ("slots", "rows", "num_scheduled", "token_ids", "block_tables", "seq_lens", "sample", "remaining")


def plan_fingerprint(plan: StepPlan) -> int:
    """64 bits of everything a step's device call reads from its plan (0 is kept for "no plan")."""
    h = hashlib.blake2b(digest_size=8)
    h.update("\0".join(plan.req_ids + ("|",) + plan.preempted).encode())
    for name in _PLAN_FIELDS:
        h.update(np.ascontiguousarray(getattr(plan, name)).tobytes())
    return int.from_bytes(h.digest(), "little") | 1


class LockstepScheduler(Scheduler):
    """The scheduler whose every plan the ranks compare before it runs (module docstring)."""

    step_count = 0

    def schedule(self) -> StepPlan:
        plan = super().schedule()
        self.step_count += 1
        channel.agree(plan_fingerprint(plan), f"the plan of step {self.step_count}")
        return plan


class LockstepEngine(Engine):
    """kvjax.engine.core.Engine on one rank of a multi-process job (module docstring)."""

    scheduler_cls = LockstepScheduler

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.leader = runtime.rank() == 0
        self._pending: list[tuple] = []  # rank 0: what changed since the last step, for the other ranks

    @atomic
    def add_request(self, request_id, prompt, params, *, priority: int = 0, arrival_time=None):
        result = super().add_request(request_id, prompt, params, priority=priority, arrival_time=arrival_time)
        self._note(("add", request_id, [int(t) for t in prompt], params, int(priority)))
        return result

    @atomic
    def abort_requests(self, request_ids):
        ended = super().abort_requests(request_ids)
        self._note(("abort", list(request_ids)))
        return ended

    @atomic
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        done = super().reset_prefix_cache(reset_running_requests, reset_connector)
        self._note(("reset", reset_running_requests, reset_connector))
        return done

    def _note(self, command: tuple) -> None:
        if self.leader:
            self._pending.append(command)

    def step(self):
        """One step on every rank: rank 0 first broadcasts what changed since the last one; a step with nothing
        to schedule still agrees (on "no plan"), so that every rank makes the same collectives."""
        with lock_of(self):
            if self.leader:
                channel.send(self._pending or None, "a step's commands")
                self._pending = []
            if not self.scheduler.has_unfinished():
                channel.agree(0, f"the plan of step {self.scheduler.step_count + 1}")
                return []
            return super().step()

    def follow(self, commands: list[tuple] | None) -> None:
        """Ranks > 0: apply rank 0's commands of one step, then run the step."""
        for command in commands or ():
            try:
                if command[0] == "add":
                    _, request_id, prompt, params, priority = command
                    self.add_request(request_id, prompt, params, priority=priority)
                elif command[0] == "abort":
                    self.abort_requests(command[1])
                else:
                    self.reset_prefix_cache(command[1], command[2])
            except KvjaxError as e:
                runtime.abort(f"rank {runtime.rank()} of {runtime.world()}: rank 0's {command[0]} "
                              f"({command[1]!r:.60}) was refused here: {e}")
        self.step()


def announce(config) -> None:
    """Rank 0: tell the other ranks to build the engine of this resolved config (kvjax.engine.llm_engine)."""
    if not announce.exit_registered:
        runtime.at_exit(lambda: channel.send(EXIT, "the job's end"))
        announce.exit_registered = True
    channel.send(("engine", config), "the engine's config")


announce.exit_registered = False


def rank0_value(value):
    """The value rank 0 passes (every rank calls this at the same point): e.g. a profiled pool size, which each
    rank measures on its own devices but which must be one number."""
    if runtime.rank() == 0:
        channel.send(value, "rank 0's value")
        return value
    return channel.receive("rank 0's value")


def run_follower(make_engine, expect_model: str | None = None) -> None:
    """Ranks > 0: build each engine rank 0 announces (make_engine(config): kvjax.engine.llm_engine.LLMEngine, which
    calls this) and step it as rank 0 says; return when rank 0 ends the job. expect_model: the model this rank was
    started with, if it was given one: rank 0's must be the same."""
    llm_engine = None
    while True:
        message = channel.receive("rank 0's next step")
        if message == EXIT:
            return
        if isinstance(message, tuple) and message[0] == "engine":
            if expect_model is not None and message[1].model != expect_model:
                runtime.abort(f"rank {runtime.rank()} of {runtime.world()} was started with model {expect_model!r}, "
                              f"rank 0 runs {message[1].model!r}: start every rank with the same model")
            llm_engine = make_engine(message[1])
        elif llm_engine is None:
            runtime.abort(f"rank {runtime.rank()} of {runtime.world()}: rank 0 sent a step before any engine")
        else:
            llm_engine.engine.follow(message)


__all__ = ["EXIT", "LockstepEngine", "LockstepScheduler", "announce", "plan_fingerprint", "rank0_value",
           "run_follower"]
