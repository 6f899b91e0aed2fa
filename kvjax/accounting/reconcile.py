"""Reconcile: allocate the cache that kvjax.accounting.sizing planned, and set analytic beside measured bytes.

`reconcile` takes a sizing.SizingReport (profile → budget → blocks), allocates its paged cache
(pages with int8's per-slot scale pages, then the static scales and counters) and the block
tables of max_num_seqs × cdiv(max_model_len, block_size) entries, and measures each increase of
bytes in use on every device. Each item becomes a kvjax.accounting.memory.Row of one device —
weights, kv pages, scales + counters, block tables, the profile's activation peak, and the total
resident — holding the analytic and the measured bytes and the cause of any difference. This is
the table `kvjax memory` prints.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.accounting import memory as mem
from kvjax.accounting.sizing import SizingReport
from kvjax.math_utils import cdiv
from kvjax.worker import sharding as shd


@dataclasses.dataclass(frozen=True)
class DeviceCheck:
    """The reconciliation rows of one device."""

    device: str
    rows: tuple[mem.Row, ...]  # weights, kv pages, scales + counters, block tables, activation peak, total
    shard_kv_bytes: int  # the cache's per-slot arrays held on this device

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "rows": [r.to_json() for r in self.rows],
                "shard_kv_bytes": self.shard_kv_bytes}


@dataclasses.dataclass(frozen=True)
class Reconciliation:
    per_device: tuple[DeviceCheck, ...]

    @property
    def rows(self) -> tuple[mem.Row, ...]:
        return self.per_device[0].rows

    @property
    def devices_agree(self) -> bool:
        first = [r.measured for r in self.rows]
        return all([r.measured for r in d.rows] == first for d in self.per_device)

    @property
    def kv_measured_over_analytic(self) -> float | None:
        return self.rows[1].ratio


def _allocate(sized: SizingReport) -> dict:
    """Pages (with int8's per-slot scale pages), then static scales and counters, then the block
    tables, each measured as the increase of bytes in use on every device."""
    devices, mesh = sized.devices, sized.mesh
    # decode context parallelism (a mesh with a "dcp" axis): a block is block_size tokens on each of dcp ranks,
    # the latent pages split by token (kvjax.worker.dcp_pages), so a rank holds num_blocks pages of block_size tokens
    dcp = mesh.shape.get(shd.DCP_AXIS, 1)
    make = shd.cache_maker(sized.layout, sized.num_blocks, sized.block_size * dcp, layer_slots=sized.layer_slots) \
        if sized.pool is None else sized.pool.cache_maker(sized.layout.cache_spec, sized.num_blocks, sized.block_size)
    shapes = jax.eval_shape(make)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    shardings = jax.tree_util.tree_leaves(shd.cache_shardings(shapes, mesh))
    groups = {"pages": [i for i, x in enumerate(leaves) if x.ndim >= 2],  # a hybrid's Mamba states inside them
              "static": [i for i, x in enumerate(leaves) if x.ndim < 2]}
    made, snaps = [None] * len(leaves), [mem.snapshot(devices)]
    for want in groups.values():
        arrays = jax.jit(lambda want=want: [jax.tree_util.tree_leaves(make())[i] for i in want],
                         out_shardings=[shardings[i] for i in want])()
        jax.block_until_ready(arrays)
        snaps.append(mem.snapshot(devices))
        for i, a in zip(want, arrays):
            made[i] = a
    cache = jax.tree_util.tree_unflatten(treedef, made)
    width = cdiv(sized.max_model_len, sized.block_size * dcp)
    num_groups = 1 if sized.groups is None else len(sized.groups.groups)  # one table per KV cache group
    tables = jax.device_put(jnp.zeros((sized.max_num_seqs, num_groups, width), jnp.int32),
                            NamedSharding(mesh, P()))  # i32[B, G, M]
    jax.block_until_ready(tables)
    snaps.append(mem.snapshot(devices))
    return {"cache": cache, "tables": tables, "snapshots": snaps,
            "page_arrays": [shd.shard_nbytes(leaves[i], shardings[i]) for i in groups["pages"]],
            "static_arrays": [shd.shard_nbytes(leaves[i], shardings[i]) for i in groups["static"]],
            "table_bytes": sized.max_num_seqs * num_groups * width * 4}


def reconcile(sized: SizingReport, *, baseline: Sequence[int] | None = None) -> Reconciliation:
    """Allocate the planned cache and block tables, then analytic vs measured bytes per device.

    baseline: bytes in use on each device before the weights were loaded, for the "total
    resident" row; None: in use before the cache minus the weights. The cache and tables are
    freed on return.
    """
    alloc = _allocate(sized)
    before_kv, after_pages, after_static, after_tables = alloc["snapshots"]
    if baseline is None:
        baseline = [b - w for b, w in zip(before_kv, sized.weights_per_device)]
    platform, rank_spec, z = sized.platform, sized.layout.rank_spec, sized.block_size
    analytic = {"weights": sized.weights_analytic, "kv pages": sized.num_blocks * (
                    rank_spec.bytes_per_block(z) if sized.groups is None else sized.groups.bytes_per_block),
                "scales + counters": mem.cache_static_bytes(
                    rank_spec, None if sized.groups is None else max(sized.layer_slots) + 1), "block tables": alloc["table_bytes"]}
    arrays = {"weights": list(sized.weight_arrays), "kv pages": alloc["page_arrays"],
              "scales + counters": alloc["static_arrays"], "block tables": [alloc["table_bytes"]]}
    notes = {}
    if sized.pool is not None:  # which groups' pages and states the shared tensors hold (accounting.mamba_pool)
        notes = sized.pool.row_notes(sized.groups)
    act_analytic = sized.profile.analytic
    per_device = []
    for d, dev in enumerate(sized.devices):
        measured = {"weights": sized.weights_per_device[d], "kv pages": after_pages[d] - before_kv[d],
                    "scales + counters": after_static[d] - after_pages[d],
                    "block tables": after_tables[d] - after_static[d]}
        rows = [mem.Row(k, analytic[k], measured[k], (f"{notes[k]}: " if k in notes else "") + mem.explain_arrays(
                    analytic[k], measured[k], arrays[k], platform)) for k in analytic]
        act = sized.profile.measured[d]
        rows.append(mem.Row("activation peak", act_analytic, act, _explain_activations(act_analytic, act, platform)))
        resident, expected = after_tables[d] - baseline[d], sum(analytic.values())
        rows.append(mem.Row("total resident", expected, resident,
                            "weights + KV + scales + tables; the profile's buffers were freed"
                            if resident == expected else
                            "in use now − in use before the weights; beyond the rows above: buffers the "
                            "runtime keeps for the compiled step (constants) and allocator rounding"))
        kv = mem.tree_bytes_on([x for x in jax.tree_util.tree_leaves(alloc["cache"]) if x.ndim >= 2], dev)
        per_device.append(DeviceCheck(str(dev), tuple(rows), kv))
    return Reconciliation(tuple(per_device))


def _explain_activations(analytic: int, measured: int | None, platform: str) -> str:
    if measured is None:
        return ("the allocator's peak was set earlier (weight loading) and the profile stayed below it; "
                "the budget uses XLA's plan")
    if platform == "cpu":
        return "cpu keeps no allocator peak: measured is live arrays + XLA temp, so it equals XLA's plan"
    diff = measured - analytic
    if diff == 0:
        return "exact"
    return (f"allocator peak vs XLA's buffer plan: {diff:+,} B (256 B rounding of each buffer, buffers the "
            "runtime adds around the call)")
