"""Measuring what a device really holds, to set beside the analytic bytes of kvjax.spec/budget.

vLLM sizes its KV cache from measurements (`vllm/v1/worker/gpu_worker.py:
determine_available_memory`): it loads the weights, runs a profiling forward pass over
`max_num_batched_tokens`, reads the allocator's peak, and gives the rest of
`gpu_memory_utilization × total` to KV blocks. kvjax does the same with JAX's own numbers:

- On GPU, `device.memory_stats()` reports the allocator's `bytes_in_use`, `peak_bytes_in_use`
  and `bytes_limit` (the part of the card JAX's allocator may use: with preallocation on, that
  is XLA_PYTHON_CLIENT_MEM_FRACTION × memory, 0.75 by default).
- On CPU `memory_stats()` is None. There, the bytes of every live jax.Array on the device
  (`jax.live_arrays()`, counting each array's shard on that device) track allocations exactly,
  and a compiled step's `memory_analysis()` gives the temporaries XLA will need at its peak.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax


def _devices(device: jax.Device | None) -> list[jax.Device]:
    return [device] if device is not None else list(jax.local_devices())


def live_bytes(device: jax.Device | None = None) -> int:
    """Bytes of all live jax.Arrays resident on `device` (all local devices if None)."""
    wanted = set(_devices(device))
    total = 0
    for arr in jax.live_arrays():
        if arr.is_deleted():
            continue
        for shard in arr.addressable_shards:
            if shard.device in wanted:
                total += shard.data.nbytes
    return total


def bytes_in_use(device: jax.Device | None = None) -> int:
    """The allocator's bytes in use where the backend reports them, else the live-array sum."""
    devs = _devices(device)
    stats = [d.memory_stats() for d in devs]
    if all(s and "bytes_in_use" in s for s in stats):
        return sum(s["bytes_in_use"] for s in stats)
    return live_bytes(device)


def peak_bytes(device: jax.Device) -> int | None:
    """The allocator's peak since start (GPU), or None where the backend keeps none (CPU)."""
    stats = device.memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def bytes_limit(device: jax.Device) -> int | None:
    """How much the device's allocator may use in all (GPU), or None (CPU)."""
    stats = device.memory_stats()
    return None if not stats else stats.get("bytes_limit")


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's memory analysis of one compiled computation, in bytes."""

    argument: int
    output: int
    temp: int
    alias: int  # output bytes that reuse donated argument buffers
    generated_code: int

    @property
    def peak_extra(self) -> int:
        """Bytes the call needs beyond its arguments: outputs not aliased to inputs + temporaries."""
        return self.output - self.alias + self.temp


def compiled_memory(fn: Callable, *args: Any, **kwargs: Any) -> CompiledMemory:
    """Compile `fn` (a jitted function) for these arguments and read XLA's memory analysis."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    m = jitted.lower(*args, **kwargs).compile().memory_analysis()
    return CompiledMemory(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.temp_size_in_bytes),
                          int(m.alias_size_in_bytes), int(m.generated_code_size_in_bytes))


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of a pytree (global size, all shards)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "nbytes"))


def tree_bytes_on(tree: Any, device: jax.Device) -> int:
    """Bytes of a pytree's arrays that live on one device (its shards there)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device == device:
                total += shard.data.nbytes
    return total
