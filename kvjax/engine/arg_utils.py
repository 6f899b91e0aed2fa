"""The LLM's arguments: vLLM's names checked and read before anything runs (vLLM's `vllm/engine/arg_utils.py`).

A vLLM script runs unchanged: `LLM(model, **engine args)` takes vLLM's names (kv_cache_dtype,
num_gpu_blocks_override, gpu_memory_utilization, kv_cache_memory_bytes, enable_prefix_caching,
enable_chunked_prefill, max_num_seqs, max_num_batched_tokens, max_model_len, scheduling_policy,
attention_backend, kv_offloading_size, kv_cache_dtype_skip_layers, tensor_parallel_size, seed,
dtype, max_logprobs, generation_config) with vLLM's meanings; kvjax's own extras keep kvjax
names (scales, kv_layout, steps_per_call, kv_skip_dtype, total_memory_bytes). A vLLM argument
that means nothing here is refused by name (`_NOT_HERE`; LLMError, one line), never silently dropped.

- `check_engine_args` checks every argument's type and range before a model is loaded, so no
  bad value reaches JAX, NumPy or XLA; `check_limits` those that need the loaded model's length.
- `eviction_policy` reads vLLM's kv_transfer_config (the OffloadingConnector's eviction policy),
  `skip_layers` kv_cache_dtype_skip_layers, `read_scales` kvjax's scales (fp8 KVScales or a
  file), `read_template` a chat_template (text or file), and `generation_defaults` the
  checkpoint's generation_config.json (vLLM's default sampling params).
"""
from __future__ import annotations

import math
import os

from kvjax.attention import IMPLS, default_impl
from kvjax.config.engine import EngineConfig, EngineError, model_len
from kvjax.engine.sampling import SamplingParams
from kvjax.errors import INT32_MAX, MAX_GIB, KvjaxError, check_int, is_int
from kvjax.kv_offload import host_pages as offload
from kvjax.quant import formats as quant
from kvjax.quant.kv_formats import FP8_FORMATS, kv_format

# vLLM LLM(...) / engine arguments that kvjax does not implement: (the values that mean what kvjax
# does anyway, the reason any other value is refused). vLLM's defaults are accepted, so a script
# that spells them out still runs.
_NOT_HERE = {
    "quantization": ((None,), "weight quantization is not implemented (kvjax quantizes the KV cache only)"),
    "cpu_offload_gb": ((0,), "weight offloading is not implemented"),
    "enable_lora": ((False,), "LoRA is not implemented"),
    "speculative_config": ((None,), "speculative decoding is not implemented"),
    "pipeline_parallel_size": ((1,), "pipeline parallelism is not implemented"),
    "data_parallel_size": ((1,), "data parallelism is not implemented"),
    "tokenizer": ((None,), "kvjax reads the checkpoint's own tokenizer"),
    "tokenizer_mode": (("auto",), "kvjax reads the checkpoint's own tokenizer"),
    "skip_tokenizer_init": ((False,), "kvjax always loads the tokenizer"),
    "trust_remote_code": ((False,), "kvjax runs no code from checkpoints"),
    "revision": ((None,), "kvjax loads local folders and its own registry"),
    "hf_overrides": ((None,), "config overrides are not implemented"),
    "calculate_kv_scales": ((False,), "dynamic KV scales are not implemented (pass scales=)"),
    "kv_offloading_backend": (("native",), "kvjax's host tier is vLLM's native backend"),
    "enforce_eager": ((False,), "kvjax compiles every step with XLA (there are no CUDA graphs to turn off)"),
    "compilation_config": ((None,), "kvjax compiles every step with XLA"),
    "disable_log_stats": ((True, False), ""),  # kvjax logs no stats: either value holds
    "runner": (("auto", "generate"), "kvjax runs generative models only"),
    "convert": (("auto", "none"), "kvjax runs generative models only"),
    "pooler_config": ((None,), "pooling is not implemented"),
    "mm_processor_kwargs": ((None,), "multimodal inputs are not implemented"),
    "limit_mm_per_prompt": ((None,), "multimodal inputs are not implemented"),
    "structured_outputs_config": ((None,), "structured outputs are not implemented"),
    "logits_processors": ((None,), "custom logits processors are not implemented"),
    "swap_space": ((), "vLLM V1 recomputes on preemption; it never swaps"),
}


class LLMError(KvjaxError):
    """An LLM built or called with values that break a rule; the message names the value."""


