"""Measuring what a device really holds, to set beside the analytic bytes of kvjax.core.kv_cache_interface/budget.

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

The second half is the reconciliation that kvjax.accounting.reconcile builds and `kvjax memory`
prints: a `Row` per item (weights, KV pages, scales, block tables, activation peak) holding the
analytic and the measured bytes of one device, and `explain_arrays`, which names the cause of a
difference (the GPU allocator's 256-byte rounding, or other buffers allocated or freed meanwhile).

Before any large allocation that follows from a user's input (weights, KV pages, the scheduler's
tables, the host tier), `check_fits` refuses it when it exceeds what the device could ever hold:
its `bytes_limit`, or on CPU, which reports none, the host's physical memory. A ceiling for
refusing impossible sizes up front, not a budget: the budget is kvjax.accounting.sizing's.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import jax

from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv
from kvjax.quant.kv_formats import FP8_FORMATS


def _devices(device: jax.Device | None) -> list[jax.Device]:
    return [device] if device is not None else list(jax.local_devices())


def live_bytes(device: jax.Device | None = None) -> int:
    """Bytes of all live jax.Arrays resident on `device` (all local devices if None).

    Each device buffer is counted once: several Array objects can share one buffer (reading a
    sharded array's `addressable_shards` leaves a single-device Array per shard alive beside it,
    and a CPU array can alias host memory), and `jax.live_arrays()` lists every one of them.
    """
    wanted = set(_devices(device))
    seen: dict[tuple[int, int], int] = {}
    for arr in jax.live_arrays():
        if arr.is_deleted():
            continue
        for shard in arr.addressable_shards:
            if shard.device in wanted:
                data = shard.data
                try:
                    key = data.unsafe_buffer_pointer()
                except Exception:  # noqa: BLE001 - a backend without raw pointers: count per Array
                    key = id(data)
                seen[(shard.device.id, key)] = data.nbytes
    return sum(seen.values())


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


def host_ram_bytes() -> int:
    """The host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class WontFitError(KvjaxError):
    """An allocation that follows from the input and exceeds what the device could ever hold."""


def check_fits(what: str, nbytes: int, devices: jax.Device | Sequence[jax.Device] | None = None) -> None:
    """Refuse, before allocating it, `nbytes` on each of `devices` (default the first device)
    when that is more than one device's bytes_limit, or, for devices that report none (CPU,
    whose devices all share the host), when their sum is more than the host's RAM.
    WontFitError names `what`, both byte counts and where the ceiling comes from."""
    devs = [jax.local_devices()[0]] if devices is None else [devices] if isinstance(devices, jax.Device) else list(devices)
    devs = [d for d in devs if d.process_index == jax.process_index()]  # another host's devices hold its own memory
    if not devs:
        return
    limit = bytes_limit(devs[0])
    if limit is not None:
        need, ceiling, where = nbytes, limit, f"the {devs[0].platform} device's bytes_limit"
    else:
        need, ceiling = nbytes * len(devs), host_ram_bytes()
        where = "the host's RAM (a CPU device reports no limit)"
    _refuse_above(what, need, ceiling, where, f" ({len(devs)} devices × {nbytes:,} B)" if need != nbytes else "")


def check_host_fits(what: str, nbytes: int) -> None:
    """Refuse host memory (the offload tier's pages) beyond the host's RAM."""
    _refuse_above(what, nbytes, host_ram_bytes(), "the host's RAM")


def _refuse_above(what: str, need: int, ceiling: int, where: str, per: str = "") -> None:
    if need > ceiling:
        raise WontFitError(f"{what} need {need:,} B ({_human(need)}){per}, more than {where}, "
                           f"{ceiling:,} B ({_human(ceiling)})")


def _human(nbytes: int) -> str:
    from kvjax.accounting.budget import human_bytes

    return human_bytes(nbytes)


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
    return analyse(jitted.lower(*args, **kwargs).compile())


