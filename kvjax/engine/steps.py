"""The engine's two compiled device calls (vLLM V1's model runner's execute_model with its sampler,
as jitted JAX functions, each around kvjax.worker.model_runner.forward, the one model step);
shapes are padded to buckets so that a run compiles a handful of programs, never one per step.

* `ragged_step` — any plan with prefill tokens: the flat ragged batch of vLLM V1's model
  runner (`BatchMetadata`), T tokens padded to a power of two, B rows.
* `decode_loop` — a plan of one token per request, every request sampling: the decode form
  (T = B; the Pallas kernels with attn_impl "pallas"). It runs that step, then up to
  `steps_per_call` - 1 more inside one `lax.while_loop`, with sampling and the functional
  block pool in the carry: after each step it applies the decode transition
  (kvjax.core.sched.transition: the stop check, the append of each token that goes on, and the
  next token's slot) — the same function the host's `Scheduler.update` applies, so the rule
  exists once. The scheduler hands its pool to the loop and adopts the result
  (`Scheduler.decode_steps`); the engine never reads the scheduler's state. The loop stops
  early, and returns to the host scheduler, when a request finishes (its blocks are freed and
  a waiting request may be admitted) or when `manager.step_fits` — the rule the host scheduler applies too — says the
  next step's blocks do not all fit (checked before allocating, so the pool is left as the
  host expects; the host's next `schedule` repeats the allocation and preempts). Between
  those events the host scheduler would only have run the same decodes — a waiting request
  that did not fit cannot fit while blocks are only taken — so steps_per_call 8 gives the same
  schedule, and (with `kvjax.engine.sampling`'s position-keyed draws) the same tokens, as 1. A step that
  preempted runs alone, since the next one may admit. Every `ok` flag the pool returns in
  the loop is checked; a refusal raises `SchedulerError` naming the request and the counts.

The block table width passed to a step is bucketed too (powers of two, at least 64 tokens):
the reference attention reads every position of the table it is given, so a short batch is
not charged for max_model_len.

Axes: the kvjax package docstring's legend; M here is the bucketed table width a step is given.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.metadata import decode_metadata
from kvjax.core import kv_cache_manager as manager
from kvjax.core.sched.output import StepPlan
from kvjax.core.sched.scheduler import SchedulerError
from kvjax.core.sched.transition import DecodeRows, decode_transition
from kvjax.engine import sampling
from kvjax.math_utils import cdiv, pow2_bucket
from kvjax.worker.model_runner import forward
from kvjax.worker.paged_cache import PagedCache

MIN_TABLE_TOKENS = 64  # smallest block-table width bucket, in tokens
MIN_STEP_TOKENS = 16  # smallest ragged-step token bucket


def table_width(tokens: int, block_size: int, max_blocks: int) -> int:
    """The block-table width (in blocks) a step is given: the blocks of its longest row (`tokens`),
    bucketed to a power of two of at least MIN_TABLE_TOKENS tokens, at most the tables' width."""
    return pow2_bucket(cdiv(tokens, block_size), cdiv(MIN_TABLE_TOKENS, block_size), max_blocks)


def ragged_tokens(total: int, budget: int) -> int:
    """A ragged step's token count, padded to a power of two (at least MIN_STEP_TOKENS, at most the budget)."""
    return pow2_bucket(total, MIN_STEP_TOKENS, budget)


def step_shape(plan: StepPlan, config) -> tuple[bool, int, int]:
    """The compiled shape of one model step of `plan` (config: its SchedulerConfig): (the decode
    form, the rows or padded tokens it computes, its table width in tokens). The decode form runs
    max_num_seqs rows; a ragged step its tokens padded to a power of two (kvjax.simulator's step
    profile fits these, what a step really computes)."""
    if plan.is_decode:
        return decode_shape(int(plan.seq_lens.max()), config)
    z = config.block_size
    width = table_width(int(plan.seq_lens.max()), z, plan.block_tables.shape[1]) * z
    return False, ragged_tokens(int(plan.num_scheduled.sum()), config.max_num_batched_tokens), width


def decode_shape(longest: int, config) -> tuple[bool, int, int]:
    """`step_shape` of a decode plan whose longest row ends at `longest` tokens: max_num_seqs rows,
    its table width in tokens (the tables are cdiv(max_model_len, Z) blocks wide)."""
    z = config.block_size
    return True, config.max_num_seqs, table_width(longest, z, cdiv(config.max_model_len, z)) * z


def ragged_step(model, params, cache, tokens, md, rows: sampling.SamplingRows, positions, *, num_logprobs: int):
    """One ragged step. tokens: i32[T]; rows: each row's sampling parameters (their draw decided on
    the device: one program for any rows); positions: i32[B] the position each sampled token
    takes → (sampling.Sampled per row, cache)."""
    return _ragged_step(model, params, cache, tokens, md, rows.decided_on_device(), positions,
                        num_logprobs=num_logprobs)


@functools.partial(jax.jit, static_argnames=("model", "num_logprobs"), donate_argnames="cache")
def _ragged_step(model, params, cache, tokens, md, rows: sampling.SamplingRows, positions, *, num_logprobs: int):
    logits, cache = forward(model, params, tokens, md, cache, md.logits_indices)  # f32[B, V]
    return sampling.sample(logits, rows, positions, num_logprobs), cache


