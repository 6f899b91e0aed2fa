"""Profile → budget → blocks: size the paged KV cache from measured memory, as vLLM V1 does.

vLLM sizes its cache once at engine start (`vllm/v1/worker/gpu_worker.py:
determine_available_memory`, SPEC "Budget → blocks"): the weights are loaded and their bytes
measured while loading (`model_memory_usage`), one profiling forward runs over
`max_num_batched_tokens` tokens, the allocator's peak gives the activations, and
`ceil(total × gpu_memory_utilization) − (weights + activations)` goes to KV blocks. kvjax does
the same on JAX devices:

1. `compile_profile`: the profiling step, one prefill chunk of max_num_batched_tokens tokens at
   the end of a max_model_len context (one sequence, the logits of its last token), compiled from
   shapes alone;
2. `run_profile`: run it once. GPU: the allocator's `peak_bytes_in_use`; CPU, which keeps no
   allocator stats: the live arrays at the call plus the compiled step's `memory_analysis()`
   temporaries and unaliased outputs. Activations = that peak − what was in use before the
   step's inputs arrived (weights and the profile's own small cache);
3. `profile_and_size`: total = the caller's bytes or the device's `bytes_limit` (GPU);
   kvjax.accounting.budget.plan for the layout one tensor-parallel rank holds → num_blocks.

kvjax.accounting.reconcile then allocates what the SizingReport planned and sets analytic beside
measured bytes; that is what `kvjax memory` prints.

Unlike vLLM's dummy run, which spreads the tokens over min(tokens, max_num_seqs) requests and
samples max_num_seqs rows, the profile is one sequence with one row of logits. And unlike vLLM's,
whose dummy requests start at position 0, its tokens are the last chunk of a max_model_len context,
the worst prefill step the engine runs: kvjax's prefill attention keeps temporaries that grow with
the context S as well as with the chunk (the reference's f32 scores B·Q·N·S; kvjax.attention.tiled),
so a chunk at position 0 would leave them out of the peak. Its block table is as wide as
cdiv(max_model_len, Z), its entries cycling over the profile's own cdiv(T, Z) + 1 pages (the
attention's temporaries follow the table's width, not how many distinct pages it names, and the
chunk's own writes land in distinct pages). max_num_batched_tokens above max_model_len keeps one
sequence of T tokens (context T), more than the several sequences such a step really holds. On
CPU the tiled attention's one copy of the page pool (`tiled.as_bits`) is of the profile's small pool.

Tensor parallelism: pass a mesh (kvjax.worker.sharding.make_mesh) and params placed by
kvjax.worker.sharding.param_shardings; with tp > K the model and params must already carry the
repeated kv heads (TPLayout.cache_kv_heads, sharding.replicate_kv_heads).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.accounting import budget as bud
from kvjax.accounting import memory as mem
from kvjax.attention.metadata import build_metadata
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv
from kvjax.utils.checks import check_int
from kvjax.worker import sharding as shd
from kvjax.worker.model_runner import make_step

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256
# max_model_len unset: the model's maximum, capped so that a 128K-context model's block tables
# and concurrency readout stay at a typical serving length.
MAX_MODEL_LEN_CAP = 8192


class SizingError(KvjaxError):
    """A sizing input that breaks a rule; the message names the value."""


class NoMemoryLimitError(SizingError):
    """The device reports no memory limit (CPU keeps no allocator stats): pass total_bytes."""


class NoUsableBlockError(SizingError):
    """The budget leaves fewer than 2 blocks: no block besides the null block 0."""

    def __init__(self, plan: bud.Plan):
        self.plan = plan
        super().__init__(f"the budget leaves {plan.num_blocks} blocks of {plan.bytes_per_block:,} B (requested "
                         f"{plan.requested_bytes:,} B, non-KV {plan.weights_bytes + plan.activations_bytes:,} B): "
                         "no usable block; raise total_bytes or util, or lower max_num_batched_tokens")


def device_total_bytes(device: jax.Device) -> int:
    """The memory the device's allocator may use (GPU `bytes_limit`: with preallocation,
    XLA_CLIENT_MEM_FRACTION × memory); NoMemoryLimitError where it reports none (CPU)."""
    total = mem.bytes_limit(device)
    if total is None:
        raise NoMemoryLimitError(f"the {device.platform} device reports no memory limit: pass total_bytes")
    return total


def _check_positive(**values: Any) -> None:
    for name, value in values.items():
        check_int(value, name, 1, None, SizingError)


# --------------------------------------------------------------------------------------------
# 1-2. The profiling step
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class ProfileStep:
    """The compiled profiling prefill and its inputs, kept on the host until the profile runs."""

    mesh: Mesh
    layout: shd.TPLayout  # the model's kv heads over the mesh's tp ranks
    block_size: int
    tokens: int  # T = max_num_batched_tokens
    context: int  # the chunk's last position + 1: max(T, max_model_len)
    compiled: Any  # (params, ids, metadata, cache, rows) → (logits, cache), the cache donated
    xla: mem.CompiledMemory  # XLA's buffer plan of `compiled`, per device
    inputs: tuple  # (ids i32[T], BatchMetadata, logits rows i32[1]), numpy
    cache_blocks: int  # the profile's own cache: cdiv(T, Z) + 1 blocks + the null block
    pool: Any = None  # an attention + Mamba hybrid's kvjax.accounting.mamba_pool.MambaPool (+ a state block a group)

    def make_cache(self):
        if self.pool is not None:
            return self.pool.cache_maker(self.layout.cache_spec, self.cache_blocks, self.block_size)
        return shd.cache_maker(self.layout, self.cache_blocks, self.block_size)


def _profile_inputs(vocab_size: int, tokens: int, block_size: int, context: int, pool=None):
    """One sequence's last `tokens` tokens of a `context`-token context, its table cdiv(context, Z)
    wide with entries cycling over blocks 1..cdiv(tokens, Z) + 1 (module docstring): (ids, metadata,
    logits row, cache blocks with the null block), as host arrays, so that they reach the devices
    only when the profile measures them."""
    width, pages = cdiv(context, block_size), cdiv(tokens, block_size) + 1  # + 1: an unaligned chunk's extra page
    table = [1 + j % pages for j in range(width)]
    groups = {} if pool is None else dict(windows=pool.groups.windows, layer_groups=pool.groups.layer_groups)
    tables = [table if pool is None else pool.profile_tables(table, pages + 1)]  # a hybrid: one table a group
    md = build_metadata([context - tokens], [tokens], tables, block_size=block_size, max_tokens=tokens, max_seqs=1,
                        max_blocks_per_seq=width, **groups)
    md = jax.tree_util.tree_map(np.array, md)  # copies: a numpy view would keep the device buffer alive
    ids = (np.arange(tokens) % vocab_size).astype(np.int32)  # i32[T]
    return ids, md, md.logits_indices.copy(), pages + 1 + (0 if pool is None else pool.mamba_groups)


def _abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree` carrying `shardings` (one sharding, or a matching tree)."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree_util.tree_map(lambda _: shardings, tree)
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _param_abstract(params: Any, mesh: Mesh) -> Any:
    """The params' shapes with where they live: an array's own sharding, else kvjax.worker.sharding's rules."""
    rules = shd.param_shardings(params, mesh)
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or s),
        params, rules)


