"""The decoding engine: continuous batching through the scheduler, block pool, paged cache and a model.

One engine step is vLLM V1's `EngineCore.step`: the scheduler plans which requests run and
how many tokens each computes (`kvjax.scheduler`, with the block pool's allocation,
prefix-cache hits and preemption by recompute), the model runs the plan over the paged cache,
a token is sampled for every request whose last token was computed, and the scheduler takes
the tokens back. Prefill is not chunked (vLLM with `enable_chunked_prefill=False`): a waiting
request is admitted only when its whole prompt, less its prefix-cache hit, fits the step's
token budget, which is therefore at least max_model_len.

Two compiled device calls serve every plan; shapes are padded to buckets so that a run
compiles a handful of programs, never one per step:

* `_ragged_step` — any plan with prefill tokens: the flat ragged batch of vLLM V1's model
  runner (`BatchMetadata`), T tokens padded to a power of two, B = max_num_seqs rows.
* `_decode_loop` — a plan of one token per request, every request sampling: the decode form
  (T = B; the Pallas kernels with attn_impl "pallas"). It runs that step, then up to K - 1
  more (`steps_per_call`) inside one `lax.while_loop`, with sampling and the functional
  block pool in the carry: each iteration appends the sampled tokens (`pool.append_token_step`)
  and allocates the next token's slot (`pool.allocate_step`), exactly what the host's
  `update` + `schedule` would do between two steps. The loop stops early, and returns to the
  host scheduler, when a request finishes (its blocks are freed and a waiting request may be
  admitted) or when the next step's blocks do not all fit in the free queue (checked before
  allocating, so the pool is left as the host expects; the host's next `schedule` repeats the
  allocation and preempts). Between those events the host scheduler would only have run the
  same decodes — a waiting request that did not fit cannot fit while blocks are only taken —
  so K = 8 gives the same schedule, and (with `kvjax.sampling`'s position-keyed draws) the
  same tokens, as K = 1. A step that preempted runs alone, since the next one may admit.

The block table width passed to a step is bucketed too (powers of two, at least 64 tokens):
the reference attention reads every position of the table it is given, so a short batch is
not charged for max_model_len.

The engine never prints; `generate` takes an optional progress callback. The model is any Flax
module called as `model.apply({"params": p}, tokens i32[T], md, cache, logits_indices)` →
(logits f32[R, V], cache) (models.build_model); its `config` supplies max_position_embeddings
and vocab_size unless they are passed in. This module imports nothing from `models/`.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import pool, sampling
from kvjax.attention.metadata import build_metadata, decode_metadata
from kvjax.cache import PagedCache
from kvjax.scheduler import Scheduler, SchedulerConfig, StepPlan

MIN_TABLE_TOKENS = 64  # smallest block-table width bucket, in tokens
MIN_STEP_TOKENS = 16  # smallest ragged-step token bucket
DEFAULT_BUDGET = 2048  # tokens per step when max_num_batched_tokens is not given (vLLM's long-time default)


class EngineError(ValueError):
    """An engine built with values that break a rule; the message names the value."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_blocks: int  # P, including the null block 0
    block_size: int = 16  # Z
    max_num_seqs: int = 8  # B: requests running at once (rows of every step)
    max_model_len: int | None = None  # prompt + generated tokens; None: the model's max_position_embeddings
    max_num_batched_tokens: int | None = None  # step token budget; None: max(max_model_len, 2048)
    prefix_caching: bool = True
    steps_per_call: int = 1  # K decode steps per device call
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    policy: str = "fcfs"  # or "priority" (requests then all have priority 0: same as fcfs)

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_num_seqs", "steps_per_call"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineError(f"{name} must be a positive integer, got {value!r}")
        if self.num_blocks < 2:
            raise EngineError(f"num_blocks={self.num_blocks} leaves no usable block (block 0 is the null block)")
        if not self.temperature >= 0:
            raise EngineError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")


@dataclasses.dataclass
class RequestResult:
    index: int  # position in the prompts passed to generate
    prompt_tokens: int
    output: list[int]  # generated token ids
    error: str | None = None  # why this request was refused; None if it ran
    finish_reason: str | None = None  # "max_tokens", "max_model_len" (clamped), or None on error
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache, summed over admissions


