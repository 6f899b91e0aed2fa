"""The Python API: `kvjax.LLM`, vLLM's offline entry point (vLLM's `vllm/entrypoints/llm.py`).

    from kvjax import LLM, SamplingParams
    llm = LLM("small-gqa", kv_cache_dtype="fp8", block_size=16, enable_prefix_caching=True)
    outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, n=2, logprobs=1))
    print(outs[0].outputs[1].text, outs[0].outputs[1].logprobs[0], outs[0].num_cached_tokens)

`LLM(model, **engine args)` takes vLLM's engine arguments (kvjax.engine.arg_utils.EngineArgs: vLLM's
names and meanings, kvjax's extras, and vLLM's unimplemented ones refused by name) and builds one
`LLMEngine` (kvjax.engine.llm_engine) from their resolved config; the engine lives as long as
the LLM, as vLLM's does: its block pool, prefix cache and host tier carry over from one
`generate` / `chat` call to the next, and `reset_prefix_cache()` clears them.

`generate` is a loop over that engine: every prompt is checked first (a request that breaks a
rule raises LLMError, a ValueError, before any request runs, as vLLM raises), then each is added
with output_kind FINAL_ONLY and the engine steps until all finished; the outputs come back in
prompt order. `chat` renders conversations with the checkpoint's chat template first;
`beam_search` is vLLM's beam search over `generate` (kvjax.engine.beam_search); `score_windows`
is kvjax's teacher-forced scoring. `get_metrics` returns vLLM's metrics (kvjax.engine.metrics);
`start_profile` / `stop_profile` write a JAX profiler trace where `profiler_config` says.
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from kvjax.engine.arg_utils import EngineArgs, LLMError, read_template
from kvjax.engine.llm_engine import LLMEngine
from kvjax.engine.outputs import GenerateOutputs
from kvjax.engine.sampling_params import RequestOutputKind, SamplingParams
from kvjax.utils.atomic import BatchCall, lock_of
from kvjax.utils.checks import INT32_MAX, check_int, is_int

_ENGINE_ARGS = {f.name for f in dataclasses.fields(EngineArgs)}


class LLM:
    """A model served through kvjax's engine. See the module docstring."""

    def __init__(self, model, **kwargs):
        """model: a built-in name, a checkpoint folder, PATH.gguf, `preset:NAME`, or a
        models.hub.LoadedModel; kwargs: EngineArgs' fields (vLLM's engine arguments)."""
        for name in kwargs:
            if name not in _ENGINE_ARGS or name == "model":
                raise LLMError(f"LLM() has no argument {name!r}")
        self._start(LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs)))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, request_lens=None) -> "LLM":
        """The LLM of these engine arguments, as `LLM(engine_args.model, **its fields)`; request_lens
        (kvjax decode's): the tokens (prompt + output) of every sequence the caller will send, so that
        a pool no argument sizes holds those rather than max_num_seqs requests of max_model_len."""
        llm = cls.__new__(cls)
        llm._start(LLMEngine.from_engine_args(engine_args, request_lens=request_lens))
        return llm

    def _start(self, llm_engine: LLMEngine) -> None:
        self.llm_engine = llm_engine
        self._request_counter = itertools.count()
        self._batch = BatchCall()  # generate's bookkeeping (kvjax.utils.atomic)

    # ------------------------------------------------------------------ what it runs
    # The resolved config (kvjax.config.engine.EngineConfig, vLLM's VllmConfig), the engine core
    # (kvjax.engine.core.Engine: scheduler, pool, cache), the loaded model, its architecture
    # (ModelConfig) and tokenizer, and the config's values a caller reads most.
    vllm_config = property(lambda self: self.llm_engine.vllm_config)
    engine = property(lambda self: self.llm_engine.engine)
    model = property(lambda self: self.llm_engine.model)
    config = property(lambda self: self.vllm_config.model_config)
    tokenizer = property(lambda self: self.llm_engine.tokenizer)
    kv_spec = property(lambda self: self.vllm_config.cache_config.kv_spec)
    scales = property(lambda self: self.vllm_config.cache_config.scales)
    block_size = property(lambda self: self.vllm_config.block_size)
    num_blocks = property(lambda self: self.vllm_config.num_blocks)
    max_model_len = property(lambda self: self.vllm_config.max_model_len)

    def get_tokenizer(self):
        """The model's tokenizer (models.tokenizer.Tokenizer: encode, decode, eos_token_id, ...)."""
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """A copy of the SamplingParams used when generate is given none: the checkpoint's
        generation_config.json values over vLLM's defaults (generation_config="auto"); change it
        freely (`sp.max_tokens = 8`), as vLLM's examples do."""
        return self.llm_engine.get_default_sampling_params()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block so that no later request hits (vLLM's): False while requests
        hold blocks (e.g. from a progress callback), unless reset_running_requests, which preempts
        them first; reset_connector also empties the host tier."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_metrics(self):
        """vLLM's metrics of this LLM's engine (kvjax.engine.metrics: Counter, Gauge, Histogram, Vector)."""
        return self.llm_engine.get_metrics()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start a JAX profiler trace of the engine's steps into profiler_config's folder (vLLM's
        start_profile; TensorBoard's profile plugin and Perfetto open it)."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable = True, priority: int | Sequence[int] | None = None,
                 progress: Callable[[int], None] | None = None) -> GenerateOutputs:
        """Generate for one prompt or a list of prompts (vLLM's forms: a string, {"prompt": ...},
        {"prompt_token_ids": [...]}; kvjax also takes a list of ids). sampling_params: one for all,
        one per prompt, or None (get_default_sampling_params()); priority: an int for all or one
        per prompt (policy "priority": lower first; "fcfs" ignores it, as vLLM); use_tqdm: a
        progress bar of generated tokens on stderr (or a tqdm-like class); progress(n) (kvjax's)
        is called with the tokens each engine step generated. Every request is checked before
        any runs: a bad one raises LLMError naming the prompt. Returns one RequestOutput per
        prompt, in order, with the call's Summary as `.summary`."""
        engine = self.llm_engine
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise LLMError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and
                                                 all(isinstance(t, (int, np.integer)) for t in prompts)):
            prompts = [prompts]
        params = engine.default_sampling_params if sampling_params is None else sampling_params
        if isinstance(params, (dict, str, bytes)) or not isinstance(params, (SamplingParams, Iterable)):
            raise LLMError(f"sampling_params must be a SamplingParams or one per prompt, got {type(params).__name__}")
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if progress is not None and not callable(progress):
            raise LLMError(f"progress must be a function of the tokens each step generated, got "
                           f"{type(progress).__name__}")
        if len(params) != len(prompts):
            raise LLMError(f"give one SamplingParams for all prompts or one per prompt; got {len(params)} for "
                           f"{len(prompts)} prompts")
        priorities = _priorities(priority, len(prompts))
        with lock_of(engine):  # one call at a time: another thread's waits for this one (kvjax.utils.atomic)
            return self._generate(engine, prompts, params, priorities, use_tqdm, progress)

    def _generate(self, engine: LLMEngine, prompts, params, priorities, use_tqdm, progress) -> GenerateOutputs:
        self._batch.begin(engine.abort_request, engine.get_num_unfinished_requests, LLMError)
        requests = []  # every prompt checked before any request is added (vLLM raises before any runs)
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            text, ids = engine.process_prompt(prompt)
            try:
                sp = engine.check_request(ids, sp)
            except LLMError as e:
                raise LLMError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
            sp.output_kind = RequestOutputKind.FINAL_ONLY  # on the engine's copy: the user's is untouched
            requests.append((str(next(self._request_counter)), text, ids, sp))
        bar = _progress_bar(use_tqdm, "Generating")
        if bar is not None:
            progress = _both(progress, lambda n: _advance(bar, n))
        core, finished = engine.engine, {}
        self._batch.running = True
        core.begin_run()
        try:
            for (rid, text, ids, sp), prio in zip(requests, priorities):
                self._batch.request_ids.append(rid)
                engine.add_request(rid, {"prompt_token_ids": ids}, sp, priority=prio, prompt_text=text, checked=True)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                if progress is not None:
                    progress(core.last_step_tokens)
            self._batch.request_ids = []
        except BaseException:  # an interrupt or a bug: no request of this call is left in the engine
            engine.abort_request([r[0] for r in requests])
            raise
        finally:
            self._batch.running = False
            summary = core.end_run()
            if bar is not None:
                bar.close()
        return GenerateOutputs([finished[r[0]] for r in requests], summary)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool | Callable = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, **kwargs) -> GenerateOutputs:
        """Generate the assistant's reply to one conversation or a list of them (vLLM `LLM.chat`):
        each is a list of {"role", "content"} messages, rendered with chat_template (default the
        LLM's: the checkpoint's, or LLM(chat_template=...)) as transformers renders it
        (LLMEngine.render_chat). Other arguments as `generate`."""
        template = read_template(chat_template) if chat_template is not None else self.llm_engine.chat_template
        if not template:
            raise LLMError(f"model {self.model.name!r} has no chat template: pass chat_template=")
        conversations = _conversations(messages)
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       tools=tools, **_template_kwargs(chat_template_kwargs))
        prompts = [self.llm_engine.render_chat(c, template, **options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, **kwargs)

    def beam_search(self, prompts, params, **kwargs):
        """vLLM's beam search (kvjax.engine.beam_search): beams as requests sharing the prompt's
        blocks through the prefix cache, scored with vLLM's length penalty."""
        from kvjax.engine.beam_search import beam_search

        return beam_search(self, prompts, params, **kwargs)

    # ------------------------------------------------------------------ scoring
    def score_windows(self, token_windows, batch_size: int = 8) -> np.ndarray:
        """Teacher-forced log-probabilities f32[W, S, V] of token_windows i32[W, S]: position s
        holds log p(next token | tokens ≤ s); kvjax's batch form of vLLM's prompt_logprobs (not
        vLLM's pooling `score`). Each window is prefilled alone into a fresh cache of this LLM's
        KV format (dtype, scales, skipped layers, block size), so the keys and values every query
        reads are stored and read back exactly as in generation."""
        return self.llm_engine.score_windows(token_windows, batch_size)

    def __repr__(self) -> str:
        c = self.vllm_config
        return (f"LLM({self.model.name!r}, kv_cache_dtype={self.kv_spec.kv_dtype!r}, block_size={c.block_size}, "
                f"num_gpu_blocks_override={c.num_blocks}, max_num_seqs={c.max_num_seqs})")


# ----------------------------------------------------------------------------------- helpers
def _conversations(messages) -> list[list]:
    """vLLM's chat forms: one conversation (a list of message dicts) or a list of them."""
    if not isinstance(messages, (list, tuple)):
        raise LLMError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, or a list of such "
                       f"conversations; got {type(messages).__name__}")
    if messages and isinstance(messages[0], dict):
        return [list(messages)]
    for i, c in enumerate(messages):
        if not isinstance(c, (list, tuple)):
            raise LLMError(f"conversation {i} must be a list of {{'role': ..., 'content': ...}} dicts, got "
                           f"{type(c).__name__}")
    return [list(c) for c in messages]


