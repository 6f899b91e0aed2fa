"""The one model step: a decoder's forward pass over a batch of scheduled tokens through the paged
cache, and its jit (the role of vLLM V1's `vllm/v1/worker/gpu_model_runner.py`, `execute_model`).

    logits, cache = forward(model, params, tokens, md, cache)   # the un-jitted body, to jit inside a caller
    step = make_step(model)                                     # jit of the same, the cache donated
    logits, cache = step(params, tokens, md, cache, md.logits_indices)
    step = make_step(model, mesh, cache)                        # tensor parallel: the cache stays in its shards

`model` is any Flax decoder called as `model.apply({"params": p}, tokens i32[T], md, cache,
logits_indices)` → (logits f32[T or B, V], cache), such as `kvjax.models.build_model`'s; it is
passed in, never imported here (the worker is below the models: models import the worker).
Whatever runs the model (scoring, calibration, the chunked scorer, the tensor-parallel profile)
calls `forward` or `make_step`, so the step is written once.

Axes: the kvjax package docstring's legend; logits rows are B, one per sequence (logits_indices).
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.worker.paged_cache import PagedCache
from kvjax.worker.sharding import cache_shardings


def forward(model, params: Any, tokens: jax.Array, md, cache: PagedCache,
            logits_indices: jax.Array | None = None) -> tuple[jax.Array, PagedCache]:
    """One step: tokens i32[T] at md's positions → (logits f32[T, V], or f32[B, V] for the rows
    logits_indices i32[B] select; the cache with this step's K/V written)."""
    return model.apply({"params": params}, tokens, md, cache, logits_indices)


def make_step(model, mesh: Mesh | None = None, cache: PagedCache | None = None):
    """jit of (params, tokens i32[T], metadata, cache, logits_indices=None) → (logits, cache).

    The cache argument is donated, so each layer's scatter updates its pages in place; the
    caller must use the returned cache and drop the one it passed. With a mesh, `cache` (arrays
    or ShapeDtypeStructs) fixes the cache's shardings (kvjax.worker.sharding.cache_shardings),
    which the step's output keeps; the logits come back replicated.
    """
    def step(params, tokens, md, cache, logits_indices=None):
        return forward(model, params, tokens, md, cache, logits_indices)

    if mesh is None:
        return jax.jit(step, donate_argnames="cache")
    if cache is None:
        raise ValueError("make_step with a mesh needs the cache (arrays or ShapeDtypeStructs) to fix its shardings")
    out = (NamedSharding(mesh, P()), cache_shardings(cache, mesh))
    return jax.jit(step, out_shardings=out, donate_argnames="cache")
