"""The engine's resolved configuration (vLLM's `VllmConfig`): made once, by
`kvjax.engine.arg_utils.EngineArgs.create_engine_config()`, and read by everything below it.

vLLM resolves its engine arguments in one place (`EngineArgs.create_engine_config()` → `VllmConfig`)
and every layer below reads the result. kvjax does the same: each value derived from the
arguments is computed by exactly one function here, called once while the config is made,

    resolve_kv_dtype            "auto" → the model's dtype (the one place it means anything)
    resolve_kv_spec             every layer's format; skipped layers (indices or vLLM's layer-type
                                name "sliding_window") keep kv_skip_dtype: the KV format of every layer
    resolve_attention_backend   the attention backend, checked against the kernels' preconditions
    resolve_block_size          the block size, grown beside Mamba layers until a page holds a state (vLLM's)
    resolve_kv_cache_groups     vLLM's KV cache groups of a model with sliding windows or Mamba layers,
                                each layer's group and page tensor (kvjax.core.kv_cache_groups's grouping)
    resolve_max_model_len       the longest request: max_model_len, at most the model's positions
    resolve_step_budget         a step's token budget (max_num_batched_tokens or vLLM's default)
    resolve_num_blocks          the pool size when no profiling is needed (override, KV bytes, CPU default:
                                max_num_seqs whole requests within a share of the memory node)
    EngineConfig.with_num_blocks   once the pool size is known (given, or profiled by
                                kvjax.engine.llm_engine): the pool scheduler's config
                                (kvjax.config.scheduler.SchedulerConfig) and the longest request the
                                pool can hold

and nothing below re-derives them: the engine, scheduler, cache and commands read `EngineConfig`.
The parts follow vLLM's split: the model (kvjax.config.model.ModelConfig, the architecture with
dtype and hf_overrides applied), `CacheConfig`, the scheduler's settings, the parallel size and
the front end's (generation defaults, chat template, profiler). No JAX at import.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from kvjax.config import attention as backends
from kvjax.config.parallel import ParallelConfig
from kvjax.config.scheduler import SchedulerConfig, check_host_tier, check_policy, pool_limits, request_blocks
from kvjax.core import kv_cache_groups as grouping
from kvjax.errors import KvjaxError
from kvjax.utils.checks import INT32_MAX, MAX_SEED, check_int, is_int, show_value

MAX_STEPS_PER_CALL = 1024  # the CLI's cap too
MAX_NUM_SEQS = 2**16  # rows of every step
DEFAULT_BUDGET = 2048  # tokens per step when max_num_batched_tokens is not given (vLLM's long-time default)
KV_LAYOUTS = ("paged", "contiguous")
LAYER_TYPES = ("sliding_window",)  # vLLM's attention-type names kv_cache_dtype_skip_layers takes
# A CPU engine's KV budget when nothing sizes its pool: this share of the memory node's total. vLLM's CPU
# worker reserves gpu_memory_utilization (0.92) of the node for its whole process and gives the cache what
# the weights leave; kvjax takes a quarter, because nothing profiles a CPU engine's other memory (weights,
# a step's activations, XLA's compilations) before the pool is allocated at once, beside other processes.
CPU_KV_SHARE = 0.25


class EngineError(KvjaxError):
    """An engine built or called with values that break a rule; the message names the value."""


# ----------------------------------------------------------------------------------- the parts
@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    """vLLM's KV cache groups (kvjax.core.kv_cache_groups): one block table per group, the j-th layer
    of every group sharing page tensor j. One full-attention group when the model has no sliding
    window, the layout is contiguous or hybrid groups are off: then windows is (None,), the two
    per-layer tuples are empty and a window, if any, is the attention mask alone."""

    windows: tuple = (None,)  # each group's sliding window (None: full attention; "mamba": a Mamba group)
    layer_groups: tuple = ()  # each layer's group
    layer_slots: tuple = ()  # each layer's page tensor (with Mamba layers: each decoder layer's, its state inside)
    # With Mamba layers (resolve_kv_cache_groups): one layer's state (kvjax.core.mamba_spec.MambaSpec) and one
    # block's bytes, the largest group's pages with every Mamba page padded to the attention page
    state: Any = None
    block_bytes: int | None = None

    @property
    def hybrid(self) -> bool:
        return self.windows != (None,)


@dataclasses.dataclass(frozen=True)
class ProfilerConfig:
    """vLLM's `ProfilerConfig`, for `LLM.start_profile` / `stop_profile`: kvjax writes a JAX
    profiler trace (jax.profiler, which TensorBoard and Perfetto open) into `torch_profiler_dir`
    (vLLM's field name; kvjax has no torch profiler). delay_iterations / max_iterations: engine
    steps to skip before the trace starts, and the most steps it covers (0: until stop_profile)."""

    profiler: str | None = None  # "torch" (vLLM's; here a JAX trace) or None
    torch_profiler_dir: str = ""
    delay_iterations: int = 0
    max_iterations: int = 0

    def __post_init__(self):
        if self.profiler not in (None, "torch", "jax"):
            raise EngineError(f"profiler_config profiler={self.profiler!r}: kvjax writes a JAX trace for 'torch' "
                              "(or 'jax'); None profiles nothing")
        if not isinstance(self.torch_profiler_dir, str):
            raise EngineError(f"profiler_config torch_profiler_dir must be a folder name, got "
                              f"{self.torch_profiler_dir!r:.60}")
        for name in ("delay_iterations", "max_iterations"):
            check_int(getattr(self, name), f"profiler_config {name}", 0, INT32_MAX, EngineError)

    @classmethod
    def from_any(cls, value) -> "ProfilerConfig | None":
        """None, a ProfilerConfig, or a dict of its fields (vLLM takes both)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise EngineError(f"profiler_config must be a ProfilerConfig or a dict, got {type(value).__name__}")
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise EngineError(f"profiler_config field {sorted(unknown)[0]!r} is not implemented in kvjax")
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV cache (vLLM's `vllm/config/cache.py`), resolved."""

    block_size: int  # Z
    kv_spec: Any  # kvjax.core.kv_cache_interface.KVSpec: every layer's KV format ("auto" applied)
    scales: Any  # fp8 dequantization scales (kvjax.quant.formats.KVScales) or None (1.0, vLLM's default)
    enable_prefix_caching: bool
    groups: KVCacheGroups
    kv_layout: str = "paged"  # or "contiguous": the baseline without paging (no prefix caching)
    num_gpu_blocks: int | None = None  # P, null block included; None until profiled (gpu_memory_utilization)
    sized_by: str = ""  # how num_gpu_blocks was chosen when it was no budget (for messages)
    gpu_memory_utilization: float | None = None  # the share of total_memory_bytes the profile sizes from
    total_memory_bytes: int | None = None  # the memory a utilization takes a share of (None: the device's)
    kv_offloading_size: float | None = None  # GiB of host memory for offloaded blocks (vLLM's)
    num_host_blocks: int = 0  # E: the host tier's blocks (0: none)
    host_policy: str = "lru"  # its eviction policy, "lru" or "arc"
    dcp: int = 1  # decode context parallelism: a block's tokens spread over dcp ranks, block_size // dcp on each


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an engine runs with, resolved once (vLLM's `VllmConfig`). `scheduler_config` and
    `cache_config.num_gpu_blocks` are None until the pool is sized (`with_num_blocks`)."""

    model: str  # what the model argument named (a built-in, a folder, a GGUF, preset:NAME)
    model_config: Any  # kvjax.config.model.ModelConfig: the architecture, dtype and hf_overrides applied
    cache_config: CacheConfig
    attention_backend: str  # "reference" or "pallas"
    max_model_len: int  # the longest request (prompt + output) the model allows
    max_num_seqs: int  # B: requests running at once (rows of every step)
    max_num_batched_tokens: int  # a step's token budget, resolved
    enable_chunked_prefill: bool
    scheduling_policy: str  # "fcfs" or "priority"
    steps_per_call: int  # decode steps per device call (1 with enforce_eager)
    tensor_parallel_size: int
    seed: int  # the random stream of requests without a seed of their own
    max_logprobs: int  # -1: no limit
    enforce_eager: bool = False
    enable_trace_replay: bool = False  # requests may force their output (SamplingParams.trace_decode_token_ids)
    generation_config: str = "auto"  # where default SamplingParams come from ("auto", "vllm" or a folder)
    chat_template: str | None = None  # the template text given to the LLM (None: the checkpoint's)
    profiler_config: ProfilerConfig | None = None
    disable_log_stats: bool = False
    scheduler_config: SchedulerConfig | None = None  # the pool scheduler's, once num_gpu_blocks is known
    parallel_config: ParallelConfig = ParallelConfig()  # processes, replicas, DCP (kvjax.config.parallel)

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    @property
    def num_blocks(self) -> int:
        if self.cache_config.num_gpu_blocks is None:
            raise EngineError("the block pool is not sized yet (EngineConfig.with_num_blocks)")
        return self.cache_config.num_gpu_blocks

    def request_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens holds at once, summed over the KV cache groups
        (cdiv(num_tokens, Z) with one full-attention group; kvjax.config.scheduler.request_blocks)."""
        return request_blocks(self.cache_config.groups.windows, self.block_size, self.max_num_batched_tokens,
                              num_tokens)

    def with_num_blocks(self, num_blocks: int, sized_by: str = "") -> "EngineConfig":
        """This config with its pool size known: P blocks (null block included) and the pool
        scheduler's config, whose longest request is what the pool can hold (at most
        max_model_len; with sliding windows, vLLM's per-group blocks with one step's chunk)."""
        check_int(num_blocks, "num_blocks", 2, INT32_MAX, EngineError)
        z, usable = self.block_size, num_blocks - 1
        if num_blocks * z > INT32_MAX:
            raise EngineError(f"num_blocks {num_blocks:,} × block_size {z:,} = {num_blocks * z:,} token slots; "
                              f"slots are int32 indices (at most {INT32_MAX:,})")
        sched_len = min(self.max_model_len, usable * z)  # one group: cdiv(n, Z) blocks
        groups = self.cache_config.groups
        if groups.hybrid:  # over the groups, with the chunk before the pool caps it (an upper bound)
            _, sched_len = pool_limits(groups.windows, z, self.max_num_batched_tokens, usable, self.max_model_len)
        try:
            scheduler = SchedulerConfig(
                num_blocks=num_blocks, block_size=z, max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=sched_len, prefix_caching=self.cache_config.enable_prefix_caching,
                policy=self.scheduling_policy, chunked_prefill=self.enable_chunked_prefill,
                num_host_blocks=self.cache_config.num_host_blocks, host_policy=self.cache_config.host_policy,
                windows=groups.windows)
        except KvjaxError as e:
            raise EngineError(str(e)) from None
        cache = dataclasses.replace(self.cache_config, num_gpu_blocks=num_blocks, sized_by=sized_by)
        return dataclasses.replace(self, cache_config=cache, scheduler_config=scheduler)


# ----------------------------------------------------------------------------------- resolving
def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """vLLM's kv_cache_dtype as a KV format's name: "auto" (any case) is the model's dtype; any
    other name is a format's, or one of its aliases (kvjax.quant.kv_formats; unknown: SpecError).
    The one place "auto" means anything."""
    from kvjax.quant.kv_formats import kv_format

    return kv_format(model_dtype if str(kv_cache_dtype).lower() == "auto" else kv_cache_dtype).name


def resolve_kv_spec(model_config, kv_cache_dtype: str, skip_layers=(), kv_skip_dtype: str | None = None):
    """Every layer's KV format (a KVSpec): kv_cache_dtype through `resolve_kv_dtype`; skip_layers
    (layer indices, as ints or digit strings, or vLLM's layer-type name "sliding_window": every
    layer with a window) keep kv_skip_dtype, default the model's dtype."""
    kv_dtype = resolve_kv_dtype(kv_cache_dtype, model_config.dtype)
    layers = set()
    for item in skip_layers:
        if isinstance(item, str) and item.strip().isdigit():
            item = int(item)
        if item in LAYER_TYPES:
            layers |= {i for i, w in enumerate(model_config.layer_windows) if w is not None}
        elif is_int(item) and 0 <= item < model_config.num_layers:
            layers.add(int(item))
        else:
            raise EngineError(f"kv_cache_dtype_skip_layers: {item!r} is neither a layer index in "
                              f"[0, {model_config.num_layers}) nor a layer type ({', '.join(LAYER_TYPES)})")
    spec = model_config.kv_spec(kv_dtype, skip_layers=tuple(sorted(layers)))
    return spec.replace(model_dtype=kv_skip_dtype) if kv_skip_dtype else spec


def resolve_attention_backend(attention_backend: str | None, kv_spec, tensor_parallel_size: int) -> str:
    """The attention backend: the one named, checked against what the kernels take, or by
    default the platform's (kvjax.config.attention.default_impl: "pallas" on a GPU), but "reference" when
    MLA's latent pages carry per-token scales (the MLA kernels read static scales only; the GQA kernels read
    per-token-head scales too) or with tensor parallelism (the kernels are not partitioned over a mesh)."""
    if attention_backend is not None and attention_backend not in backends.IMPLS:
        raise EngineError(f"attention_backend={attention_backend!r}: kvjax's backends are {', '.join(backends.IMPLS)}")
    per_token = kv_spec.kind == "mla" and any(kv_spec.layer_dtype(i).scale == "per_token"
                                               for i in range(kv_spec.num_layers))
    if attention_backend == "pallas":
        if tensor_parallel_size > 1:
            raise EngineError(f"attention_backend='pallas' with tensor_parallel_size={tensor_parallel_size}: the "
                              "Pallas kernels are not partitioned over a mesh; use 'reference'")
        if per_token:
            raise EngineError(f"attention_backend='pallas': the MLA kernels read static scales only; "
                              f"{kv_spec.kv_dtype} latent pages carry per-token scales: use 'reference'")
        return "pallas"
    if attention_backend == "reference":
        return "reference"
    return "reference" if tensor_parallel_size > 1 or per_token else backends.default_impl()


def resolve_kv_cache_groups(model_config, kv_spec, block_size: int, *, hybrid: bool, kv_layout: str,
                            host_tier: bool, tensor_parallel_size: int) -> KVCacheGroups:
    """vLLM's grouping (kvjax.core.kv_cache_groups) for a model with sliding windows on the paged
    layout with hybrid groups on (vLLM's default; disable_hybrid_kv_cache_manager turns them off);
    else one full-attention group. Groups with a host tier or tensor parallelism are refused."""
    if model_config.mamba is not None:
        return _mamba_groups(model_config, kv_spec, block_size, hybrid=hybrid, kv_layout=kv_layout,
                             host_tier=host_tier, tensor_parallel_size=tensor_parallel_size)
    windows = tuple(model_config.layer_windows)
    if not any(w is not None for w in windows) or not hybrid or kv_layout != "paged":
        return KVCacheGroups()
    for what, value in (("a host offload tier", host_tier), ("tensor parallelism", tensor_parallel_size > 1)):
        if value:
            raise EngineError(f"{what} with KV cache groups is not implemented: this model has sliding windows; "
                              "pass disable_hybrid_kv_cache_manager=True to keep every layer in one group")
    try:
        groups = grouping.kv_cache_groups(kv_spec, windows, block_size)
    except grouping.HybridError as e:  # e.g. kv_cache_dtype_skip_layers giving the groups pages of two sizes
        raise EngineError(f"{e}; disable_hybrid_kv_cache_manager=True keeps every layer in one group") from None
    layer_groups, layer_slots = [0] * len(windows), [0] * len(windows)
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            layer_groups[layer], layer_slots[layer] = g, j
    return KVCacheGroups(tuple(g.window for g in groups), tuple(layer_groups), tuple(layer_slots))


def resolve_block_size(model_config, kv_spec, block_size: int) -> int:
    """The attention block size: block_size, grown beside Mamba layers until an attention page holds one layer's
    state (vLLM's `_align_hybrid_block_size`, kvjax.core.mamba_spec.hybrid_block_size), as vLLM grows it."""
    if model_config.mamba is None:
        return block_size
    from kvjax.core.mamba_spec import hybrid_block_size

    state = model_config.mamba.state_spec(model_config.dtype)
    return hybrid_block_size(kv_spec.layer_bytes_per_token(0), state.page_bytes, block_size)


def _mamba_groups(model_config, kv_spec, block_size: int, *, hybrid: bool, kv_layout: str, host_tier: bool,
                  tensor_parallel_size: int) -> KVCacheGroups:
    """The KV cache groups of an attention + Mamba hybrid (vLLM's: Mamba groups of one state block a request,
    each Mamba page padded to the attention page); each decoder layer's group (an MLP-only layer: 0, never read)."""
    from kvjax.config.mamba import cache_layers

    for what, bad in (("disable_hybrid_kv_cache_manager=True", not hybrid), ("kv_layout='contiguous'",
                      kv_layout != "paged"), ("a host offload tier", host_tier),
                      ("tensor parallelism", tensor_parallel_size > 1)):
        if bad:
            raise EngineError(f"{what} with Mamba layers is not implemented (vLLM serves them through the hybrid "
                              "KV cache manager's groups only)")
    if "attention_mamba" in model_config.layer_types:
        raise EngineError(f"{model_config.model_type}: layers with attention and Mamba side by side cannot be served yet")
    windows, layer_ids = cache_layers(model_config)
    state = model_config.mamba.state_spec(model_config.dtype)
    try:
        groups = grouping.kv_cache_groups(kv_spec, windows, block_size, layer_ids=layer_ids, mamba_page=state.page_bytes)
    except grouping.HybridError as e:
        raise EngineError(str(e)) from None
    layer_groups, slots = [0] * model_config.num_layers, [0] * model_config.num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            layer_groups[layer], slots[layer] = g, j
    return KVCacheGroups(tuple(g.window for g in groups), tuple(layer_groups), tuple(slots),
                         state=state, block_bytes=max(g.block_bytes for g in groups))


def resolve_max_model_len(max_model_len, max_position_embeddings: int) -> int:
    """The longest request (prompt + generated tokens): max_model_len, an integer in [1, the model's
    max_position_embeddings], or the model's own length when None."""
    if max_model_len is None:
        return max_position_embeddings
    if not is_int(max_model_len) or not 1 <= max_model_len <= max_position_embeddings:
        raise EngineError(f"max_model_len={show_value(max_model_len)} must be in [1, {max_position_embeddings}] "
                          "(an integer; the model's max_position_embeddings)")
    return int(max_model_len)


def resolve_step_budget(max_num_batched_tokens: int | None, max_num_seqs: int, chunked_prefill: bool,
                        max_len: int) -> int:
    """A step's token budget: max_num_batched_tokens, else vLLM's default (DEFAULT_BUDGET), at
    least one token per row, and without chunked prefill never below max_len (the longest
    request), or a long prompt could never be admitted."""
    return max_num_batched_tokens or max(max_num_seqs, DEFAULT_BUDGET, 0 if chunked_prefill else max_len)


def resolve_num_blocks(cache: CacheConfig, *, kv_cache_memory_bytes: int | None, num_gpu_blocks_override: int | None,
                       max_num_seqs: int, max_model_len: int, tensor_parallel_size: int,
                       platform: str, max_num_batched_tokens: int, cpu_kv_budget_bytes: int | None = None,
                       request_lens=None) -> tuple[int | None, str]:
    """(P, how it was chosen when that is no budget) where no profiling is needed:
    num_gpu_blocks_override; kv_cache_memory_bytes // one rank's bytes per block (the groups'
    with sliding windows), + the null block, as vLLM. With neither and no gpu_memory_utilization,
    on a CPU (or wherever the caller knows the requests it will send, request_lens: their tokens,
    prompt + output, as kvjax decode knows them), enough blocks that nothing is preempted: a block
    table per KV cache group (`request_blocks`: a sliding group its window's blocks) for each of
    max_num_seqs requests of max_model_len, or for the max_num_seqs longest of request_lens (each
    at most max_model_len); but on a CPU no more than cpu_kv_budget_bytes hold (vLLM's CPU backend
    sizes its cache from a memory budget and preempts), and never fewer than the longest request
    needs. (None, "") when a gpu_memory_utilization budget must be profiled (kvjax.engine.llm_engine)."""
    if num_gpu_blocks_override is not None:
        return num_gpu_blocks_override, ""
    if kv_cache_memory_bytes is not None:
        per_block = _bytes_per_block(cache, tensor_parallel_size)
        if kv_cache_memory_bytes // per_block < 1:
            raise EngineError(f"kv_cache_memory_bytes={kv_cache_memory_bytes:,} holds no block of {per_block:,} bytes")
        return 1 + kv_cache_memory_bytes // per_block, ""  # vLLM: the budget's blocks, the null block among them
    if cache.gpu_memory_utilization is not None or (platform != "cpu" and request_lens is None):
        return None, ""
    groups = cache.groups
    blocks_for = functools.partial(request_blocks, groups.windows, cache.block_size, max_num_batched_tokens)
    over = "" if not groups.hybrid else f" over {len(groups.windows)} KV cache groups"
    if request_lens is None:
        longest = blocks_for(max_model_len)
        need = max_num_seqs * longest
        what = f"max_num_seqs={max_num_seqs:,} requests of {max_model_len:,} tokens, {longest:,} blocks each{over}"
    else:
        running = sorted((blocks_for(max(1, min(int(n), max_model_len))) for n in request_lens), reverse=True)
        running = running[:max_num_seqs] or [1]
        longest, need = running[0], sum(running)
        what = f"the {len(running):,} longest requests' blocks{over} (max_num_seqs={max_num_seqs:,} run at once)"
    per_block = _bytes_per_block(cache, 1) * cache.dcp  # a CPU's devices share its memory: every rank's share
    if cpu_kv_budget_bytes is None or platform != "cpu" or need <= cpu_kv_budget_bytes // per_block:
        return 1 + need, f" (1 + {need:,} blocks: {what}; nothing is preempted)"
    return 1 + max(longest, cpu_kv_budget_bytes // per_block), (
        f" (the CPU's KV budget of {cpu_kv_budget_bytes:,} B // {per_block:,} B per block, at least the longest "
        f"request's {longest:,} blocks; {what} would need {need:,}: preemption covers the rest)")


def _bytes_per_block(cache: CacheConfig, tensor_parallel_size: int) -> int:
    """One block's bytes on one rank: every layer's page, or with KV cache groups the largest
    group's pages (a block of the shared pool holds one page of each of its group's layers)."""
    spec, z, groups = cache.kv_spec, cache.block_size, cache.groups
    if groups.block_bytes is not None:  # with Mamba layers: their padded pages (resolve_kv_cache_groups)
        return groups.block_bytes
    if not groups.hybrid:  # with DCP a rank's page holds its share of the block's tokens (vLLM's dcp_sharded)
        return spec.per_rank(tensor_parallel_size).bytes_per_block(z // cache.dcp)
    return max(sum(spec.page_bytes(layer, z) for layer, g in enumerate(groups.layer_groups) if g == group)
               for group in range(len(groups.windows)))


def check_settings(*, block_size: int, max_num_seqs: int, max_num_batched_tokens, steps_per_call: int, seed: int,
                   max_logprobs: int, tensor_parallel_size: int, scheduling_policy: str, kv_layout: str,
                   enable_prefix_caching: bool, enable_chunked_prefill: bool, num_host_blocks: int) -> None:
    """The engine settings' own ranges and combinations, before any model is read: beyond these,
    XLA would be asked for the impossible (steps_per_call=10**9 aborts the process inside the
    compiler) or int32 indices would wrap."""
    for name, value, low, high in (("block_size", block_size, 1, INT32_MAX),
                                   ("max_num_seqs", max_num_seqs, 1, MAX_NUM_SEQS),
                                   ("steps_per_call", steps_per_call, 1, MAX_STEPS_PER_CALL),
                                   ("seed", seed, 0, MAX_SEED), ("max_logprobs", max_logprobs, -1, INT32_MAX),
                                   ("tensor_parallel_size", tensor_parallel_size, 1, 256)):
        check_int(value, name, low, high, EngineError)
    if max_num_batched_tokens is not None:
        check_int(max_num_batched_tokens, "max_num_batched_tokens", 1, INT32_MAX, EngineError)
    for name, value in (("enable_chunked_prefill", enable_chunked_prefill),
                        ("enable_prefix_caching", enable_prefix_caching)):
        if not isinstance(value, bool):
            raise EngineError(f"{name} must be True or False, got {value!r}")
    check_policy(scheduling_policy, EngineError, "scheduling_policy")
    if kv_layout not in KV_LAYOUTS:
        raise EngineError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
    if kv_layout == "contiguous" and enable_prefix_caching:
        raise EngineError("the contiguous KV layout cannot share prefixes (a row belongs to one request): "
                          "turn prefix caching off")
    check_host_tier(num_host_blocks, enable_prefix_caching, EngineError, "kv_offloading_size")
    if tensor_parallel_size > 1 and (num_host_blocks or kv_layout != "paged"):
        raise EngineError(f"tensor_parallel_size={tensor_parallel_size} needs the paged layout and no host tier "
                          "(the host tier copies whole pages of one device)")
