"""The host offload tier's data side: KV blocks copied between the paged cache and host memory.

`kvjax/kv_offload/manager.py` decides which host slot holds which block hash; this module moves the
bytes, the worker side of vLLM's OffloadingConnector (`vllm/v1/kv_offload/worker/cpu_gpu.py`):

* A host page is one whole device block: every layer's K and V (or MLA latent) pages for that
  block, and int8's per-token scale pages, packed into one u8[bytes_per_block] array, so one
  transfer moves one block and host bytes = device bytes per block exactly
  (kvjax.core.kv_cache_interface's `bytes_per_block`; static fp8 scales stay on the device, shared by all blocks).
* Pages live in `pinned_host` memory (`jax.device_put(..., memory_kind="pinned_host")`) where
  the backend has that memory kind (GPU and CPU backends do), else in host NumPy arrays;
  `HostPages.memory_kind` says which.
* `store(cache, blocks, slots)` gathers the blocks on the device in one jitted call and starts
  their device → host copies; nothing waits for them (JAX dispatch is asynchronous), so a store
  never delays the next step. NumPy pages are filled from the finished copies on the next call.
* `load(cache, slots, blocks)` copies host pages to the device and scatters them into the given
  blocks of the (donated) cache; the step that reads them is dispatched after it.

Block counts are padded to powers of two (padding moves the null block 0, which no request
reads), so a run compiles a handful of gather / scatter programs. `host_blocks(gib,
bytes_per_block)` is the tier's size: floor(gib × 2**30 / bytes per block), vLLM's
`kv_offloading_size`.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from kvjax.accounting import budget
from kvjax.errors import KvjaxError
from kvjax.kv_offload import manager as host_cache
from kvjax.math_utils import pow2_bucket


class OffloadError(KvjaxError):
    """A host tier sized or configured with a bad value; the message names it."""


def host_blocks(gib, bytes_per_block: int, name: str = "kv_offloading_size") -> int:
    """Host blocks that `gib` GiB hold: whole bytes (kvjax.accounting.budget.gib, as `kvjax plan` reads
    --kv-offloading-size) // bytes per block, vLLM's kv_offloading_size // page bytes. Refuses a
    negative, non-finite or non-numeric size and a positive one below a single block."""
    nbytes = budget.gib(gib, name)
    if nbytes and nbytes < bytes_per_block:
        raise OffloadError(f"{name} {gib!r} GiB = {nbytes:,} bytes is smaller than one block of "
                           f"{bytes_per_block:,} bytes")
    return nbytes // bytes_per_block


def check_policy(policy) -> str:
    """The host tier's eviction policy as LLM / EngineConfig take it (kvjax.kv_offload.manager's rule)."""
    return host_cache.check_policy(policy, OffloadError, "kv offload policy", str, repr)


def _per_block(cache):
    """A predicate for the cache's per-block arrays (leading axis = P blocks): pages and int8's
    per-token scale pages; static per-head scales and the non-finite counters are not per block."""
    first = cache.layers[0]
    p = (first.latent if hasattr(first, "latent") else first.k).shape[0]
    return lambda x: x.ndim >= 2 and x.shape[0] == p


def _paged_leaves(cache) -> list[jax.Array]:
    per_block = _per_block(cache)
    return [x for x in jax.tree_util.tree_leaves(cache) if per_block(x)]


def _row_bytes(x) -> int:
    return math.prod(x.shape[1:]) * x.dtype.itemsize


def block_nbytes(cache) -> int:
    """Bytes of one block over all layers: what one host page holds."""
    return sum(_row_bytes(x) for x in _paged_leaves(cache))


def _as_bytes(x):
    u = jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype.itemsize > 1 else x.view(jnp.uint8)
    return u.reshape(x.shape[0], -1)


@functools.partial(jax.jit, static_argnames="n")
def _gather(cache, blocks, *, n: int):
    """n blocks → a tuple of n u8[bytes_per_block] pages (one array per block: one transfer each)."""
    packed = jnp.concatenate([_as_bytes(x[blocks]) for x in _paged_leaves(cache)], axis=1)
    return tuple(packed[i] for i in range(n))


@functools.partial(jax.jit, donate_argnames="cache")
def _scatter(cache, blocks, *pages):
    """Write pages (u8[bytes_per_block] each) into the cache's blocks; → cache."""
    packed, n = jnp.stack(pages), len(pages)
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    per_block, out, at = _per_block(cache), [], 0
    for x in leaves:  # the order _paged_leaves packed them in
        if not per_block(x):
            out.append(x)
            continue
        raw, at = packed[:, at:at + _row_bytes(x)], at + _row_bytes(x)
        if x.dtype.itemsize > 1:
            vals = jax.lax.bitcast_convert_type(raw.reshape(n, *x.shape[1:], x.dtype.itemsize), x.dtype)
            out.append(x.at[blocks].set(vals))
        else:  # scattered as bytes: XLA's CPU has no fp8 scatter (kvjax.worker.paged_cache._as_bytes)
            out.append(x.view(jnp.uint8).at[blocks].set(raw.reshape(n, *x.shape[1:])).view(x.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


class HostPages:
    """`num_slots` host pages of one block each (module docstring). Byte counters are what
    crossed the host link in each direction."""

    def __init__(self, num_slots: int, cache, memory_kind: str | None = None):
        device = jax.tree_util.tree_leaves(cache)[0].devices().pop()
        kinds = {m.kind for m in device.addressable_memories()}
        self.memory_kind = memory_kind or ("pinned_host" if "pinned_host" in kinds else "numpy")
        if self.memory_kind not in ("pinned_host", "numpy"):
            raise OffloadError(f"host memory kind must be 'pinned_host' or 'numpy', got {self.memory_kind!r}")
        if self.memory_kind == "pinned_host" and "pinned_host" not in kinds:
            raise OffloadError(f"device {device} has no pinned_host memory (it has {', '.join(sorted(kinds))})")
        self._host = SingleDeviceSharding(device, memory_kind="pinned_host") if self.memory_kind == "pinned_host" \
            else None
        self._device = SingleDeviceSharding(device)
        self.num_slots = num_slots
        self.bytes_per_block = block_nbytes(cache)
        self.pages: list = [None] * num_slots
        self._pending: list[tuple[int, jax.Array]] = []  # NumPy mode: copies not yet read back
        self.bytes_stored = self.bytes_loaded = 0

    def _flush(self) -> None:
        for slot, page in self._pending:
            self.pages[slot] = np.asarray(page)
        self._pending = []

    def store(self, cache, blocks, slots) -> None:
        """Copy device blocks[i] into host slot slots[i] (both int sequences of one length)."""
        n = len(blocks)
        if n == 0:
            return
        self._flush()
        padded = np.zeros(pow2_bucket(n), np.int32)
        padded[:n] = blocks
        pages = _gather(cache, padded, n=len(padded))[:n]
        if self._host is not None:
            pages = jax.device_put(list(pages), self._host)
            for slot, page in zip(slots, pages):
                self.pages[int(slot)] = page
        else:
            for slot, page in zip(slots, pages):
                page.copy_to_host_async()
                self._pending.append((int(slot), page))
        self.bytes_stored += n * self.bytes_per_block

    def load(self, cache, slots, blocks):
        """Copy host slots[i] into device blocks[i]; → the updated cache (the input is donated)."""
        n = len(slots)
        if n == 0:
            return cache
        self._flush()
        missing = [int(s) for s in slots if self.pages[int(s)] is None]
        if missing:
            raise OffloadError(f"host slot {missing[0]} holds no page: the index and the pages disagree")
        pages = jax.device_put([self.pages[int(s)] for s in slots], self._device)
        m = pow2_bucket(n)
        pages += [pages[0]] * (m - n)  # padding rows rewrite the null block 0, which no request reads
        padded = np.zeros(m, np.int32)
        padded[:n] = blocks
        self.bytes_loaded += n * self.bytes_per_block
        return _scatter(cache, padded, *pages)
