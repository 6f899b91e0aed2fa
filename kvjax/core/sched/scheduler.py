"""Continuous batching with preemption by recompute (vLLM V1 `core/sched/scheduler.py`).

Host-side Python around the jitted KV cache manager and its block pool
(`kvjax/core/kv_cache_manager.py`, `kvjax/core/block_pool.py`). Each `schedule()` call
plans one engine step, the way vLLM V1's `Scheduler.schedule` does:

1. RUNNING requests first, in admission order: each gets min(its unscheduled tokens,
   remaining token budget) tokens (1 for a decoding request). If the pool cannot give a
   request the blocks for them, the scheduler preempts `running[-1]`, the most recently
   admitted request (policy "priority": the running request with the largest
   (priority, arrival), lower value = more important, as in vLLM), frees all its blocks,
   resets its computed tokens to 0 and puts it at the FRONT of the waiting queue; it
   repeats until the allocation fits or the request itself is the victim. V1 recomputes;
   it never swaps KV out. The victim's tokens and block hashes stay in the pool, so when
   it is re-admitted its prefix can hit the blocks it cached itself, if not yet evicted.
2. If nothing was preempted this step, WAITING requests are admitted in order (FCFS, or
   by (priority, arrival)) while fewer than `max_num_seqs` run and budget remains: prefix
   hits from `get_computed_blocks`, then `allocate_slots` for (a chunk of) the rest. The
   first one that does not fit stops admission. A prompt longer than the remaining budget is
   admitted with a chunk and continues, as a running request, in the next steps (chunked
   prefill, kvjax.engine.core's default); it samples only once its last token is computed. With
   `chunked_prefill=False` (vLLM's `enable_chunked_prefill=False`) a request is admitted only
   if all of its tokens past its prefix hit fit the remaining budget, so a prompt is never split.

Host offload tier (`num_host_blocks` > 0; vLLM's OffloadingConnector, scheduler side,
kvjax.kv_offload.connector): at admission, the tier's hits after the device prefix hits take
fresh blocks in the same `allocate_slots` call and count as computed, so only the rest is
scheduled (`StepPlan.loads` lists their copies); after every step, each request's full blocks
not yet offered are offered to the tier (`take_stores` hands the engine the copies to make).

`schedule()` reads as those steps: `_schedule_running` (`_preempt_for` when the pool is short),
`_admit_waiting`, `_plan`. The host `Request` holds tokens, output and status; the pool (the
one owner) block tables and computed tokens (the plan's `seq_lens` are read from it).

The scheduler knows nothing about the model: `schedule()` returns a `StepPlan` (which requests
run, how many tokens each, their token ids, block tables, remaining tokens and stop ids as NumPy
arrays) that a model runner consumes. Schedule and update live in one class, as in vLLM: `update
(plan, sampled)` (vLLM's `update_from_output`) takes the sampled tokens back through the decode
transition (kvjax.core.sched.transition: the stop check in vLLM 0.33 `check_stop`'s order, then
the append of the tokens that go on), the one rule the engine's device loop applies too, whose
steps `decode_steps` / `apply_decode_steps` adopt (kvjax.engine.core, `steps_per_call`);
`finish_request` ends one from outside (a stop string, an abort). A finished request's blocks
return to the pool at once; its full blocks stay cached.

The running requests' allocation is one batched call up to the first refusal (`_schedule_running`).
A pool refusal that the accounting says cannot happen raises `SchedulerError` (never `assert`).
"""

from __future__ import annotations

import collections
import heapq
import itertools
from typing import Sequence

import jax
import numpy as np

from kvjax.accounting import memory as mem
from kvjax.config.scheduler import SchedulerConfig
from kvjax.core import kv_cache_manager as manager
from kvjax.core import kv_cache_utils as hashing
from kvjax.core.sched.first_blocks import FirstBlocks
from kvjax.core.sched.output import StepDraft, StepPlan
from kvjax.core.sched.request import Request
from kvjax.core.sched.stats import SchedulerStats, SinceLastStats
from kvjax.core.sched.tables import state_bytes
from kvjax.core.sched.transition import FINISH_REASONS, DecodeRows, host_transition
from kvjax.errors import KvjaxError
from kvjax.kv_offload import connector
from kvjax.math_utils import cdiv, pow2_bucket


class SchedulerError(manager.PoolRefusedError):
    """The block pool refused an operation that the scheduler's own accounting said must
    succeed, or the schedule itself went wrong: a bug in kvjax, not bad input. The message
    names the request and the counts."""


