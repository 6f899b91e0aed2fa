"""`LLMEngine`: requests in, one engine step at a time, RequestOutputs out (vLLM V1's
`vllm/v1/engine/llm_engine.py`).

    engine = LLMEngine.from_engine_args(EngineArgs(model="small-gqa"))
    engine.add_request("0", "To be or not to be,", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                print(out.outputs[0].text)

It owns what vLLM splits over its front end and engine core: the model (models.hub, loaded for the
resolved config: `EngineArgs.create_engine_config()`), the block pool's size (profiled when a
gpu_memory_utilization budget asks for it: kvjax.accounting.sizing), the engine
(kvjax.engine.core: scheduler, pool, cache, the one token producer), the input side (prompt
forms → token ids, every rule checked before a request is queued: an error raises, vLLM's
validation error, and nothing is added) and the output side (kvjax.engine.output_processor: n
samples as n engine requests, RequestOutputs per output kind). Requests may be added between
any two steps; `kvjax.LLM.generate` is a loop over this engine, and kvjax.engine.async_llm drives
it from a thread.

Pool size: `num_gpu_blocks_override`; else `kv_cache_memory_bytes` (vLLM's, or on a CPU
KVJAX_CPU_KVCACHE_SPACE / VLLM_CPU_KVCACHE_SPACE) or `gpu_memory_utilization` sizes it the way vLLM does (profile one step,
then (ceil(total × util) − weights − activations) // bytes per block; total = the device's memory,
a CPU's memory node's, or total_memory_bytes); with none, a GPU uses vLLM's default utilization
0.92 and a CPU gets enough blocks for max_num_seqs requests of max_model_len tokens, within a share
of its memory node (kvjax.config.engine.resolve_num_blocks).

This is the API layer: it imports `models/` (lazily), which the core modules never do.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

import jax
import numpy as np

from kvjax.config.engine import EngineConfig, EngineError
from kvjax.engine.arg_utils import EngineArgs, LLMError
from kvjax.engine import lockstep
from kvjax.engine.core import Engine
from kvjax.engine.output_processor import OutputProcessor
from kvjax.engine.outputs import Logprob, RequestOutput, prompt_logprobs
from kvjax.engine.processor import fan_out, normalize_trace_replay
from kvjax.engine.sampling import SamplingParams
from kvjax.errors import KvjaxError
from kvjax.utils.atomic import atomic
from kvjax.utils.checks import is_int

DEFAULT_UTIL = 0.92  # vLLM's gpu_memory_utilization
_GENERATION_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                      "top_p", "min_p", "max_new_tokens", "skip_special_tokens")


class LLMEngine:
    """See the module docstring."""

    def __init__(self, vllm_config: EngineConfig, *, model=None, use_tqdm_on_load: bool = False, devices=None):
        """vllm_config: the resolved config (EngineArgs.create_engine_config). model: an already
        loaded models.hub.LoadedModel for it (default: loaded here, with a progress bar on stderr
        if use_tqdm_on_load). devices: the tensor_parallel_size devices it runs on (a data-parallel replica's,
        kvjax.engine.data_parallel; default the first). In a multi-process job (kvjax.distributed.runtime) rank 0
        announces the config to the other ranks first, and every rank runs kvjax.engine.lockstep's engine."""
        from kvjax.distributed import runtime
        from kvjax.models import build_model
        from kvjax.models.hub import load_model

        config = vllm_config
        multi = runtime.is_multi_process()
        if multi and runtime.rank() == 0:
            if model is not None:
                raise LLMError("a multi-process job loads its model on every rank: give the model by name, folder "
                               "or preset, not as a loaded model")
            lockstep.announce(config)
        if config.parallel_config.data_parallel_size > 1 and devices is None:
            raise LLMError(f"data_parallel_size={config.parallel_config.data_parallel_size}: an engine is one "
                           "replica; data-parallel replicas run behind `kvjax serve --data-parallel-size` "
                           "(kvjax.engine.data_parallel)")
        if model is None:
            model = load_model(config.model, config=config.model_config, attn_impl=config.attention_backend,
                               seed=config.seed, progress=use_tqdm_on_load)
        elif model.module.attn_impl != config.attention_backend:
            model = model.replace(module=build_model(model.config, attn_impl=config.attention_backend))
        self.model, self.tokenizer = model, model.tokenizer
        module, params, mesh = self._place(config, devices)
        if config.cache_config.num_gpu_blocks is None:
            num_blocks = self._profile_num_blocks(config, module, params, mesh)
            config = config.with_num_blocks(lockstep.rank0_value(num_blocks) if multi else num_blocks)
        self.vllm_config = config
        self.engine = (lockstep.LockstepEngine if multi else Engine)(
            module, params, config, eos_token_ids=model.eos_token_ids, tokenizer=self.tokenizer, mesh=mesh)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.chat_template = config.chat_template if config.chat_template is not None else model.chat_template
        folder = None if config.generation_config == "vllm" else model.folder if config.generation_config == "auto" \
            else config.generation_config
        self.diff_sampling_param = generation_config_values(folder)  # what the checkpoint's file sets
        self.default_sampling_params = generation_defaults(folder)
        self._profile: _Profile | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, request_lens=None, **_) -> "LLMEngine":
        """vLLM's: the engine of these arguments (their config resolved once). request_lens
        (kvjax's): the sequences the caller will send, when it knows (EngineArgs.create_engine_config)."""
        from kvjax.models.hub import LoadedModel

        config = engine_args.create_engine_config(request_lens=request_lens)
        if config.parallel_config.multi_process and config.parallel_config.node_rank > 0:
            serve_rank0()  # does not return: the same script on every rank runs its front end on rank 0 only
        model = engine_args.model if isinstance(engine_args.model, LoadedModel) else None
        return cls(config, model=model, use_tqdm_on_load=engine_args.use_tqdm_on_load)

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, **_) -> "LLMEngine":
        return cls(vllm_config)

    # ------------------------------------------------------------------ building
    def _place(self, config: EngineConfig, devices=None):
        """(module, params, mesh) the engine runs: the loaded model on one device (devices[0]), or with
        tensor_parallel_size > 1 its params on a mesh (kvjax.worker.sharding: Megatron's column /
        row split, the KV pages by kv heads, each expert's intermediate width), each kv head
        repeated when ranks outnumber kv heads and the experts' gate/up columns in one block a rank."""
        tp = config.tensor_parallel_size
        from kvjax.worker import sharding as shd

        if tp == 1:
            if devices is None:
                return self.model.module, self.model.params, None
            return self.model.module, jax.device_put(self.model.params, devices[0]), shd.make_mesh(1, devices)
        try:
            layout = shd.tp_layout(config.cache_config.kv_spec, tp)
            mesh = shd.make_mesh(tp, devices, dcp=config.parallel_config.decode_context_parallel_size)
            run_config = shd.tp_model_config(self.model.config, layout)
        except shd.ShardingError as e:
            raise LLMError(f"tensor_parallel_size={tp}: {e}") from None
        module, params = self.model.module, self.model.params
        if run_config is not self.model.config:
            from kvjax.models import build_model

            module = build_model(run_config, attn_impl=config.attention_backend)
            params = shd.tp_params(params, self.model.config, layout)
        return module, shd.shard_params(params, mesh), mesh

    @staticmethod
    def _profile_num_blocks(config: EngineConfig, module, params, mesh) -> int:
        """vLLM's sizing from a gpu_memory_utilization budget: profile the largest step the engine
        can schedule (its token budget, or all rows prefilling max_model_len if less), as the last
        chunk of a max_model_len context (kvjax.accounting.sizing: the attention's temporaries grow with it)."""
        from kvjax.accounting.mamba_pool import MambaPool
        from kvjax.accounting.sizing import profile_and_size

        cache = config.cache_config
        # beside Mamba layers: vLLM's groups, their states inside the pages (kvjax.worker.mamba_state), so the budget
        # buys exactly the blocks the cache holds
        pool = None if cache.groups.state is None else MambaPool.from_config(config.model_config, cache.groups)
        util = DEFAULT_UTIL if cache.gpu_memory_utilization is None else cache.gpu_memory_utilization
        report = profile_and_size(
            module, params, cache.kv_spec, mesh=mesh, util=util, total_bytes=cache.total_memory_bytes,
            block_size=cache.block_size,
            max_num_batched_tokens=min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len),
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            windows=config.model_config.layer_windows if cache.groups.hybrid and pool is None else None, pool=pool)
        if report.num_blocks < 2:
            raise LLMError(f"gpu_memory_utilization={util} leaves {report.plan.budget_bytes:,} bytes for KV after "
                           f"{report.weights_bytes:,} of weights and {report.activations_bytes:,} of activations: "
                           f"no usable block of {report.plan.bytes_per_block:,} bytes")
        return report.num_blocks

    # ------------------------------------------------------------------ requests
    def process_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt in vLLM's forms: a string, {"prompt": str},
        {"prompt_token_ids": [...]} (with an optional "prompt" text), or (kvjax) a list of ids."""
        if isinstance(prompt, dict):
            extra = set(prompt) - {"prompt", "prompt_token_ids"}
            if extra:
                raise LLMError(f"prompt field {sorted(extra)[0]!r} is not implemented in kvjax (a prompt is "
                               "{'prompt': str} or {'prompt_token_ids': [...]})")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _ids(prompt["prompt_token_ids"])
            if not isinstance(prompt.get("prompt"), str):
                raise LLMError(f"a prompt dict needs 'prompt' (a string) or 'prompt_token_ids', got {prompt!r:.80}")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, _ids(prompt)

    def check_request(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """vLLM's input processing of one request: params verified (a value set after construction
        is checked now), its token ids checked against the vocabulary, bad words tokenized, the
        engine's rules (kvjax.engine.processor.check_request) applied to each of its n samples, and
        a trace to replay normalised (processor.normalize_trace_replay). Raises LLMError naming
        the rule, in vLLM's words where vLLM has the rule; → a copy of params the engine may keep."""
        if not isinstance(params, SamplingParams):
            raise LLMError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = params.clone()
        try:
            params.verify(self.vllm_config.model_config.vocab_size)
            params.update_from_tokenizer(self.tokenizer)
        except KvjaxError as e:
            raise LLMError(str(e)) from None
        if params.trace_decode_token_ids and not self.vllm_config.enable_trace_replay:
            raise LLMError("trace_decode_token_ids is set but trace replay is not enabled. Start the engine with "
                           "--enable-trace-replay to use it.")
        for child in fan_out(params):
            error, _ = self.engine.check_request(ids, child)
            if error is not None:
                raise LLMError(error)
        if params.trace_decode_token_ids:
            normalize_trace_replay(params, len(ids), self.vllm_config.max_model_len)
        return params

    @atomic
    def add_request(self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None,
                    priority: int = 0, *, prompt_text: str | None = None, checked: bool = False) -> str:
        """Queue one request (vLLM's `add_request`): a prompt in any of vLLM's forms, its
        SamplingParams (n samples are n engine requests "j_request_id", vLLM's parallel sampling);
        arrival_time on time.perf_counter()'s clock. Every rule is checked first (LLMError);
        a refused request changes nothing. → request_id."""
        if not isinstance(request_id, str):
            raise LLMError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self.output_processor.requests:
            raise LLMError(f"request id {request_id!r} is already in use by an unfinished request")
        text, ids = self.process_prompt(prompt)
        params = params if checked else self.check_request(ids, params)
        prompt_lps = None if params.prompt_logprobs is None else \
            self.prompt_logprobs(ids, params.prompt_logprobs, params.detokenize)
        children = fan_out(params)
        names = [request_id] if len(children) == 1 else [f"{j}_{request_id}" for j in range(len(children))]
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        added = []
        try:
            for name, child in zip(names, children):
                self.engine.add_request(name, ids, child, priority=priority, arrival_time=arrival)
                added.append(name)
        except EngineError as e:
            self.engine.abort_requests(added)
            raise LLMError(str(e)) from None
        self.output_processor.add_request(request_id, prompt_text if prompt_text is not None else text, ids,
                                          params, names, prompt_lps)
        return request_id

    @atomic
    def abort_request(self, request_ids: Sequence[str] | str) -> list[RequestOutput]:
        """End these requests now (vLLM's `abort_request`): their blocks return to the pool.
        Unknown or finished ids are ignored. → their last RequestOutputs (finish_reason "abort")."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        results = self.engine.abort_requests(self.output_processor.children(ids))
        return self.output_processor.process(results)

    @atomic
    def step(self) -> list[RequestOutput]:
        """One engine step (kvjax.engine.core.Engine.step) → the RequestOutputs it produced (per
        output kind: kvjax.engine.output_processor). [] when nothing is unfinished."""
        if self._profile is not None:
            self._profile.before_step()
        results = self.engine.step()
        if self._profile is not None:
            self._profile.after_step()
        outputs = self.output_processor.process(results)
        for out in outputs:  # vLLM observes n and the longest sample once all n finished
            if out.finished:
                self.engine.metrics.record_prompt_finished(len(out.outputs), max(len(c.token_ids) for c in out.outputs))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    @atomic
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block so that no later request hits (vLLM's): False, changing
        nothing, while requests hold blocks, unless reset_running_requests, which first preempts
        every running request (it recomputes when next scheduled); reset_connector also empties
        the host tier."""
        for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            if not isinstance(value, bool):
                raise LLMError(f"{name} must be True or False, got {value!r:.40}")
        return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_tokenizer(self):
        return self.tokenizer

    def render_chat(self, messages, template: str | None = None, /, **options) -> str:
        """One conversation as the prompt text LLM.chat and `kvjax serve` generate from:
        models.tokenizer.render_chat with `template` (default this engine's chat template) and the
        tokenizer's bos_token / eos_token as template variables; options: add_generation_prompt,
        continue_final_message, tools, and more template variables."""
        from kvjax.models.tokenizer import render_chat

        tok = self.tokenizer
        variables = {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or "", **options}
        return render_chat(template or self.chat_template, list(messages), **variables)

    def get_metrics(self):
        """vLLM's metrics over the engine's life (kvjax.engine.metrics: Counter, Gauge, Histogram, Vector)."""
        return self.engine.metrics.snapshot()

    @atomic
    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Trace the engine's next steps with the JAX profiler (vLLM's start_profile, with
        profiler_config's folder, delay_iterations and max_iterations): a TensorBoard / Perfetto
        trace under torch_profiler_dir (/profile_prefix)."""
        cfg = self.vllm_config.profiler_config
        if cfg is None or cfg.profiler is None:
            raise LLMError("start_profile needs profiler_config={'profiler': 'torch', 'torch_profiler_dir': DIR} "
                           "(vLLM's; kvjax writes a JAX trace there)")
        if self._profile is not None:
            raise LLMError("a profile is already running: stop_profile() first")
        folder = os.path.join(cfg.torch_profiler_dir or ".", profile_prefix or "")
        self._profile = _Profile(folder, cfg.delay_iterations, cfg.max_iterations)
        if cfg.delay_iterations == 0:
            self._profile.start()

    @atomic
    def stop_profile(self) -> None:
        """Stop the trace (it is written now); nothing happens without one running."""
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.stop()

    def get_diff_sampling_param(self) -> dict:
        """vLLM's ModelConfig.get_diff_sampling_param: only the sampling values the generation config sets
        (max_new_tokens as max_tokens); the server reads max_tokens from it, so that a chat request without
        max_tokens may run to the context's end instead of SamplingParams' 16, as vLLM's server does."""
        return dict(self.diff_sampling_param)

    def get_default_sampling_params(self) -> SamplingParams:
        """A copy of the SamplingParams used when none are given: the checkpoint's
        generation_config.json values over vLLM's defaults (generation_config="auto")."""
        return self.default_sampling_params.clone()

    # ------------------------------------------------------------------ scoring
    def prompt_logprobs(self, ids: list[int], k: int, detokenize: bool = True) -> list[dict[int, Logprob] | None]:
        """vLLM's prompt_logprobs: None for the first token, then for each later prompt token its
        log-probability given the tokens before it, its rank, and the k most likely (-1: all);
        each token's text unless detokenize is False (vLLM's: then decoded_token is None)."""
        from kvjax.math_utils import pow2_bucket

        positions = self.vllm_config.model_config.max_position_embeddings
        window = np.zeros((1, pow2_bucket(len(ids), 16, max(16, positions))), np.int32)
        window[0, :len(ids)] = ids  # causal: the padding after the prompt changes nothing before it
        lp = self.score_windows(window)[0, :len(ids) - 1]  # [S-1, V]: row s predicts token s + 1
        return prompt_logprobs(self.tokenizer if detokenize else None, ids, lp, k)

    def score_windows(self, token_windows, batch_size: int = 8) -> np.ndarray:
        """Teacher-forced log-probabilities f32[W, S, V] of token_windows i32[W, S] (kvjax.LLM's
        score_windows): each window prefilled alone into a fresh cache of this engine's KV format."""
        import jax.numpy as jnp

        from kvjax.evaluation.scoring import empty_cache, prefill_layout, window_logprobs
        from kvjax.utils.checks import INT32_MAX, check_int

        check_int(batch_size, "batch_size", 1, INT32_MAX, LLMError)
        model_config, cache_config = self.vllm_config.model_config, self.vllm_config.cache_config
        try:
            windows = np.asarray(token_windows)
        except ValueError:  # ragged: NumPy cannot make one array of them
            raise LLMError("token_windows must be integer ids [W, S]: the windows have different lengths") from None
        if windows.ndim != 2 or windows.shape[1] < 1 or not np.issubdtype(windows.dtype, np.integer):
            raise LLMError(f"token_windows must be integer ids [W, S], got {windows.dtype} {windows.shape}")
        if windows.shape[1] > model_config.max_position_embeddings:
            raise LLMError(f"windows of {windows.shape[1]} tokens exceed the model's max_position_embeddings "
                           f"{model_config.max_position_embeddings}")
        if windows.min(initial=0) < 0 or windows.max(initial=0) >= model_config.vocab_size:
            raise LLMError(f"token ids must be in [0, {model_config.vocab_size})")
        if len(windows) == 0:  # no window: no scores, in the shape of many
            return np.zeros((0, windows.shape[1], model_config.vocab_size), np.float32)
        z = cache_config.block_size
        blocks = prefill_layout(windows.shape[1], z, layer_types=model_config.layer_types)[1]
        cache = empty_cache(model_config, cache_config.kv_spec, blocks, z, cache_config.scales)
        parts = [window_logprobs(self.model.module, self.model.params,
                                 jnp.asarray(windows[i:i + batch_size], jnp.int32), cache)
                 for i in range(0, len(windows), batch_size)]
        return np.concatenate([np.asarray(p) for p in parts])