@dataclasses.dataclass(frozen=True)
class Summary:
    """What an inference engineer looks at after a run. Rates and latencies leave out the device
    calls during which JAX traced or compiled anything (a first call runs several times slower
    even after its compile time is subtracted); a rate with no such call left is NaN (None in
    to_json). Run the workload twice on one Engine to time every step."""

    requests: int
    failed: int  # refused with an error
    prompt_tokens: int  # of the requests that ran
    prefix_queried_tokens: int  # tokens looked up in the prefix cache, over all admissions
    prefix_hit_tokens: int
    prefix_hit_rate: float  # hit / queried
    generated_tokens: int
    prefill_tokens: int  # tokens computed for prompts and for recomputation after preemption
    decode_tokens: int  # tokens computed for generated tokens, one per request per step
    prefill_tokens_per_s: float  # prefill tokens / time of the steps that had any
    decode_tokens_per_s: float  # decode tokens / time of decode-only steps
    step_latency_p50_ms: float  # per token step, scheduling included; a K-step call counts as K steps
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

    def to_json(self) -> dict:
        """A JSON-safe dict: tuples as lists, NaN (a rate with no timed step) as None."""
        def fix(v):
            return list(v) if isinstance(v, tuple) else None if isinstance(v, float) and v != v else v

        return {k: fix(v) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass
class EngineRun:
    results: list[RequestResult]
    summary: Summary


_COMPILE_S = [0.0]  # seconds JAX spent tracing, lowering and compiling in this process


def _count_compile(name: str, seconds: float, **kwargs) -> None:
    if name.startswith("/jax/core/compile/"):
        _COMPILE_S[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def _pow2_bucket(n: int, lo: int, hi: int) -> int:
    """The smallest power of two >= max(n, lo), capped at hi (callers guarantee n <= hi)."""
    return min(hi, 1 << (max(n, lo) - 1).bit_length())


# ----------------------------------------------------------------------------------- device calls
@functools.partial(jax.jit, static_argnames="model", donate_argnames="cache")
def _ragged_step(model, params, cache, tokens, md, sample_ids, positions, key, temperature):
    """One ragged step. tokens: i32[T]; sample_ids, positions: i32[B] (the new token's position)
    → (sampled i32[B], cache)."""
    logits, cache = model.apply({"params": params}, tokens, md, cache, md.logits_indices)  # f32[B, V]
    return sampling.sample(logits, key, sample_ids, positions, temperature), cache


@functools.partial(jax.jit, static_argnames=("model", "num_steps", "width"), donate_argnames="cache")
def _decode_loop(model, params, state: pool.PoolState, cache, slots, tokens, computed, remaining, sample_ids,
                 key, temperature, max_steps, *, num_steps: int, width: int):
    """Up to max_steps (<= num_steps) decode steps of the same requests, in one call.

    slots: i32[B] pool slots, -1 = padding row; tokens: i32[B] each row's last token (its KV is
    computed now); computed: i32[B] tokens already cached; remaining: i32[B] tokens still to
    generate. The pool already holds the first step's allocation (the host's `schedule`).
    → (state, cache, sampled i32[num_steps, B], steps run, blocks in use per step i32[num_steps],
    refused: the pool refused an allocation that fit — a bug, the host raises).
    """
    active = slots >= 0  # bool[B]
    rows = jnp.where(active, slots, 0)
    scatter_at = jnp.where(active, slots, state.max_requests)  # padding rows scatter out of range
    usable = state.num_blocks - 1

    def body(c):
        i, state, cache, tokens, computed, remaining, out, used, refused, _ = c
        used = used.at[i].set(usable - state.num_free)
        tables = jnp.where(active[:, None], state.block_table[rows, :width], 0)  # i32[B, M]
        md = decode_metadata(tables, computed, active, state.block_size)
        logits, cache = model.apply({"params": params}, tokens, md, cache)  # f32[B, V]
        new = jnp.where(active, sampling.sample(logits, key, sample_ids, computed + 1, temperature), 0)
        remaining = remaining - active
        keep = active & (remaining > 0)  # a request's last token is never appended (Scheduler.update)
        finished = active & ~keep
        append = jnp.zeros(state.max_requests, jnp.int32).at[scatter_at].set(new, mode="drop")
        mask = jnp.zeros(state.max_requests, bool).at[scatter_at].set(keep, mode="drop")
        state, _ = pool.append_token_step(state, append, mask)
        go_on = (i + 1 < max_steps) & ~finished.any()
        # Allocate the next step's slots only if all of them fit, so that a failure leaves the
        # pool untouched: a request's next token needs cdiv(computed + 1, Z) - held new blocks
        # (0 or 1; the pool's own rule) and the requests draw from one free queue. If they
        # don't fit, stop here: the host's next `schedule` repeats the allocation and preempts.
        need = jnp.maximum(-(-(state.num_computed[rows] + 1) // state.block_size) - state.num_held[rows], 0)
        fits = jnp.where(keep, need, 0).sum() <= state.num_free

        def allocate(s):
            s, ok = pool.allocate_step(s, jnp.where(keep, slots, -1), keep.astype(jnp.int32), stop_at_failure=True)
            return s, jnp.all(ok | ~keep)

        state, ok = jax.lax.cond(go_on & fits, allocate, lambda s: (s, jnp.bool_(True)), state)
        return (i + 1, state, cache, new, computed + 1, remaining, out.at[i].set(new), used, refused | ~ok,
                go_on & fits & ok)

    b = slots.shape[0]
    init = (jnp.int32(0), state, cache, tokens, computed, remaining, jnp.zeros((num_steps, b), jnp.int32),
            jnp.zeros(num_steps, jnp.int32), jnp.bool_(False), jnp.bool_(True))
    n, state, cache, _, _, _, out, used, refused, _ = jax.lax.while_loop(lambda c: c[-1], body, init)
    return state, cache, out, n, used, refused


# ----------------------------------------------------------------------------------- the engine
class Engine:
    """Batched generation over one model and one paged cache; `generate` may be called again
    (each call starts from an empty pool; compiled steps are reused)."""

    def __init__(self, model, params, kv_spec, config: EngineConfig, *, scales=None,
                 max_position_embeddings: int | None = None, vocab_size: int | None = None):
        model_config = getattr(model, "config", None)
        model_len = max_position_embeddings or getattr(model_config, "max_position_embeddings", None)
        self.vocab_size = vocab_size or getattr(model_config, "vocab_size", None)
        if model_len is None or self.vocab_size is None:
            raise EngineError("pass max_position_embeddings and vocab_size: the model has no config with them")
        if config.max_model_len is not None and not 1 <= config.max_model_len <= model_len:
            raise EngineError(f"max_model_len={config.max_model_len} must be in [1, {model_len}] "
                              "(the model's max_position_embeddings)")
        self.model, self.params, self.config = model, params, config
        self.max_model_len = config.max_model_len or model_len  # what a request may reach
        self.usable_blocks = config.num_blocks - 1
        z = config.block_size
        # The scheduler's table width: the longest request the pool could ever hold.
        sched_len = min(self.max_model_len, self.usable_blocks * z)
        # vLLM's default budget (2048): enough to admit a batch of prompts in one step; never
        # below max_model_len, since prompts are not chunked.
        budget = config.max_num_batched_tokens or max(sched_len, config.max_num_seqs, DEFAULT_BUDGET)
        self.scheduler_config = SchedulerConfig(
            num_blocks=config.num_blocks, block_size=z, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget, max_model_len=sched_len, prefix_caching=config.prefix_caching,
            policy=config.policy, chunked_prefill=False)
        self.cache = PagedCache.create(kv_spec, config.num_blocks, z, scales)
        self.scheduler: Scheduler | None = None  # the latest run's, for inspection
        self._rng = jax.random.key(config.seed)

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt: Sequence[int], max_tokens) -> tuple[str | None, int]:
        """(why the request is refused or None, tokens it may generate: max_tokens clamped to
        max_model_len). Rules: max_tokens >= 1; a non-empty prompt of ids in the vocabulary,
        shorter than max_model_len; prompt + new tokens fit the pool's usable blocks."""
        z, n = self.config.block_size, len(prompt)
        if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens < 1:
            return f"max_tokens must be a positive integer, got {max_tokens!r}", 0
        if n == 0:
            return "empty prompt: at least one token is needed", 0
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the model's vocabulary [0, {self.vocab_size})", 0
        if n >= self.max_model_len:
            return (f"prompt has {n} tokens; the model's max length is {self.max_model_len} tokens "
                    "including at least one generated token"), 0
        new = min(int(max_tokens), self.max_model_len - n)
        need = -(-(n + new) // z)
        if need > self.usable_blocks:
            return (f"needs {need} blocks of {z} tokens ({n} prompt + {new} new), but the pool has only "
                    f"{self.usable_blocks} usable blocks"), 0
        return None, new

    # ------------------------------------------------------------------ the loop
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int],
                 progress: Callable[[int], None] | None = None) -> EngineRun:
        """Generate for every prompt (token id lists). max_tokens: one for all, or one per prompt.
        A request that breaks a rule gets an error in its result and the others still run.
        progress(n) is called with the number of tokens each device call generated."""
        if isinstance(max_tokens, (int, np.integer)) and not isinstance(max_tokens, bool):
            max_tokens = [max_tokens] * len(prompts)
        if len(max_tokens) != len(prompts):
            raise EngineError(f"{len(max_tokens)} max_tokens for {len(prompts)} prompts")
        sched = self.scheduler = Scheduler(self.scheduler_config)
        results = []
        for i, (prompt, mt) in enumerate(zip(prompts, max_tokens)):
            prompt = [int(t) for t in prompt]
            error, new = self.check_request(prompt, mt)
            results.append(RequestResult(i, len(prompt), [], error))
            if error is None:
                sched.add_request(str(i), prompt, new)
        stats = _Stats(self.usable_blocks)
        start = time.perf_counter()
        while sched.has_unfinished():
            t0 = time.perf_counter()
            running = {r.req_id for r in sched.running}
            plan = sched.schedule()
            if plan.num_requests == 0:
                raise RuntimeError("the scheduler planned an empty step with requests unfinished")
            prefill = stats.admissions(sched, plan, running, results)
            decode_form = bool(plan.sample.all() and (plan.num_scheduled == 1).all())
            if decode_form:
                steps, used = self._decode_call(sched, plan)
            else:
                steps, used = self._ragged_call(sched, plan), [stats.used(sched)]
            generated = int(plan.sample.sum()) + (steps - 1) * plan.num_requests
            decode_tokens = plan.num_requests * steps - len(prefill) if decode_form else \
                plan.num_requests - len(prefill)
            stats.call(time.perf_counter() - t0, steps, used,
                       prefill_tokens=int(sum(plan.num_scheduled[i] for i in prefill)), decode_tokens=decode_tokens)
            if progress is not None:
                progress(generated)
        wall = time.perf_counter() - start
        for res in results:
            if res.error is None:
                req = sched.requests[str(res.index)]
                res.output, res.preemptions = list(req.output), req.num_preemptions
                res.finish_reason = "max_tokens" if len(req.output) == max_tokens[res.index] else "max_model_len"
        return EngineRun(results, stats.summary(results, sched.num_preemptions, wall))

    def _ragged_call(self, sched: Scheduler, plan: StepPlan) -> int:
        cfg, z = self.config, self.config.block_size
        n, total = plan.num_requests, int(plan.num_scheduled.sum())
        budget = self.scheduler_config.max_num_batched_tokens
        width = _pow2_bucket(-(-int(plan.seq_lens.max()) // z), -(-MIN_TABLE_TOKENS // z), sched.max_blocks)
        md = build_metadata(plan.seq_lens - plan.num_scheduled, plan.num_scheduled, list(plan.block_tables),
                            block_size=z, max_tokens=_pow2_bucket(total, MIN_STEP_TOKENS, budget),
                            max_seqs=cfg.max_num_seqs, max_blocks_per_seq=width)
        pad = lambda a, size: np.pad(np.asarray(a, np.int32), (0, size - len(a)))  # noqa: E731
        ids = pad([int(r) for r in plan.req_ids], cfg.max_num_seqs)
        sampled, self.cache = _ragged_step(
            self.model, self.params, self.cache, pad(plan.token_ids, md.num_tokens), md, ids,
            pad(plan.seq_lens, cfg.max_num_seqs), self._rng, np.float32(cfg.temperature))
        sched.update(plan, np.asarray(sampled)[:n])
        return 1

    def _decode_call(self, sched: Scheduler, plan: StepPlan):
        cfg, z, k = self.config, self.config.block_size, self.config.steps_per_call
        n, b = plan.num_requests, cfg.max_num_seqs
        # A step that preempted skipped admission (vLLM does too): the next one may admit.
        max_steps = 1 if plan.preempted else k
        width = _pow2_bucket(-(-(int(plan.seq_lens.max()) + max_steps - 1) // z), -(-MIN_TABLE_TOKENS // z),
                             sched.max_blocks)
        reqs = [sched.requests[r] for r in plan.req_ids]
        # NumPy arguments: jit transfers them in its C++ fast path (jnp.asarray costs ~0.1 ms each).
        pad = lambda a, fill=0: np.pad(np.asarray(a, np.int32), (0, b - n), constant_values=fill)  # noqa: E731
        state, self.cache, out, steps, used, refused = _decode_loop(
            self.model, self.params, sched.state, self.cache, pad(plan.slots, -1), pad(plan.token_ids),
            pad(plan.seq_lens - 1), pad([r.max_new_tokens - len(r.output) for r in reqs]),
            pad([int(r) for r in plan.req_ids]), self._rng, np.float32(cfg.temperature),
            np.int32(max_steps), num_steps=k, width=width)
        out, steps, used, refused = jax.device_get((out, steps, used, refused))  # one transfer
        if refused:
            raise RuntimeError("the block pool refused a decode allocation that fit its free blocks")
        sched.apply_decode_steps(plan, out[:steps, :n], state)
        return int(steps), [int(u) for u in used[:steps]]


class _Stats:
    """Per-call bookkeeping for the Summary."""

    def __init__(self, usable: int):
        self.usable = usable
        self.latencies: list[float] = []
        self.blocks: list[int] = []
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_timed = [0, 0.0]  # tokens, seconds of the steps with prefill tokens
        self.decode_timed = [0, 0.0]  # tokens, seconds of the decode-only steps
        self.calls = self.untimed_calls = 0
        self.queried = self.hits = 0
        self._compile_start = self._compile_mark = _COMPILE_S[0]

    def used(self, sched: Scheduler) -> int:
        return self.usable - int(sched.state.num_free)

    def admissions(self, sched: Scheduler, plan: StepPlan, running: set[str], results) -> list[int]:
        """Rows of requests admitted by this plan; records their prefix-cache lookups."""
        rows = [i for i, r in enumerate(plan.req_ids) if r not in running]
        for i in rows:
            req = sched.requests[plan.req_ids[i]]
            hit = int(plan.seq_lens[i] - plan.num_scheduled[i])  # computed before this step: all hits
            self.queried += req.num_tokens
            self.hits += hit
            results[int(plan.req_ids[i])].prefix_hit_tokens += hit
        return rows

    def call(self, seconds: float, steps: int, used: list[int], *, prefill_tokens: int, decode_tokens: int) -> None:
        compiled, self._compile_mark = _COMPILE_S[0] > self._compile_mark, _COMPILE_S[0]
        self.calls += 1
        self.blocks += used
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens
        if compiled:
            self.untimed_calls += 1
            return
        self.latencies += [seconds / steps] * steps
        timed = self.prefill_timed if prefill_tokens else self.decode_timed
        timed[0] += prefill_tokens or decode_tokens
        timed[1] += seconds

    def summary(self, results: list[RequestResult], preemptions: int, wall: float) -> Summary:
        ran = [r for r in results if r.error is None]
        lat = np.asarray(self.latencies or [np.nan]) * 1e3
        rate = lambda t: t[0] / t[1] if t[1] > 0 else float("nan")  # noqa: E731
        return Summary(
            requests=len(results), failed=len(results) - len(ran), prompt_tokens=sum(r.prompt_tokens for r in ran),
            prefix_queried_tokens=self.queried, prefix_hit_tokens=self.hits,
            prefix_hit_rate=self.hits / self.queried if self.queried else 0.0,
            generated_tokens=sum(len(r.output) for r in ran), prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens, prefill_tokens_per_s=rate(self.prefill_timed),
            decode_tokens_per_s=rate(self.decode_timed), step_latency_p50_ms=float(np.percentile(lat, 50)),
            step_latency_p99_ms=float(np.percentile(lat, 99)), steps=len(self.blocks), device_calls=self.calls,
            untimed_calls=self.untimed_calls,
            compile_s=_COMPILE_S[0] - self._compile_start, wall_s=wall, peak_blocks_used=max(self.blocks, default=0),
            usable_blocks=self.usable, preemptions=preemptions, blocks_in_use=tuple(self.blocks))