def _require(ok, message: str) -> None:
    if not bool(ok):
        raise SchedulerError(message)


def _devices(placement) -> list:
    """The devices a placement (a device, or a sharding) puts an array on."""
    return [placement] if isinstance(placement, jax.Device) else sorted(placement.device_set, key=lambda d: d.id)


class Scheduler:
    """Requests, their queues and the block pool state (the module docstring)."""

    def __init__(self, config: SchedulerConfig, placement=None):
        """placement: the device (or a replicated sharding over a tensor-parallel mesh) that holds
        the pool state; default the first device."""
        self.config = config
        self.placement = placement if placement is not None else jax.devices()[0]
        z = config.block_size
        self.max_blocks = cdiv(config.max_model_len, z)
        self.num_slots = config.num_slots
        mem.check_fits(f"the scheduler's tables ({config.describe()})", state_bytes(config), _devices(self.placement))
        # Committed to the device, as every pool function's output is: otherwise a function first
        # called on the fresh state compiles once more when it later sees a committed one.
        self.state = jax.device_put(manager.init(config.num_blocks, z, self.num_slots, self.max_blocks,
                                                 config.prefix_caching, config.windows), self.placement)
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_rows = list(range(config.max_num_seqs))  # a heap: admission takes the lowest
        self.free_slots = list(range(self.num_slots))  # a heap of the pool slots no request holds
        self.first_blocks = FirstBlocks(z)  # skips the prefix search of a request that cannot hit
        self._no_hits = jax.device_put((np.zeros((len(config.windows), self.max_blocks), np.int32), np.int32(0)),
                                       self.placement)  # get_computed_blocks' miss, as its outputs are placed
        self.num_preemptions = 0
        self._arrivals = 0
        self._since = SinceLastStats()  # what happened since the last make_stats()
        # The host offload tier's index; the engine moves the bytes (kvjax.kv_offload.host_pages).
        self.tier = connector.HostTier(config.num_host_blocks, config.host_policy, self.placement, z,
                                       self.max_blocks) if config.num_host_blocks else None

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt: list[int], max_new_tokens: int,
                    priority: int = 0, salt: str | None = None, stop_ids=frozenset()) -> None:
        if req_id in self.requests:
            raise KvjaxError(f"request id {req_id!r} already used")
        if not prompt or max_new_tokens < 1:
            raise KvjaxError(f"request {req_id!r}: need a non-empty prompt and max_new_tokens >= 1, "
                             f"got {len(prompt)} tokens, max_new_tokens={max_new_tokens}")
        if len(prompt) + max_new_tokens > self.config.max_model_len:
            raise KvjaxError(f"request {req_id!r}: {len(prompt)} prompt + {max_new_tokens} new tokens "
                             f"> max_model_len={self.config.max_model_len}")
        if min(prompt) < 0:
            raise KvjaxError(f"request {req_id!r}: token ids must be >= 0, got {min(prompt)}")
        req = Request(req_id, list(prompt), max_new_tokens, priority, salt, frozenset(stop_ids), self._arrivals)
        self._arrivals += 1
        self.requests[req_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def output(self, req_id: str) -> Sequence[int]:
        """The tokens a request has generated so far: the request's own list, not a copy (the
        engine reads it for every row of every step), so read it and do not change it."""
        return self.requests[req_id].output

    def prompt(self, req_id: str) -> Sequence[int]:
        """A request's prompt tokens (its own list: read it, do not change it)."""
        return self.requests[req_id].prompt

    def finish_reason(self, req_id: str) -> str | None:
        return self.requests[req_id].finish_reason

    def forget(self, req_id: str) -> Request:
        """Drop a finished request's record (vLLM's scheduler forgets finished requests) and
        return it: its output, finish reason and preemptions."""
        if self.requests[req_id].status != "finished":
            raise SchedulerError(f"request {req_id!r} is {self.requests[req_id].status}, not finished")
        return self.requests.pop(req_id)

    def reset_prefix_cache(self, reset_running: bool = False, reset_host: bool = False) -> bool:
        """Forget every cached block (vLLM's `reset_prefix_cache`): refused (False, nothing changed)
        while a request holds blocks, as the pool refuses, unless reset_running, which first
        preempts every running request, last admitted first, so that they wait again in their
        admission order (vLLM's). reset_host also empties the host tier's index."""
        if reset_running:
            step = StepDraft(budget=0)
            while self.running:
                self._preempt(self.running[-1], step)
        state, ok = manager.reset_prefix_cache(self.state)
        if not bool(ok):
            _require(not reset_running, "the block pool refused to reset its prefix cache with every request "
                                        "preempted")
            return False
        self.state = state
        if reset_host and self.tier is not None:
            self.tier.index = self.tier.new_index()
        return True

    def num_free_blocks(self) -> int:
        return int(self.state.pool.num_free)

    def host_blocks_in_use(self) -> int:
        return 0 if self.tier is None else self.tier.blocks_in_use()

    def _key(self, req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival) if self.config.policy == "priority" else (0, req.arrival)

    def _put_in_pool(self, req: Request) -> bool:
        """Give req a pool slot holding its tokens (prompt + output so far)."""
        if not self.free_slots:  # take the slot of the last waiting request that has one (it holds no blocks)
            donor = next((r for r in reversed(self.waiting) if r.slot is not None and r is not req), None)
            if donor is None:
                return False
            self.state, ok = manager.owned.remove_request(self.state, donor.slot)
            _require(ok, f"the pool refused to remove waiting request {donor.req_id!r} from slot "
                         f"{donor.slot}: it still holds blocks")
            self._release_slot(donor)
        slot = self.free_slots[0]  # the lowest free slot
        toks = np.zeros(self.max_blocks * self.config.block_size, np.int32)
        toks[: req.num_tokens] = req.tokens
        has_salt, key = hashing.salt_key(req.salt)
        self.state, ok = manager.owned.add_request(self.state, slot, toks, req.num_tokens,
                                                   has_salt, np.asarray(key, np.uint32))
        _require(ok, f"the pool refused request {req.req_id!r} ({req.num_tokens} tokens) in free slot {slot}")
        req.slot = heapq.heappop(self.free_slots)
        self.first_blocks.add(req)
        return True

    def _release_slot(self, req: Request) -> None:  # the pool removed req: its slot is free
        heapq.heappush(self.free_slots, req.slot)
        req.slot = None

    def _preempt(self, victim: Request, step: StepDraft) -> None:
        """Free all the victim's blocks (the pool resets its computed tokens), put it at the
        front of waiting, and give back any budget it had been given this step."""
        self.state, ok = manager.owned.free(self.state, victim.slot)
        _require(ok, f"the pool refused to free running request {victim.req_id!r} (slot {victim.slot})")
        self._leave_running(victim)
        victim.status, victim.num_preemptions = "waiting", victim.num_preemptions + 1
        self.num_preemptions += 1
        self._since.preempted.append(victim.req_id)
        self.waiting.appendleft(victim)
        step.budget += step.scheduled.pop(victim.req_id, (victim, 0, 0))[1]
        step.preempted.append(victim.req_id)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        """Plan one engine step: running requests first (preempting until they fit), then, if
        nothing was preempted, admit waiting requests into what is left of the token budget."""
        step = StepDraft(budget=self.config.max_num_batched_tokens)
        self._since.used = None
        self._schedule_running(step, self._computed())
        if not step.preempted:
            self._admit_waiting(step)
        return self._plan(step)

    def _computed(self) -> np.ndarray:
        """Tokens computed per pool slot, i32[R]: the pool owns this count (read once per step; the
        plan's seq_lens are these plus the tokens scheduled)."""
        return np.asarray(jax.device_get(self.state.reqs.num_computed))

    def _schedule_running(self, step: StepDraft, computed: np.ndarray) -> None:
        """Give every running request min(its unscheduled tokens, remaining budget), in order.
        The batch is one `allocate_step`, which allocates up to the first refusal (all of it when
        `manager.step_fits` says it fits); `_preempt_for` resolves the refusal and the rest
        continue after it (vLLM's request-at-a-time loop, batched where it can be)."""
        i = 0
        while i < len(self.running) and step.budget > 0:
            batch = self.running[i:]
            b = len(batch)
            slots, num_tokens = np.array([(r.slot, r.num_tokens) for r in batch], np.int32).T
            starts = computed[slots]  # allocated once per step: `computed` stays valid
            want = num_tokens - starts
            nums = np.clip(step.budget - (np.cumsum(want) - want), 0, want)  # in order, while the budget lasts
            reqs = np.where(nums > 0, slots, -1)
            pad = (0, self.config.max_num_seqs - b)  # one static batch size: one compile
            reqs_a, nums_a = np.pad(reqs, pad, constant_values=-1).astype(np.int32), np.pad(nums, pad).astype(np.int32)
            self.state, ok, need, fits = manager.owned.allocate_running(self.state, reqs_a, nums_a)
            refused = (reqs >= 0) & ~np.asarray(ok)[:b]
            stop = int(np.argmax(refused)) if refused.any() else b  # the first refusal
            if stop < b and fits:
                raise SchedulerError(f"the pool refused {int(need[stop])} new block(s) for request "
                                     f"{batch[stop].req_id!r} though the step's {int(need.sum())} fit its free blocks")
            took = np.flatnonzero(reqs[:stop] >= 0)
            step.take([batch[j] for j in took.tolist()], nums[took].tolist(), starts[took].tolist())
            if stop == b:
                return
            self._preempt_for(req := batch[stop], int(nums[stop]), int(starts[stop]), step)
            i = self.running.index(req) + 1 if req in self.running else len(self.running)

    def _preempt_for(self, req: Request, n: int, start: int, step: StepDraft) -> None:
        """Preempt (policy's victim first) until req's n tokens fit, or req itself is preempted."""
        while True:
            victim = max(self.running, key=self._key) if self.config.policy == "priority" else self.running[-1]
            self._preempt(victim, step)
            if victim is req:
                return
            self.state, ok = manager.owned.allocate_slots(self.state, req.slot, n)
            if bool(ok):
                step.take([req], [n], [start])
                return

    def _admit_waiting(self, step: StepDraft) -> None:
        """Admit waiting requests in order while rows and budget remain: prefix hits, then a
        chunk of the rest (all of it without chunked prefill). The first that does not fit stops."""
        cfg, z = self.config, self.config.block_size
        while self.waiting and len(self.running) < cfg.max_num_seqs and step.budget > 0:
            req = min(self.waiting, key=self._key) if cfg.policy == "priority" else self.waiting[0]
            may_hit = cfg.prefix_caching and self.first_blocks.may_hit(req)  # before it is itself recorded
            if req.slot is None and not self._put_in_pool(req):
                return
            hits, nh = manager.get_computed_blocks(self.state, req.slot) if may_hit else self._no_hits
            host_hashes, nx = (None, 0) if self.tier is None else \
                self.tier.lookup(np.asarray(self.state.reqs.req_hash[req.slot]), req.num_tokens, int(nh))
            rest = req.num_tokens - (int(nh) + nx) * z
            if not cfg.chunked_prefill and rest > step.budget:
                return  # vLLM without chunked prefill: wait for a step with room for the whole prompt
            n = min(rest, step.budget)
            # Host hits take fresh blocks and count as computed (vLLM's external tokens); their
            # bytes are copied in before the step, so only the rest is prefilled.
            self.state, ok = manager.owned.allocate_slots(self.state, req.slot, nx * z + n, hits, nh)
            if not bool(ok):
                return
            if nx:
                step.loads += self.tier.plan_loads(
                    host_hashes, nx, np.asarray(self.state.reqs.block_table[req.slot, 0])[int(nh):int(nh) + nx])
            req.host_next = connector.first_offer(int(nh), nx, req.host_next)
            self.waiting.remove(req)
            self.running.append(req)
            req.row, req.status = heapq.heappop(self.free_rows), "running"
            step.admitted.append(req.req_id)
            self._since.prefix.record(req.num_tokens, (int(nh) + nx) * z, preempted=req.num_preemptions > 0)
            step.take([req], [n], [(int(nh) + nx) * z])

    # ------------------------------------------------------------------ taking a step's results back
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
        if self.tier is not None:
            self._store([self.requests[r] for r in plan.req_ids], plan.block_tables, plan.seq_lens // z)
        active = np.zeros(b, bool)
        active[:plan.num_requests] = np.asarray(plan.sample, bool) & np.array(
            [self.requests[r].status == "running" for r in plan.req_ids], bool)
        tokens = np.zeros(b, np.int32)
        tokens[:plan.num_requests] = sampled
        self.state, t = host_transition(self.state, self.decode_rows(plan), tokens, active)
        finish, refused = jax.device_get((t.finish, t.append_refused))
        if refused.any():
            req = self.requests[plan.req_ids[i := int(np.flatnonzero(refused)[0])]]
            raise SchedulerError(f"the pool refused sampled token {int(tokens[i])} of request {req.req_id!r} "
                                 f"({req.num_tokens + 1} tokens)")
        return self._adopt(plan, tokens[None, :plan.num_requests], active[:plan.num_requests],
                           finish[:plan.num_requests])

    def _adopt(self, plan: StepPlan, sampled: np.ndarray, active: np.ndarray, finish: np.ndarray,
               taken=None) -> list[str]:
        """Append the steps' tokens (i32[steps, B]; row i's first taken[i] with `taken`) to the active
        requests' outputs, and finish those whose transition finished them (finish: i32[B]
        FINISH_REASONS index, after the last step), in the order they finished."""
        finished, columns, finish = [], np.asarray(sampled).T.tolist(), np.asarray(finish).tolist()
        for i, rid in enumerate(plan.req_ids):
            if not active[i]:
                continue
            req = self.requests[rid]
            req.output += columns[i] if taken is None else columns[i][:taken[i]]
            req.finish_reason = FINISH_REASONS[finish[i]]
            if req.finish_reason:
                finished.append((0 if taken is None else int(taken[i]), req))
        self.first_blocks.grown()
        finished.sort(key=lambda f: f[0])  # stable: step by step, plan order in each
        for _, req in finished:
            self._finish(req, in_pool=taken is not None)
        return [r.req_id for _, r in finished]

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
            self.state, ok = manager.owned.remove_request(self.state, req.slot)
            _require(ok, f"the pool refused to remove waiting request {req_id!r} from slot {req.slot}")
            self._release_slot(req)
        req.status = "finished"
        self._since.finished.add(req_id)

    def _finish(self, req: Request, in_pool: bool = False) -> None:
        if not in_pool:  # else a device loop freed and removed it (apply_decode_steps' `taken`)
            self.state, ok = manager.owned.finish(self.state, req.slot)
            _require(bool(ok), f"the pool refused to finish request {req.req_id!r} (slot {req.slot})")
        self._leave_running(req)
        self._release_slot(req)
        req.status = "finished"
        self._since.finished.add(req.req_id)

    def _leave_running(self, req: Request) -> None:
        """A running request stops running (finished or preempted): its batch row is free again."""
        self.running.remove(req)
        heapq.heappush(self.free_rows, req.row)
        req.row = None

    def decode_steps(self, plan: StepPlan, run) -> tuple[list[str], object]:
        """Let a device loop run the decode plan and its next steps itself: run(pool state) →
        (pool state, sampled i32[steps, B] per step and plan row, finish i32[B], used i32[steps]
        blocks in use after each step, extra), adopted (apply_decode_steps). → (finished ids, extra)."""
        if not plan.is_decode:
            raise SchedulerError("decode_steps needs a decode plan: one token per request, all sampling")
        state, sampled, finish, used, extra = run(self.state)
        finished = self.apply_decode_steps(plan, sampled, state, finish)
        self._since.used = tuple(int(u) for u in used)
        return finished, extra

    def make_stats(self) -> SchedulerStats:
        """The step that just ran as the engine reports it (vLLM's `make_stats`, kvjax.core.sched.stats):
        queues and usage after it, blocks in use after each of its model steps (the device loop's
        count, else the pool's now), and what happened since the last stats."""
        usable, since = self.config.num_blocks - 1, self._since
        return since.stats(running=len(self.running), waiting=len(self.waiting), usable=usable,
                           used=since.used or (usable - self.num_free_blocks(),), host_hits=self.host_hit_tokens,
                           host_in_use=self.host_blocks_in_use())

    def apply_decode_steps(self, plan: StepPlan, sampled, state: manager.KVCacheManager, finish,
                           taken=None) -> list[str]:
        """Adopt n decode steps that a device loop ran itself (kvjax.engine.core, --steps-per-call).

        `plan`, from `schedule()`, has every request sample (one token each: `decode_steps` checks it;
        or prompts finishing, in the simulator's model-free loop); the device loop ran it, then n - 1
        more decode steps of the same requests, doing what `update` + `schedule` would have done, with
        the same decode transition (kvjax.core.sched.transition) after each step. It stopped
        after the first step in which a request finished (length or stop token), before an
        allocation that did not fit (the host then preempts as usual), or after its step limit.
        sampled: i32[steps, B] tokens per step and plan row; state: the loop's final pool;
        finish: i32[B] each row's FINISH_REASONS index after the last step; taken: i32[B] the
        steps each row took part in, for a loop that went on past a finish, freeing and removing
        the finished requests in the pool as `update` would (kvjax.simulator.decode); None: every
        row took every step. Finishes the requests that ended. Returns their ids."""
        sampled, finish = np.asarray(sampled), np.asarray(finish)
        if sampled.ndim != 2 or sampled.shape[1] != plan.num_requests or sampled.shape[0] < 1:
            raise SchedulerError(f"sampled must be [n >= 1, {plan.num_requests}], got {sampled.shape}")
        if taken is not None and self.tier is not None:
            raise SchedulerError("a loop past a finish cannot offer the finished requests' blocks to the host tier")
        self.state = state
        steps, z = sampled.shape[0], self.config.block_size
        if self.tier is not None:
            tables = np.asarray(state.reqs.block_table)[plan.slots, 0]
            self._store([self.requests[r] for r in plan.req_ids], tables, (plan.seq_lens - 1 + steps) // z)
        return self._adopt(plan, sampled, np.ones(plan.num_requests, bool), finish, taken)

    # ------------------------------------------------------------------ the host tier
    @property
    def host(self):
        """The host tier's index (kvjax.kv_offload.manager.HostIndex), or None without a tier."""
        return None if self.tier is None else self.tier.index

    @property
    def host_hit_tokens(self) -> int:
        return 0 if self.tier is None else self.tier.hit_tokens

    def loads_done(self, plan: StepPlan) -> None:
        """The engine copied the plan's loads in: unpin their host slots."""
        self.tier.loads_done(plan.loads)

    def take_stores(self) -> list[tuple[int, int]]:
        return [] if self.tier is None else self.tier.take_stores()

    def _store(self, reqs: list[Request], tables, end) -> None:
        """Offer the host tier each row's full blocks not yet offered (logical blocks
        req.host_next .. end[i] - 1 of tables[i]), row by row as vLLM's connector does."""
        if not any(b > r.host_next for r, b in zip(reqs, end)):
            return
        req_hash = np.asarray(self.state.reqs.req_hash)  # a computed full block's hash is its request's
        for req, t, b in zip(reqs, tables, end):
            req.host_next = self.tier.store(req_hash[req.slot], req.host_next, int(b), t)

    def _plan(self, step: StepDraft) -> StepPlan:
        entries, n = step.scheduled.values(), len(step.scheduled)
        reqs = [r for r, _, _ in entries]
        slots, rows, prompt_lens, outputs, max_new, preemptions, stops, nums, starts = np.array(
            [(r.slot, r.row, len(r.prompt), len(r.output), r.max_new_tokens, r.num_preemptions, len(r.stop_ids), k, s)
             for r, k, s in entries], np.int32).reshape(n, 9).T
        tables = np.asarray(jax.device_get(self.state.reqs.block_table))[slots] if reqs else \
            np.zeros((0, len(self.config.windows), self.max_blocks), np.int32)
        seq_lens, num_tokens = starts + nums, prompt_lens + outputs  # in the cache after the step
        token_ids = np.fromiter(itertools.chain.from_iterable(  # a decoding row's one token read in place
            (r.output[e - 1 - p],) if k == 1 and e > p else r.token_range(e - k, e)
            for r, k, e, p in zip(reqs, nums.tolist(), seq_lens.tolist(), prompt_lens.tolist())), np.int32)
        stop_ids = np.full((n, pow2_bucket(max(int(stops.max(initial=0)), 1))), -1, np.int32)
        for i in np.flatnonzero(stops).tolist():
            stop_ids[i, :stops[i]] = sorted(reqs[i].stop_ids)
        return StepPlan(
            req_ids=tuple(step.scheduled), slots=slots, rows=rows, num_scheduled=nums, token_ids=token_ids,
            seq_lens=seq_lens, block_tables=tables[:, 0],
            group_tables=None if self.config.windows == (None,) else tables,
            sample=seq_lens == num_tokens, preempted=tuple(step.preempted), remaining=max_new - outputs,
            stop_ids=stop_ids, admitted=np.arange(n) >= n - len(step.admitted),  # admissions are scheduled last
            # a decoding request computes the one token it sampled last; every other row prefills
            prefill=(outputs == 0) | (seq_lens - nums < num_tokens - 1),
            num_tokens=num_tokens, num_preemptions=preemptions, loads=np.array(step.loads, np.int32).reshape(-1, 2))
