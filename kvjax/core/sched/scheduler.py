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
model runner consumes; `update(plan, sampled)` takes the sampled tokens back, appends them
(one batched `append_token_step`), and finishes requests (vLLM 0.33 `check_stop`, in its
order): "stop" when the token is one of its stop ids (its stop_token_ids, and the model's EOS
unless it ignores EOS), else "length" when it reached its `max_new_tokens` (the engine clamps it
to max_model_len). `finish_request` ends one from outside (a stop string). A finished request's
blocks return to the pool at once; its full blocks stay cached.

The running requests' allocation asks `manager.step_fits` first — the same rule the engine's
device decode loop applies before each of its steps — and, when everything fits, is one
batched `allocate_step` that must then succeed for every request. Otherwise the same call
allocates up to the first refusal, the scheduler preempts and resumes from the refused request,
which reproduces vLLM's one-request-at-a-time loop. `apply_decode_steps(plan, sampled, state)` adopts several
decode steps that a device loop ran itself with the same pool functions (kvjax.engine.core,
`steps_per_call`). A pool refusal that the accounting says cannot happen raises
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
from kvjax.core import kv_cache_manager as manager
from kvjax.core import kv_cache_utils as hashing
from kvjax.errors import KvjaxError
from kvjax.kv_offload import manager as host_cache


class SchedulerError(manager.PoolRefusedError):
    """The block pool refused an operation that the scheduler's own accounting said must
    succeed, or the schedule itself went wrong: a bug in kvjax, not bad input. The message
    names the request and the counts."""


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # pool size P, including the null block
    block_size: int  # Z tokens per block
    max_num_seqs: int = 8  # most requests running at once
    max_num_batched_tokens: int = 256  # token budget per step (prefill chunks + decodes)
    max_model_len: int = 256  # prompt + generated tokens per request
    prefix_caching: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority"
    max_requests: int | None = None  # pool request slots; default 2 * max_num_seqs
    chunked_prefill: bool = True  # False: a waiting request is admitted only if all its tokens fit the budget
    num_host_blocks: int = 0  # host offload tier slots (kvjax.kv_offload.manager); 0 = no tier
    host_policy: str = "lru"  # the tier's eviction policy: "lru" or "arc"

    def __post_init__(self):
        if self.policy not in ("fcfs", "priority"):
            raise KvjaxError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise KvjaxError(f"{name} must be >= 1, got {getattr(self, name)}")
        if -(-self.max_model_len // self.block_size) > self.num_blocks - 1:
            # Otherwise a lone request could preempt itself forever.
            raise KvjaxError(f"a max_model_len={self.max_model_len} request needs "
                             f"{-(-self.max_model_len // self.block_size)} blocks but the pool "
                             f"has only {self.num_blocks - 1} usable")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM's rule too: otherwise a long prompt could never be admitted whole.
            raise KvjaxError(f"without chunked prefill, max_num_batched_tokens={self.max_num_batched_tokens} "
                             f"must be >= max_model_len={self.max_model_len}")
        if self.num_host_blocks < 0 or (self.num_host_blocks and not self.prefix_caching):
            raise KvjaxError(f"num_host_blocks={self.num_host_blocks}: a host tier needs >= 0 blocks and prefix "
                             "caching (its blocks are named by their hashes)")
        if self.max_requests is not None and self.max_requests < self.max_num_seqs:
            raise KvjaxError(f"max_requests={self.max_requests} < max_num_seqs={self.max_num_seqs}")

    @property
    def num_slots(self) -> int:
        """The pool's request slots: max_requests, default 2 × max_num_seqs."""
        return self.max_requests or 2 * self.max_num_seqs

    def state_bytes(self) -> int:
        """The bytes of the pool state and host index a Scheduler allocates, from their shapes
        (jax.eval_shape: nothing is allocated)."""
        z = self.block_size
        shapes = jax.eval_shape(lambda: manager.init(self.num_blocks, z, self.num_slots, -(-self.max_model_len // z),
                                                     self.prefix_caching))
        host = jax.eval_shape(lambda: host_cache.init(self.num_host_blocks, self.host_policy)) \
            if self.num_host_blocks else ()
        return mem.tree_bytes((shapes, host))

    def describe(self) -> str:
        """The sizes the tables follow from, for messages."""
        return (f"num_blocks={self.num_blocks:,}, max_num_seqs={self.max_num_seqs:,} ({self.num_slots:,} request "
                f"slots), max_model_len={self.max_model_len:,}, block_size={self.block_size}"
                + (f", num_host_blocks={self.num_host_blocks:,}" if self.num_host_blocks else ""))


def _devices(placement) -> list:
    """The devices a placement (a device, or a sharding) puts an array on."""
    return [placement] if isinstance(placement, jax.Device) else sorted(placement.device_set, key=lambda d: d.id)


@dataclass
class Request:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    priority: int = 0
    salt: str | None = None
    stop_ids: frozenset[int] = frozenset()  # sampling one of these ends the request ("stop")
    arrival: int = 0  # order of add_request calls
    output: list[int] = field(default_factory=list)
    slot: int | None = None  # pool request slot; kept while preempted
    num_preemptions: int = 0
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None  # "length" | "stop" once finished
    host_next: int = 0  # host tier: the next logical block to offer it (vLLM's next stored block)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass(frozen=True)
class StepPlan:
    """One engine step for a model runner. B scheduled requests, T scheduled tokens."""

    req_ids: tuple[str, ...]  # B, in scheduling order
    slots: np.ndarray  # i32[B] pool request slots
    num_scheduled: np.ndarray  # i32[B] tokens computed this step
    token_ids: np.ndarray  # i32[T] tokens whose KV is computed this step, request after request
    block_tables: np.ndarray  # i32[B, M] each request's block table (0 = null)
    seq_lens: np.ndarray  # i32[B] tokens in the KV cache after this step
    sample: np.ndarray  # bool[B] a token is sampled (the request's last token is computed)
    preempted: tuple[str, ...]  # requests preempted while planning this step
    loads: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))  # i32[L, 2] (host slot,
    # device block): host tier hits to copy in before the step runs, then `Scheduler.loads_done`

    @property
    def num_requests(self) -> int:
        return len(self.req_ids)


