"""The Python API: `kvjax.LLM`, `SamplingParams` and their outputs, with vLLM's names and shapes.

    from kvjax import LLM, SamplingParams
    llm = LLM("small-gqa", kv_cache_dtype="fp8", block_size=16, enable_prefix_caching=True)
    outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, n=2, logprobs=1))
    print(outs[0].outputs[1].text, outs[0].outputs[1].logprobs[0], outs[0].num_cached_tokens)

`LLM(model, **engine args)` takes vLLM's arguments with vLLM's meanings, plus kvjax's own
extras; kvjax.engine.arg_utils lists them, checks them before a model loads, and refuses by
name (LLMError) a vLLM argument that means nothing here. `generate` returns vLLM's output types
(kvjax.engine.outputs: RequestOutput, CompletionOutput, Logprob, RequestMetrics).

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
tokens (nothing is ever preempted). A model with sliding windows is sized by its KV cache
groups' bytes per block, unless disable_hybrid_kv_cache_manager.

This is the API layer: it imports `models/` (lazily), which the core modules never do.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config.engine import EngineConfig, EngineError, step_budget
from kvjax.engine.arg_utils import (LLMError, check_engine_args, check_limits, eviction_policy, generation_defaults,
                                    read_scales, read_template, skip_layers)
from kvjax.engine.core import Engine
from kvjax.engine.outputs import GenerateOutputs, Logprob, RequestResult, prompt_logprobs, request_output
from kvjax.engine.sampling import SamplingParams
from kvjax.errors import INT32_MAX, check_int, is_int
from kvjax.evaluation.scoring import prefill_layout, window_logprobs
from kvjax.kv_offload import host_pages as offload
from kvjax.math_utils import cdiv, pow2_bucket
from kvjax.worker.paged_cache import PagedCache

DEFAULT_UTIL = 0.92  # vLLM's gpu_memory_utilization


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
                 total_memory_bytes: int | None = None, disable_hybrid_kv_cache_manager: bool = False, **kwargs):
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

        kv_dtype, attn_impl, model_dtype = check_engine_args(
            kwargs, dtype=dtype, seed=seed, block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=num_gpu_blocks_override,
            kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, scheduling_policy=scheduling_policy,
            attention_backend=attention_backend, tensor_parallel_size=tensor_parallel_size,
            kv_offloading_size=kv_offloading_size, kv_transfer_config=kv_transfer_config, max_logprobs=max_logprobs,
            generation_config=generation_config, chat_template=chat_template, use_tqdm_on_load=use_tqdm_on_load,
            scales=scales, kv_layout=kv_layout, steps_per_call=steps_per_call, kv_skip_dtype=kv_skip_dtype,
            total_memory_bytes=total_memory_bytes, disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager)
        tp = tensor_parallel_size
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
        spec = loaded.config.kv_spec(kv_dtype, skip_layers=skip_layers(kv_cache_dtype_skip_layers))
        self.kv_spec = spec.replace(model_dtype=kv_skip_dtype) if kv_skip_dtype else spec  # KVSpec normalises it
        self.scales = scales = read_scales(scales, self.kv_spec.kv_dtype)
        self.max_model_len = check_limits(block_size, max_num_seqs, max_logprobs, max_model_len,
                                          loaded.config.max_position_embeddings)
        self.block_size = block_size
        self.tensor_parallel_size = tp
        self._engine_model = self._place(tp, attn_impl)
        w = loaded.config.layer_windows  # sized as the engine groups them (config.engine.kv_cache_groups)
        self._windows = w if disable_hybrid_kv_cache_manager is False and tp == 1 and kv_offloading_size is None \
            and kv_layout == "paged" and any(w) else None
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
            tensor_parallel_size=tp, hybrid_kv_cache=disable_hybrid_kv_cache_manager is False)
        module, params, mesh = self._engine_model
        self.engine = Engine(module, params, self.kv_spec, self.engine_config, scales=scales,
                             eos_token_ids=loaded.eos_token_ids, tokenizer=self.tokenizer, mesh=mesh, sized_by=why)
        self.chat_template = read_template(chat_template) if chat_template is not None else loaded.chat_template
        self.default_sampling_params = generation_defaults(
            None if generation_config == "vllm" else generation_config if generation_config != "auto"
            else loaded.folder)

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
            if self._windows is not None:  # the groups' bytes per block
                from kvjax.accounting.hybrid import kv_cache_groups
                per_block = max(g.block_bytes for g in kv_cache_groups(self.kv_spec, self._windows, self.block_size))
            if kv_bytes // per_block < 1:
                raise LLMError(f"kv_cache_memory_bytes={kv_bytes:,} holds no block of {per_block:,} bytes")
            return 1 + kv_bytes // per_block, ""  # vLLM: the budget's blocks, block 0 among them as the null block
        if util is None and jax.default_backend() == "cpu":
            return 1 + max_num_seqs * cdiv(self.max_model_len, self.block_size), (
                f" (CPU's default: 1 + max_num_seqs={max_num_seqs:,} × cdiv(max_model_len={self.max_model_len:,}, "
                f"block_size={self.block_size}))")
        from kvjax.accounting.sizing import profile_and_size

        # Profile the largest step the engine can schedule: its token budget (before sizing, with
        # max_model_len for the longest request), or all rows prefilling max_model_len if less.
        budget = step_budget(max_num_batched_tokens, max_num_seqs, chunked, self.max_model_len)
        module, params, mesh = self._engine_model
        report = profile_and_size(module, params, self.kv_spec, mesh=mesh,
                                  util=DEFAULT_UTIL if util is None else util, total_bytes=total_bytes,
                                  block_size=self.block_size,
                                  max_num_batched_tokens=min(budget, max_num_seqs * self.max_model_len),
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, windows=self._windows)
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
        if ids is None or not all(is_int(t) for t in ids):
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
        if is_int(priority):
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
            error = results[0].error
            prompt_lps = None if error or sp.prompt_logprobs is None else self._prompt_logprobs(ids, sp.prompt_logprobs)
            outputs.append(request_output(text, ids, results, prompt_lps, self.tokenizer))
        return GenerateOutputs(outputs, run.summary)

    def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict[int, Logprob] | None]:
        """vLLM's prompt_logprobs: None for the first token, then for each later prompt token its
        log-probability given the tokens before it, its rank, and the k most likely (-1: all)."""
        length = pow2_bucket(len(ids), 16, max(16, self.config.max_position_embeddings))
        window = np.zeros((1, length), np.int32)
        window[0, :len(ids)] = ids  # causal: the padding after the prompt changes nothing before it
        lp = self.score_windows(window)[0, :len(ids) - 1]  # [S-1, V]: row s predicts token s + 1
        return prompt_logprobs(self.tokenizer, ids, lp, k)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool | Callable = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, **kwargs) -> GenerateOutputs:
        """Generate the assistant's reply to one conversation or a list of them (vLLM `LLM.chat`):
        each is a list of {"role", "content"} messages, rendered with chat_template (default the
        LLM's: the checkpoint's, or LLM(chat_template=...)) as transformers renders it
        (models.tokenizer.render_chat). Other arguments as `generate`."""
        from kvjax.models.tokenizer import render_chat

        template = read_template(chat_template) if chat_template is not None else self.chat_template
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
        cache = PagedCache.create(self.kv_spec, prefill_layout(windows.shape[1], self.block_size)[1],
                                  self.block_size, self.scales)
        parts = [window_logprobs(self.model.module, self.model.params,
                                 jnp.asarray(windows[i:i + batch_size], jnp.int32), cache)
                 for i in range(0, len(windows), batch_size)]
        return np.concatenate([np.asarray(p) for p in parts])

    def __repr__(self) -> str:
        return (f"LLM({self.model.name!r}, kv_cache_dtype={self.kv_spec.kv_dtype!r}, block_size={self.block_size}, "
                f"num_gpu_blocks_override={self.num_blocks}, max_num_seqs={self.engine_config.max_num_seqs})")


# ----------------------------------------------------------------------------------- helpers
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


__all__ = ["LLM"]
