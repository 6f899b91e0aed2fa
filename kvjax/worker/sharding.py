"""Tensor parallelism on a JAX mesh: which axis of each parameter and cache array is split.

This is Megatron-LM's tensor parallelism as vLLM applies it (`vllm/model_executor/layers/
linear.py`: `QKVParallelLinear`, `ColumnParallelLinear`, `RowParallelLinear`;
`vllm/config/model.py: get_num_kv_heads`), written as shardings on a one-axis mesh ("tp")
rather than as a rewritten model. The model code never mentions devices: the parameters and
the paged cache are placed with `NamedSharding`s and the jitted step's partitioner (GSPMD)
propagates them through the forward pass, inserting the one all-reduce each row-parallel
projection needs. That step is `kvjax.worker.model_runner.make_step(model, mesh, cache)`, which
keeps the cache in the shardings `cache_shardings` gives.

    q/k/v projections, MLA q_b_proj / kv_b_proj, MLP gate/up   column parallel: split the output
                                                                (head / intermediate) axis
    o_proj, MLP down_proj                                       row parallel: split the input axis
    gpt-oss attention sinks f32[N] (self_attn/sinks)            split over query heads, as q_proj's
    MoE experts/gate_up_proj [E, D, 2I] (+ bias [E, 2I])        column parallel: split each expert's I
    MoE experts/down_proj [E, I, D]                             row parallel: split each expert's I
    shared experts' gate/up/down_proj                           as a dense MLP's
    embeddings, lm_head, norms, MLA q_a_proj / kv_a_proj,       replicated
    MoE router (gate, e_score_correction_bias), down_proj_bias
    GQA/MHA KV pages [P, Z, K, H]                               split over kv heads (axis K)
    MLA latent pages [P, Z, C]                                  replicated on every rank

KV heads follow `KVSpec.kv_heads_per_rank` (SPEC "Budget → blocks", vLLM's rule): with tp ≤ K
each rank holds K / tp heads; with tp > K each head is held by tp / K ranks, one head per
rank. A NamedSharding cannot give two ranks the same slice of an axis that is split, so the
replicated case is expressed the way vLLM's weight loader does it: the k/v projection
columns (and fp8 scales) of each kv head are repeated tp / K times, making a model with
tp kv heads whose head k·r + j is a copy of head k. Query head n of that model reads kv head
n // (N / tp), a copy of the original n // (N / K): the same function, and a cache whose
head axis (tp heads) splits evenly, one head per rank. Build the model from the config with
`num_kv_heads = layout.cache_kv_heads`.

The MLA latent is one vector per token shared by all heads, so every rank keeps the whole
latent cache (SPEC: TP does not shrink per-device MLA KV); its per-head projections are split.

Mixture-of-experts layers split as vLLM 0.33's FusedMoE does without expert parallelism
(`fused_moe/routed_experts.py` `_load_w13` / `_load_w2`, `config.py`
`intermediate_size_per_partition = intermediate_size // tp_size`): every rank holds every expert,
each cut to I / tp of its intermediate width — w13 (gate and up) column parallel, w2 (down) row
parallel — so each rank computes its slice of every chosen expert's MLP and one all-reduce sums
the partial down projections (GSPMD puts it right after them: kvjax rounds each expert's output to
the model dtype before weighting, as transformers does, so the sum cannot move past the weighted
combine as vLLM's does). The router runs whole on every rank; shared experts are dense MLPs. vLLM
loads gate (w1) and up (w3) into its w13 one shard at a time, rank r taking rows r·I/tp onward of
each; here the two sit side by side in one [E, D, 2I] tensor, and a split of its last axis would
give rank 0 gate columns only. So under TP the model runs with `MoEConfig.gate_up_blocks = tp`
(`tp_model_config`) and its gate_up_proj columns reordered into tp blocks [gate_r | up_r]
(`block_gate_up`): rank r's contiguous slice is block r, both halves of its share, and down_proj's
rows r·I/tp onward, split in their natural order, are the ones block r's activations multiply.
`tp_params` applies both rewrites (repeated kv heads, gate/up blocks) to checkpoint weights.

Axes: the kvjax package docstring's legend.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.config.model import ModelConfig
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.errors import KvjaxError
from kvjax.utils.checks import check_int
from kvjax.worker.paged_cache import LatentPages, PagedCache

AXIS = "tp"
DCP_AXIS = "dcp"  # decode context parallelism: the minor axis of a 2-D mesh (tp / dcp, dcp); TP splits over both

# Parameter module names (Hugging Face's, which the Flax trees keep) → the axis of the kernel
# [in, out] that is split. Biases of column-parallel layers split with their output axis;
# row-parallel biases are added after the all-reduce, so they stay whole.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
KV_PROJECTIONS = ("k_proj", "v_proj")
# Per-query-head parameters [N] of an attention module: split like q_proj's output heads (contiguous, rank r
# holding heads r·N/tp onward; query heads are never repeated, only kv heads are), so each rank's attention
# sees the sink logits of its own heads.
QUERY_HEAD_PARAMS = ("sinks",)
# The stacked routed experts (models.moe.Experts, module "experts"): leaf → its PartitionSpec. Each
# expert's intermediate axis I is split; down_proj_bias is added after the reduction, so it is whole.
EXPERTS = {"gate_up_proj": P(None, None, AXIS), "gate_up_proj_bias": P(None, AXIS), "down_proj": P(None, AXIS, None)}
GATE_UP = ("gate_up_proj", "gate_up_proj_bias")  # the leaves whose last axis is [gate | up]


class ShardingError(KvjaxError):
    """A tensor-parallel size or a tensor that cannot be split as asked; the message names it."""


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None, dcp: int = 1) -> Mesh:
    """A one-axis mesh ("tp") over the first `tp` devices (or the ones given); with decode context parallelism
    (dcp > 1, dividing tp) the same devices as a (tp / dcp, dcp) mesh ("tp", "dcp"): the tensor-parallel split
    runs over both axes (`tp_axes`), device i·dcp + j holding shard i·dcp + j as in the one-axis mesh, and MLA's
    latent pages split by token over "dcp" (vLLM: DCP reuses the TP ranks, consecutive ranks one DCP group).

    Auto axis types: shardings are hints the partitioner propagates through the unchanged
    model code (JAX's default for `jax.make_mesh` is now Explicit, which would require every
    reshape in the model to name its output sharding).
    """
    check_int(tp, "tp", 1, None, ShardingError)
    available = list(devices) if devices is not None else jax.devices()
    if len(available) < tp:
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)"
                if available and available[0].platform == "cpu" else "")
        raise ShardingError(f"tp {tp} needs {tp} devices, {len(available)} available{hint}")
    if dcp == 1:
        return Mesh(np.array(available[:tp]), (AXIS,), axis_types=(AxisType.Auto,))
    check_int(dcp, "dcp", 1, tp, ShardingError)
    if tp % dcp:
        raise ShardingError(f"tp_size={tp} must be divisible by dcp_size={dcp}.")
    return Mesh(np.array(available[:tp]).reshape(tp // dcp, dcp), (AXIS, DCP_AXIS),
                axis_types=(AxisType.Auto, AxisType.Auto))


def tp_axes(mesh: Mesh):
    """The mesh axes the tensor-parallel split runs over: "tp", or ("tp", "dcp") on a DCP mesh."""
    return (AXIS, DCP_AXIS) if DCP_AXIS in mesh.axis_names else AXIS


def tp_size(mesh: Mesh) -> int:
    """Ranks of the tensor-parallel split (every device of a DCP mesh)."""
    return math.prod(mesh.shape[a] for a in mesh.axis_names if a in (AXIS, DCP_AXIS))


def on_mesh(spec: P, mesh: Mesh) -> P:
    """spec with its "tp" entries split over `tp_axes(mesh)` (the identity on a one-axis mesh)."""
    axes = tp_axes(mesh)
    return spec if axes == AXIS else P(*(axes if entry == AXIS else entry for entry in spec))


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How one model's KV heads spread over `tp` ranks (validated against the spec's rules)."""

    spec: KVSpec  # the model's own layout (all ranks together)
    tp: int

    def __post_init__(self):
        try:
            self.spec.kv_heads_per_rank(self.tp)
        except ValueError as e:
            raise ShardingError(str(e)) from None

    @property
    def kv_heads_per_rank(self) -> int:
        return self.spec.kv_heads_per_rank(self.tp)

    @property
    def head_replicas(self) -> int:
        """Copies of each kv head across ranks: tp / K when tp > K (GQA/MHA), else 1."""
        if self.spec.kind == "mla":
            return 1  # the latent is not split at all: every rank holds it (see cache_shardings)
        return max(1, self.tp // self.spec.num_kv_heads)

    @property
    def cache_kv_heads(self) -> int:
        """The head axis of the (global) sharded cache and of the model that fills it."""
        return self.spec.num_kv_heads * self.head_replicas

    @property
    def cache_spec(self) -> KVSpec:
        """The layout of the global cache: the spec with each kv head repeated head_replicas times."""
        if self.head_replicas == 1:
            return self.spec
        kind = "mha" if self.cache_kv_heads == self.spec.num_heads else "gqa"
        return self.spec.replace(num_kv_heads=self.cache_kv_heads, kind=kind)

    @property
    def rank_spec(self) -> KVSpec:
        """The layout one rank holds: the foundation's `spec.per_rank(tp)`."""
        return self.spec.per_rank(self.tp)


def tp_layout(spec: KVSpec, tp: int) -> TPLayout:
    return TPLayout(spec, tp)


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
def _keys(path) -> list[str]:
    return [str(getattr(p, "key", getattr(p, "name", p))) for p in path]


def param_partition(path, ndim: int) -> P:
    """The PartitionSpec of one parameter, from its Flax path (`layers_3/self_attn/q_proj/kernel`)."""
    keys = _keys(path)
    module, leaf = (keys[-2], keys[-1]) if len(keys) >= 2 else ("", keys[-1])
    if module == "experts":
        return EXPERTS.get(leaf, P())
    if module == "self_attn" and leaf in QUERY_HEAD_PARAMS:
        return P(AXIS)
    if module in COLUMN_PARALLEL:
        return P(None, AXIS) if leaf == "kernel" else P(AXIS)  # kernel [in, out]; bias [out]
    if module in ROW_PARALLEL and leaf == "kernel":
        return P(AXIS, None)
    return P()


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """A pytree of NamedShardings matching `params` (arrays or ShapeDtypeStructs).

    Raises ShardingError naming the first tensor whose split axis tp does not divide.
    """
    tp = tp_size(mesh)

    def one(path, leaf):
        spec = param_partition(path, len(leaf.shape))
        for axis, name in enumerate(spec):
            if name == AXIS and leaf.shape[axis] % tp:
                raise ShardingError(f"parameter {'/'.join(_keys(path))} {tuple(leaf.shape)}: axis {axis} "
                                    f"({leaf.shape[axis]}) does not split over tp {tp}")
        return NamedSharding(mesh, on_mesh(spec, mesh))

    return jax.tree_util.tree_map_with_path(one, params)


def replicate_kv_heads(params: Any, layout: TPLayout, head_dim: int) -> Any:
    """Repeat each kv head's k_proj / v_proj columns (and biases) `layout.head_replicas` times.

    kernel [D, K·H] → [D, K·r·H] with new head k·r + j = old head k; the identity when r = 1.
    Works on host or device arrays; the result feeds a model built with
    num_kv_heads = layout.cache_kv_heads.
    """
    r = layout.head_replicas
    if r == 1:
        return params
    k = layout.spec.num_kv_heads

    def one(path, leaf):
        keys = _keys(path)
        if len(keys) < 2 or keys[-2] not in KV_PROJECTIONS:
            return leaf
        if leaf.shape[-1] != k * head_dim:
            raise ShardingError(f"{'/'.join(keys)} {tuple(leaf.shape)}: last axis is not {k} kv heads × {head_dim}")
        heads = leaf.reshape(*leaf.shape[:-1], k, head_dim)  # [..., K, H]
        xp = np if isinstance(leaf, np.ndarray) else jax.numpy
        return xp.repeat(heads, r, axis=-2).reshape(*leaf.shape[:-1], k * r * head_dim)

    return jax.tree_util.tree_map_with_path(one, params)


def block_gate_up(params: Any, blocks: int) -> Any:
    """Reorder every MoE gate_up_proj's (and its bias's) last axis from transformers' [gate | up] into
    `blocks` blocks [gate_b | up_b]: [..., 2I] → [..., blocks, 2, I / blocks] order, flattened.

    Column c·I/b + j of gate (c-th block, j-th in it) moves to c·2I/b + j, up's to c·2I/b + I/b + j;
    the identity when blocks = 1. The result feeds a model built with MoEConfig.gate_up_blocks =
    blocks (tp_model_config). Works on host or device arrays."""
    if blocks == 1:
        return params

    def one(path, leaf):
        keys = _keys(path)
        if len(keys) < 2 or keys[-2] != "experts" or keys[-1] not in GATE_UP:
            return leaf
        width = leaf.shape[-1]
        if width % (2 * blocks):
            raise ShardingError(f"{'/'.join(keys)} {tuple(leaf.shape)}: {width} gate/up columns do not split into "
                                f"{blocks} blocks of gate and up")
        xp = np if isinstance(leaf, np.ndarray) else jax.numpy
        halves = leaf.reshape(*leaf.shape[:-1], 2, blocks, width // (2 * blocks))  # [..., 2, b, I/b]
        return xp.swapaxes(halves, -3, -2).reshape(leaf.shape)  # [..., b, 2, I/b] → [..., 2I]

    return jax.tree_util.tree_map_with_path(one, params)


def tp_model_config(config: ModelConfig, layout: TPLayout) -> ModelConfig:
    """The config of the model that runs on `layout.tp` ranks: the same function as `config`'s, with
    each kv head repeated `layout.head_replicas` times and, for a MoE model, the experts' gate/up
    columns in tp blocks. `config` itself when neither applies (tp 1, a dense model with tp ≤ K)."""
    changes: dict[str, Any] = {}
    if layout.head_replicas > 1:
        changes["num_kv_heads"] = layout.cache_kv_heads
    if config.moe is not None and layout.tp > 1:
        if config.moe.intermediate_size % layout.tp:
            raise ShardingError(f"the experts' intermediate_size {config.moe.intermediate_size} does not split "
                                f"over tp {layout.tp} (vLLM: intermediate_size_per_partition = I / tp)")
        changes["moe"] = dataclasses.replace(config.moe, gate_up_blocks=layout.tp)
    return config.replace(**changes) if changes else config


def tp_params(params: Any, config: ModelConfig, layout: TPLayout) -> Any:
    """Checkpoint weights of `config` rewritten for the model of tp_model_config(config, layout):
    kv heads repeated (replicate_kv_heads), gate/up columns blocked (block_gate_up). Not yet placed:
    shard_params does that."""
    params = replicate_kv_heads(params, layout, config.head_dim or 0)
    return block_gate_up(params, layout.tp) if config.moe is not None else params


def replicate_scales(scales, layout: TPLayout):
    """fp8 KVScales for the replicated-head cache: each per-head f32[K] repeated head_replicas times."""
    if scales is None or layout.head_replicas == 1:
        return scales
    r = layout.head_replicas
    rep = lambda arrs: tuple(np.repeat(np.asarray(a).reshape(-1), r) for a in arrs)  # noqa: E731
    return dataclasses.replace(scales, k=rep(scales.k), v=rep(scales.v))


def shard_params(params: Any, mesh: Mesh) -> Any:
    """Place `params` on the mesh by the rules above (a copy; drop the unsharded tree after).

    A mesh over several processes (kvjax.distributed.runtime): every process holds the same host weights and
    builds only its own devices' shards from them (jax.make_array_from_callback), where device_put would first
    all-gather every tensor to check that the processes agree."""
    shardings = param_shardings(params, mesh)
    if mesh.is_multi_process:
        return jax.tree.map(lambda a, s: _from_host(np.asarray(a), s), params, shardings)
    return jax.device_put(params, shardings)


def _from_host(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# --------------------------------------------------------------------------------------------
# The paged cache
# --------------------------------------------------------------------------------------------
def cache_shardings(cache: PagedCache, mesh: Mesh) -> PagedCache:
    """A PagedCache-shaped pytree of NamedShardings (`cache` may hold ShapeDtypeStructs).

    KVPages: pages [P, Z, K, H] and int8 scale pages [P, Z, K] split on K, static fp8 scales
    f32[K] split on K; LatentPages replicated, or on a DCP mesh their pages [P, Zv, C] (and per-token scale
    pages [P, Zv]) split on the token axis over "dcp" (kvjax.attention.dcp: which rank holds which token);
    the non-finite counters replicated.
    """
    tp = tp_size(mesh)
    whole = NamedSharding(mesh, P())

    def heads(a):
        if a.ndim == 0:
            return whole
        axis = 2 if a.ndim >= 3 else 0  # [P, Z, K, (H)] or f32[K]
        if a.shape[axis] % tp:
            raise ShardingError(f"cache array {tuple(a.shape)}: {a.shape[axis]} kv heads do not split over tp {tp}; "
                                "build the cache from TPLayout.cache_spec")
        spec = [None] * a.ndim
        spec[axis] = AXIS
        return NamedSharding(mesh, on_mesh(P(*spec), mesh))

    def latent(a):  # token axis 1 of pages [P, Zv, C] and scale pages [P, Zv]; the static f32[C] scale whole
        return NamedSharding(mesh, P(None, DCP_AXIS)) if DCP_AXIS in mesh.axis_names and a.ndim >= 2 else whole

    return cache.replace(layers=tuple(jax.tree.map(lambda a: latent(a) if isinstance(layer, LatentPages) else heads(a),
                                                   layer) for layer in cache.layers))


def cache_maker(layout: TPLayout, num_blocks: int, block_size: int, scales=None, layer_slots: tuple = ()):
    """A function of no arguments that creates the zeroed paged cache of `layout.cache_spec` (to
    jit into its shards, or to eval_shape). `scales`: the model's fp8 KVScales (per original kv
    head; repeated here); layer_slots: with KV cache groups, each layer's shared page tensor."""
    spec, scales = layout.cache_spec, replicate_scales(scales, layout)
    return lambda: PagedCache.create(spec, num_blocks, block_size, scales, layer_slots)


def create_cache(layout: TPLayout, num_blocks: int, block_size: int, mesh: Mesh, scales=None,
                 dcp: int = 1) -> PagedCache:
    """Zeroed paged cache for `layout.cache_spec`, created directly in its shards (no full copy
    on one device). dcp > 1: MLA latent pages marked for decode context parallelism (LatentPages.dcp; the
    mesh must be make_mesh(..., dcp=dcp)'s), each rank holding block_size / dcp tokens of every block."""
    make = cache_maker(layout, num_blocks, block_size, scales)
    if dcp > 1:
        if mesh.shape.get(DCP_AXIS) != dcp:
            raise ShardingError(f"a cache split over dcp {dcp} needs make_mesh(..., dcp={dcp})'s mesh, got {mesh.shape}")
        plain = make
        make = lambda: mark_dcp(plain(), mesh)  # noqa: E731
    return jax.jit(make, out_shardings=cache_shardings(jax.eval_shape(make), mesh))()


def mark_dcp(cache: PagedCache, mesh: Mesh) -> PagedCache:
    """The cache with every latent layer split by token over `mesh`'s "dcp" axis (LatentPages.dcp_mesh)."""
    return cache.replace(layers=tuple(layer.replace(dcp_mesh=mesh) if isinstance(layer, LatentPages) else layer
                                      for layer in cache.layers))


def replicated(mesh: Mesh, tree: Any) -> Any:
    """Put host/device arrays (tokens, metadata) on every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


# --------------------------------------------------------------------------------------------
# Bytes per device
# --------------------------------------------------------------------------------------------
def shard_nbytes(leaf: Any, sharding: NamedSharding) -> int:
    """Bytes one device holds of an array (or ShapeDtypeStruct) placed with `sharding`."""
    shape = sharding.shard_shape(tuple(leaf.shape))
    return math.prod(shape) * np.dtype(leaf.dtype).itemsize


def tree_shard_nbytes(tree: Any, shardings: Any) -> int:
    """Analytic bytes per device of a pytree placed with matching shardings (every rank holds
    the same amount under these rules)."""
    leaves = jax.tree_util.tree_leaves(tree)
    shards = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    if len(leaves) != len(shards):
        raise ShardingError(f"{len(leaves)} arrays but {len(shards)} shardings")
    return sum(shard_nbytes(leaf, s) for leaf, s in zip(leaves, shards))