def check_engine_args(kwargs: dict, *, dtype, seed, block_size, gpu_memory_utilization, kv_cache_dtype,
                      num_gpu_blocks_override, kv_cache_memory_bytes, max_num_seqs, max_model_len,
                      max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill, scheduling_policy,
                      attention_backend, tensor_parallel_size, kv_offloading_size, kv_transfer_config, max_logprobs,
                      generation_config, chat_template, use_tqdm_on_load, scales, kv_layout, steps_per_call,
                      kv_skip_dtype, total_memory_bytes, disable_hybrid_kv_cache_manager=False
                      ) -> tuple[str | None, str, str | None]:
    """LLM(...)'s arguments, before a model is loaded: kwargs (the vLLM arguments kvjax does not
    name) against `_NOT_HERE`, then every named one's type and range; the engine's own rules run
    on a probe config. → (kv dtype, attention backend, model dtype): the dtypes None for "auto",
    the backend by kv dtype unless given ("reference" with tensor_parallel_size > 1)."""
    _refuse_unknown(kwargs)
    try:
        EngineConfig(num_blocks=2, block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                     max_num_batched_tokens=max_num_batched_tokens, chunked_prefill=enable_chunked_prefill,
                     prefix_caching=enable_prefix_caching, steps_per_call=steps_per_call, seed=seed,
                     policy=scheduling_policy, kv_layout=kv_layout, max_logprobs=max_logprobs,
                     tensor_parallel_size=tensor_parallel_size,
                     kv_offload_policy=eviction_policy(kv_transfer_config, kv_offloading_size))
    except EngineError as e:
        raise LLMError(str(e).replace("policy must", "scheduling_policy must").replace(
            "chunked_prefill must", "enable_chunked_prefill must").replace(
            "prefix_caching must", "enable_prefix_caching must")) from None
    _check_args(dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype, generation_config=generation_config,
                     attention_backend=attention_backend, kv_skip_dtype=kv_skip_dtype, chat_template=chat_template),
                dict(gpu_memory_utilization=gpu_memory_utilization, kv_offloading_size=kv_offloading_size),
                dict(num_gpu_blocks_override=num_gpu_blocks_override, kv_cache_memory_bytes=kv_cache_memory_bytes,
                     total_memory_bytes=total_memory_bytes), use_tqdm_on_load, scales, disable_hybrid_kv_cache_manager)
    given = [n for n, v in (("num_gpu_blocks_override", num_gpu_blocks_override),
                            ("kv_cache_memory_bytes", kv_cache_memory_bytes),
                            ("gpu_memory_utilization", gpu_memory_utilization)) if v is not None]
    if len(given) > 1:
        raise LLMError(f"give one of {' or '.join(given)}: each sizes the block pool")
    tp = tensor_parallel_size
    if tp > 1 and attention_backend == "pallas":
        raise LLMError(f"attention_backend='pallas' with tensor_parallel_size={tp}: the Pallas kernels are not "
                       "partitioned over a mesh; use 'reference'")
    if attention_backend is not None and attention_backend not in IMPLS:
        raise LLMError(f"attention_backend={attention_backend!r}: kvjax's backends are {', '.join(IMPLS)}")
    if generation_config not in ("auto", "vllm") and not (isinstance(generation_config, str)
                                                           and os.path.isdir(generation_config)):
        raise LLMError(f"generation_config={generation_config!r}: 'auto', 'vllm' or a folder with "
                       "generation_config.json")
    # An unknown kv dtype fails here, before a model loads (in any case; the backend is not always chosen by it).
    kv_dtype = None if str(kv_cache_dtype).lower() == "auto" else kv_format(kv_cache_dtype).name
    attn_impl = attention_backend or ("reference" if tp > 1 else default_impl(kv_dtype))
    model_dtype = None if dtype == "auto" else dtype
    return kv_dtype, attn_impl, model_dtype


