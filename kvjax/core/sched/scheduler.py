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

Host offload tier (`num_host_blocks` > 0; vLLM's OffloadingConnector, scheduler side): at
each admission attempt, all of the request's full-block hashes are touched first (resident
or not, so an ARC ghost hit moves p); after the device prefix hits, the request's hash chain
continues in the tier (kvjax.kv_offload.manager.lookup, capped so the last token is still
computed); its contiguous host hits take fresh blocks in the same `allocate_slots` call and
count as computed tokens (vLLM's external tokens), so only the rest is scheduled, and the
plan lists their copies (`StepPlan.loads`; the slots stay pinned until `loads_done`). If
the pool has no room for them and the rest, the request waits like any admission. After
every step (`update`, `apply_decode_steps`), each request's full blocks not yet offered are
offered to the tier
(`host_cache.store`, which keeps the hashes it lacks and evicts by its policy, LRU or ARC):
from block 0, device hits included, or from after its host hits; when it stored any, the
request's earlier blocks are touched too. `take_stores` hands the engine the copies to make.

`schedule()` reads as those steps: `_schedule_running` (with `_preempt_for` when the pool is
short), then `_admit_waiting`, then `_plan`. Each piece of request state has one owner: the
host `Request` holds tokens, output and status; the pool holds block tables and how many
tokens each request has computed (the plan's `seq_lens` are read from it, never mirrored).

The scheduler knows nothing about the model: `schedule()` returns a `StepPlan` (which
requests run, how many tokens each, their token ids and block tables as NumPy arrays) that a
model runner consumes; `update(plan, sampled)` takes the sampled tokens back through the decode
transition (kvjax.core.sched.transition, the one rule the engine's device loop applies too): the
stop check in vLLM 0.33 `check_stop`'s order, "stop" when the token is one of its stop ids (its
stop_token_ids, and the model's EOS unless it ignores EOS), else "length" when it reached its
`max_new_tokens` (the engine clamps it to max_model_len); then one batched `append_token_step` of
the tokens that go on. The plan carries each request's remaining tokens and stop ids, so a model
runner never reads them from the requests. `finish_request` ends one from outside (a stop
string). A finished request's blocks return to the pool at once; its full blocks stay cached.

The running requests' allocation asks `manager.step_fits` first — the same rule the engine's
device decode loop applies before each of its steps — and, when everything fits, is one
batched `allocate_step` that must then succeed for every request. Otherwise the same call
allocates up to the first refusal, the scheduler preempts and resumes from the refused request,
which reproduces vLLM's one-request-at-a-time loop. `apply_decode_steps(plan, sampled, state, finish)`
adopts several decode steps that a device loop ran itself with the same transition
(kvjax.engine.core, `steps_per_call`). A pool refusal that the accounting says cannot happen raises
`SchedulerError` (never `assert`, which `python -O` strips).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.accounting import memory as mem
from kvjax.accounting.budget import pow2_bucket
from kvjax.config.scheduler import SchedulerConfig
from kvjax.core import kv_cache_manager as manager
from kvjax.core import kv_cache_utils as hashing
from kvjax.core.sched.output import StepPlan
from kvjax.core.sched.request import Request
from kvjax.core.sched.transition import FINISH_REASONS, DecodeRows, host_transition
from kvjax.errors import KvjaxError
from kvjax.kv_offload import connector
from kvjax.kv_offload import manager as host_cache


class SchedulerError(manager.PoolRefusedError):
    """The block pool refused an operation that the scheduler's own accounting said must
    succeed, or the schedule itself went wrong: a bug in kvjax, not bad input. The message
    names the request and the counts."""


def _devices(placement) -> list:
    """The devices a placement (a device, or a sharding) puts an array on."""
    return [placement] if isinstance(placement, jax.Device) else sorted(placement.device_set, key=lambda d: d.id)


@dataclass
class _Step:
    """What one `schedule()` call has planned so far."""

    budget: int  # tokens left in this step
    scheduled: dict[str, int] = field(default_factory=dict)  # req_id -> tokens; insertion = scheduling order
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)

    def take(self, req: Request, n: int) -> None:
        self.scheduled[req.req_id] = n
        self.budget -= n


class Scheduler:
    """Requests, their queues, and the block pool state (the one owner of block tables and of
    how many tokens each request has computed); see the module docstring."""

    def __init__(self, config: SchedulerConfig, placement=None):
        """placement: the device (or a replicated sharding over a tensor-parallel mesh) that holds
        the pool state; default the first device."""
        self.config = config
        self.placement = placement if placement is not None else jax.devices()[0]
        z = config.block_size
        self.max_blocks = -(-config.max_model_len // z)
        self.num_slots = config.num_slots
        mem.check_fits(f"the scheduler's tables ({config.describe()})", config.state_bytes(),
                       _devices(self.placement))
        # Committed to the device, as every pool function's output is: otherwise a function first
        # called on the fresh state compiles once more when it later sees a committed one.
        self.state = jax.device_put(manager.init(config.num_blocks, z, self.num_slots, self.max_blocks,
                                                 config.prefix_caching), self.placement)
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._arrivals = 0
        # The host offload tier's index; the engine moves the bytes (kvjax.kv_offload.host_pages).
        self.host = self.new_host_index() if config.num_host_blocks else None
        self.stores: list[tuple[int, int]] = []  # (device block, host slot) to copy after the step
        self.host_hit_tokens = 0

    def new_host_index(self) -> host_cache.HostIndex:
        """An empty host tier index, committed to the device like the pool state."""
        return jax.device_put(host_cache.init(self.config.num_host_blocks, self.config.host_policy),
                              self.placement)

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

    def output(self, req_id: str) -> tuple[int, ...]:
        """The tokens a request has generated so far."""
        return tuple(self.requests[req_id].output)

    def finish_reason(self, req_id: str) -> str | None:
        return self.requests[req_id].finish_reason

    def forget(self, req_id: str) -> Request:
        """Drop a finished request's record (vLLM's scheduler forgets finished requests) and
        return it: its output, finish reason and preemptions."""
        if self.requests[req_id].status != "finished":
            raise SchedulerError(f"request {req_id!r} is {self.requests[req_id].status}, not finished")
        return self.requests.pop(req_id)

    def abort_all(self) -> None:
        """End and forget every request (an interrupt or an error in the engine): no request,
        block or slot is left behind in a scheduler that outlives the call."""
        for rid, req in list(self.requests.items()):
            if req.status != "finished":
                self.finish_request(rid, "abort")
            self.requests.pop(rid)

    def reset_prefix_cache(self, reset_host: bool = False) -> bool:
        """Forget every cached block (vLLM's `reset_prefix_cache`); reset_host also empties the
        host tier's index. False, changing nothing, while requests run."""
        if self.has_unfinished():
            return False
        state, ok = manager.reset_prefix_cache(self.state)
        _require(ok, "the block pool refused to reset its prefix cache with no request running")
        self.state = state
        if reset_host and self.host is not None:
            self.host = self.new_host_index()
        return True

    def num_free_blocks(self) -> int:
        return int(self.state.pool.num_free)

    def host_blocks_in_use(self) -> int:
        return 0 if self.host is None else int(self.host.valid.sum())

    def _key(self, req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival) if self.config.policy == "priority" else (0, req.arrival)

    def _put_in_pool(self, req: Request) -> bool:
        """Give req a pool slot holding its tokens (prompt + output so far)."""
        used = {r.slot for r in self.requests.values() if r.slot is not None}
        free = [s for s in range(self.num_slots) if s not in used]
        if not free:  # take the slot of the last waiting request that has one (it holds no blocks)
            donors = [r for r in reversed(self.waiting) if r.slot is not None and r is not req]
            if not donors:
                return False
            self.state, ok = manager.remove_request(self.state, donors[0].slot)
            _require(ok, f"the pool refused to remove waiting request {donors[0].req_id!r} from slot "
                         f"{donors[0].slot}: it still holds blocks")
            free, donors[0].slot = [donors[0].slot], None
        toks = np.zeros(self.max_blocks * self.config.block_size, np.int32)
        toks[: req.num_tokens] = req.tokens
        has_salt, key = hashing.salt_key(req.salt)
        self.state, ok = manager.add_request(self.state, free[0], jnp.asarray(toks), req.num_tokens,
                                          has_salt, np.asarray(key, np.uint32))
        _require(ok, f"the pool refused request {req.req_id!r} ({req.num_tokens} tokens) in free slot {free[0]}")
        req.slot = free[0]
        return True

    def _preempt(self, victim: Request, step: "_Step") -> None:
        """Free all the victim's blocks (the pool resets its computed tokens), put it at the
        front of waiting, and give back any budget it had been given this step."""
        self.state, ok = manager.free(self.state, victim.slot)
        _require(ok, f"the pool refused to free running request {victim.req_id!r} (slot {victim.slot})")
        self.running.remove(victim)
        victim.status = "waiting"
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        step.budget += step.scheduled.pop(victim.req_id, 0)
        step.preempted.append(victim.req_id)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        """Plan one engine step: running requests first (preempting until they fit), then, if
        nothing was preempted, admit waiting requests into what is left of the token budget."""
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step, self._computed())
        if not step.preempted:
            self._admit_waiting(step)
        return self._plan(step)

    def _computed(self) -> np.ndarray:
        """Tokens computed per pool slot, i32[R]: the pool owns this count (one copy, read once)."""
        return np.asarray(jax.device_get(self.state.reqs.num_computed))

    def _schedule_running(self, step: "_Step", computed: np.ndarray) -> None:
        """Give every running request min(its unscheduled tokens, remaining budget), in order.
        The batch is one `allocate_step`, which allocates up to the first refusal (all of it when
        `manager.step_fits` says it fits); `_preempt_for` resolves the refusal and the rest
        continue after it (vLLM's request-at-a-time loop, batched where it can be)."""
        i = 0
        while i < len(self.running) and step.budget > 0:
            batch, nums, left = self.running[i:], [], step.budget
            for r in batch:  # each running request is allocated once per step: `computed` stays valid
                nums.append(min(r.num_tokens - int(computed[r.slot]), left))
                left -= nums[-1]
            reqs = [r.slot if n > 0 else -1 for r, n in zip(batch, nums)]
            pad = self.config.max_num_seqs - len(reqs)  # one static batch size: one compile
            reqs_a = np.asarray(reqs + [-1] * pad, np.int32)
            nums_a = np.asarray(nums + [0] * pad, np.int32)
            need, fits = manager.step_fits(self.state, reqs_a, nums_a)
            self.state, ok = manager.allocate_step(self.state, reqs_a, nums_a)
            failed = None
            for r, n, s, k, blocks in zip(batch, nums, reqs, np.asarray(ok), np.asarray(need)):
                if s < 0:
                    continue
                if not k:
                    if fits:
                        raise SchedulerError(f"the pool refused {int(blocks)} new block(s) for request {r.req_id!r} "
                                             f"although the step's {int(need.sum())} fit its free blocks")
                    failed = (r, n)
                    break
                step.take(r, n)
            if failed is None:
                return
            req, n = failed
            self._preempt_for(req, n, step)
            i = self.running.index(req) + 1 if req in self.running else len(self.running)

    def _preempt_for(self, req: Request, n: int, step: "_Step") -> None:
        """Preempt (policy's victim first) until req's n tokens fit, or req itself is preempted."""
        while True:
            victim = max(self.running, key=self._key) if self.config.policy == "priority" else self.running[-1]
            self._preempt(victim, step)
            if victim is req:
                return
            self.state, ok = manager.allocate_slots(self.state, req.slot, n)
            if bool(ok):
                step.take(req, n)
                return

    def _admit_waiting(self, step: "_Step") -> None:
        """Admit waiting requests in order while rows and budget remain: prefix hits, then a
        chunk of the rest (all of it without chunked prefill). The first that does not fit stops."""
        cfg, z = self.config, self.config.block_size
        while self.waiting and len(self.running) < cfg.max_num_seqs and step.budget > 0:
            req = min(self.waiting, key=self._key) if cfg.policy == "priority" else self.waiting[0]
            if req.slot is None and not self._put_in_pool(req):
                return
            hits, nh = manager.get_computed_blocks(self.state, req.slot)
            host_hashes, nx = self._host_lookup(req, int(nh))
            rest = req.num_tokens - (int(nh) + nx) * z
            if not cfg.chunked_prefill and rest > step.budget:
                return  # vLLM without chunked prefill: wait for a step with room for the whole prompt
            n = min(rest, step.budget)
            # Host hits take fresh blocks and count as computed (vLLM's external tokens); their
            # bytes are copied in before the step, so only the rest is prefilled.
            self.state, ok = manager.allocate_slots(self.state, req.slot, nx * z + n, hits, nh)
            if not bool(ok):
                return
            if nx:
                self._host_load(req, host_hashes, int(nh), nx, step)
                req.host_next = int(nh) + nx  # loaded blocks are not offered back
            self.waiting.remove(req)
            self.running.append(req)
            step.admitted.append(req.req_id)
            req.status = "running"
            step.take(req, n)

    # ------------------------------------------------------------------ the host tier
    def _host_lookup(self, req: Request, num_hits: int) -> tuple[np.ndarray | None, int]:
        """The request's block hashes after its num_hits device hits (u32[M, 2], zero padded) and
        how many of them, from the first, the host tier holds, capped like device hits so the
        last token is computed. First, as vLLM's connector does at each admission attempt, all
        of the request's full-block hashes are touched, resident or not (ARC: a ghost hit
        moves p)."""
        if self.host is None:
            return None, 0
        self.host, hashes, n = connector.lookup(self.host, np.asarray(self.state.reqs.req_hash[req.slot]),
                                                req.num_tokens, num_hits, self.config.block_size, self.max_blocks)
        return hashes, n

    def _host_load(self, req: Request, hashes: np.ndarray, num_hits: int, n: int, step: "_Step") -> None:
        """Pin the request's n host hits until loaded (prepare_load) and plan their copies into
        the fresh blocks after its device hits."""
        self.host, slots = host_cache.prepare_load(self.host, hashes, n)
        blocks = np.asarray(self.state.reqs.block_table[req.slot])[num_hits:num_hits + n]
        step.loads += zip(np.asarray(slots[:n]).tolist(), blocks.tolist())
        self.host_hit_tokens += n * self.config.block_size

    def loads_done(self, plan: StepPlan) -> None:
        """The engine copied the plan's loads in: unpin their host slots (complete_load)."""
        if len(plan.loads):
            slots = np.full(pow2_bucket(len(plan.loads)), -1, np.int32)
            slots[: len(plan.loads)] = plan.loads[:, 0]
            self.host, ok = host_cache.complete_load(self.host, slots, len(plan.loads))
            _require(ok, f"the host tier refused to unpin slots {plan.loads[:, 0].tolist()} after their load")

    def _store(self, reqs: list[Request], tables, end) -> None:
        """Offer the host tier each row's full blocks not yet offered: logical blocks
        req.host_next .. end[i] - 1 of tables[i] (vLLM's connector starts a request at block 0,
        device hits included, or after its host hits), row by row as the connector does
        (`host_cache.offer`). `stores` lists the (device block, host slot) copies to make."""
        if self.host is None or not any(b > r.host_next for r, b in zip(reqs, end)):
            return
        req_hash = np.asarray(self.state.reqs.req_hash)  # a computed full block's hash is its request's
        for req, t, b in zip(reqs, tables, end):
            self.host, stored, req.host_next = connector.offer(self.host, req_hash[req.slot], req.host_next, int(b))
            self.stores += [(int(t[j]), s) for j, s in stored]

    def take_stores(self) -> list[tuple[int, int]]:
        stores, self.stores = self.stores, []
        return stores

    def _plan(self, step: "_Step") -> StepPlan:
        reqs = [self.requests[r] for r in step.scheduled]
        nums = np.array([step.scheduled[r.req_id] for r in reqs], np.int32)
        slots = np.array([r.slot for r in reqs], np.int32)
        tables, computed = jax.device_get((self.state.reqs.block_table, self.state.reqs.num_computed))
        tables = np.asarray(tables)[slots] if reqs else np.zeros((0, self.max_blocks), np.int32)
        seq_lens = np.asarray(computed)[slots].astype(np.int32) if reqs else np.zeros(0, np.int32)
        token_ids = np.array([t for r, n, e in zip(reqs, nums, seq_lens) for t in r.tokens[e - n:e]], np.int32)
        stop_ids = np.full((len(reqs), pow2_bucket(max((len(r.stop_ids) for r in reqs), default=1))), -1, np.int32)
        for i, r in enumerate(reqs):
            stop_ids[i, :len(r.stop_ids)] = sorted(r.stop_ids)
        return StepPlan(
            req_ids=tuple(r.req_id for r in reqs), slots=slots, num_scheduled=nums, token_ids=token_ids,
            block_tables=tables, seq_lens=seq_lens,
            sample=np.array([e == r.num_tokens for r, e in zip(reqs, seq_lens)], bool),
            preempted=tuple(step.preempted),
            remaining=np.array([r.max_new_tokens - len(r.output) for r in reqs], np.int32).reshape(-1),
            stop_ids=stop_ids, admitted=np.array([r.req_id in step.admitted for r in reqs], bool),
            # a decoding request computes the one token it sampled last; every other row prefills
            prefill=np.array([not r.output or e - n < r.num_tokens - 1 for r, n, e in zip(reqs, nums, seq_lens)],
                             bool),
            num_tokens=np.array([r.num_tokens for r in reqs], np.int32).reshape(-1),
            num_preemptions=np.array([r.num_preemptions for r in reqs], np.int32).reshape(-1),
            loads=np.array(step.loads, np.int32).reshape(-1, 2))

    def decode_rows(self, plan: StepPlan, rows=None, num_rows: int | None = None) -> DecodeRows:
        """The plan's requests as the decode transition's rows: plan order, padded to
        max_num_seqs rows (one compile), or placed at `rows` of `num_rows` (the engine's rows)."""
        b = num_rows or self.config.max_num_seqs
        at = np.arange(plan.num_requests) if rows is None else np.asarray(rows, np.int64)
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
        """Append the steps' tokens (i32[n, B]) to the active requests' outputs, and finish those
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
        self.running.remove(req)
        req.status, req.slot = "finished", None

    def decode_steps(self, plan: StepPlan, run) -> tuple[list[str], object]:
        """Let a device loop run the decode plan and its next steps itself: run(pool state) →
        (pool state, sampled i32[n, B] per step and plan row, finish i32[B], extra). The
        scheduler hands its pool to the loop and adopts what it returns (apply_decode_steps).
        → (finished request ids, extra)."""
        if not plan.is_decode:
            raise SchedulerError("decode_steps needs a decode plan: one token per request, all sampling")
        state, sampled, finish, extra = run(self.state)
        return self.apply_decode_steps(plan, sampled, state, finish), extra

    def apply_decode_steps(self, plan: StepPlan, sampled, state: manager.KVCacheManager, finish) -> list[str]:
        """Adopt n decode steps that a device loop ran itself (kvjax.engine.core, --steps-per-call).

        `plan` is a decode plan (one token per request, every request samples) that `schedule()`
        returned; the device loop ran it, then n - 1 more steps of the same requests, doing
        what `update` + `schedule` would have done between them, with the same decode transition
        (kvjax.core.sched.transition) after each step. It stopped after the first step in which
        a request finished (length or stop token), before an allocation that did not fit (the
        host then preempts as usual), or after its step limit. sampled: i32[n, B] tokens per step
        and plan row; state: the loop's final pool; finish: i32[B] each row's FINISH_REASONS
        index after the last step. Finishes the requests that ended. Returns their ids."""
        sampled, finish = np.asarray(sampled), np.asarray(finish)
        if sampled.ndim != 2 or sampled.shape[1] != plan.num_requests or sampled.shape[0] < 1:
            raise SchedulerError(f"sampled must be [n >= 1, {plan.num_requests}], got {sampled.shape}")
        if not plan.is_decode:
            raise SchedulerError("apply_decode_steps needs a decode plan: one token per request, all sampling")
        self.state = state
        steps, z = sampled.shape[0], self.config.block_size
        if self.host is not None:
            tables = np.asarray(state.reqs.block_table)[plan.slots]
            self._store([self.requests[r] for r in plan.req_ids], tables, (plan.seq_lens - 1 + steps) // z)
        return self._adopt(plan, sampled, np.ones(plan.num_requests, bool), finish)


def _require(ok, message: str) -> None:
    if not bool(ok):
        raise SchedulerError(message)
