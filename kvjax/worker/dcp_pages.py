"""Which rank holds which token of MLA's latent cache under decode context parallelism, and the write that puts it
there (vLLM's DCP KV layout: `cp_kv_cache_interleave_size` 1, `vllm/v1/worker/block_table.py`).

vLLM interleaves a sequence's tokens over the D ranks of a DCP group: token p is stored on rank p % D, and the
scheduler's blocks are D times the page size (`resolve_dcp_kv_block_size`): a block of Zv = Z·D tokens is a page
of Z tokens on each rank. kvjax keeps the latent pages as one global array [P, Zv, C] whose token axis is split
over the mesh's "dcp" axis (kvjax.worker.sharding.cache_shardings), so rank r holds the contiguous run of slots
[r·Z, (r+1)·Z) of every block, a local page [P, Z, C]. Token p of a sequence, at offset o = p % Zv of its block,
therefore lives on rank o % D at local slot o // D:

    global slot  b·Zv + o   →   rank o % D,  local slot b·Z + o // D

and since Zv is a multiple of D, rank r's tokens of a sequence are exactly its positions p ≡ r (mod D), local
position p // D: a paged sequence of its own, with the same block table and page size Z, which any of kvjax's
attention forms reads (kvjax.attention.dcp: positions and lengths mapped to the local sequence).

`write_latent_dcp` writes a step's tokens this way, inside `jax.shard_map` over the mesh: every rank sees every
token (the latent is replicated) and scatters those it holds into its local page; the others go to the null
block's slot 0, which is never read (kvjax.worker.paged_cache.scatter_slots). Quantized formats are written as
write_latent writes them, the per-token scale pages split like the pages.

Axes: the kvjax package docstring's legend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

DCP_AXIS = "dcp"


def local_slots(slot_mapping: jax.Array, block_size: int, dcp: int, rank) -> jax.Array:
    """i32[T] global slots (blocks of block_size = Zv tokens) → rank `rank`'s local slots (blocks of Zv / dcp
    tokens), the tokens another rank holds sent to the null block's slot 0."""
    z = block_size // dcp
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    return jnp.where(offset % dcp == rank, block * z + offset // dcp, 0).astype(jnp.int32)


def local_lengths(lengths: jax.Array, dcp: int, rank) -> jax.Array:
    """How many of a sequence's first `lengths` tokens rank `rank` holds: ceil((L - r) / D), at least 0 (vLLM's
    get_dcp_local_seq_lens with interleave 1)."""
    return jnp.maximum(lengths - rank + dcp - 1, 0) // dcp


def local_positions(positions: jax.Array, dcp: int, rank) -> jax.Array:
    """The last local position a query at global position p may see on rank r: floor((p - r) / D) (-1: none)."""
    return jnp.floor_divide(positions - rank, dcp)


def write_latent_dcp(pages, latent: jax.Array, slot_mapping: jax.Array, write_latent):
    """pages: LatentPages [P, Zv, C] split by token over pages.dcp_mesh; latent: [T, C] (replicated); slot_mapping:
    i32[T] global slots → the pages with each rank's tokens written into its share (module docstring).
    write_latent: kvjax.worker.paged_cache's, which writes one rank's unsplit pages (passed in: that module calls
    this one)."""
    mesh = pages.dcp_mesh
    dcp, zv = mesh.shape[DCP_AXIS], pages.latent.shape[1]
    split = P(None, DCP_AXIS)  # the token axis of pages [P, Zv, C] and per-token scale pages [P, Zv]
    names = [n for n in ("latent", "scale", "nonfinite") if getattr(pages, n) is not None]
    specs = tuple(P() if n == "nonfinite" or getattr(pages, n).ndim < 2 else split for n in names)

    def write(arrays, values, slots):  # on one rank: pages [P, Z, C]
        layer = pages.replace(**dict(zip(names, arrays)), dcp_mesh=None)  # this rank's pages [P, Z, C]
        out = write_latent(layer, values, local_slots(slots, zv, dcp, jax.lax.axis_index(DCP_AXIS)))
        return tuple(getattr(out, n) for n in names)

    # Every rank counts every token's non-finite values (the latent is replicated), so the counter stays equal.
    arrays = jax.shard_map(write, mesh=mesh, in_specs=(specs, P(), P()), out_specs=specs, check_vma=False)(
        tuple(getattr(pages, n) for n in names), latent, slot_mapping)
    return pages.replace(**dict(zip(names, arrays)))


__all__ = ["local_lengths", "local_positions", "local_slots", "write_latent_dcp"]