def compile_profile(model, params: Any, spec: KVSpec, *, mesh: Mesh | None = None,
                    block_size: int = bud.DEFAULT_BLOCK_SIZE,
                    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                    max_model_len: int | None = None, pool=None) -> ProfileStep:
    """Compile the profiling prefill of `model` (a models.build_model decoder with a `.config`):
    max_num_batched_tokens new tokens at the end of a max_model_len context (None: no context
    before them), the worst prefill step (module docstring).

    params: the parameters, or their shapes (ShapeDtypeStructs; without a sharding they are
    placed by kvjax.worker.sharding.param_shardings). On a GPU, compile before the weights are loaded:
    the compiler's autotuning scratch then peaks on an empty device and cannot hide the
    profile's peak later. mesh None: one device.
    """
    _check_positive(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens)
    if max_model_len is not None:
        _check_positive(max_model_len=max_model_len)
    mesh = mesh if mesh is not None else shd.make_mesh(1)
    layout = shd.tp_layout(spec, shd.tp_size(mesh))
    context = max(max_num_batched_tokens, max_model_len or 0)
    ids, md, rows, blocks = _profile_inputs(model.config.vocab_size, max_num_batched_tokens, block_size, context, pool)
    cache_shapes = jax.eval_shape(shd.cache_maker(layout, blocks, block_size) if pool is None else
                                  pool.cache_maker(layout.cache_spec, blocks, block_size))
    whole = NamedSharding(mesh, P())
    compiled = make_step(model, mesh, cache_shapes).lower(
        _param_abstract(params, mesh), _abstract(ids, whole), _abstract(md, whole),
        _abstract(cache_shapes, shd.cache_shardings(cache_shapes, mesh)), _abstract(rows, whole)).compile()
    return ProfileStep(mesh, layout, block_size, max_num_batched_tokens, context, compiled, mem.analyse(compiled),
                       (ids, md, rows), blocks, pool)


