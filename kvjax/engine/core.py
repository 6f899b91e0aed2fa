"""The decoding engine: continuous batching through the scheduler, block pool, KV cache and a model.

This is the only code in kvjax that produces tokens: `kvjax.LLM`, `kvjax decode`, the
accuracy evaluation and the benchmarks all generate through it.

One engine step is vLLM V1's `EngineCore.step`: the scheduler plans which requests run and
how many tokens each computes (`kvjax.core.sched.scheduler`, with the block pool's allocation,
prefix-cache hits and preemption by recompute), the model runs the plan over the KV cache,
a token is sampled for every request whose last token was computed (`kvjax.engine.sampling`), and
the scheduler takes the tokens back, finishing requests that sampled a stop token or reached
their length; the engine then checks (kvjax.engine.processor) stop strings in the text and that
the logits were finite. Every public method is one unit (kvjax.utils.atomic: locked, Ctrl-C held).

The engine lives as long as its owner (`kvjax.LLM`), as vLLM's engine core does: one scheduler,
block pool, prefix cache and host tier serve every call, until `reset_prefix_cache`. A prompt's n samples
(SamplingParams.n, vLLM's parallel sampling) are n requests: the first caches the prompt's full
blocks and the others hit them, so they are held once with ref_cnt n.

Rows. Like vLLM's persistent batch (`gpu_input_batch.InputBatch`), every running request keeps
one row of the step's batch (B = max_num_seqs rows) from admission until it finishes or is
preempted (the scheduler assigns it, `StepPlan.rows`); empty rows are padding. The contiguous
cache (`kv_layout="contiguous"`, the baseline paging is measured against) stores row r's K/V in
its row r, so one set of steps serves both.

Two compiled device calls serve every plan (kvjax.engine.steps: the ragged step for any plan
with prefill tokens, the decode loop for `steps_per_call` decode steps in one call), their
shapes padded to buckets so that a run compiles a handful of programs, never one per step.

Host offload tier (`CacheConfig.num_host_blocks`, vLLM's CPU offloading with `kv_offloading_size`): the
scheduler plans, at admission, the loads of host hits (`StepPlan.loads`, kvjax.kv_offload.connector);
the engine copies those pages in before the step (kvjax.kv_offload.host_pages) and, after it,
copies out the blocks the tier newly took (`Scheduler.take_stores`), without waiting.

Tensor parallelism (`tensor_parallel_size` > 1, vLLM's): the params and the paged cache are
placed on a one-axis mesh with kvjax.worker.sharding's rules (column / row split, pages by kv heads)
and the same jitted steps run on them, the pool replicated (every vLLM worker holds the tables).

The engine never prints (`generate` takes a progress callback) and imports nothing from
`models/`: the model is any Flax module called as kvjax.worker.model_runner.forward calls it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kvjax.accounting import memory as mem
from kvjax.attention.metadata import build_metadata
from kvjax.config.engine import EngineConfig, EngineError
from kvjax.core.sched.output import StepPlan
from kvjax.core.sched.scheduler import Scheduler, SchedulerError
from kvjax.core.sched.tables import state_bytes
from kvjax.engine import processor, sampling
from kvjax.engine import steps as device
from kvjax.engine.outputs import EngineRun, RequestResult, token_logprobs
from kvjax.engine.sampling import SamplingParams
from kvjax.engine.metrics import EngineMetrics, FinishedRequest, cache_config_info
from kvjax.engine.stats import RunStats, StepLog, Summary
from kvjax.engine.structured_output import Grammar, StructuredOutputError, StructuredOutputManager
from kvjax.kv_offload import host_pages as offload
from kvjax.math_utils import cdiv, pow2_bucket
from kvjax.utils.atomic import BatchCall, atomic, lock_of
from kvjax.utils.checks import INT32_MAX, check_int
from kvjax.worker import sharding as shd
from kvjax.worker.mamba_state import create_hybrid_cache
from kvjax.worker.paged_cache import ContiguousCache, PagedCache


@dataclasses.dataclass
class _Active:
    """What the engine keeps of a request it runs, beside the scheduler's own record."""

    params: SamplingParams  # this sample's own (n = 1; the j-th of n samples has seed + j)
    key: np.ndarray  # u32[2]
    result: RequestResult
    arrival: float  # time.perf_counter() when it was added: its latencies count from here
    text_chars: int = 0  # characters of its output's text at the last stop-string check
    scheduled: float | None = None  # when it was first scheduled (vLLM's scheduled_ts; not moved by preemption)
    last_token: float | None = None  # when its last tokens came out
    cut: int | None = None  # its output's length when the model's logits stopped being finite ("error")
    grammar: Grammar | None = None  # its structured output's matcher (kvjax.engine.structured_output)


