"""The Python API: `kvjax.LLM`, `SamplingParams` and their outputs, with vLLM's names and shapes.

    from kvjax import LLM, SamplingParams
    llm = LLM("small-gqa", kv_cache_dtype="fp8", block_size=16, enable_prefix_caching=True)
    outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, n=2, logprobs=1))
    print(outs[0].outputs[1].text, outs[0].outputs[1].logprobs[0], outs[0].num_cached_tokens)

A vLLM script runs unchanged: `LLM(model, **engine args)` takes vLLM's names (kv_cache_dtype,
num_gpu_blocks_override, gpu_memory_utilization, kv_cache_memory_bytes, enable_prefix_caching,
enable_chunked_prefill, max_num_seqs, max_num_batched_tokens, max_model_len, scheduling_policy,
attention_backend, kv_offloading_size, kv_cache_dtype_skip_layers, tensor_parallel_size, seed,
dtype, max_logprobs, generation_config) with vLLM's meanings; kvjax's own extras keep kvjax
names (scales, kv_layout, steps_per_call, kv_skip_dtype, total_memory_bytes). A vLLM argument
that means nothing here is refused by name (LLMError, one line), never silently dropped.

`LLM(model, ...)` loads a model (models.hub: a built-in name, a Hugging Face folder, or
`preset:NAME` with random weights; or an already loaded `models.hub.LoadedModel`), sizes the
block pool, and builds one `kvjax.engine.core.Engine` that lives as long as the LLM: its block pool,
prefix cache and host tier carry over from one `generate` / `chat` call to the next, and
`reset_prefix_cache()` clears them (vLLM's engine core). `generate` runs every prompt through
that engine (the only code that produces tokens); `prompt_logprobs` and `score_windows`
(teacher-forced log-probabilities, kvjax's batch form of vLLM's prompt_logprobs) run the same
model over a fresh cache of the same KV format.

Pool size: `num_gpu_blocks_override` when given; else `kv_cache_memory_bytes` (the KV budget in
bytes, as vLLM) or `gpu_memory_utilization` sizes it the way vLLM does (kvjax.accounting.sizing: profile
one prefill, then (ceil(total × util) − weights − activations) // bytes per block, total = the
device's memory, or `total_memory_bytes` on a CPU); with none, a GPU uses vLLM's default
utilization 0.92 and a CPU gets enough blocks for max_num_seqs requests of max_model_len
tokens (nothing is ever preempted).

This is the API layer: it imports `models/` (lazily), which the core modules never do.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kv_offload import host_pages as offload
from kvjax.quant import formats as quant
from kvjax.attention import IMPLS, default_impl
from kvjax.accounting.budget import cdiv, pow2_bucket
from kvjax.worker.paged_cache import PagedCache
from kvjax.engine.core import DEFAULT_BUDGET, Engine, EngineConfig, EngineError, RequestResult
from kvjax.errors import INT32_MAX, MAX_GIB, KvjaxError, check_int
from kvjax.engine.sampling import SamplingParams
from kvjax.evaluation.scoring import sequence_logits
from kvjax.core.kv_cache_interface import kv_dtype as lookup_kv_dtype
from kvjax.engine.stats import Summary

DEFAULT_UTIL = 0.92  # vLLM's gpu_memory_utilization

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


# ----------------------------------------------------------------------------------- outputs
@dataclasses.dataclass
class Logprob:
    """vLLM `Logprob`: a token's log-probability, its rank in the vocabulary (1 = most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class RequestMetrics:
    """vLLM's per-request stats (`RequestStateStats`), with the prefix-cache hit. Times are
    seconds from the start of the `generate` call."""

    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    first_token_latency: float | None = None
    last_token_ts: float | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence (vLLM `CompletionOutput`, its fields in its order). logprobs: one
    {token id: Logprob} per generated token (the sampled token and the k most likely); stop_reason:
    the stop string or stop token id that ended it (None for EOS or length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "length" or "stop"; None if the request was refused
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """What one prompt produced (vLLM `RequestOutput`). outputs: its n completions;
    prompt_logprobs: None, then one {token id: Logprob} per later prompt token, when asked.
    kvjax's extra: `error` says why a request was refused (the other prompts still run)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first scheduled
    error: str | None = None


class GenerateOutputs(list):
    """The RequestOutputs of one `generate` call, in prompt order (a list, as vLLM returns), and
    the call's `summary` (kvjax.engine.stats.Summary: throughput, latencies, prefix hits, preemptions,
    blocks in use)."""

    def __init__(self, outputs: list[RequestOutput], summary: Summary):
        super().__init__(outputs)
        self.summary = summary


# ----------------------------------------------------------------------------------- the LLM
class LLM:
    """A model served through kvjax's engine. See the module docstring."""

    def __init__(self, model, *, dtype: str = "auto", seed: int = 0, block_size: int = 16,
                 gpu_memory_utilization: float | None = None, kv_cache_dtype: str = "auto",
                 kv_cache_dtype_skip_layers: Sequence[int | str] = (), num_gpu_blocks_override: int | None = None,
                 kv_cache_memory_bytes: int | None = None, max_num_seqs: int = 8, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, scheduling_policy: str = "fcfs",
                 attention_backend: str | None = None, tensor_parallel_size: int = 1,
                 kv_offloading_size: float | None = None, kv_transfer_config: dict | None = None,
                 max_logprobs: int = 20, generation_config: str = "auto", chat_template: str | None = None,
                 use_tqdm_on_load: bool = True,
                 scales=None, kv_layout: str = "paged", steps_per_call: int = 1, kv_skip_dtype: str | None = None,
                 total_memory_bytes: int | None = None, **kwargs):
        """model: a built-in name, a checkpoint folder, `preset:NAME`, or a models.hub.LoadedModel.
        vLLM's arguments as in vLLM (module docstring), with kvjax's defaults where vLLM's follow
        the GPU (max_num_seqs 8). kv_cache_dtype: "auto" (the model dtype), fp8 = fp8_e4m3, fp8_e5m2,
        int8_per_token_head, bf16, ...; kv_cache_dtype_skip_layers keep kv_skip_dtype (default the
        model dtype). attention_backend: "reference" or "pallas" (kvjax's backends; default by kv
        dtype). kv_offloading_size: GiB of host memory for offloaded KV blocks (vLLM's native CPU
        offloading); its eviction policy is kv_transfer_config={"kv_connector_extra_config":
        {"eviction_policy": "lru" | "arc"}}, as vLLM's OffloadingConnector. tensor_parallel_size:
        devices the model and the KV pages are split over (a JAX mesh, kvjax.worker.sharding; the
        reference attention, no host tier).
        generation_config: "auto" takes default sampling parameters from the checkpoint's
        generation_config.json, "vllm" uses SamplingParams(). chat_template: a template (text or
        file) used by `chat` instead of the checkpoint's. use_tqdm_on_load: a progress bar on
        stderr while the model is fetched and loaded (vLLM's, default on).
        kvjax's extras: scales (fp8 KVScales or a scales file; default 1.0, vLLM's), kv_layout
        "contiguous" (the unpaged baseline; needs enable_prefix_caching=False), steps_per_call
        (decode steps per device call), total_memory_bytes (the memory gpu_memory_utilization
        takes a share of, on a CPU)."""
        from kvjax.models.hub import LoadedModel, load_model

        self._refuse_unknown(kwargs)
        # Every argument's type and range first, before a model is loaded: no bad value reaches
        # JAX, NumPy or XLA. The engine's own rules run on a probe config.
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
                         total_memory_bytes=total_memory_bytes), use_tqdm_on_load, scales)
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
        kv_dtype = None if str(kv_cache_dtype).lower() == "auto" else kv_cache_dtype
        attn_impl = attention_backend or ("reference" if tp > 1 else
                                          default_impl(lookup_kv_dtype(kv_dtype).name if kv_dtype else None))
        model_dtype = None if dtype == "auto" else dtype
        if isinstance(model, LoadedModel):
            if model_dtype is not None and model_dtype != model.config.dtype:
                raise LLMError(f"dtype={dtype!r}: the loaded model is already {model.config.dtype}")
            from kvjax.models import build_model

            loaded = model if model.module.attn_impl == attn_impl else \
                model.replace(module=build_model(model.config, attn_impl=attn_impl))
        elif isinstance(model, str):
            loaded = load_model(model, dtype=model_dtype, attn_impl=attn_impl, seed=seed,
                                progress=bool(use_tqdm_on_load))
        else:
            raise LLMError(f"model must be a name, a folder, preset:NAME or a LoadedModel, got {type(model).__name__}")
        self.model = loaded
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        spec = loaded.config.kv_spec(kv_dtype, skip_layers=_skip_layers(kv_cache_dtype_skip_layers))
        self.kv_spec = spec.replace(model_dtype=lookup_kv_dtype(kv_skip_dtype).name) if kv_skip_dtype else spec
        if isinstance(scales, str):
            scales = quant.KVScales.load(scales)
        if scales is not None and not lookup_kv_dtype(self.kv_spec.kv_dtype).name.startswith("fp8"):
            raise LLMError(f"scales are fp8 dequantization scales, but the kv dtype is {self.kv_spec.kv_dtype}")
        if scales is not None:
            scales.check_kv_dtype(lookup_kv_dtype(self.kv_spec.kv_dtype).name)
        self.scales = scales
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= INT32_MAX:
                raise LLMError(f"{name} must be an integer in [1, {INT32_MAX}], got {value!r}")
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < -1:
            raise LLMError(f"max_logprobs must be an integer >= -1 (-1: no limit), got {max_logprobs!r}")
        self.block_size = block_size
        model_len = loaded.config.max_position_embeddings
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or not 1 <= max_model_len <= model_len):
            raise LLMError(f"max_model_len must be an integer in [1, {model_len}] (the model's maximum length), "
                           f"got {max_model_len!r}")
        self.max_model_len = max_model_len or model_len
        self.tensor_parallel_size = tp
        self._engine_model = self._place(tp, attn_impl)
        num_blocks, why = num_gpu_blocks_override, ""
        if num_blocks is None:
            num_blocks, why = self._size(gpu_memory_utilization, kv_cache_memory_bytes, total_memory_bytes,
                                         max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        host_blocks = 0 if kv_offloading_size is None else \
            offload.host_blocks(kv_offloading_size, self.kv_spec.bytes_per_block(block_size))
        self.engine_config = EngineConfig(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, chunked_prefill=enable_chunked_prefill,
            prefix_caching=enable_prefix_caching, steps_per_call=steps_per_call, seed=seed, policy=scheduling_policy,
            kv_layout=kv_layout, kv_offload_blocks=host_blocks,
            kv_offload_policy=eviction_policy(kv_transfer_config, kv_offloading_size), max_logprobs=max_logprobs,
            tensor_parallel_size=tp)
        from kvjax.accounting.sizing import check_cache_fits

        check_cache_fits(self.kv_spec, num_blocks, block_size, why=why)  # before allocating the pages
        module, params, _ = self._engine_model
        self.engine = Engine(module, params, self.kv_spec, self.engine_config, scales=scales,
                             eos_token_ids=loaded.eos_token_ids, tokenizer=self.tokenizer)
        self.chat_template = _read_template(chat_template) if chat_template is not None else loaded.chat_template
        self.default_sampling_params = _generation_defaults(
            None if generation_config == "vllm" else generation_config if generation_config != "auto"
            else loaded.folder)
        self._score_fn = None

    @staticmethod
    def _refuse_unknown(kwargs: dict) -> None:
        for name, value in kwargs.items():
            if name not in _NOT_HERE:
                raise LLMError(f"LLM() has no argument {name!r}")
            neutral, reason = _NOT_HERE[name]
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise LLMError(f"LLM({name}={value!r}): {reason}")

    def _place(self, tp: int, attn_impl: str):
        """(module, params, mesh) the engine runs: the loaded model on one device, or with tp > 1
        its params on a mesh of tp devices (kvjax.worker.sharding: Megatron's column / row split, the KV
        pages by kv heads), each kv head repeated when there are more ranks than kv heads."""
        if tp == 1:
            return self.model.module, self.model.params, None
        from kvjax.worker import sharding as shd

        try:
            layout = shd.tp_layout(self.kv_spec, tp)
            mesh = shd.make_mesh(tp)
        except shd.ShardingError as e:
            raise LLMError(f"tensor_parallel_size={tp}: {e}") from None
        module, params = self.model.module, self.model.params
        if layout.head_replicas > 1:
            from kvjax.models import build_model

            module = build_model(self.config.replace(num_kv_heads=layout.cache_kv_heads), attn_impl=attn_impl)
            params = shd.replicate_kv_heads(params, layout, self.config.head_dim)
        return module, shd.shard_params(params, mesh), mesh

    def _size(self, util, kv_bytes, total_bytes, max_num_seqs: int, max_num_batched_tokens,
              chunked: bool) -> tuple[int, str]:
        """num_blocks when none was given (see the module docstring), and how it was chosen when
        that is no budget (for a message that refuses it)."""
        if kv_bytes is not None:  # an integer >= 1 (_check_args)
            # per device, as vLLM: one rank's share of a block
            per_block = self.kv_spec.per_rank(self.tensor_parallel_size).bytes_per_block(self.block_size)
            if kv_bytes // per_block < 1:
                raise LLMError(f"kv_cache_memory_bytes={kv_bytes:,} holds no block of {per_block:,} bytes")
            return 1 + kv_bytes // per_block, ""  # vLLM: the budget's blocks, block 0 among them as the null block
        if util is None and jax.default_backend() == "cpu":
            return 1 + max_num_seqs * cdiv(self.max_model_len, self.block_size), (
                f" (CPU's default: 1 + max_num_seqs={max_num_seqs:,} × cdiv(max_model_len={self.max_model_len:,}, "
                f"block_size={self.block_size}))")
        from kvjax.accounting.sizing import profile_and_size

        # Profile the largest step the engine can schedule: its token budget (kvjax.engine.core's
        # default), or all rows prefilling max_model_len tokens if that is less.
        budget = max_num_batched_tokens or max(max_num_seqs, DEFAULT_BUDGET, 0 if chunked else self.max_model_len)
        module, params, mesh = self._engine_model
        report = profile_and_size(module, params, self.kv_spec, mesh=mesh,
                                  util=DEFAULT_UTIL if util is None else util, total_bytes=total_bytes,
                                  block_size=self.block_size,
                                  max_num_batched_tokens=min(budget, max_num_seqs * self.max_model_len),
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        if report.num_blocks < 2:
            raise LLMError(f"gpu_memory_utilization={util} leaves {report.plan.budget_bytes:,} bytes for KV after "
                           f"{report.weights_bytes:,} of weights and {report.activations_bytes:,} of activations: "
                           f"no usable block of {report.plan.bytes_per_block:,} bytes")
        return report.num_blocks, ""

    @property
    def num_blocks(self) -> int:
        return self.engine_config.num_blocks

    def get_tokenizer(self):
        """The model's tokenizer (models.tokenizer.Tokenizer: encode, decode)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams used when generate is given none: the checkpoint's
        generation_config.json values over vLLM's defaults (generation_config="auto")."""
        return self.default_sampling_params

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block so that no later request hits (vLLM's semantics: False while
        requests run, e.g. from a progress callback); reset_connector also empties the host tier."""
        if reset_running_requests:
            raise LLMError("reset_prefix_cache(reset_running_requests=True): kvjax cannot preempt from outside a "
                           "step; call it between generate calls")
        return self.engine.reset_prefix_cache(reset_connector)

    # ------------------------------------------------------------------ generation
    def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt in vLLM's forms: a string, {"prompt": str},
        {"prompt_token_ids": [...]}, or (kvjax) a list of token ids."""
        if isinstance(prompt, dict):
            extra = set(prompt) - {"prompt", "prompt_token_ids"}
            if extra:
                raise LLMError(f"prompt field {sorted(extra)[0]!r} is not implemented in kvjax (a prompt is "
                               "{'prompt': str} or {'prompt_token_ids': [...]})")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._ids(prompt["prompt_token_ids"])
            if not isinstance(prompt.get("prompt"), str):
                raise LLMError(f"a prompt dict needs 'prompt' (a string) or 'prompt_token_ids', got {prompt!r:.80}")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, self._ids(prompt)

    @staticmethod
    def _ids(ids) -> list[int]:
        ids = list(ids) if isinstance(ids, (list, tuple, np.ndarray)) else None
        if ids is None or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise LLMError(f"prompt token ids must be a list of integers, got {ids!r:.80}")
        return [int(t) for t in ids]

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable = True, priority: int | Sequence[int] | None = None,
                 progress: Callable[[int], None] | None = None) -> GenerateOutputs:
        """Generate for one prompt or a list of prompts (module docstring's forms).
        sampling_params: one for all, one per prompt, or None (get_default_sampling_params());
        priority: an int for all or one per prompt, lower first (scheduling_policy="priority");
        use_tqdm: a progress bar of generated tokens on stderr (or a tqdm-like class to use);
        progress(n) (kvjax's extra) is called with the tokens each device call generated.
        Returns one RequestOutput per prompt, with the call's Summary as `.summary`."""
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise LLMError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and
                                                 all(isinstance(t, (int, np.integer)) for t in prompts)):
            prompts = [prompts]
        pairs = [self._prompt(p) for p in prompts]
        params = self.default_sampling_params if sampling_params is None else sampling_params
        if isinstance(priority, (int, np.integer)) and not isinstance(priority, bool):
            priority = [int(priority)] * len(pairs)
        if priority is not None:
            if not isinstance(priority, (list, tuple)):
                raise LLMError(f"priority must be an int or one per prompt, got {type(priority).__name__}")
            for p in priority:  # a fractional priority is refused, not truncated
                check_int(p, "a priority", -INT32_MAX - 1, INT32_MAX, LLMError)
        bar = _progress_bar(use_tqdm, "Generating")
        if bar is not None:
            progress = _both(progress, lambda n: _advance(bar, n))
        try:
            run = self.engine.generate([ids for _, ids in pairs], params, priorities=priority, progress=progress)
        except EngineError as e:
            raise LLMError(str(e)) from None
        finally:
            if bar is not None:
                bar.close()
        per_prompt: list[list[RequestResult]] = [[] for _ in pairs]
        for res in run.results:
            per_prompt[res.index].append(res)
        params_list = [params] * len(pairs) if isinstance(params, SamplingParams) else list(params)
        outputs = []
        for (text, ids), results, sp in zip(pairs, per_prompt, params_list):
            first = results[0]
            error = first.error
            prompt_lps = None if error or sp.prompt_logprobs is None else self._prompt_logprobs(ids, sp.prompt_logprobs)
            metrics = None if error else RequestMetrics(
                sum(len(r.output) for r in results), sum(r.preemptions for r in results), first.num_cached_tokens,
                first.ttft_s, max((r.last_token_s or 0.0) for r in results))
            outputs.append(RequestOutput(
                first.request_id, text, ids, prompt_lps, [self._completion(r) for r in results], True,
                metrics, None if error else first.num_cached_tokens, error))
        return GenerateOutputs(outputs, run.summary)

    def _completion(self, res: RequestResult) -> CompletionOutput:
        text = "" if res.error or res.text is None else res.text
        logprobs = None if res.logprobs is None else [
            self._logprob_dict(tok, t.logprob, t.rank, t.top_ids, t.top_logprobs)
            for tok, t in zip(res.output, res.logprobs)]
        cumulative = None if res.logprobs is None else float(sum(t.logprob for t in res.logprobs))
        return CompletionOutput(res.sample, text, list(res.output), cumulative, logprobs, res.finish_reason,
                                res.stop_reason)

    def _logprob_dict(self, token: int, logprob: float, rank: int, top_ids, top_logprobs) -> dict[int, Logprob]:
        """vLLM's per-token dict: the chosen token first, then the k most likely (ranks 1..k)."""
        out = {int(token): Logprob(float(logprob), int(rank), self.tokenizer.decode([int(token)]))}
        for r, (t, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
            out.setdefault(int(t), Logprob(float(lp), r, self.tokenizer.decode([int(t)])))
        return out

    def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict[int, Logprob] | None]:
        """vLLM's prompt_logprobs: None for the first token, then for each later prompt token its
        log-probability given the tokens before it, its rank, and the k most likely (-1: all)."""
        length = pow2_bucket(len(ids), 16, max(16, self.config.max_position_embeddings))
        window = np.zeros((1, length), np.int32)
        window[0, :len(ids)] = ids  # causal: the padding after the prompt changes nothing before it
        lp = self.score_windows(window)[0, :len(ids) - 1]  # [S-1, V]: row s predicts token s + 1
        k = lp.shape[-1] if k == -1 else k
        out: list[dict[int, Logprob] | None] = [None]
        for s, token in enumerate(ids[1:]):
            row = lp[s]
            top = np.argsort(-row, kind="stable")[:k]
            out.append(self._logprob_dict(token, row[token], int((row >= row[token]).sum()), top, row[top]))
        return out

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool | Callable = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, **kwargs) -> GenerateOutputs:
        """Generate the assistant's reply to one conversation or a list of them (vLLM `LLM.chat`):
        each is a list of {"role", "content"} messages, rendered with chat_template (default the
        LLM's: the checkpoint's, or LLM(chat_template=...)) as transformers renders it
        (models.tokenizer.render_chat). Other arguments as `generate`."""
        from kvjax.models.tokenizer import render_chat

        template = _read_template(chat_template) if chat_template is not None else self.chat_template
        if not template:
            raise LLMError(f"model {self.model.name!r} has no chat template: pass chat_template=")
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        variables = dict(bos_token=self._special(0), eos_token=self._special(-1))
        variables.update(chat_template_kwargs or {})
        prompts = [render_chat(template, list(c), add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools, **variables)
                   for c in messages]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, **kwargs)

    def _special(self, which: int) -> str:
        """The text of the model's BOS (which=0, when known) or first EOS (which=-1) token."""
        if which == -1 and self.model.eos_token_ids:
            return self.tokenizer.id_to_token(self.model.eos_token_ids[0]) or ""
        bos = getattr(self.config, "bos_token_id", None)
        return (self.tokenizer.id_to_token(bos) or "") if which == 0 and bos is not None else ""

    # ------------------------------------------------------------------ scoring
    def score_windows(self, token_windows, batch_size: int = 8) -> np.ndarray:
        """Teacher-forced log-probabilities f32[W, S, V] of token_windows i32[W, S]: position s
        holds log p(next token | tokens ≤ s); kvjax's batch form of vLLM's prompt_logprobs (not
        vLLM's pooling `score`). Each window is prefilled alone into a fresh cache of this LLM's
        KV format (dtype, scales, skipped layers, block size), so the keys and values every query
        reads are stored and read back exactly as in generation."""
        check_int(batch_size, "batch_size", 1, INT32_MAX, LLMError)
        try:
            windows = np.asarray(token_windows)
        except ValueError:  # ragged: NumPy cannot make one array of them
            raise LLMError("token_windows must be integer ids [W, S]: the windows have different lengths") from None
        if windows.ndim != 2 or windows.shape[1] < 1 or not np.issubdtype(windows.dtype, np.integer):
            raise LLMError(f"token_windows must be integer ids [W, S], got {windows.dtype} {windows.shape}")
        if windows.shape[1] > self.config.max_position_embeddings:
            raise LLMError(f"windows of {windows.shape[1]} tokens exceed the model's max_position_embeddings "
                           f"{self.config.max_position_embeddings}")
        if windows.min(initial=0) < 0 or windows.max(initial=0) >= self.config.vocab_size:
            raise LLMError(f"token ids must be in [0, {self.config.vocab_size})")
        if self._score_fn is None:
            spec, scales, z, module = self.kv_spec, self.scales, self.block_size, self.model.module

            def make_cache(n, block_size):
                return PagedCache.create(spec, n, block_size, scales)

            self._score_fn = jax.jit(lambda p, t: jax.nn.log_softmax(
                sequence_logits(module, p, t, spec, z, make_cache), axis=-1))
        parts = [self._score_fn(self.model.params, jnp.asarray(windows[i:i + batch_size], jnp.int32))
                 for i in range(0, len(windows), batch_size)]
        return np.concatenate([np.asarray(p) for p in parts])

    def __repr__(self) -> str:
        return (f"LLM({self.model.name!r}, kv_cache_dtype={self.kv_spec.kv_dtype!r}, block_size={self.block_size}, "
                f"num_gpu_blocks_override={self.num_blocks}, max_num_seqs={self.engine_config.max_num_seqs})")