@dataclasses.dataclass(frozen=True)
class Profile:
    """One profiling run; tuples hold one value per device of the mesh, in mesh order."""

    tokens: int
    context: int  # the profiled chunk's last position + 1
    how: str  # where the peak came from
    peak_bytes: tuple[int, ...]  # bytes in use at the step's peak
    base_bytes: tuple[int, ...]  # in use before its inputs arrived: weights + the profile's cache
    xla_temp: int
    xla_output: int
    xla_alias: int
    inputs: int  # ids + metadata + logits rows on one device
    profile_cache_bytes: tuple[int, ...]
    analytic: int  # XLA's plan: inputs + temporaries + unaliased outputs
    measured: tuple[int | None, ...]  # peak − base; None where an earlier, higher peak hides it

    @property
    def peak_hidden_by_earlier_peak(self) -> bool:
        return any(m is None for m in self.measured)

    @property
    def activations(self) -> int:
        """Non-KV activations for the budget: the measured peak, or XLA's plan where the device
        could not show it; the largest over devices (every rank must fit)."""
        return max(self.analytic if m is None else m for m in self.measured)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "context": self.context, "how": self.how, "peak_bytes": list(self.peak_bytes),
                "base_bytes": list(self.base_bytes), "xla_temp": self.xla_temp, "xla_output": self.xla_output,
                "xla_alias": self.xla_alias, "inputs": self.inputs,
                "profile_cache_bytes": list(self.profile_cache_bytes), "analytic": self.analytic,
                "measured": list(self.measured), "peak_hidden_by_earlier_peak": self.peak_hidden_by_earlier_peak,
                "activations": self.activations}


def run_profile(step: ProfileStep, params: Any) -> Profile:
    """Run the compiled profiling step once with `params` on the devices; the activation peak."""
    devices = list(step.mesh.devices.flat)
    make = step.make_cache()
    cache = jax.jit(make, out_shardings=shd.cache_shardings(jax.eval_shape(make), step.mesh))()
    cache_bytes = [mem.tree_bytes_on(cache, d) for d in devices]
    base = mem.snapshot(devices)  # weights + profile cache (+ anything else alive)
    peak_before = [mem.peak_bytes(d) for d in devices]
    ids, md, rows = shd.replicated(step.mesh, step.inputs)
    input_bytes = mem.tree_bytes_on((ids, md, rows), devices[0])
    live_at_call = mem.snapshot(devices)
    logits, cache = step.compiled(params, ids, md, cache, rows)
    jax.block_until_ready((logits, cache))
    peak_after = [mem.peak_bytes(d) for d in devices]
    extra = step.xla.temp + step.xla.output - step.xla.alias
    if peak_after[0] is None:  # CPU: live arrays at the call + XLA's temporaries and new outputs
        peaks = [live + extra for live in live_at_call]
        how = "no allocator stats (cpu): live arrays at the call + XLA temp + unaliased outputs"
    else:
        peaks, how = peak_after, "allocator peak_bytes_in_use"
    # An earlier peak (weight loading) above the profile's hides it: measured is then unknown.
    measured = [None if before is not None and peak <= before else peak - b
                for peak, before, b in zip(peaks, peak_before, base)]
    return Profile(step.tokens, step.context, how, tuple(peaks), tuple(base), step.xla.temp, step.xla.output,
                   step.xla.alias, input_bytes, tuple(cache_bytes), input_bytes + extra, tuple(measured))