# ----------------------------------------------------------------------------------- helpers
class _Profile:
    """A JAX profiler trace over engine steps: it starts after `delay` untraced steps and stops
    after `limit` traced ones (0: at stop_profile)."""

    def __init__(self, folder: str, delay: int, limit: int):
        self.folder, self.skip, self.left = folder, delay, limit or None
        self.running = self.done = False

    def start(self) -> None:
        import jax

        os.makedirs(self.folder, exist_ok=True)
        jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
        self.running = True

    def stop(self) -> None:
        if self.running:
            import jax

            jax.profiler.stop_trace()
            self.running, self.done = False, True

    def before_step(self) -> None:
        if not self.running and not self.done:
            if self.skip == 0:
                self.start()
            else:
                self.skip -= 1

    def after_step(self) -> None:
        if self.running and self.left is not None:
            self.left -= 1
            if self.left == 0:
                self.stop()



def serve_rank0(expect_model: str | None = None) -> None:
    """A rank > 0 of a multi-process job (nnodes > 1): run the engines rank 0 announces, in lockstep with it
    (kvjax.engine.lockstep.run_follower), until rank 0 ends the job; then leave the runtime and end the process
    (status 0). `LLM(...)`, `LLMEngine.from_engine_args` and `kvjax decode` call it on such a rank, so one
    script started on every host runs its front end on rank 0 only; `kvjax serve --headless` calls it too.
    expect_model: the model this rank was started with, if any (rank 0's must be the same)."""
    from kvjax.distributed import runtime

    lockstep.run_follower(LLMEngine, expect_model)
    runtime.finish()
    raise SystemExit(0)