@dataclass
class _Step:
    """What one `schedule()` call has planned so far."""

    budget: int  # tokens left in this step
    scheduled: dict[str, int] = field(default_factory=dict)  # req_id -> tokens; insertion = scheduling order
    preempted: list[str] = field(default_factory=list)
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
        z = self.config.block_size
        req_hash = np.asarray(self.state.reqs.req_hash[req.slot])
        full = req.num_tokens // z
        self.host = host_cache.touch(self.host, host_cache.pad_hashes(req_hash[:full], self.max_blocks), full)
        cap = (req.num_tokens - 1) // z - num_hits
        if cap <= 0:
            return None, 0
        hashes = host_cache.pad_hashes(req_hash[num_hits:], self.max_blocks)
        return hashes, int(host_cache.lookup(self.host, hashes, cap))

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
            a, req.host_next = req.host_next, max(req.host_next, int(b))
            if b <= a:
                continue
            self.host, slots, stored = host_cache.offer(self.host, req_hash[req.slot, :b], a)
            self.stores += [(int(t[j]), int(s)) for j, s, k in zip(range(a, b), slots, stored) if k]

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
        return StepPlan(
            req_ids=tuple(r.req_id for r in reqs), slots=slots, num_scheduled=nums, token_ids=token_ids,
            block_tables=tables, seq_lens=seq_lens,
            sample=np.array([e == r.num_tokens for r, e in zip(reqs, seq_lens)], bool),
            preempted=tuple(step.preempted), loads=np.array(step.loads, np.int32).reshape(-1, 2))

    @staticmethod
    def _stop_reason(req: Request) -> str | None:
        """vLLM `check_stop` after a token was appended: stop ids first, then the length cap."""
        if req.output[-1] in req.stop_ids:
            return "stop"
        if len(req.output) >= req.max_new_tokens:
            return "length"
        return None

    def update(self, plan: StepPlan, sampled) -> list[str]:
        """Take the sampled tokens (i32[B], aligned with plan rows; rows with sample False
        are ignored), append them, and finish requests that reached max_new_tokens or a stop
        token. Returns the finished request ids."""
        sampled = np.asarray(sampled).reshape(-1)
        if sampled.shape[0] != plan.num_requests:
            raise SchedulerError(f"got {sampled.shape[0]} sampled tokens for {plan.num_requests} requests")
        z = self.config.block_size
        self._store([self.requests[r] for r in plan.req_ids], plan.block_tables, plan.seq_lens // z)
        tokens = np.zeros(self.num_slots, np.int32)
        mask = np.zeros(self.num_slots, bool)
        finished = []
        for rid, do, tok in zip(plan.req_ids, plan.sample, sampled):
            req = self.requests[rid]
            if not do or req.status != "running":
                continue
            req.output.append(int(tok))
            req.finish_reason = self._stop_reason(req)
            if req.finish_reason:
                finished.append(req)  # a request's last token is never appended: nothing computes it
            else:
                tokens[req.slot], mask[req.slot] = tok, True
        if mask.any():
            self.state, ok = manager.append_token_step(self.state, tokens, mask)
            refused = np.flatnonzero(mask & ~np.asarray(ok))
            if refused.size:
                req = next(r for r in self.running if r.slot == refused[0])
                raise SchedulerError(f"the pool refused sampled token {int(tokens[refused[0]])} of request "
                                     f"{req.req_id!r} ({req.num_tokens} tokens)")
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

    def apply_decode_steps(self, plan: StepPlan, sampled, state: manager.KVCacheManager) -> list[str]:
        """Adopt n decode steps that a device loop ran itself (kvjax.engine.core, --steps-per-call).

        `plan` is a decode plan (one token per request, every request samples) that `schedule()`
        returned; the device loop ran it, then n - 1 more steps of the same requests, doing
        what `update` + `schedule` would have done between them with the same pool functions:
        `append_token_step` of each sampled token (except a request's last), then, when
        `manager.step_fits` says the next step fits, `allocate_step` of one more token per request.
        It stopped after the first step in which a request finished (length or stop token),
        before an allocation that did not fit (the host then preempts as usual), or after its
        step limit. sampled: i32[n, B] tokens per step and plan row; state: the loop's final
        pool. Finishes the requests that ended. Returns their ids."""
        sampled = np.asarray(sampled)
        if sampled.ndim != 2 or sampled.shape[1] != plan.num_requests or sampled.shape[0] < 1:
            raise SchedulerError(f"sampled must be [n >= 1, {plan.num_requests}], got {sampled.shape}")
        if not (plan.sample.all() and (plan.num_scheduled == 1).all()):
            raise SchedulerError("apply_decode_steps needs a decode plan: one token per request, all sampling")
        self.state = state
        steps, finished, z = sampled.shape[0], [], self.config.block_size
        if self.host is not None:
            tables = np.asarray(state.reqs.block_table)[plan.slots]
            self._store([self.requests[r] for r in plan.req_ids], tables, (plan.seq_lens - 1 + steps) // z)
        for i, rid in enumerate(plan.req_ids):
            req = self.requests[rid]
            for step, token in enumerate(sampled[:, i]):
                req.output.append(int(token))
                req.finish_reason = self._stop_reason(req)
                if req.finish_reason and step < steps - 1:
                    raise SchedulerError(f"the device loop ran {steps - 1 - step} step(s) past request {rid!r}'s "
                                         f"end ({req.finish_reason})")
            if req.finish_reason:
                finished.append(req)
        for req in finished:
            self._finish(req)
        return [r.req_id for r in finished]


def _require(ok, message: str) -> None:
    if not bool(ok):
        raise SchedulerError(message)
