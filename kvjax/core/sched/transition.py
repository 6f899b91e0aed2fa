"""The decode transition: what happens to running requests once a token was sampled for each.

One jittable function over the pool state, so that the rule exists once: the host loop
(`Scheduler.update`, one engine step per call) and the engine's device loop (`steps_per_call`
decode steps in one call, kvjax.engine.core) both call it. For every active row, in order:

1. the stop check, in vLLM 0.33 `check_stop`'s order: a sampled stop id (the request's
   stop_token_ids, and the model's EOS unless it ignores EOS) finishes it with "stop"; else
   reaching its max tokens finishes it with "length";
2. a row that goes on has its token appended to the pool (`append_token_step`, which hashes a
   block the token completes). A finished row's last token is never appended: nothing computes
   its KV;
3. with `allocate` on (the device loop, between its steps), one more token's slot for every row
   that goes on, if nothing finished and all of them fit (`manager.step_fits`, then
   `allocate_step`, which must then succeed), so that a loop that stops leaves the pool as the
   host's next `schedule` expects. Otherwise nothing is allocated, and the host's `schedule`
   allocates, preempting where the pool is short.

Axes: the kvjax package docstring's legend.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.core import kv_cache_manager as manager

FINISH_REASONS = (None, "stop", "length")  # Transition.finish indexes this
_STOP, _LENGTH = 1, 2


@struct.dataclass
class DecodeRows:
    """The running requests of one decode step, one per batch row."""

    slots: jax.Array  # i32[B] pool request slots, -1 = an empty row
    remaining: jax.Array  # i32[B] tokens each request may still generate
    stop_ids: jax.Array  # i32[B, X] tokens that finish the request "stop" (-1 padding)


@struct.dataclass
class Transition:
    """What one decode transition did."""

    rows: DecodeRows  # the rows after it: remaining counted down
    finish: jax.Array  # i32[B] FINISH_REASONS index: 0 goes on, 1 "stop", 2 "length"
    append_refused: jax.Array  # bool[B] rows whose token the pool refused (a kvjax bug)
    alloc_refused: jax.Array  # bool[B] rows refused although step_fits said it fit (a kvjax bug)
    need: jax.Array  # i32[B] blocks each going row needed for the next step
    allocated: jax.Array  # bool[] the next step's slots were allocated


def decode_transition(state: manager.KVCacheManager, rows: DecodeRows, sampled, active, allocate):
    """sampled: i32[B] each row's new token; active: bool[B] rows that sampled one; allocate:
    bool[] allocate the next step (see the module docstring), or False (a Python bool) for never.
    → (state, Transition)."""
    remaining = rows.remaining - active
    stop = active & (sampled[:, None] == rows.stop_ids).any(axis=1)
    length = active & ~stop & (remaining <= 0)
    keep = active & ~stop & ~length
    r = state.reqs.max_requests
    present = rows.slots >= 0
    at = jnp.where(present, rows.slots, r)  # empty rows scatter out of range: dropped
    tokens = jnp.zeros(r, jnp.int32).at[at].set(sampled, mode="drop")
    mask = jnp.zeros(r, bool).at[at].set(keep, mode="drop")
    state, appended = manager.append_token_step(state, tokens, mask)
    append_refused = keep & ~appended[jnp.where(present, rows.slots, 0)]
    reqs = jnp.where(keep, rows.slots, -1)
    need, fits = manager.step_fits(state, reqs, keep.astype(jnp.int32))
    if allocate is False:  # the host loop: its next `schedule` allocates (no allocate_step to compile)
        go, ok = jnp.bool_(False), jnp.ones(reqs.shape, bool)
    else:
        go = allocate & fits & ~(stop | length).any() & ~append_refused.any()
        # Not a lax.cond: with `go` off every row asks for nothing (slot -1, no tokens), which leaves
        # the pool as it was. On a GPU a cond in the device loop copies its predicate to the host
        # and waits for it, every step, and a branch over the pool may copy its tables.
        state, ok = manager.allocate_step(state, jnp.where(go, reqs, -1), (keep & go).astype(jnp.int32))
        ok = ok | ~go
    alloc_refused = keep & ~ok
    finish = jnp.where(stop, _STOP, jnp.where(length, _LENGTH, 0)).astype(jnp.int32)
    return state, Transition(rows.replace(remaining=remaining), finish, append_refused, alloc_refused, need,
                             go & ~alloc_refused.any())


@functools.partial(jax.jit, donate_argnums=0)
def host_transition(state: manager.KVCacheManager, rows: DecodeRows, sampled, active):
    """The host loop's call (no allocation): one compile per (B, X); the scheduler pads B to
    max_num_seqs and X to a power of two. The state is donated (the scheduler replaces its own;
    manager.owned)."""
    return decode_transition(state, rows, sampled, active, False)