# --------------------------------------------------------------------------------------------
# 3. Budget → blocks
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class SizingReport:
    """What profile_and_size measured and decided. Bytes are per device (one tensor-parallel
    rank); tuples hold one value per device of the mesh."""

    spec: KVSpec  # the model's KV layout, all ranks together
    layout: shd.TPLayout  # its kv heads over the mesh's ranks
    mesh: Mesh
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int  # rows of the block tables (kvjax.accounting.reconcile)
    max_model_len: int  # block-table width in tokens and the plan's context
    total_bytes: int  # one device's memory: the caller's, or the device's bytes_limit
    total_from_device: bool  # True when total_bytes is the device's bytes_limit
    weights_per_device: tuple[int, ...]  # measured while loading, or the params' resident bytes
    weights_analytic: int  # the params' bytes on one device, by their shardings
    weight_arrays: tuple[int, ...]  # bytes of each parameter on one device
    profile: Profile
    plan: bud.Plan  # budget.plan of layout.rank_spec
    groups: Any = None  # kvjax.accounting.hybrid.GroupPlan for a model with sliding windows or Mamba layers, else None
    pool: Any = None  # with Mamba layers: kvjax.accounting.mamba_pool.MambaPool (the engine's groups and arrays)

    @property
    def num_blocks(self) -> int:
        """The pool's blocks: the budget over the hybrid groups' bytes per block when there are groups."""
        return self.plan.num_blocks if self.groups is None else self.groups.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.plan.bytes_per_block if self.groups is None else self.groups.bytes_per_block

    @property
    def layer_slots(self) -> tuple:
        """Each layer's page tensor with groups (its place in its group), else ()."""
        if self.groups is None:
            return ()
        if self.pool is not None:  # with Mamba layers: each decoder layer's (the states inside the pages)
            return tuple(self.pool.groups.layer_slots)
        slots = [0] * self.spec.num_layers
        for g in self.groups.groups:
            for j, layer in enumerate(g.layers):
                slots[layer] = j
        return tuple(slots)

    @property
    def weights_bytes(self) -> int:
        """The budget's weights: the largest over devices."""
        return max(self.weights_per_device)

    @property
    def activations_bytes(self) -> int:
        return self.profile.activations

    @property
    def non_kv_bytes(self) -> int:
        return self.weights_bytes + self.activations_bytes

    @property
    def devices(self) -> list[jax.Device]:
        return list(self.mesh.devices.flat)

    @property
    def platform(self) -> str:
        return self.devices[0].platform


def _resident_weights(params: Any, devices: list[jax.Device]) -> list[int]:
    """Bytes the params hold on each device; where an allocator keeps stats (GPU), each buffer is
    counted as the allocator rounds it (kvjax.accounting.memory.ALLOCATOR_ALIGNMENT)."""
    out = []
    for d in devices:
        nbytes = [s.data.nbytes for leaf in jax.tree_util.tree_leaves(params)
                  for s in getattr(leaf, "addressable_shards", ()) if s.device == d]
        out.append(sum(nbytes) if mem.peak_bytes(d) is None else mem.rounded_bytes(nbytes))
    return out