def _refuse_unknown(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name not in _NOT_HERE:
            raise LLMError(f"LLM() has no argument {name!r}")
        neutral, reason = _NOT_HERE[name]
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise LLMError(f"LLM({name}={value!r}): {reason}")


def _check_args(texts: dict, reals: dict, counts: dict, use_tqdm_on_load, scales,
                disable_hybrid_kv_cache_manager=False) -> None:
    """The LLM arguments the engine's config does not check: strings (None where optional),
    real numbers (gpu_memory_utilization in (0, 1], kv_offloading_size in GiB >= 0), byte and block
    counts, real bools, and scales (a file name or KVScales)."""
    optional = {"attention_backend", "kv_skip_dtype", "chat_template"}
    for name, value in texts.items():
        if not (isinstance(value, str) or (value is None and name in optional)):
            raise LLMError(f"{name} must be a string{' or None' if name in optional else ''}, got {value!r:.60}")
    for name, value in reals.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise LLMError(f"{name} must be a finite number, got {value!r:.60}")
        if name == "gpu_memory_utilization" and not 0 < value <= 1:
            raise LLMError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")
        if name == "kv_offloading_size" and not 0 <= value <= MAX_GIB:
            raise LLMError(f"kv_offloading_size must be in [0, {MAX_GIB}] GiB, got {value!r}")
    for name, value in counts.items():
        if value is not None:
            check_int(value, name, 2 if name == "num_gpu_blocks_override" else 1, 2**62, LLMError)
    for name, flag in (("use_tqdm_on_load", use_tqdm_on_load),
                       ("disable_hybrid_kv_cache_manager", disable_hybrid_kv_cache_manager)):
        if not isinstance(flag, bool):
            raise LLMError(f"{name} must be True or False, got {flag!r:.60}")
    if scales is not None and not isinstance(scales, (str, quant.KVScales)):
        raise LLMError(f"scales must be a scales file or kvjax.quant.formats.KVScales, got {type(scales).__name__}")


def check_limits(block_size, max_num_seqs, max_logprobs, max_model_len, max_position_embeddings: int) -> int:
    """The sizes once the model is loaded: block_size and max_num_seqs in [1, INT32_MAX],
    max_logprobs >= -1 (-1: no limit), max_model_len (None: the model's) at most the model's
    length (kvjax.config.engine.model_len). → the longest request."""
    for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs)):
        check_int(value, name, 1, INT32_MAX, LLMError)
    check_int(max_logprobs, "max_logprobs", -1, None, LLMError)
    return model_len(max_model_len, max_position_embeddings, LLMError)


def read_scales(scales, kv_dtype: str):
    """The scales argument for a cache of kv_dtype (a KVSpec's, normalised, name): None, a
    KVScales, or a scales file (read here); fp8 dequantization scales only, checked against the
    kv dtype."""
    if isinstance(scales, str):
        scales = quant.KVScales.load(scales)
    if scales is not None and kv_dtype not in FP8_FORMATS:
        raise LLMError(f"scales are fp8 dequantization scales, but the kv dtype is {kv_dtype}")
    if scales is not None:
        scales.check_kv_dtype(kv_dtype)
    return scales


def skip_layers(layers) -> tuple[int, ...]:
    """vLLM's kv_cache_dtype_skip_layers: layer indices (ints or digit strings)."""
    if isinstance(layers, (str, int)):
        layers = [layers]
    out = []
    for x in layers:
        if isinstance(x, str) and x.strip().isdigit():
            x = int(x)
        if not is_int(x):
            raise LLMError(f"kv_cache_dtype_skip_layers: {x!r} is not a layer index (attention-type names such as "
                           "'sliding_window' need hybrid KV cache groups, not implemented yet)")
        out.append(x)
    return tuple(out)


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
    policy = extra.get("eviction_policy", "lru")
    offload.check_policy(policy)
    return policy


def read_template(template: str) -> str:
    """A chat template given as its text or as a file holding it (vLLM's chat_template)."""
    if not isinstance(template, str) or not template:
        raise LLMError(f"chat_template must be a template or a file, got {template!r:.80}")
    if "{" not in template and os.path.isfile(template):
        from kvjax.errors import decode_utf8, read_bytes

        return decode_utf8(read_bytes(template, "chat template"), template, "chat template")
    return template


_GENERATION_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                      "top_p", "min_p", "max_new_tokens", "skip_special_tokens")


def generation_defaults(folder: str | None) -> SamplingParams:
    """vLLM's get_default_sampling_params: the generation_config.json values it reads (max_new_tokens
    as max_tokens), over SamplingParams()."""
    path = None if folder is None or not os.path.isdir(folder) else os.path.join(folder, "generation_config.json")
    if path is None or not os.path.exists(path):
        return SamplingParams()
    from kvjax.errors import read_json_object

    config = read_json_object(path, "generation_config.json")
    values = {k: config[k] for k in _GENERATION_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in values:
        values["max_tokens"] = values.pop("max_new_tokens")
    try:
        return SamplingParams(**values)
    except KvjaxError as e:
        raise LLMError(f"{path}: {e}") from None