# ----------------------------------------------------------------------------------- helpers
def _check_args(texts: dict, reals: dict, counts: dict, use_tqdm_on_load, scales) -> None:
    """The LLM arguments the engine's config does not check: strings (None where optional),
    real numbers (gpu_memory_utilization in (0, 1], kv_offloading_size in GiB >= 0), byte and block
    counts, a real bool, and scales (a file name or KVScales)."""
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
    if not isinstance(use_tqdm_on_load, bool):
        raise LLMError(f"use_tqdm_on_load must be True or False, got {use_tqdm_on_load!r:.60}")
    if scales is not None and not isinstance(scales, (str, quant.KVScales)):
        raise LLMError(f"scales must be a scales file or kvjax.quant.formats.KVScales, got {type(scales).__name__}")


def _skip_layers(layers) -> tuple[int, ...]:
    """vLLM's kv_cache_dtype_skip_layers: layer indices (ints or digit strings)."""
    if isinstance(layers, (str, int)):
        layers = [layers]
    out = []
    for x in layers:
        if isinstance(x, str) and x.strip().isdigit():
            x = int(x)
        if isinstance(x, bool) or not isinstance(x, int):
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


def _read_template(template: str) -> str:
    """A chat template given as its text or as a file holding it (vLLM's chat_template)."""
    if not isinstance(template, str) or not template:
        raise LLMError(f"chat_template must be a template or a file, got {template!r:.80}")
    if "{" not in template and os.path.isfile(template):
        from kvjax.errors import decode_utf8, read_bytes

        return decode_utf8(read_bytes(template, "chat template"), template, "chat template")
    return template


_GENERATION_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                      "top_p", "min_p", "max_new_tokens", "skip_special_tokens")


def _generation_defaults(folder: str | None) -> SamplingParams:
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


def _progress_bar(use_tqdm, desc: str):
    """A tqdm bar of generated tokens on stderr, or None (use_tqdm False)."""
    if use_tqdm is False or use_tqdm is None:
        return None
    if use_tqdm is True:
        from tqdm import tqdm

        return tqdm(unit="tok", desc=desc, file=sys.stderr, dynamic_ncols=True)
    if callable(use_tqdm):
        return use_tqdm(unit="tok", desc=desc)
    raise LLMError(f"use_tqdm must be True, False or a tqdm-like class, got {use_tqdm!r}")


def _advance(bar, n: int) -> None:
    """Move the generate bar by n tokens, showing the seconds spent compiling so far (the first
    calls of each step shape compile; kvjax.engine.stats counts it)."""
    from kvjax.engine.stats import COMPILE_S

    bar.set_postfix_str(f"compile {COMPILE_S[0]:.1f} s", refresh=False)
    bar.update(n)


def _both(first, second):
    if first is None:
        return second
    return lambda n: (first(n), second(n))


__all__ = ["LLM", "LLMError", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics",
           "GenerateOutputs"]