def profile_and_size(model, params: Any, spec: KVSpec, *, util: Any = None, total_bytes: int | None = None,
                     block_size: int = bud.DEFAULT_BLOCK_SIZE,
                     max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                     max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_model_len: int | None = None,
                     mesh: Mesh | None = None, weights_bytes: int | Sequence[int] | None = None,
                     step: ProfileStep | None = None, windows: Sequence[int | None] | None = None,
                     pool=None) -> SizingReport:
    """Profile `model` with `params` (already on the mesh's devices) and size its KV cache.

    model: a models.build_model decoder (its `.config` gives vocab and max_position_embeddings);
    spec: the KVSpec it caches (`config.kv_spec(kv_dtype)`). util None: vLLM's 0.92.
    total_bytes None: the device's bytes_limit; NoMemoryLimitError on CPU, which has none.
    max_model_len None: min(max_position_embeddings, 8192). mesh None: one device.
    weights_bytes: what loading the weights took on each device (an int: on every device), as
    vLLM measures it; None: the params' resident bytes. step: a ProfileStep compiled before the
    weights were loaded (compile_profile), else one is compiled here.
    windows: each layer's sliding window (None: full attention) for vLLM's hybrid KV cache: the
    budget then buys blocks of the groups' bytes per block (kvjax.accounting.hybrid), which the
    engine's grouped pool holds; None or no window: every layer full, as before.
    pool: an attention + Mamba hybrid's kvjax.accounting.mamba_pool.MambaPool (block_size already grown,
    kvjax.config.engine.resolve_block_size): the profile runs on its hybrid cache, and the budget buys
    vLLM's blocks of its groups (spec: the attention layers' alone).
    Raises NoUsableBlockError when the budget leaves no block besides the null block.
    """
    _check_positive(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                    max_num_seqs=max_num_seqs)
    if max_model_len is not None:
        _check_positive(max_model_len=max_model_len)
    else:
        max_model_len = min(model.config.max_position_embeddings, MAX_MODEL_LEN_CAP)
    context = max(max_num_batched_tokens, max_model_len)
    if step is not None:
        mesh = step.mesh if mesh is None else mesh
        got = (step.mesh, step.layout.spec, step.block_size, step.tokens, step.context, step.pool)
        if got != (mesh, spec, block_size, max_num_batched_tokens, context, pool):
            raise SizingError(f"the profile step was compiled for block_size {step.block_size}, "
                              f"max_num_batched_tokens {step.tokens} over a context of {step.context} on "
                              f"{step.mesh.shape} devices; asked for {block_size}, {max_num_batched_tokens} over "
                              f"{context} (max_model_len {max_model_len}) on {mesh.shape}, or another spec")
    mesh = mesh if mesh is not None else shd.make_mesh(1)
    devices = list(mesh.devices.flat)
    total_from_device = total_bytes is None
    total = device_total_bytes(devices[0]) if total_from_device else total_bytes  # fail before compiling
    if weights_bytes is None:
        weights = _resident_weights(params, devices)
    else:
        weights = ([int(weights_bytes)] * len(devices) if isinstance(weights_bytes, (int, np.integer))
                   else list(weights_bytes))
        if len(weights) != len(devices) or any(w < 0 for w in weights):
            raise SizingError(f"weights_bytes must be ≥ 0 for each of the {len(devices)} devices, "
                              f"got {weights_bytes}")
    layout = shd.tp_layout(spec, shd.tp_size(mesh))
    # The plan without non-KV bytes checks util, total and the sizes before anything compiles.
    bud.plan(layout.rank_spec, context=max_model_len, block_size=block_size, total_bytes=total, util=util)
    if step is None:
        step = compile_profile(model, params, spec, mesh=mesh, block_size=block_size,
                               max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, pool=pool)
    profile = run_profile(step, params)
    # The budget of one device for the layout one rank holds: its weights are already per rank.
    plan = bud.plan(layout.rank_spec, context=max_model_len, block_size=block_size, total_bytes=total,
                    util=util, weights_bytes=max(weights), activations_bytes=profile.activations)
    groups = None
    if pool is not None:  # Mamba layers: vLLM's groups (tensor parallelism is refused by the engine's resolver)
        groups = pool.plan(layout.rank_spec, max(plan.budget_bytes or 0, 0), block_size=block_size,
                           max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    elif windows is not None and any(w is not None for w in windows):
        from kvjax.accounting import hybrid

        if shd.tp_size(mesh) > 1:
            raise SizingError("tensor parallelism with KV cache groups is not implemented (a model with sliding "
                              "windows): size it with every layer full")
        groups = hybrid.plan_groups(layout.rank_spec, windows, max(plan.budget_bytes or 0, 0), block_size=block_size,
                                    max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    if (plan.num_blocks if groups is None else groups.num_blocks) < 2:
        raise NoUsableBlockError(plan)
    leaves = jax.tree_util.tree_leaves(params)
    arrays = tuple(shd.shard_nbytes(x, x.sharding) for x in leaves)
    return SizingReport(spec, layout, mesh, block_size, max_num_batched_tokens, max_num_seqs, max_model_len,
                        total, total_from_device, tuple(weights), sum(arrays), arrays, profile, plan, groups, pool)