def analyse(compiled) -> CompiledMemory:
    """XLA's memory analysis of an already compiled computation (`jit(f).lower(...).compile()`).

    For a computation partitioned over a mesh the sizes are per device (one partition's buffers).
    """
    m = compiled.memory_analysis()
    return CompiledMemory(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.temp_size_in_bytes),
                          int(m.alias_size_in_bytes), int(m.generated_code_size_in_bytes))


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of a pytree (global size, all shards), arrays or the
    jax.ShapeDtypeStruct leaves of jax.eval_shape."""
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree)
               if hasattr(leaf, "dtype") and hasattr(leaf, "size"))


def shard_bytes(tree: Any, shardings: Any) -> int:
    """The bytes one device holds of a pytree (arrays or ShapeDtypeStructs) placed by
    `shardings` (a matching pytree of shardings): each leaf's shard shape, without allocating."""
    import math

    leaves, shards = jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)
    return sum(math.prod(sh.shard_shape(tuple(x.shape))) * x.dtype.itemsize for x, sh in zip(leaves, shards))


def tree_bytes_on(tree: Any, device: jax.Device) -> int:
    """Bytes of a pytree's arrays that live on one device (its shards there)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device == device:
                total += shard.data.nbytes
    return total


# --------------------------------------------------------------------------------------------
# Reconciliation: analytic bytes beside measured bytes, and why they differ
# --------------------------------------------------------------------------------------------
# XLA's GPU allocator (a best-fit-with-coalescing "BFC" allocator, tsl/framework/bfc_allocator)
# rounds every allocation up to a multiple of 256 bytes and counts the rounded chunk in
# `bytes_in_use`; a chunk is split off a larger free one only when the rest is worth keeping,
# so a measured increase can exceed the rounded sizes too. The CPU client counts exact nbytes.
ALLOCATOR_ALIGNMENT = 256


def snapshot(devices: list[jax.Device]) -> list[int]:
    """Bytes in use on each device (allocator's count on GPU, live-array sum on CPU)."""
    return [bytes_in_use(d) for d in devices]


def rounded_bytes(nbytes: list[int], unit: int = ALLOCATOR_ALIGNMENT) -> int:
    """What an allocator that rounds each allocation up to `unit` bytes counts for these arrays."""
    return sum(cdiv(n, unit) * unit for n in nbytes)


def cache_static_bytes(spec, num_tensors: int | None = None) -> int:
    """Analytic bytes of the paged cache's arrays that have no per-slot axis, on one rank of
    layout `spec` (kvjax.worker.paged_cache): static fp8 scales (f32 per kv head for K and for V, or f32 per
    latent channel for MLA), nvfp4's per-tensor scales (f32 per kv head for K and for V), and one i32
    non-finite counter per layer, or per page tensor when KV cache groups share num_tensors of them."""
    total = 0
    for i in range(spec.num_layers if num_tensors is None else num_tensors):
        kv = spec.layer_dtype(i)
        if kv.name in FP8_FORMATS or kv.scale == "per_block":
            total += 4 * (spec.head_dim if spec.kind == "mla" else 2 * spec.num_kv_heads)
        total += 4  # i32 counter
    return total


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the reconciliation table (bytes on one device)."""

    name: str
    analytic: int
    measured: int | None  # None: the device could not show it (see note)
    note: str = ""  # why measured differs from analytic, or how it was measured

    @property
    def diff(self) -> int | None:
        return None if self.measured is None else self.measured - self.analytic

    @property
    def ratio(self) -> float | None:
        if self.measured is None or self.analytic == 0:
            return None if self.measured is None or self.measured else 1.0
        return self.measured / self.analytic

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "analytic": self.analytic, "measured": self.measured, "diff": self.diff,
                "ratio": self.ratio, "note": self.note}


def explain_arrays(analytic: int, measured: int | None, nbytes: list[int], platform: str) -> str:
    """Why an allocation of arrays of `nbytes` (analytic = their sum) measured as `measured`."""
    if measured is None:
        return "not measurable on this device"
    diff = measured - analytic
    if diff == 0:
        return "exact" if platform == "cpu" or not nbytes else \
            f"exact: all {len(nbytes)} arrays are multiples of the allocator's {ALLOCATOR_ALIGNMENT} B"
    rounding = rounded_bytes(nbytes) - analytic
    if diff == rounding:
        return (f"allocator rounding: each of the {len(nbytes)} arrays is rounded up to a multiple of "
                f"{ALLOCATOR_ALIGNMENT} B")
    if diff > 0:
        return (f"allocator: {diff:,} B more than the arrays ({rounding:,} B of it {ALLOCATOR_ALIGNMENT} B rounding; "
                "the rest is chunk granularity or other buffers allocated meanwhile)")
    return f"{-diff:,} B less than the arrays: other buffers were freed during the measurement"