# What render_chat passes to a template itself: chat_template_kwargs may not replace them.
_TEMPLATE_ARGS = ("messages", "add_generation_prompt", "continue_final_message", "tools", "documents")


def _template_kwargs(kwargs) -> dict:
    """chat_template_kwargs: a dict of extra template variables, none of them one of the call's own."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise LLMError(f"chat_template_kwargs must be a dict of variable names to values, got "
                       f"{type(kwargs).__name__}")
    taken = [k for k in kwargs if k in _TEMPLATE_ARGS]
    if taken:
        raise LLMError(f"chat_template_kwargs may not set {taken[0]!r}: chat() passes it itself "
                       f"({', '.join(_TEMPLATE_ARGS)})")
    return kwargs


def _priorities(priority, n: int) -> list[int]:
    """One priority per prompt: vLLM's int-for-all or list; a fractional one is refused, not cut."""
    if priority is None:
        return [0] * n
    if is_int(priority):
        priority = [priority] * n
    if not isinstance(priority, (list, tuple)):
        raise LLMError(f"priority must be an int or one per prompt, got {type(priority).__name__}")
    if len(priority) != n:
        raise LLMError(f"{len(priority)} priorities for {n} prompts")
    return [check_int(p, "a priority", -INT32_MAX - 1, INT32_MAX, LLMError) for p in priority]


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
