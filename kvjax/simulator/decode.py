"""Decode steps without a model: the pool's side of many engine steps in one device call.

Between two events the simulator cares about (an arrival, and with requests waiting a finish),
the engine's host loop would only run decode steps of the same requests after a step in which
they all sample (decoding, or finishing their prompts; kvjax.simulator.clock._runs_on): `schedule()` gives each
one token's slot, `update()` appends the sampled tokens through the decode transition and frees
the requests that finished. `decode_run` does exactly those pool operations, in that order, for
up to `max_steps` steps inside one `lax.while_loop`, with the tokens given:

    for each step:
        the decode transition (kvjax.core.sched.transition)       update(): stop check, append
        free + remove each finished row's request, in row order    update(): _finish, plan order
        step_fits, then allocate_step for the rows left            the next schedule()
        stop before that allocation if it does not fit

With stop_at_finish the loop stops after a step that finished a request, without freeing it:
the engine's device loop's rule, whose steps the host adopts as the engine's
(`Scheduler.apply_decode_steps`); for a run with requests waiting (a finish may let one in) or a
host tier (the finished request's blocks are offered to it first).

A step that does not fit leaves the pool as `update()` does, and the host's next `schedule()`
preempts as usual; so the pool ends as the host loop leaves it after the same steps
(tests/simulator checks the two step by step). The engine's device decode loop
(kvjax.engine.steps) is this loop with a model; it stops at every finish because a waiting request
might then be admitted. With nothing waiting nothing can be, so this one goes on. Every `ok` flag
is gathered into one refusal flag that the caller raises as a kvjax bug.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.core import kv_cache_manager as manager
from kvjax.core.sched.transition import DecodeRows, decode_transition


@struct.dataclass
class _Carry:
    step: jax.Array  # i32[] steps run so far
    state: manager.KVCacheManager
    rows: DecodeRows  # slots -1 once a row's request finished
    free_after: jax.Array  # i32[num_steps] the pool's free blocks after each step (before the next allocation)
    finished_at: jax.Array  # i32[B] the step in which each row finished; num_steps while it runs
    refused: jax.Array  # bool[] the pool refused something the rules said it must do
    go_on: jax.Array  # bool[]


def _free_finished(state: manager.KVCacheManager, slots, done):
    """free, then remove_request, for each row where done, in row order. → (state, refused)."""
    b = slots.shape[0]
    i = jnp.arange(b)

    def after(k):  # the first finished row after row k, or b
        later = done & (i > k)
        return jnp.where(later.any(), jnp.argmax(later), b)

    def body(c):
        k, s, bad = c
        s, ok = manager.finish(s, slots[k])
        return after(k), s, bad | ~ok

    _, state, bad = jax.lax.while_loop(lambda c: c[0] < b, body, (after(-1), state, jnp.bool_(False)))
    return state, bad


@functools.partial(jax.jit, static_argnames="num_steps", donate_argnums=0)
def decode_run(state: manager.KVCacheManager, rows: DecodeRows, tokens, max_steps, stop_at_finish, *,
               num_steps: int):
    """Up to max_steps (<= num_steps) steps of rows (plan order, B = max_num_seqs rows, slots -1 =
    none), every row sampling. The pool already holds the first step's allocation (the host's
    `schedule()`; it may finish prompts), the others decode.
    tokens: i32[num_steps, B] the token each row samples at each step. → (state, steps run,
    free blocks after each step i32[num_steps], the step each row finished in i32[B] (num_steps:
    it did not), refused bool[])."""
    b = rows.slots.shape[0]

    def body(c: _Carry) -> _Carry:
        active = c.rows.slots >= 0
        state, t = decode_transition(c.state, c.rows, tokens[c.step], active, False)
        done = t.finish > 0
        state, bad = jax.lax.cond(done.any() & ~stop_at_finish, _free_finished, lambda s, *_: (s, jnp.bool_(False)),
                                  state, c.rows.slots, done)
        free_after = c.free_after.at[c.step].set(state.pool.num_free)
        left = active & ~done
        slots = jnp.where(left, c.rows.slots, -1)
        nums = left.astype(jnp.int32)
        _, fits = manager.step_fits(state, slots, nums)
        go = (c.step + 1 < max_steps) & fits & left.any() & ~(stop_at_finish & done.any())
        state, ok = jax.lax.cond(go, lambda s: manager.allocate_step(s, slots, nums),
                                 lambda s: (s, jnp.ones(b, bool)), state)
        refused = c.refused | bad | t.append_refused.any() | (left & ~ok).any()
        return _Carry(c.step + 1, state, t.rows.replace(slots=slots), free_after,
                      jnp.where(done, c.step, c.finished_at), refused, go & ~refused)

    init = _Carry(jnp.int32(0), state, rows, jnp.zeros(num_steps, jnp.int32), jnp.full(b, num_steps, jnp.int32),
                  jnp.bool_(False), jnp.bool_(True))
    c = jax.lax.while_loop(lambda c: c.go_on, body, init)
    return c.state, c.step, c.free_after, c.finished_at, c.refused