@struct.dataclass
class _LoopCarry:
    """The device decode loop's state between its steps."""

    step: jax.Array  # i32[] steps run so far
    pool: manager.KVCacheManager
    cache: PagedCache
    rows: DecodeRows  # the requests, one per batch row (remaining counted down)
    sampling: sampling.SamplingRows
    tokens: jax.Array  # i32[B] each row's last token (its KV is computed next)
    computed: jax.Array  # i32[B] tokens already in the cache
    out: sampling.Sampled  # [num_steps, B] what each step sampled
    used: jax.Array  # i32[num_steps] blocks in use at each step
    finish: jax.Array  # i32[B] FINISH_REASONS index once a row finished
    refusal: tuple  # (append refused bool[B], allocation refused bool[B], blocks needed i32[B], free blocks i32[])
    go_on: jax.Array  # bool[]


@functools.partial(jax.jit, static_argnames=("model", "num_steps", "width", "num_logprobs", "layer_groups"),
                   donate_argnames="cache")
def decode_loop(model, params, pool: manager.KVCacheManager, cache, rows: DecodeRows, tokens, computed,
                 sampling_rows: sampling.SamplingRows, max_steps, *, num_steps: int, width: int, num_logprobs: int,
                 layer_groups: tuple = ()):
    """Up to max_steps (<= num_steps) decode steps of the same requests, in one call: after each,
    the decode transition (kvjax.core.sched.transition), the host loop's rule, with the next
    step's allocation. Per row (B): rows the requests (slots -1 = empty row); tokens i32 each
    row's last token (its KV is computed now); computed i32 tokens already cached;
    sampling_rows the rows' sampling parameters; layer_groups: each layer's KV cache group (() for
    one group). The pool already holds the first step's
    allocation (the host's `schedule`). → (pool, cache, sampled [num_steps, B], steps run, blocks
    in use per step i32[num_steps], finish i32[B], refusal): refusal = (rows whose token the pool
    refused bool[B], rows whose allocation it refused although `step_fits` said it fit bool[B],
    blocks each row needed i32[B], free blocks i32[]); either refusal is a bug the host raises."""
    active = rows.slots >= 0  # bool[B]
    slot = jnp.where(active, rows.slots, 0)
    usable = pool.pool.num_blocks - 1

    def body(c: _LoopCarry) -> _LoopCarry:
        used = c.used.at[c.step].set(usable - c.pool.pool.num_free)
        tables = c.pool.reqs.block_table[slot, :, :width] if layer_groups else c.pool.reqs.block_table[slot, 0, :width]
        tables = jnp.where(active.reshape((-1,) + (1,) * (tables.ndim - 1)), tables, 0)  # i32[B, M] or [B, G, M]
        md = decode_metadata(tables, c.computed, active, c.pool.reqs.block_size, layer_groups)
        logits, cache = forward(model, params, c.tokens, md, c.cache)  # f32[B, V]
        sampled = sampling.sample(logits, c.sampling, c.computed + 1, num_logprobs)
        new = jnp.where(active, sampled.tokens, 0)
        pool, t = decode_transition(c.pool, c.rows, new, active, c.step + 1 < max_steps)
        refusal = (c.refusal[0] | t.append_refused, c.refusal[1] | t.alloc_refused,
                   jnp.where(t.alloc_refused, t.need, c.refusal[2]),
                   jnp.where(t.alloc_refused.any(), pool.pool.num_free, c.refusal[3]))
        out = jax.tree.map(lambda o, x: o.at[c.step].set(x), c.out, sampled.replace(tokens=new))
        return _LoopCarry(c.step + 1, pool, cache, t.rows, c.sampling.add_tokens(new, active), new, c.computed + 1,
                          out, used, jnp.where(t.finish > 0, t.finish, c.finish), refusal, t.allocated)

    b = rows.slots.shape[0]
    no = jnp.zeros(b, bool)
    out = sampling.Sampled(jnp.zeros((num_steps, b), jnp.int32), jnp.zeros((num_steps, b), jnp.float32),
                           jnp.zeros((num_steps, b), jnp.int32), jnp.zeros((num_steps, b, num_logprobs), jnp.int32),
                           jnp.zeros((num_steps, b, num_logprobs), jnp.float32))
    init = _LoopCarry(jnp.int32(0), pool, cache, rows, sampling_rows, tokens, computed, out,
                      jnp.zeros(num_steps, jnp.int32), jnp.zeros(b, jnp.int32),
                      (no, no, jnp.zeros(b, jnp.int32), jnp.int32(0)), jnp.bool_(True))
    c = jax.lax.while_loop(lambda c: c.go_on, body, init)
    return c.pool, c.cache, c.out, c.step, c.used, c.finish, c.refusal


def raise_refusal(plan: StepPlan, rows: list[int], refusal) -> None:
    """Raise SchedulerError if the device loop's pool refused a token or an allocation."""
    append_refused, alloc_refused, need, num_free = refusal
    for rid, row in zip(plan.req_ids, rows):
        if append_refused[row]:
            raise SchedulerError(f"the block pool refused request {rid!r}'s sampled token in the device loop")
        if alloc_refused[row]:
            raise SchedulerError(f"the block pool refused {int(need[row])} new block(s) for request {rid!r} in the "
                                 f"device loop with {int(num_free)} free, although manager.step_fits said the step fit")