# ----------------------------------------------------------------------------------- the engine
class Engine:
    """Batched generation over one model and one KV cache. The engine lives as long as its
    owner: the block pool, its prefix cache and the host tier carry over from one `generate`
    call to the next (vLLM's engine core), until `reset_prefix_cache`."""

    scheduler_cls = Scheduler  # kvjax.engine.lockstep's checks every rank's plan against rank 0's

    def __init__(self, model, params, config: EngineConfig, *, eos_token_ids=(), tokenizer=None, mesh=None):
        """config: the resolved config with its pool sized (kvjax.engine.arg_utils.EngineArgs.create_engine_config,
        then EngineConfig.with_num_blocks): the engine reads every value from it and derives none. tokenizer:
        anything with decode(ids) → str (results' text, stop strings). With tensor_parallel_size > 1 the params and
        KV pages are placed on a mesh (kvjax.worker.sharding); `model` and `params` must already be the TP model's
        (sharding.tp_model_config, sharding.tp_params: kv heads repeated when ranks outnumber them, MoE gate/up
        columns one block a rank), as kvjax.engine.llm_engine does. eos_token_ids: the first is the primary EOS (its
        stop has stop_reason None; the others act as stop_token_ids, as in vLLM)."""
        if config.scheduler_config is None:
            raise EngineError("the engine needs a sized pool: EngineConfig.with_num_blocks(...)")
        self.model, self.params, self.config, self.tokenizer = model, params, config, tokenizer
        self.scheduler_config = sched = config.scheduler_config
        self.vocab_size = config.model_config.vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.max_model_len = config.max_model_len  # what a request may reach
        self.usable_blocks = config.num_blocks - 1
        cache = config.cache_config
        self.layer_groups = cache.groups.layer_groups  # each layer's KV cache group (() for one group)
        self.limits = processor.Limits(self.vocab_size, self.max_model_len, config.block_size, self.usable_blocks,
                                       config.max_logprobs, tokenizer is not None, config.request_blocks)
        tp = config.tensor_parallel_size
        self.mesh = None if tp == 1 else mesh if mesh is not None else shd.make_mesh(tp)
        self._check_fits()
        if tp > 1:  # Megatron TP as vLLM applies it, as shardings the partitioner propagates
            self.cache = shd.create_cache(shd.tp_layout(cache.kv_spec, tp), config.num_blocks, config.block_size,
                                          self.mesh, cache.scales, dcp=cache.dcp)
            if mesh is None:
                self.params = shd.shard_params(params, self.mesh)
            placement = NamedSharding(self.mesh, PartitionSpec())  # the pool state: on every rank
        else:
            placement = jax.devices()[0] if mesh is None else mesh.devices.flat[0]  # a data-parallel replica's
            # Committed to the device, as every step's output is: otherwise the first call of each
            # compiled step would see an uncommitted cache, a second jit cache entry to compile.
            self.cache = jax.device_put(self._make_cache()(), placement)
        self.scheduler = self.scheduler_cls(sched, placement=placement)
        self.host_pages = offload.HostPages(sched.num_host_blocks, self.cache) if sched.num_host_blocks else None
        self._next_request = 0  # request numbers: the random stream of unseeded requests
        self._batch = BatchCall()  # generate's bookkeeping
        self._rows_cache = None  # (plan's requests and rows, their SamplingRows): _sampling_rows
        self._active: dict[str, _Active] = {}  # the unfinished requests, by id
        self._run: RunStats | None = None  # a run's Summary being collected (begin_run, generate)
        self.step_log: StepLog | None = None  # set one to record every step (kvjax bench serve, experiments)
        self.last_step_tokens = 0  # tokens the last step generated
        self.metrics = EngineMetrics(config.model, config.max_model_len)  # vLLM's, over the engine's life
        self.metrics.log_metrics_info(cache_config_info(config))  # the pool is sized: vLLM logs it now
        self.structured = StructuredOutputManager(tokenizer, self.vocab_size, self.eos_token_ids)

    def _make_cache(self):
        """A thunk that creates the one-device KV cache (pages, or contiguous rows)."""
        cfg, cache, z = self.config, self.config.cache_config, self.config.block_size
        if cache.kv_layout == "contiguous":
            rows = cdiv(self.scheduler_config.max_model_len, z) * z
            return lambda: ContiguousCache.create(cache.kv_spec, cfg.max_num_seqs, rows)
        if cache.groups.state is not None:  # attention + Mamba: per-slot pages, a Mamba layer's state in its page
            return lambda: create_hybrid_cache(cache.kv_spec, cache.groups.state, cfg.model_config.layer_types,
                                               cfg.num_blocks, z, cache.groups.layer_slots, cache.scales)
        return lambda: PagedCache.create(cache.kv_spec, cfg.num_blocks, z, cache.scales, cache.groups.layer_slots)

    def _check_fits(self) -> None:
        """Refuse, before allocating any of it, an engine whose KV pages alone, or whose KV cache, scheduler tables
        and one step's logits rows (max_num_seqs × vocab f32) together, exceed what each device could hold."""
        cfg, cache, tp = self.config, self.config.cache_config, self.config.tensor_parallel_size
        kv_spec = cache.kv_spec
        per_block = kv_spec.per_rank(tp).bytes_per_block(cfg.block_size)  # one rank's share of a block
        devices = None if self.mesh is None else list(self.mesh.devices.flat)
        mem.check_fits(f"num_blocks {cfg.num_blocks:,}{cache.sized_by} of {per_block:,} B of KV cache",
                       cfg.num_blocks * per_block, devices)
        if self.mesh is not None:
            shapes = jax.eval_shape(shd.cache_maker(shd.tp_layout(kv_spec, tp), cfg.num_blocks, cfg.block_size,
                                                    cache.scales))
            cache_bytes = mem.shard_bytes(shapes, shd.cache_shardings(shapes, self.mesh))
        else:
            cache_bytes = mem.tree_bytes(jax.eval_shape(self._make_cache()))
        logits = cfg.max_num_seqs * self.vocab_size * 4
        mem.check_fits(f"the KV cache ({cache_bytes:,} B), the scheduler's tables "
                       f"({self.scheduler_config.describe()}) and one step's logits ({logits:,} B)",
                       cache_bytes + state_bytes(self.scheduler_config) + logits, devices)
        if cache.num_host_blocks:  # the host tier's pages fill as blocks are stored: at most this many
            per_block = kv_spec.bytes_per_block(cfg.block_size)
            mem.check_host_fits(f"the host tier's {cache.num_host_blocks:,} blocks of {per_block:,} B",
                                cache.num_host_blocks * per_block)

    # ------------------------------------------------------------------ the prefix cache
    @atomic
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block, so that no later request hits (vLLM's `reset_prefix_cache`): False, changing
        nothing, while requests hold blocks, unless reset_running_requests, which first preempts every running
        request (each recomputes when next scheduled, as vLLM's); reset_connector also empties the host tier."""
        return self.scheduler.reset_prefix_cache(reset_running=reset_running_requests, reset_host=reset_connector)

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> tuple[str | None, int]:
        """(why the request is refused or None, tokens it may generate): kvjax.engine.processor."""
        error, new = processor.check_request(prompt, params, self.limits)
        if error is None and params.structured_outputs is not None:  # a grammar that does not compile
            error = self.structured.check(params.structured_outputs)
        return error, new

    def num_logprobs(self, params: SamplingParams) -> int:
        return processor.num_logprobs(params, self.vocab_size)

    @atomic
    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams, *, priority: int = 0,
                    arrival_time: float | None = None) -> RequestResult:
        """Queue one request (vLLM's `EngineCore.add_request`): its token ids and its own
        SamplingParams with n = 1 (a prompt's n samples are n requests: `processor.fan_out`);
        priority orders it under policy "priority" (lower first) and is ignored under "fcfs", as in
        vLLM; arrival_time (time.perf_counter()'s clock, default now) is what its latencies count
        from. A request that breaks a rule (`check_request`) or an id already in use is refused
        with an EngineError naming the rule, and nothing changes. → its RequestResult, which each
        `step` that gives it tokens fills in."""
        if not isinstance(request_id, str):
            raise EngineError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self._active:
            raise EngineError(f"request id {request_id!r} is already in use by an unfinished request")
        if not isinstance(params, SamplingParams) or params.n != 1:
            raise EngineError(f"the engine takes one SamplingParams with n = 1 per request (fan a prompt's n samples "
                              f"out first: kvjax.engine.processor.fan_out), got {params!r:.80}")
        check_int(priority, "priority", -INT32_MAX - 1, INT32_MAX, EngineError)  # fractional: refused, not cut
        prompt = [int(t) for t in prompt]
        error, new = self.check_request(prompt, params)
        if error is not None:
            raise EngineError(error)
        try:  # its own matcher (kvjax.engine.structured_output), before anything is queued
            grammar = None if params.structured_outputs is None else self.structured.compile(params.structured_outputs)
        except StructuredOutputError as e:
            raise EngineError(str(e)) from None
        self.scheduler.add_request(request_id, prompt, new, priority=int(priority),
                                   stop_ids=params.stop_ids(self.eos_token_ids))
        res = RequestResult(request_id, len(prompt), [], None if params.logprobs is None else [])
        key = sampling.request_key(self.config.seed, self._next_request, params.seed)
        self._next_request += 1
        self._rows_cache = None  # an id may come back with other params
        self._active[request_id] = _Active(params, key, res, time.perf_counter() if arrival_time is None
                                           else arrival_time, grammar=grammar)
        if self._run is not None:
            self._run.results.append(res)
        return res

    @atomic
    def abort_requests(self, request_ids: Sequence[str]) -> list[RequestResult]:
        """End these requests now (vLLM's `abort_requests`): their blocks return to the pool (full
        ones stay cached), finish_reason "abort". Ids of finished or unknown requests are ignored,
        as vLLM ignores them. → the aborted requests' results."""
        ended = []
        for rid in request_ids:
            if rid in self._active:
                self.scheduler.finish_request(rid, "abort")
                ended.append(self._close(rid))
        return ended

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------------ one step
    @atomic
    def step(self) -> list[RequestResult]:
        """One engine step (vLLM's `EngineCore.step`): schedule, copy in host-tier hits, run the model (one ragged
        step, or a decode plan's device loop of up to steps_per_call steps), take the sampled tokens back, check stop
        strings, copy newly full blocks out to the host tier. → the results of the requests that got tokens in it
        (`new_tokens` says how many) or finished; a finished request is complete and the engine forgets it. [] when
        nothing is unfinished."""
        sched, host = self.scheduler, self.host_pages
        if not sched.has_unfinished():
            return []
        t0 = time.perf_counter()
        plan = sched.schedule()
        if plan.num_requests == 0:
            raise SchedulerError("the scheduler planned an empty step with requests unfinished")
        for i in np.flatnonzero(plan.admitted):  # vLLM's num_cached_tokens: the prefix hit when first scheduled
            if plan.num_preemptions[i] == 0:
                a = self._active[plan.req_ids[i]]
                a.scheduled, a.result.num_cached_tokens = t0, int(plan.seq_lens[i] - plan.num_scheduled[i])
                a.result.scheduled_s = t0 - a.arrival
        if len(plan.loads):  # host tier hits: copied in before the step that reads them
            self.cache = host.load(self.cache, plan.loads[:, 0], plan.loads[:, 1])
            sched.loads_done(plan)
        steps, finished, chosen = (self._decode_call if plan.is_decode else self._ragged_call)(sched, plan)
        finished += self._output_checks(sched, plan, chosen, finished)
        if host is not None:  # blocks this step computed in full, copied out without waiting
            stores = sched.take_stores()
            host.store(self.cache, [b for b, _ in stores], [s for _, s in stores])
        stats = sched.make_stats()  # what the step did, as the scheduler reports it (vLLM's SchedulerStats)
        now, changed, prompts, ttfts, itls = time.perf_counter(), [], [0, 0], [], []
        for rid, do in zip(plan.req_ids, plan.sample):
            a = self._active[rid]
            res, out = a.result, sched.output(rid)[:a.cut]
            res.new_tokens = len(out) - len(res.output) if do else 0
            if res.new_tokens:
                res.output += out[len(res.output):]
                if res.ttft_s is None:  # its first token: vLLM counts its prompt now
                    res.ttft_s = now - a.arrival
                    ttfts.append(res.ttft_s)
                    prompts = [prompts[0] + res.prompt_tokens, prompts[1] + res.num_cached_tokens]
                else:
                    itls.append(now - a.last_token)
                res.last_token_s, a.last_token = now - a.arrival, now
                changed.append(res)
        for rid in finished:
            res = self._close(rid, now)
            if res.new_tokens == 0:  # finished without a token in this step (an "error" before its first)
                changed.append(res)
        self.last_step_tokens = sum(r.new_tokens for r in changed)
        self.metrics.record_latencies(ttfts, itls)
        self.metrics.record(stats, num_prompt_tokens=prompts[0], num_cached_prompt_tokens=prompts[1],
                            num_generation_tokens=self.last_step_tokens)
        for observer in (self._run, self.step_log):  # a run's Summary, a per-step record (kvjax.engine.stats)
            if observer is not None:
                observer.observe(self, plan, t0, time.perf_counter(), steps, stats)
        return changed

    def _close(self, rid: str, now: float | None = None) -> RequestResult:
        """A finished request: the scheduler forgets it (vLLM does), its result is completed and
        its latencies recorded (kvjax.engine.metrics)."""
        now = time.perf_counter() if now is None else now
        a, req = self._active.pop(rid), self.scheduler.forget(rid)
        res = a.result
        res.output, res.preemptions = list(req.output[:a.cut]), req.num_preemptions
        if a.cut is not None and res.logprobs is not None:
            del res.logprobs[a.cut:]
        res.finish_reason = res.finish_reason or req.finish_reason
        if res.stop_reason is None and req.finish_reason == "stop" and (
                not self.eos_token_ids or req.output[-1] != self.eos_token_ids[0]):
            res.stop_reason = req.output[-1]  # a stop token id (the primary EOS gives None)
        if res.text is None and self.tokenizer is not None and a.params.detokenize:
            res.text = processor.detokenize(self.tokenizer, res.output, a.params)
        scheduled = now if a.scheduled is None else a.scheduled
        first = now if res.ttft_s is None else a.arrival + res.ttft_s
        self.metrics.record_finished(FinishedRequest.from_timestamps(
            res.finish_reason, arrival=a.arrival, queued=a.arrival, scheduled=scheduled, first_token=first,
            last_token=first if a.last_token is None else a.last_token, finished=now,
            num_prompt_tokens=res.prompt_tokens, num_generation_tokens=len(res.output),
            num_cached_tokens=res.num_cached_tokens, num_preemptions=res.preemptions,
            max_tokens_param=a.params.max_tokens))
        return res

    # ------------------------------------------------------------------ a batch, to the end
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 *, priorities: Sequence[int] | None = None,
                 progress: Callable[[int], None] | None = None) -> EngineRun:
        """Generate for every prompt (token id lists) to the end: add every request, then step
        until none is unfinished. params: one SamplingParams for all, or one per prompt; a prompt's
        n samples run as n requests that share its blocks (vLLM's parallel sampling). priorities:
        one per prompt (policy "priority": lower runs first). Every request is checked before any
        is added: one that breaks a rule raises EngineError naming its prompt, and nothing runs.
        progress(n) is called with the tokens each step generated. The results and the Summary
        are this call's; the pool and its cache carry over to the next call."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise EngineError(f"give one SamplingParams for all prompts or one per prompt; got {len(params)} "
                              f"for {len(prompts)} prompts")
        if priorities is not None and len(priorities) != len(prompts):
            raise EngineError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        with lock_of(self):  # one generate at a time; other threads wait (kvjax.utils.atomic)
            self._batch.begin(self.abort_requests, self.get_num_unfinished_requests, EngineError)
            requests = []  # every check first, so that a bad request leaves the engine untouched
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                for j, child in enumerate(processor.fan_out(sp)):
                    error, _ = self.check_request(prompt, child)
                    if error is not None:
                        raise EngineError(f"prompt {i}: {error}")
                    requests.append((i, j, prompt, child, 0 if priorities is None else priorities[i]))
            self._batch.running, self._run, results = True, RunStats(self), []
            try:
                for i, j, prompt, child, priority in requests:
                    res = self.add_request(str(self._next_request), prompt, child, priority=priority)
                    res.index, res.sample = i, j
                    results.append(res)
                    self._batch.request_ids.append(res.request_id)
                while self.has_unfinished_requests():
                    self.step()
                    if progress is not None:
                        progress(self.last_step_tokens)
                self._batch.request_ids = []
                return EngineRun(results, self._run.summary(self))
            except BaseException:  # an interrupt or a bug: leave no request behind in the long-lived scheduler
                self.abort_requests([r.request_id for r in results])
                raise
            finally:
                self._batch.running, self._run = False, None

    @atomic
    def begin_run(self) -> None:
        """Start collecting a run's Summary (kvjax.engine.stats) over the steps that follow."""
        self._run = RunStats(self)

    @atomic
    def end_run(self) -> Summary:
        """The Summary of the steps since `begin_run`, over the requests added since; collecting stops."""
        run, self._run = self._run, None
        if run is None:
            raise EngineError("end_run without begin_run")
        return run.summary(self)

    def _output_checks(self, sched: Scheduler, plan: StepPlan, chosen: np.ndarray, finished: list[str]) -> list[str]:
        """The host's checks on each request that sampled in this step (kvjax.engine.processor):
        a non-finite next-token distribution ("error"; chosen f32[steps, B]: the sampled tokens'
        log-probabilities), then a stop string ("stop"; also after a length finish). Returns the
        requests they finished; one that finished anyway takes their reason."""
        ended, suspect = [], not np.isfinite(chosen).all()  # one test a step; per request when it fails
        for rid, row, do in zip(plan.req_ids, plan.rows, plan.sample):
            a = self._active[rid]
            if not do or not (suspect or a.params.stop or a.grammar is not None):
                continue
            output = sched.output(rid)
            reason = processor.non_finite(a, output, chosen[:, row]) if suspect else None
            if reason is None and a.params.stop and not (rid in finished and sched.finish_reason(rid) == "stop"):
                reason = processor.stop_string(a, output, self.tokenizer)
            if reason is None and a.grammar is not None and rid not in finished:  # the matcher takes the token
                reason = a.grammar.advance(output, rid)
            if reason is not None and rid not in finished:
                sched.finish_request(rid, reason)
                ended.append(rid)
        return ended

    def _sampling_rows(self, plan: StepPlan, rows: list[int]) -> sampling.SamplingRows:
        """The plan's requests' sampling parameters laid out by row (empty rows: greedy, unused). The same requests in
        the same rows get the same rows as the step before, on the device already, unless one of them reads its
        output (penalties, bad words)."""
        key = (plan.req_ids, tuple(rows))
        if self._rows_cache is not None and self._rows_cache[0] == key:
            return self._rows_cache[1]
        b, sched = self.config.max_num_seqs, self.scheduler
        params, keys, prompts, outputs, grammars = [None] * b, [None] * b, [()] * b, [()] * b, [None] * b
        for rid, row in zip(plan.req_ids, rows):  # grammars: structured outputs' matchers, for this step's masks
            a = self._active[rid]
            params[row], keys[row], prompts[row], outputs[row], grammars[row] = (
                a.params, a.key, sched.prompt(rid), sched.output(rid), a.grammar)
        bitmask = self.structured.bitmask(grammars) if any(g is not None for g in grammars) else None
        built = sampling.SamplingRows.build(params, keys, prompts, outputs, self.eos_token_ids, self.vocab_size, bitmask)
        reads_output = bitmask is not None or any(p is not None and (p.has_penalties or p.bad_words_token_ids)
                                                  for p in params)
        if self.mesh is None:
            built = jax.device_put(built)
        self._rows_cache = None if reads_output else (key, built)
        return built

    def _plan_logprobs(self, plan: StepPlan) -> int:
        """The step's static J: the most log-probabilities any of its requests asks for, bucketed."""
        k = max(self.num_logprobs(self._active[r].params) for r in plan.req_ids)
        return 0 if k == 0 else min(pow2_bucket(k), self.vocab_size)

    def _record(self, rid: str, sampled, row: int, steps=slice(None)) -> None:
        """Keep request rid's reported log-probabilities from sampling.Sampled arrays (host copies)."""
        res = self._active[rid].result
        if res.logprobs is not None:
            res.logprobs += token_logprobs(sampled, row, steps, self.num_logprobs(self._active[rid].params))

    def _ragged_call(self, sched: Scheduler, plan: StepPlan) -> tuple[int, list[str], np.ndarray]:
        cfg, z = self.config, self.config.block_size
        total = int(plan.num_scheduled.sum())
        budget = self.scheduler_config.max_num_batched_tokens
        rows = plan.rows.tolist()
        width = device.table_width(int(plan.seq_lens.max()), z, plan.block_tables.shape[1])
        tokens_bucket = device.ragged_tokens(total, budget)
        grouped = plan.group_tables is not None
        md = build_metadata(plan.seq_lens - plan.num_scheduled, plan.num_scheduled,
                            list(plan.group_tables if grouped else plan.block_tables),
                            block_size=z, max_tokens=tokens_bucket, max_seqs=cfg.max_num_seqs, max_blocks_per_seq=width,
                            rows=rows, max_query_len=pow2_bucket(int(plan.num_scheduled.max()), 1, tokens_bucket),
                            windows=self.scheduler_config.windows if grouped else None, layer_groups=self.layer_groups)
        tokens = np.pad(plan.token_ids, (0, md.num_tokens - total))
        positions = np.zeros(cfg.max_num_seqs, np.int32)
        positions[rows] = plan.seq_lens  # the index each sampled token takes
        sampled, self.cache = device.ragged_step(self.model, self.params, self.cache, tokens, md,
                                           self._sampling_rows(plan, rows), positions,
                                           num_logprobs=self._plan_logprobs(plan))
        sampled = jax.device_get(sampled)
        for rid, row, do in zip(plan.req_ids, rows, plan.sample):
            if do:
                self._record(rid, jax.tree.map(lambda x: x[None], sampled), row, 0)
        return 1, sched.update(plan, sampled.tokens[rows]), sampled.logprobs[None]

    def _decode_call(self, sched: Scheduler, plan: StepPlan) -> tuple[int, list[str], np.ndarray]:
        cfg, z, k = self.config, self.config.block_size, self.config.steps_per_call
        b = cfg.max_num_seqs
        # A step that preempted skipped admission (vLLM does too): the next one may admit. Stop
        # strings are checked on the host after every token.
        one = plan.preempted or any(sampling.needs_host_every_token(self._active[r].params) for r in plan.req_ids)
        max_steps = 1 if one else k
        width = device.table_width(int(plan.seq_lens.max()) + max_steps - 1, z, plan.block_tables.shape[1])
        rows = plan.rows.tolist()
        tokens, computed = np.zeros(b, np.int32), np.zeros(b, np.int32)
        tokens[rows], computed[rows] = plan.token_ids, plan.seq_lens - 1
        decode_rows, sampling_rows = sched.decode_rows(plan, by_row=True), self._sampling_rows(plan, rows)
        num_logprobs = self._plan_logprobs(plan)

        def run(pool):
            # NumPy arguments: jit transfers them in its C++ fast path (jnp.asarray costs ~0.1 ms each).
            pool, self.cache, out, steps, used, finish, refusal = device.decode_loop(
                self.model, self.params, pool, self.cache, decode_rows, tokens, computed, sampling_rows,
                np.int32(max_steps), num_steps=k, width=width, num_logprobs=num_logprobs, layer_groups=self.layer_groups)
            out, steps, used, finish, refusal = jax.device_get((out, steps, used, finish, refusal))  # one transfer
            device.raise_refusal(plan, rows, refusal)
            return pool, out.tokens[:steps][:, rows], finish[rows], used[:steps], (out, int(steps))

        finished, (out, steps) = sched.decode_steps(plan, run)
        for rid, row in zip(plan.req_ids, rows):
            self._record(rid, out, row, slice(0, steps))
        return steps, finished, out.logprobs

