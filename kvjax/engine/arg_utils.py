"""Engine arguments: vLLM's `EngineArgs` and the one resolved config it makes (vLLM's `vllm/engine/arg_utils.py`).

    args = EngineArgs(model="small-gqa", kv_cache_dtype="fp8", block_size=16)
    config = args.create_engine_config()      # kvjax.config.engine.EngineConfig, resolved once
    engine = LLMEngine.from_engine_args(args)  # or LLM(model, **the same fields)

`EngineArgs` has vLLM 0.33's field names and defaults for everything kvjax implements, kvjax's
own extras under kvjax names (scales, kv_layout, steps_per_call, kv_skip_dtype,
total_memory_bytes, chat_template), and the vLLM fields kvjax does not implement (`_NOT_HERE`):
their neutral values are accepted, so a script that spells out a default still runs, and any
other value is refused by name (LLMError, one line), never silently dropped.
`add_cli_args(parser)` adds one flag per field (vLLM's `--kebab-case` names; kvjax's commands take
their engine flags from it, so a flag is defined once), `from_cli_args(args)` reads them back.

`create_engine_config()` checks every value's type and range before any model is read, reads
the model's architecture (models.hub.load_model_config: config.json with hf_overrides, a GGUF's
metadata or a preset; no weights), and resolves everything derived from the arguments once,
through kvjax.config.engine's resolve_* functions: the KV format of every layer ("auto" = the
model's dtype), the attention backend, the KV cache groups, the longest request, the step
budget, the host tier and, where no profiling is needed, the pool size. On a CPU,
`gpu_memory_utilization` takes its share of the memory node's total memory, as vLLM's CPU
platform does, and `KVJAX_CPU_KVCACHE_SPACE` or vLLM's `VLLM_CPU_KVCACHE_SPACE` (GiB) sets
kv_cache_memory_bytes; with none of them the pool holds max_num_seqs requests of max_model_len
but no more than CPU_KV_SHARE of the memory node (preemption covers the rest).

No JAX at import: `kvjax plan` and the argument parsers load this module and start at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any, Callable

from kvjax.config.engine import (CPU_KV_SHARE, CacheConfig, EngineConfig, EngineError, ProfilerConfig, check_settings,
                                 resolve_attention_backend, resolve_block_size, resolve_kv_cache_groups, resolve_kv_spec,
                                 resolve_max_model_len, resolve_num_blocks, resolve_step_budget)
from kvjax.config.parallel import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, ParallelConfig
from kvjax.utils.checks import INT32_MAX, MAX_GIB, check_int

# vLLM engine arguments that kvjax does not implement: (the values that mean what kvjax does
# anyway, the reason any other value is refused).
_NOT_HERE = {
    "tokenizer": ((None,), "kvjax reads the checkpoint's own tokenizer"),
    "tokenizer_mode": (("auto",), "kvjax reads the checkpoint's own tokenizer"),
    "skip_tokenizer_init": ((False,), "kvjax always loads the tokenizer"),
    "trust_remote_code": ((False,), "kvjax runs no code from checkpoints"),
    "revision": ((None,), "kvjax loads local folders and its own registry"),
    "quantization": ((None,), "weight quantization is not implemented (kvjax quantizes the KV cache only)"),
    "cpu_offload_gb": ((0,), "weight offloading is not implemented"),
    "enable_lora": ((False,), "LoRA is not implemented"),
    "speculative_config": ((None,), "speculative decoding is not implemented"),
    "pipeline_parallel_size": ((1,), "pipeline parallelism is not implemented"),
    "calculate_kv_scales": ((False,), "dynamic KV scales are not implemented (pass scales=)"),
    "kv_offloading_backend": (("native",), "kvjax's host tier is vLLM's native backend"),
    "compilation_config": ((None,), "kvjax compiles every step with XLA"),
    "runner": (("auto", "generate"), "kvjax runs generative models only"),
    "convert": (("auto", "none"), "kvjax runs generative models only"),
    "pooler_config": ((None,), "pooling is not implemented"),
    "mm_processor_kwargs": ((None,), "multimodal inputs are not implemented"),
    "limit_mm_per_prompt": ((None,), "multimodal inputs are not implemented"),
    "structured_outputs_config": ((None,), "structured outputs are not implemented"),
    "logits_processors": ((None,), "custom logits processors are not implemented"),
    "swap_space": ((None,), "vLLM V1 recomputes on preemption; it never swaps"),
}
MODEL_DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                "float": "float32", "float32": "float32"}  # vLLM's --dtype choices → kvjax's model dtype
# GiB of KV cache on a CPU (vLLM's CPU platform reads VLLM_CPU_KVCACHE_SPACE); kvjax's name first
CPU_KVCACHE_ENVS = ("KVJAX_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")


LLMError = EngineError  # an LLM or engine built or called with values that break a rule (one type for both)


@dataclasses.dataclass
class EngineArgs:
    """vLLM's engine arguments (module docstring). None where vLLM's default follows the platform:
    block_size 16, max_num_seqs 8 (vLLM's follows the GPU: 256 to 1024), prefix caching and
    chunked prefill on; gpu_memory_utilization None sizes the pool on a GPU with vLLM's 0.92 and on
    a CPU with enough blocks for max_num_seqs requests of max_model_len (nothing preempted) within a
    share of the memory node (kvjax.config.engine.resolve_num_blocks)."""

    model: Any = "small-gqa"  # a built-in name, a folder, PATH.gguf, preset:NAME, or a models.hub.LoadedModel
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    hf_overrides: dict | Callable | None = None  # config.json fields over the checkpoint's (a dict or a function)
    max_logprobs: int = 20
    generation_config: str = "auto"
    enforce_eager: bool = False  # kvjax: one decode step per device call (no multi-step device loop)
    enable_trace_replay: bool = False  # requests may set SamplingParams.trace_decode_token_ids (vLLM's)
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_skip_layers: list = dataclasses.field(default_factory=list)
    enable_prefix_caching: bool | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_offloading_size: float | None = None
    kv_transfer_config: dict | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    scheduling_policy: str = "fcfs"
    disable_hybrid_kv_cache_manager: bool = False
    attention_backend: str | None = None
    tensor_parallel_size: int = 1
    # vLLM's ParallelConfig fields (kvjax.config.parallel): processes, replicas, decode context parallelism
    data_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    distributed_timeout_seconds: int | None = None
    profiler_config: ProfilerConfig | dict | None = None
    disable_log_stats: bool = False
    use_tqdm_on_load: bool = True
    # kvjax's own
    scales: Any = None  # fp8 KVScales or a scales file (default 1.0, vLLM's)
    kv_layout: str = "paged"  # or "contiguous": the unpaged baseline (needs enable_prefix_caching=False)
    steps_per_call: int = 1  # decode steps per device call
    kv_skip_dtype: str | None = None  # the dtype of kv_cache_dtype_skip_layers (default the model's)
    total_memory_bytes: int | None = None  # what gpu_memory_utilization takes a share of (default the device's)
    chat_template: str | None = None  # LLM.chat's template (text or a file) instead of the checkpoint's
    # vLLM's, refused unless neutral (_NOT_HERE)
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    quantization: str | None = None
    cpu_offload_gb: float = 0
    enable_lora: bool = False
    speculative_config: dict | None = None
    pipeline_parallel_size: int = 1
    calculate_kv_scales: bool = False
    kv_offloading_backend: str = "native"
    compilation_config: Any = None
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Any = None
    mm_processor_kwargs: dict | None = None
    limit_mm_per_prompt: dict | None = None
    structured_outputs_config: Any = None
    logits_processors: list | None = None
    swap_space: float | None = None

    # ------------------------------------------------------------------ the command line
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, fields: tuple[str, ...] | None = None):
        """Add the engine flags (all, or those of `fields`) to an argparse parser, vLLM's names
        (kvjax.engine.cli_args: the one table of flags). Returns the parser, as vLLM's does."""
        from kvjax.engine.cli_args import add_engine_flags

        add_engine_flags(parser, fields)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The EngineArgs of a parsed namespace: every field the namespace has (others keep their defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    # ------------------------------------------------------------------ resolving
    def create_engine_config(self, model_config=None, *, request_lens=None) -> EngineConfig:
        """The resolved config (module docstring). model_config: the architecture when the caller
        already holds it (a loaded model, a test's tiny model); default read from `model`.
        request_lens (kvjax's): the tokens (prompt + output) of every sequence the caller will send,
        when it knows them: a pool no argument sizes holds those, not max_num_seqs requests of
        max_model_len (kvjax.config.engine.resolve_num_blocks)."""
        self._refuse_not_here()
        self._check_values()
        parallel = self.parallel_config()  # before JAX starts: a multi-process job joins its runtime first
        if request_lens is not None:
            request_lens = [check_int(n, "a request_lens entry", 1, INT32_MAX, LLMError) for n in request_lens]
        import jax

        platform = jax.default_backend()
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None and platform == "cpu":
            kv_bytes = _cpu_kvcache_space()
        default_budget = platform == "cpu" and kv_bytes is None and self.gpu_memory_utilization is None \
            and self.num_gpu_blocks_override is None
        if model_config is None:
            model_config = self._model_config()
        from kvjax.kv_offload import host_pages as offload

        z = 16 if self.block_size is None else self.block_size
        dcp = parallel.decode_context_parallel_size
        max_num_seqs = 8 if self.max_num_seqs is None else self.max_num_seqs
        chunked = True if self.enable_chunked_prefill is None else self.enable_chunked_prefill
        # beside Mamba layers kvjax runs vLLM's mamba_cache_mode "none", which caches no prefix
        prefix = model_config.mamba is None if self.enable_prefix_caching is None else self.enable_prefix_caching
        steps = 1 if self.enforce_eager else self.steps_per_call
        kv_spec = resolve_kv_spec(model_config, self.kv_cache_dtype, self.kv_cache_dtype_skip_layers,
                                  self.kv_skip_dtype)
        scales = read_scales(self.scales, kv_spec.kv_dtype)
        policy = eviction_policy(self.kv_transfer_config, self.kv_offloading_size)
        host_blocks = 0 if self.kv_offloading_size is None else \
            offload.host_blocks(self.kv_offloading_size, kv_spec.bytes_per_block(z))
        check_settings(block_size=z, max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                       steps_per_call=steps, seed=self.seed, max_logprobs=self.max_logprobs,
                       tensor_parallel_size=self.tensor_parallel_size, scheduling_policy=self.scheduling_policy,
                       kv_layout=self.kv_layout, enable_prefix_caching=prefix, enable_chunked_prefill=chunked,
                       num_host_blocks=host_blocks)
        z = resolve_block_size(model_config, kv_spec, z)  # beside Mamba layers, grown to hold a state
        tp = self.tensor_parallel_size
        if dcp > 1:
            from kvjax.attention.dcp import check_dcp

            check_dcp(kv_spec, tp, dcp, z, LLMError)
        backend = resolve_attention_backend(self.attention_backend, kv_spec, tp)
        groups = resolve_kv_cache_groups(model_config, kv_spec, z, hybrid=not self.disable_hybrid_kv_cache_manager,
                                         kv_layout=self.kv_layout, host_tier=host_blocks > 0, tensor_parallel_size=tp)
        max_len = resolve_max_model_len(self.max_model_len, model_config.max_position_embeddings)
        cache = CacheConfig(block_size=z * dcp, dcp=dcp, kv_spec=kv_spec, scales=scales, enable_prefix_caching=prefix, groups=groups,
                            kv_layout=self.kv_layout, gpu_memory_utilization=self.gpu_memory_utilization,
                            total_memory_bytes=self.total_memory_bytes if self.total_memory_bytes is not None
                            or self.gpu_memory_utilization is None or platform != "cpu" else _node_memory_bytes(),
                            kv_offloading_size=self.kv_offloading_size, num_host_blocks=host_blocks,
                            host_policy=policy)
        config = EngineConfig(
            model=self.model if isinstance(self.model, str) else self.model.name, model_config=model_config,
            cache_config=cache, attention_backend=backend, max_model_len=max_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=resolve_step_budget(self.max_num_batched_tokens, max_num_seqs, chunked, max_len),
            enable_chunked_prefill=chunked, scheduling_policy=self.scheduling_policy, steps_per_call=steps,
            tensor_parallel_size=tp, seed=self.seed, max_logprobs=self.max_logprobs, enforce_eager=self.enforce_eager,
            enable_trace_replay=self.enable_trace_replay,
            generation_config=self.generation_config,
            chat_template=None if self.chat_template is None else read_template(self.chat_template),
            profiler_config=ProfilerConfig.from_any(self.profiler_config), disable_log_stats=self.disable_log_stats,
            parallel_config=parallel)
        num_blocks, why = resolve_num_blocks(cache, kv_cache_memory_bytes=kv_bytes,
                                             num_gpu_blocks_override=self.num_gpu_blocks_override,
                                             max_num_seqs=max_num_seqs, max_model_len=max_len,
                                             tensor_parallel_size=tp, platform=platform,
                                             max_num_batched_tokens=config.max_num_batched_tokens,
                                             cpu_kv_budget_bytes=int(CPU_KV_SHARE * _node_memory_bytes())
                                             if default_budget else None, request_lens=request_lens)
        return config if num_blocks is None else config.with_num_blocks(num_blocks, why)

    def parallel_config(self) -> ParallelConfig:
        """vLLM's parallel fields, checked (kvjax.config.parallel); with nnodes > 1 this process joins the job's
        runtime first (kvjax.distributed.runtime.initialize: before JAX starts, once per process)."""
        parallel = ParallelConfig(self.data_parallel_size, self.decode_context_parallel_size, self.nnodes,
                                  self.node_rank, self.master_addr, self.master_port,
                                  self.distributed_timeout_seconds).check(self.tensor_parallel_size, LLMError)
        if parallel.multi_process:
            from kvjax.distributed import runtime

            runtime.initialize(parallel, self.tensor_parallel_size)
        return parallel

    def _model_config(self):
        """The architecture `model` names, dtype and hf_overrides applied (no weights are read)."""
        from kvjax.models.hub import LoadedModel, load_model_config

        dtype = MODEL_DTYPES[self.dtype.lower()]
        if isinstance(self.model, LoadedModel):
            if dtype is not None and dtype != self.model.config.dtype:
                raise LLMError(f"dtype={self.dtype!r}: the loaded model is already {self.model.config.dtype}")
            if self.hf_overrides is not None:
                raise LLMError("hf_overrides apply to a checkpoint's config.json; this model is already loaded")
            return self.model.config
        return load_model_config(self.model, dtype=dtype, hf_overrides=self.hf_overrides)

    def _refuse_not_here(self) -> None:
        for name, (neutral, reason) in _NOT_HERE.items():
            value = getattr(self, name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise LLMError(f"{name}={value!r:.60}: {reason}")

    def _check_values(self) -> None:
        """Every argument's type and range, before any model is read (so no bad value reaches
        JAX, NumPy or XLA); the engine's own ranges are kvjax.config.engine.check_settings'."""
        from kvjax.models.hub import LoadedModel

        if not isinstance(self.model, (str, LoadedModel)):
            raise LLMError(f"model must be a name, a folder, preset:NAME or a LoadedModel, got "
                           f"{type(self.model).__name__}")
        texts = dict(dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, generation_config=self.generation_config,
                     scheduling_policy=self.scheduling_policy, kv_layout=self.kv_layout,
                     attention_backend=self.attention_backend, kv_skip_dtype=self.kv_skip_dtype,
                     chat_template=self.chat_template)
        optional = {"attention_backend", "kv_skip_dtype", "chat_template"}
        for name, value in texts.items():
            if not (isinstance(value, str) or (value is None and name in optional)):
                raise LLMError(f"{name} must be a string{' or None' if name in optional else ''}, got {value!r:.60}")
        if self.dtype.lower() not in MODEL_DTYPES:
            raise LLMError(f"dtype={self.dtype!r}: choose one of {', '.join(MODEL_DTYPES)}")
        for name in ("gpu_memory_utilization", "kv_offloading_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise LLMError(f"{name} must be a finite number, got {value!r:.60}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise LLMError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_offloading_size is not None and not 0 <= self.kv_offloading_size <= MAX_GIB:
            raise LLMError(f"kv_offloading_size must be in [0, {MAX_GIB}] GiB, got {self.kv_offloading_size!r}")
        for name in ("num_gpu_blocks_override", "kv_cache_memory_bytes", "total_memory_bytes"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, 2 if name == "num_gpu_blocks_override" else 1, 2**62, LLMError)
        for name in ("max_num_seqs", "block_size"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, 1, INT32_MAX, LLMError)
        for name in ("use_tqdm_on_load", "disable_hybrid_kv_cache_manager", "enforce_eager", "disable_log_stats",
                     "enable_trace_replay"):
            if not isinstance(getattr(self, name), bool):
                raise LLMError(f"{name} must be True or False, got {getattr(self, name)!r:.60}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise LLMError(f"{name} must be True, False or None, got {getattr(self, name)!r:.60}")
        if self.enforce_eager and self.steps_per_call != 1:
            raise LLMError(f"enforce_eager=True runs one decode step per device call; steps_per_call="
                           f"{self.steps_per_call} asks for a multi-step device loop")
        given = [n for n in ("num_gpu_blocks_override", "kv_cache_memory_bytes", "gpu_memory_utilization")
                 if getattr(self, n) is not None]
        if len(given) > 1:
            raise LLMError(f"give one of {' or '.join(given)}: each sizes the block pool")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise LLMError(f"generation_config={self.generation_config!r}: 'auto', 'vllm' or a folder with "
                           "generation_config.json")
        if self.hf_overrides is not None and not (isinstance(self.hf_overrides, dict) or callable(self.hf_overrides)):
            raise LLMError(f"hf_overrides must be a dict of config.json fields or a function, got "
                           f"{type(self.hf_overrides).__name__}")
        skip = self.kv_cache_dtype_skip_layers
        if isinstance(skip, (str, int)):
            self.kv_cache_dtype_skip_layers = [skip]
        elif not isinstance(skip, (list, tuple)):
            raise LLMError(f"kv_cache_dtype_skip_layers must be a list of layer indices or layer types, got "
                           f"{type(skip).__name__}")
        if self.scales is not None and not isinstance(self.scales, str):
            from kvjax.quant.formats import KVScales

            if not isinstance(self.scales, KVScales):
                raise LLMError(f"scales must be a scales file or kvjax.quant.formats.KVScales, got "
                               f"{type(self.scales).__name__}")


@dataclasses.dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`: EngineArgs for kvjax.engine.async_llm.AsyncLLM."""


# ----------------------------------------------------------------------------------- readers
def _cpu_kvcache_space() -> int | None:
    """The KV cache bytes the environment gives a CPU engine: KVJAX_CPU_KVCACHE_SPACE, else vLLM's
    VLLM_CPU_KVCACHE_SPACE (whole GiB; vLLM's CPU platform sets kv_cache_memory_bytes from it); None
    when neither is set (empty counts as unset, as in vLLM)."""
    for name in CPU_KVCACHE_ENVS:
        if os.environ.get(name):
            return _env_gib(name)
    return None


def _env_gib(name: str) -> int:
    """An environment variable holding whole GiB (vLLM reads VLLM_CPU_KVCACHE_SPACE with int())."""
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        raise LLMError(f"{name}={text[:40]!r} must be a whole number of GiB") from None
    if not 1 <= value <= MAX_GIB:
        raise LLMError(f"{name}={value} must be in [1, {MAX_GIB}] GiB")
    return value * 2**30


def _node_memory_bytes() -> int:
    """vLLM's CPU platform's device memory: memory node 0's MemTotal (its meminfo), else the host's."""
    path = "/sys/devices/system/node/node0/meminfo"
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                parts = line.split()  # "Node 0 MemTotal: 97421888 kB"
                if len(parts) >= 4 and parts[2] == "MemTotal:":
                    return int(parts[3]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def read_scales(scales, kv_dtype: str):
    """The scales argument for a cache of kv_dtype (a KVSpec's, normalised, name): None, a
    KVScales, or a scales file (read here); fp8 dequantization scales only, checked against the
    kv dtype."""
    from kvjax.quant import formats as quant
    from kvjax.quant.kv_formats import FP8_FORMATS

    if scales is not None and kv_dtype not in FP8_FORMATS:  # before a scales file is read
        raise LLMError(f"scales are fp8 dequantization scales, but the kv dtype is {kv_dtype}")
    if isinstance(scales, str):
        scales = quant.KVScales.load(scales)
    if scales is not None:
        scales.check_kv_dtype(kv_dtype)
    return scales


def eviction_policy(config: dict | None, size) -> str:
    """The host tier's eviction policy from vLLM's kv_transfer_config (OffloadingConnector's
    kv_connector_extra_config["eviction_policy"], default "lru")."""
    if config is None:
        return "lru"
    if not isinstance(config, dict):
        raise LLMError(f"kv_transfer_config must be a dict, got {type(config).__name__}")
    known = {"kv_connector", "kv_role", "kv_connector_extra_config"}
    if set(config) - known:
        raise LLMError(f"kv_transfer_config field {sorted(set(config) - known)[0]!r} is not implemented in kvjax "
                       "(only the offloading connector's eviction_policy is)")
    if config.get("kv_connector") not in (None, "OffloadingConnector"):
        raise LLMError(f"kv_transfer_config kv_connector={config['kv_connector']!r}: kvjax has the "
                       "OffloadingConnector's host tier only")
    extra = config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict) or set(extra) - {"eviction_policy"}:
        raise LLMError(f"kv_connector_extra_config {extra!r}: kvjax reads only 'eviction_policy'")
    if size is None and extra:
        raise LLMError("an eviction_policy needs kv_offloading_size (the host tier it evicts from)")
    from kvjax.kv_offload.manager import check_policy

    return check_policy(extra.get("eviction_policy", "lru"), LLMError, "kv offload policy", str, repr)


def read_template(template: str) -> str:
    """A chat template given as a file holding it or as its text (vLLM's `_load_chat_template`):
    a path to an existing file is read (the template then names the file in its errors); any
    other string holding "{", "}" or a newline is the template itself; anything else looks like
    a path and is refused as a missing file (never rendered as a template)."""
    if not isinstance(template, str) or not template:
        raise LLMError(f"chat_template must be a template or a file, got {template!r:.80}")
    from kvjax.models.template_sandbox import ChatTemplate
    from kvjax.utils.input_files import decode_utf8, read_bytes

    if os.path.isfile(template):
        return ChatTemplate(decode_utf8(read_bytes(template, "chat template"), template, "chat template"), template)
    if any(c in template for c in "{}\n"):
        return template
    raise LLMError(f"chat template {template!r:.200} looks like a file path, but there is no such file")


__all__ = ["AsyncEngineArgs", "EngineArgs", "EngineError", "LLMError"]