def _ids(ids) -> list[int]:
    ids = list(ids) if isinstance(ids, (list, tuple, np.ndarray)) else None
    if ids is None or not all(is_int(t) for t in ids):
        raise LLMError(f"prompt token ids must be a list of integers, got {ids!r:.80}")
    return [int(t) for t in ids]


def _generation_config_path(folder: str | None) -> str | None:
    path = None if folder is None or not os.path.isdir(folder) else os.path.join(folder, "generation_config.json")
    return path if path is not None and os.path.exists(path) else None


def generation_config_values(folder: str | None) -> dict:
    """vLLM's get_diff_sampling_param: the sampling values folder's generation_config.json sets
    (max_new_tokens as max_tokens); {} without one."""
    path = _generation_config_path(folder)
    if path is None:
        return {}
    from kvjax.utils.strict_json import read_json_object

    config = read_json_object(path, "generation_config.json")
    values = {k: config[k] for k in _GENERATION_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in values:
        values["max_tokens"] = values.pop("max_new_tokens")
    return values


def generation_defaults(folder: str | None) -> SamplingParams:
    """vLLM's get_default_sampling_params: the generation_config.json values it reads (max_new_tokens
    as max_tokens), over SamplingParams()."""
    try:
        return SamplingParams(**generation_config_values(folder))
    except KvjaxError as e:
        raise LLMError(f"{_generation_config_path(folder)}: {e}") from None


__all__ = ["LLMEngine"]
