"""The Python API: `kvjax.LLM` and its outputs, shaped like vLLM's offline API.

    import kvjax
    llm = kvjax.LLM("small-gqa", kv_dtype="fp8", block_size=16)
    outs = llm.generate(["def fib(n):"], kvjax.SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text, outs[0].finish_reason, outs.summary.decode_tokens_per_s)

`LLM(model, ...)` loads a model (models.hub: a built-in name, a Hugging Face folder, or
`preset:NAME` with random weights; or an already loaded `models.hub.LoadedModel`), sizes the
block pool, and builds one `kvjax.engine.Engine` over it; `generate` runs every prompt through
that engine (the only code that produces tokens) and `score` computes teacher-forced
log-probabilities through the same model and cache format. Like vLLM's `LLM`, it is a thin
layer: the scheduler, block pool, paged cache and sampler it drives live in their own modules.

Pool size: `num_blocks` when given; else `gpu_memory_utilization` sizes it the way vLLM does
(kvjax.sizing: profile one prefill, then (ceil(total × util) − weights − activations) //
bytes per block, total = the device's memory, or `total_memory_bytes` on a CPU); with neither,
a GPU uses vLLM's default utilization 0.92 and a CPU gets enough blocks for max_num_seqs
requests of max_model_len tokens (nothing is ever preempted).

This is the API layer: it imports `models/` (lazily), which the core modules never do.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import offload, quant
from kvjax.attention import default_impl
from kvjax.budget import cdiv
from kvjax.cache import PagedCache
from kvjax.engine import DEFAULT_BUDGET, Engine, EngineConfig, EngineError
from kvjax.errors import INT32_MAX, KvjaxError
from kvjax.stats import Summary
from kvjax.sampling import SamplingParams
from kvjax.scoring import sequence_logits
from kvjax.spec import kv_dtype as lookup_kv_dtype

DEFAULT_UTIL = 0.92  # vLLM's gpu_memory_utilization


class LLMError(KvjaxError):
    """An LLM built or called with values that break a rule; the message names the value."""


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence (vLLM `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None  # each generated token's log-probability, when SamplingParams.logprobs is 0
    cumulative_logprob: float | None
    finish_reason: str | None  # "length" or "stop"; None if the request was refused


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one prompt produced (vLLM `RequestOutput`). `text`, `token_ids`, `finish_reason` and
    `logprobs` are its single completion's; `error` says why a request was refused (the other
    prompts still run)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prompt tokens found in the prefix cache when first scheduled
    num_preemptions: int  # times it was preempted and recomputed
    error: str | None = None
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs


class GenerateOutputs(list):
    """The RequestOutputs of one `generate` call, in prompt order, and the run's `summary`
    (kvjax.stats.Summary: throughput, latencies, prefix hits, preemptions, blocks in use)."""

    def __init__(self, outputs: list[RequestOutput], summary: Summary):
        super().__init__(outputs)
        self.summary = summary


class LLM:
    """A model served through kvjax's engine. See the module docstring."""

    def __init__(self, model, *, kv_dtype: str | None = None, scales=None, block_size: int = 16,
                 num_blocks: int | None = None, gpu_memory_utilization: float | None = None, max_num_seqs: int = 8,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True, attn_impl: str | None = None,
                 steps_per_call: int = 1, seed: int = 0, dtype: str | None = None,
                 max_num_batched_tokens: int | None = None, enable_chunked_prefill: bool = True,
                 scheduling_policy: str = "fcfs",
                 kv_layout: str = "paged", kv_skip_layers: Sequence[int] = (), kv_skip_dtype: str | None = None,
                 total_memory_bytes: int | None = None, kv_offload_gib: float = 0,
                 kv_offload_policy: str = "lru"):
        """model: a built-in name, a checkpoint folder, `preset:NAME`, or a models.hub.LoadedModel.
        kv_dtype: vLLM's kv_cache_dtype (fp8 = fp8_e4m3, fp8_e5m2, int8_per_token_head, bf16, ...;
        default the model dtype); scales: fp8 KVScales or a scales file (default 1.0, vLLM's);
        kv_skip_layers keep kv_skip_dtype (default the model dtype: vLLM's
        kv_cache_dtype_skip_layers). kv_layout "contiguous" is the unpaged baseline (needs
        enable_prefix_caching=False). scheduling_policy "priority" lets generate take priorities.
        max_num_batched_tokens: the step's token budget (default 2048); enable_chunked_prefill
        (default on, as in vLLM V1) prefills a prompt longer than the budget over several steps.
        Other arguments as vLLM's, plus steps_per_call (decode steps per device call) and
        total_memory_bytes (the memory gpu_memory_utilization takes a share of, on a CPU).
        kv_offload_gib: a host-memory tier of that many GiB (vLLM's kv_offloading_size) keeps
        computed blocks that the device evicts and loads them back on a prefix hit;
        kv_offload_policy "lru" (default) or "arc" evicts from it (kvjax.offload)."""
        from kvjax.models.hub import LoadedModel, load_model

        if num_blocks is not None and gpu_memory_utilization is not None:
            raise LLMError("give num_blocks or gpu_memory_utilization, not both")
        if attn_impl is None:
            attn_impl = default_impl(lookup_kv_dtype(kv_dtype).name if kv_dtype else None)
        if isinstance(model, LoadedModel):
            if dtype is not None and dtype != model.config.dtype:
                raise LLMError(f"dtype={dtype!r}: the loaded model is already {model.config.dtype}")
            from kvjax.models import build_model

            loaded = model if model.module.attn_impl == attn_impl else \
                model.replace(module=build_model(model.config, attn_impl=attn_impl))
        elif isinstance(model, str):
            loaded = load_model(model, dtype=dtype, attn_impl=attn_impl, seed=seed)
        else:
            raise LLMError(f"model must be a name, a folder, preset:NAME or a LoadedModel, got {type(model).__name__}")
        self.model = loaded
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        spec = loaded.config.kv_spec(kv_dtype, skip_layers=tuple(kv_skip_layers))
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
        self.block_size = block_size
        model_len = loaded.config.max_position_embeddings
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or not 1 <= max_model_len <= model_len):
            raise LLMError(f"max_model_len must be an integer in [1, {model_len}] (the model's maximum length), "
                           f"got {max_model_len!r}")
        self.max_model_len = max_model_len or model_len
        if num_blocks is None:
            num_blocks = self._size(gpu_memory_utilization, total_memory_bytes, max_num_seqs, max_num_batched_tokens,
                                    enable_chunked_prefill)
        host_blocks = offload.host_blocks(kv_offload_gib, self.kv_spec.bytes_per_block(block_size))
        self.engine_config = EngineConfig(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, chunked_prefill=enable_chunked_prefill,
            prefix_caching=enable_prefix_caching,
            steps_per_call=steps_per_call, seed=seed, policy=scheduling_policy, kv_layout=kv_layout,
            kv_offload_blocks=host_blocks, kv_offload_policy=kv_offload_policy)
        from kvjax.sizing import check_cache_fits

        check_cache_fits(self.kv_spec, num_blocks, block_size)  # before allocating the pages
        self.engine = Engine(loaded.module, loaded.params, self.kv_spec, self.engine_config, scales=scales,
                             eos_token_ids=loaded.eos_token_ids)
        self._score_fn = None

    def _size(self, util, total_bytes, max_num_seqs: int, max_num_batched_tokens, chunked: bool) -> int:
        """num_blocks when none was given (see the module docstring)."""
        if util is None and jax.default_backend() == "cpu":
            return 1 + max_num_seqs * cdiv(self.max_model_len, self.block_size)
        from kvjax.sizing import profile_and_size

        # Profile the largest step the engine can schedule: its token budget (kvjax.engine's
        # default), or all rows prefilling max_model_len tokens if that is less.
        budget = max_num_batched_tokens or max(max_num_seqs, DEFAULT_BUDGET, 0 if chunked else self.max_model_len)
        report = profile_and_size(self.model.module, self.model.params, self.kv_spec,
                                  util=DEFAULT_UTIL if util is None else util, total_bytes=total_bytes,
                                  block_size=self.block_size,
                                  max_num_batched_tokens=min(budget, max_num_seqs * self.max_model_len),
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        if report.num_blocks < 2:
            raise LLMError(f"gpu_memory_utilization={util} leaves {report.plan.budget_bytes:,} bytes for KV after "
                           f"{report.weights_bytes:,} of weights and {report.activations_bytes:,} of activations: "
                           f"no usable block of {report.plan.bytes_per_block:,} bytes")
        return report.num_blocks

    @property
    def num_blocks(self) -> int:
        return self.engine_config.num_blocks

    # ------------------------------------------------------------------ generation
    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a string (through the model's tokenizer) or a list of ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise LLMError(f"a prompt is a string or a list of token ids, got {prompt!r:.80}")
        return [int(t) for t in ids]

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: Sequence[int] | None = None,
                 progress: Callable[[int], None] | None = None) -> GenerateOutputs:
        """Generate for one prompt or a list of prompts (strings or token-id lists).
        sampling_params: one for all, one per prompt, or None (SamplingParams()); priority: one
        per prompt, lower first (scheduling_policy="priority"); progress(n) is called with the
        tokens each device call generated. Returns one RequestOutput per prompt, with the run's
        Summary as `.summary`."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                        all(isinstance(t, (int, np.integer)) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        ids = [self.encode(p) for p in prompts]
        params = SamplingParams() if sampling_params is None else sampling_params
        try:
            run = self.engine.generate(ids, params, priorities=priority, progress=progress)
        except EngineError as e:
            raise LLMError(str(e)) from None
        outputs = []
        for prompt, prompt_ids, res in zip(prompts, ids, run.results):
            text = "" if res.error else self.tokenizer.decode(res.output)
            completion = CompletionOutput(0, text, res.output, res.logprobs,
                                          None if res.logprobs is None else float(sum(res.logprobs)),
                                          res.finish_reason)
            outputs.append(RequestOutput(str(res.index), prompt if isinstance(prompt, str) else None, prompt_ids,
                                         [completion], res.num_cached_tokens, res.preemptions, res.error))
        return GenerateOutputs(outputs, run.summary)

    def chat(self, conversations, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             **kwargs) -> GenerateOutputs:
        """Generate the assistant's reply to one conversation or a list of them (vLLM `LLM.chat`):
        each is a list of {"role", "content"} messages, rendered with the model's chat template
        (models.tokenizer.render_chat). Other arguments as `generate`."""
        from kvjax.models.tokenizer import render_chat

        template = self.model.chat_template
        if not template:
            raise LLMError(f"model {self.model.name!r} has no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [render_chat(template, list(c)) for c in conversations]
        return self.generate(prompts, sampling_params, **kwargs)

    # ------------------------------------------------------------------ scoring
    def score(self, token_windows, batch_size: int = 8) -> np.ndarray:
        """Teacher-forced log-probabilities f32[W, S, V] of token_windows i32[W, S]: position s
        holds log p(next token | tokens ≤ s). Each window is prefilled alone into a fresh cache
        of this LLM's KV format (dtype, scales, skipped layers, block size), so the keys and values
        every query reads are stored and read back exactly as in generation."""
        windows = np.asarray(token_windows)
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
        return (f"LLM({self.model.name!r}, kv_dtype={self.kv_spec.kv_dtype!r}, block_size={self.block_size}, "
                f"num_blocks={self.num_blocks}, max_num_seqs={self.engine_config.max_num_seqs})")
