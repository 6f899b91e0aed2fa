"""The scheduler's second half: taking a step's results back (vLLM V1's
`Scheduler.update_from_output`), for the host loop (`update`) and for a device loop that ran
several decode steps itself (`decode_steps`, `apply_decode_steps`), both through the one decode
transition (kvjax.core.sched.transition); and ending requests (`finish_request`).

`SchedulerUpdates` is a base of kvjax.core.sched.scheduler.Scheduler, whose state it works on:
`requests`, `running`, `state` (the pool) and the host tier's offers (`_store`).
"""
from __future__ import annotations

import heapq

import jax
import numpy as np

from kvjax.core import kv_cache_manager as manager
from kvjax.core.sched.output import StepPlan
from kvjax.core.sched.request import Request
from kvjax.core.sched.transition import FINISH_REASONS, DecodeRows, host_transition


class SchedulerError(manager.PoolRefusedError):
    """The block pool refused an operation that the scheduler's own accounting said must
    succeed, or the schedule itself went wrong: a bug in kvjax, not bad input. The message
    names the request and the counts."""


class SchedulerUpdates:
    """Taking results back and ending requests (see the module docstring)."""

    def decode_rows(self, plan: StepPlan, by_row: bool = False) -> DecodeRows:
        """The plan's requests as the decode transition's max_num_seqs rows (one compile): in plan
        order, or with by_row at their batch rows (plan.rows), as the engine's device loop runs them."""
        b = self.config.max_num_seqs
        at = plan.rows if by_row else np.arange(plan.num_requests)
        slots, remaining = np.full(b, -1, np.int32), np.zeros(b, np.int32)
        stop_ids = np.full((b, plan.stop_ids.shape[1]), -1, np.int32)
        slots[at], remaining[at], stop_ids[at] = plan.slots, plan.remaining, plan.stop_ids
        return DecodeRows(slots, remaining, stop_ids)

    def update(self, plan: StepPlan, sampled) -> list[str]:
        """Take the sampled tokens (i32[B], aligned with plan rows; rows with sample False
        are ignored) through the decode transition (kvjax.core.sched.transition: the stop check,
        then the append of each token that goes on). Returns the finished request ids."""
        sampled = np.asarray(sampled).reshape(-1)
        if sampled.shape[0] != plan.num_requests:
            raise SchedulerError(f"got {sampled.shape[0]} sampled tokens for {plan.num_requests} requests")
        z, b = self.config.block_size, self.config.max_num_seqs
        self._store([self.requests[r] for r in plan.req_ids], plan.block_tables, plan.seq_lens // z)
        active = np.zeros(b, bool)
        active[:plan.num_requests] = np.asarray(plan.sample, bool) & np.array(
            [self.requests[r].status == "running" for r in plan.req_ids], bool)
        tokens = np.zeros(b, np.int32)
        tokens[:plan.num_requests] = sampled
        self.state, t = host_transition(self.state, self.decode_rows(plan), tokens, active)
        finish, refused = jax.device_get((t.finish, t.append_refused))
        if refused.any():
            i = int(np.flatnonzero(refused)[0])
            req = self.requests[plan.req_ids[i]]
            raise SchedulerError(f"the pool refused sampled token {int(tokens[i])} of request {req.req_id!r} "
                                 f"({req.num_tokens + 1} tokens)")
        return self._adopt(plan, tokens[None, :plan.num_requests], active[:plan.num_requests],
                           finish[:plan.num_requests])

    def _adopt(self, plan: StepPlan, sampled: np.ndarray, active: np.ndarray, finish: np.ndarray) -> list[str]:
        """Append the steps' tokens (i32[steps, B]) to the active requests' outputs, and finish those
        whose transition finished them (finish: i32[B] FINISH_REASONS index, after the last step)."""
        finished = []
        for i, rid in enumerate(plan.req_ids):
            if not active[i]:
                continue
            req = self.requests[rid]
            req.output += [int(x) for x in sampled[:, i]]
            req.finish_reason = FINISH_REASONS[int(finish[i])]
            if req.finish_reason:
                finished.append(req)
        for req in finished:
            self._finish(req)
        return [r.req_id for r in finished]

    def finish_request(self, req_id: str, reason: str) -> None:
        """End a running or waiting request from outside (vLLM `finish_requests`: a stop string
        the detokenizer found, an abort): its blocks return to the pool."""
        req = self.requests[req_id]
        if req.status == "finished":
            raise SchedulerError(f"request {req_id!r} already finished ({req.finish_reason})")
        req.finish_reason = reason
        if req.status == "running":
            self._finish(req)
            return
        self.waiting.remove(req)
        if req.slot is not None:
            self.state, ok = manager.remove_request(self.state, req.slot)
            _require(ok, f"the pool refused to remove waiting request {req_id!r} from slot {req.slot}")
        req.status, req.slot = "finished", None

    def _finish(self, req: Request) -> None:
        self.state, ok = manager.free(self.state, req.slot)
        self.state, ok2 = manager.remove_request(self.state, req.slot)
        _require(bool(ok) and bool(ok2), f"the pool refused to finish request {req.req_id!r} (slot {req.slot})")
        self._leave_running(req)
        req.status, req.slot = "finished", None

    def _leave_running(self, req: Request) -> None:
        """A running request stops running (finished or preempted): its batch row is free again."""
        self.running.remove(req)
        heapq.heappush(self.free_rows, req.row)
        req.row = None

    def decode_steps(self, plan: StepPlan, run) -> tuple[list[str], object]:
        """Let a device loop run the decode plan and its next steps itself: run(pool state) →
        (pool state, sampled i32[steps, B] per step and plan row, finish i32[B], extra). The
        scheduler hands its pool to the loop and adopts what it returns (apply_decode_steps).
        → (finished request ids, extra)."""
        if not plan.is_decode:
            raise SchedulerError("decode_steps needs a decode plan: one token per request, all sampling")
        state, sampled, finish, extra = run(self.state)
        return self.apply_decode_steps(plan, sampled, state, finish), extra

    def apply_decode_steps(self, plan: StepPlan, sampled, state: manager.KVCacheManager, finish) -> list[str]:
        """Adopt n decode steps that a device loop ran itself (kvjax.engine.core, --steps-per-call).

        `plan` is a decode plan (one token per request, every request samples: `decode_steps`
        checks it before the loop runs) that `schedule()` returned; the device loop ran it, then
        n - 1 more steps of the same requests, doing what `update` + `schedule` would have done
        between them, with the same decode transition
        (kvjax.core.sched.transition) after each step. It stopped after the first step in which
        a request finished (length or stop token), before an allocation that did not fit (the
        host then preempts as usual), or after its step limit. sampled: i32[steps, B] tokens per step
        and plan row; state: the loop's final pool; finish: i32[B] each row's FINISH_REASONS
        index after the last step. Finishes the requests that ended. Returns their ids."""
        sampled, finish = np.asarray(sampled), np.asarray(finish)
        if sampled.ndim != 2 or sampled.shape[1] != plan.num_requests or sampled.shape[0] < 1:
            raise SchedulerError(f"sampled must be [n >= 1, {plan.num_requests}], got {sampled.shape}")
        self.state = state
        steps, z = sampled.shape[0], self.config.block_size
        if self.tier is not None:
            tables = np.asarray(state.reqs.block_table)[plan.slots, 0]
            self._store([self.requests[r] for r in plan.req_ids], tables, (plan.seq_lens - 1 + steps) // z)
        return self._adopt(plan, sampled, np.ones(plan.num_requests, bool), finish)


def _require(ok, message: str) -> None:
    if not bool(ok):
        raise SchedulerError(message)
