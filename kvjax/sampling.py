"""Token sampling for the engine: greedy argmax, or temperature sampling keyed by token position.

Each sampled token draws its randomness from `fold_in(fold_in(key(seed), request), position)`:
the request's index in the batch the caller submitted, and the position the new token will
take in its sequence. A token's draw therefore depends on nothing the scheduler decides —
which step it lands in, which row of the batch, how many steps one device call runs, whether
the request was preempted and recomputed — so the same seed gives the same tokens under any
schedule, and `--steps-per-call 8` samples exactly what `--steps-per-call 1` does. (vLLM's
per-request `seed` gives the same guarantee with a per-request generator.)

Axis legend: B rows (requests in a step), V vocabulary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_keys(key: jax.Array, request_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row: key folded with the row's request id, then its token position.
    request_ids, positions: i32[B] → keys[B]."""
    return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(key, r), p))(request_ids, positions)


def sample(logits: jax.Array, key: jax.Array, request_ids: jax.Array, positions: jax.Array,
           temperature: jax.Array) -> jax.Array:
    """Next tokens i32[B] from logits f32[B, V].

    temperature (a traced f32 scalar, so changing it does not recompile) 0: greedy argmax,
    the lowest id on a tie (as torch.argmax and transformers' greedy search). Above 0: a draw
    from softmax(logits / temperature) with the keys of `token_keys`. A `lax.cond` runs only
    the branch taken: the draw (B × V threefry numbers) costs ~8× the argmax on a CPU.
    """
    def draw(logits):
        keys = token_keys(key, request_ids, positions)
        return jax.vmap(jax.random.categorical)(keys, logits.astype(jnp.float32) / temperature).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, draw, lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32), logits)
