"""Greedy generation through the paged cache, for experiments that compare KV formats.

A minimal generator, not the engine: every sequence gets its own contiguous run of blocks
(no allocator, no preemption), the prompts are prefilled in one ragged step, and the decode
steps run inside one jitted `lax.scan` with the cache in the carry. The engine
(kvjax.engine) does the same steps with the block pool and the scheduler.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention.metadata import build_metadata, decode_metadata
from kvjax.cache import PagedCache


def greedy_generate(model, params, prompts: list[list[int]], max_new: int, kv_spec, block_size: int = 16,
                    scales=None) -> np.ndarray:
    """Greedy continuations i32[B, max_new] of each prompt (prompts may differ in length)."""
    if max_new < 1:
        raise ValueError(f"max_new must be ≥ 1, got {max_new}")
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError("every prompt needs at least one token")
    batch = len(prompts)
    per_seq = -(-(max(lens) + max_new) // block_size)
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    cache = PagedCache.create(kv_spec, 1 + batch * per_seq, block_size, scales)
    total = sum(lens)
    md = build_metadata([0] * batch, lens, tables, block_size=block_size, max_tokens=total, max_seqs=batch,
                        max_blocks_per_seq=per_seq)
    tokens = jnp.asarray(np.concatenate([np.asarray(p, np.int32) for p in prompts]))
    first, cache = prefill_step(model, params, tokens, md, cache)
    rest, _ = decode_steps(model, params, first, jnp.asarray(lens, jnp.int32), md.block_tables, cache, max_new - 1,
                           block_size)
    return np.concatenate([np.asarray(first)[:, None], np.asarray(rest).T], axis=1)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def prefill_step(model, params, tokens, md, cache):
    """One ragged prefill step → (each sequence's greedy first token i32[B], cache)."""
    logits, cache = model.apply({"params": params}, tokens, md, cache, md.logits_indices)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnums=(0, 6, 7), donate_argnums=5)
def decode_steps(model, params, tokens, computed, tables, cache, steps: int, block_size: int):
    """`steps` greedy decode steps in one lax.scan over fixed block tables.

    tokens, computed: i32[B] (each sequence's next input token and its cached length);
    tables: i32[B, M] covering every position reached → (i32[steps, B] generated tokens, cache).
    """
    active = jnp.ones(tokens.shape, bool)

    def step(carry, _):
        tok, done, cache = carry
        md = decode_metadata(tables, done, active, block_size)
        logits, cache = model.apply({"params": params}, tok, md, cache)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (nxt, done + 1, cache), nxt

    (_, _, cache), out = jax.lax.scan(step, (tokens, computed, cache), None, length=steps)
    return out, cache
