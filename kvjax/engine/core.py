"""The decoding engine: continuous batching through the scheduler, block pool, KV cache and a model.

This is the only code in kvjax that produces tokens: `kvjax.LLM`, `kvjax decode`, the
accuracy evaluation and the benchmarks all generate through it.

One engine step is vLLM V1's `EngineCore.step`: the scheduler plans which requests run and
how many tokens each computes (`kvjax.core.sched.scheduler`, with the block pool's allocation,
prefix-cache hits and preemption by recompute), the model runs the plan over the KV cache,
a token is sampled for every request whose last token was computed (`kvjax.engine.sampling`, each
request with its own `SamplingParams`), and the scheduler takes the tokens back, finishing
requests that sampled a stop token (EOS unless ignored, or one of stop_token_ids) or reached
their length; the engine then checks stop strings in the detokenized text.

The engine lives as long as its owner (`kvjax.LLM`), as vLLM's engine core does: one scheduler,
block pool, prefix cache and host tier serve every `generate` call (a second call's shared
prefix hits the blocks the first cached, until `reset_prefix_cache`). A prompt's n samples
(SamplingParams.n, vLLM's parallel sampling) are n requests: the first caches the prompt's full
blocks and the others hit them, so they are held once with ref_cnt n.

Chunked prefill is on by default, as in vLLM V1 (the step's budget, `max_num_batched_tokens`,
defaults to 2048; without chunked prefill, to at least max_model_len).

Rows. Like vLLM's persistent batch (`gpu_input_batch.InputBatch`), every running request keeps
one row of the step's batch (B = max_num_seqs rows) from admission until it finishes or is
preempted (the scheduler assigns it, `StepPlan.rows`); empty rows are padding. The contiguous
cache (`kv_layout="contiguous"`, the baseline paging is measured against) stores row r's K/V in
its row r, so one set of steps serves both.

Two compiled device calls serve every plan (kvjax.engine.steps: the ragged step for any plan
with prefill tokens, the decode loop for `steps_per_call` decode steps in one call), their
shapes padded to buckets so that a run compiles a handful of programs, never one per step.

Host offload tier (`kv_offload_blocks`, vLLM's CPU offloading with `kv_offloading_size`): the
scheduler plans, at admission, the loads of host hits (`StepPlan.loads`, kvjax.kv_offload.connector);
the engine copies those pages in before the step (kvjax.kv_offload.host_pages) and, after it,
copies out the blocks the tier newly took (`Scheduler.take_stores`), without waiting.

Tensor parallelism (`tensor_parallel_size` > 1, vLLM's): the params and the paged cache are
placed on a one-axis mesh with kvjax.worker.sharding's rules (column / row split, pages by kv heads)
and the same jitted steps run on them; XLA's partitioner splits the work and inserts the
all-reduces. The pool state is replicated on every rank, as every vLLM worker holds the same
block tables.

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
from kvjax.config.engine import EngineConfig, EngineError, kv_cache_groups, model_len, step_budget
from kvjax.config.scheduler import SchedulerConfig, pool_limits
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.core.sched.output import StepPlan
from kvjax.core.sched.scheduler import Scheduler, SchedulerError
from kvjax.engine import processor, sampling
from kvjax.engine import steps as device
from kvjax.engine.outputs import EngineRun, RequestResult, token_logprobs
from kvjax.engine.processor import find_stop_string
from kvjax.engine.sampling import SamplingParams
from kvjax.engine.stats import RunStats
from kvjax.kv_offload import host_pages as offload
from kvjax.math_utils import cdiv, pow2_bucket
from kvjax.worker import sharding as shd
from kvjax.worker.paged_cache import ContiguousCache, PagedCache

MIN_TABLE_TOKENS = 64  # smallest block-table width bucket, in tokens
MIN_STEP_TOKENS = 16  # smallest ragged-step token bucket



@dataclasses.dataclass
class _Active:
    """What the engine keeps of a request it runs, beside the scheduler's own record."""

    params: SamplingParams  # this sample's own (n = 1; the j-th of n samples has seed + j)
    key: np.ndarray  # u32[2]
    result: RequestResult
    text_chars: int = 0  # characters of its output's text at the last stop-string check


# ----------------------------------------------------------------------------------- the engine
class Engine:
    """Batched generation over one model and one KV cache. The engine lives as long as its
    owner: the block pool, its prefix cache and the host tier carry over from one `generate`
    call to the next (vLLM's engine core), until `reset_prefix_cache`."""

    def __init__(self, model, params, kv_spec, config: EngineConfig, *, scales=None, eos_token_ids=(),
                 max_position_embeddings: int | None = None, vocab_size: int | None = None, tokenizer=None,
                 mesh=None, sized_by: str = ""):
        """tokenizer: anything with decode(ids) → str (results' text, stop strings). The model's
        `config` gives max_position_embeddings and vocab_size unless they are passed. With
        config.tensor_parallel_size > 1 the params and KV pages are placed on a mesh
        (kvjax.worker.sharding); with more ranks than kv heads, `model` and `params` must already
        carry the repeated heads (sharding.replicate_kv_heads), as kvjax.LLM does. eos_token_ids:
        the first is the primary EOS (its stop has stop_reason None; the others act as
        stop_token_ids, as in vLLM)."""
        model_config = getattr(model, "config", None)
        positions = max_position_embeddings or getattr(model_config, "max_position_embeddings", None)
        self.vocab_size = vocab_size or getattr(model_config, "vocab_size", None)
        if positions is None or self.vocab_size is None:
            raise EngineError("pass max_position_embeddings and vocab_size: the model has no config with them")
        self.model, self.params, self.config, self.tokenizer = model, params, config, tokenizer
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.max_model_len = model_len(config.max_model_len, positions)  # what a request may reach
        self.usable_blocks = config.num_blocks - 1
        z = config.block_size
        self.kv_groups, self.layer_groups, self.layer_slots = kv_cache_groups(model_config, kv_spec, config)
        # The scheduler's table width: the longest request the pool could ever hold.
        blocks_for, sched_len = None, min(self.max_model_len, self.usable_blocks * z)  # one group: cdiv(n, Z)
        if self.kv_groups != (None,):  # over the groups, with the chunk before the pool caps it (an upper bound)
            chunk = step_budget(config.max_num_batched_tokens, config.max_num_seqs, config.chunked_prefill,
                                self.max_model_len)
            blocks_for, sched_len = pool_limits(self.kv_groups, z, chunk, self.usable_blocks, self.max_model_len)
        self.limits = processor.Limits(self.vocab_size, self.max_model_len, z, self.usable_blocks, config.max_logprobs,
                                       tokenizer is not None, blocks_for)
        budget = step_budget(config.max_num_batched_tokens, config.max_num_seqs, config.chunked_prefill, sched_len)
        self.scheduler_config = SchedulerConfig(
            num_blocks=config.num_blocks, block_size=z, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget, max_model_len=sched_len, prefix_caching=config.prefix_caching,
            policy=config.policy, chunked_prefill=config.chunked_prefill,
            num_host_blocks=config.kv_offload_blocks, host_policy=config.kv_offload_policy, windows=self.kv_groups)
        tp = config.tensor_parallel_size
        self.mesh = None if tp == 1 else mesh if mesh is not None else shd.make_mesh(tp)
        self._check_fits(kv_spec, sched_len, scales, sized_by)
        if tp > 1:  # Megatron TP as vLLM applies it, as shardings the partitioner propagates
            self.cache = shd.create_cache(shd.tp_layout(kv_spec, tp), config.num_blocks, z, self.mesh, scales)
            if mesh is None:
                self.params = shd.shard_params(params, self.mesh)
            placement = NamedSharding(self.mesh, PartitionSpec())  # the pool state: on every rank
        else:
            placement = jax.devices()[0]
            # Committed to the device, as every step's output is: otherwise the first call of each
            # compiled step would see an uncommitted cache, a second jit cache entry to compile.
            self.cache = jax.device_put(self._make_cache(kv_spec, sched_len, scales)(), placement)
        self.scheduler = Scheduler(self.scheduler_config, placement=placement)
        self.host_pages = offload.HostPages(config.kv_offload_blocks, self.cache) if config.kv_offload_blocks else None
        self._next_request = 0  # request numbers: ids, and the random stream of unseeded requests
        self._active: dict[str, _Active] = {}

    def _make_cache(self, kv_spec: KVSpec, sched_len: int, scales):
        """A thunk that creates the one-device KV cache (pages, or contiguous rows)."""
        cfg, z = self.config, self.config.block_size
        if cfg.kv_layout == "contiguous":
            return lambda: ContiguousCache.create(kv_spec, cfg.max_num_seqs, cdiv(sched_len, z) * z)
        return lambda: PagedCache.create(kv_spec, cfg.num_blocks, z, scales, self.layer_slots)

    def _check_fits(self, kv_spec: KVSpec, sched_len: int, scales, sized_by: str) -> None:
        """Refuse, before allocating any of it, an engine whose KV pages alone, or whose KV cache,
        scheduler tables and one step's logits rows (max_num_seqs × vocab f32) together, exceed
        what each device could hold. sized_by: how num_blocks was chosen, for the message."""
        cfg, tp = self.config, self.config.tensor_parallel_size
        per_block = kv_spec.per_rank(tp).bytes_per_block(cfg.block_size)  # one rank's share of a block
        devices = None if self.mesh is None else list(self.mesh.devices.flat)
        mem.check_fits(f"num_blocks {cfg.num_blocks:,}{sized_by} of {per_block:,} B of KV cache",
                       cfg.num_blocks * per_block, devices)
        if self.mesh is not None:
            shapes = jax.eval_shape(shd.cache_maker(shd.tp_layout(kv_spec, tp), cfg.num_blocks, cfg.block_size, scales))
            cache_bytes = mem.shard_bytes(shapes, shd.cache_shardings(shapes, self.mesh))
        else:
            cache_bytes = mem.tree_bytes(jax.eval_shape(self._make_cache(kv_spec, sched_len, scales)))
        logits = cfg.max_num_seqs * self.vocab_size * 4
        mem.check_fits(f"the KV cache ({cache_bytes:,} B), the scheduler's tables "
                       f"({self.scheduler_config.describe()}) and one step's logits ({logits:,} B)",
                       cache_bytes + self.scheduler_config.state_bytes() + logits, devices)
        if cfg.kv_offload_blocks:  # the host tier's pages fill as blocks are stored: at most this many
            per_block = kv_spec.bytes_per_block(cfg.block_size)
            mem.check_host_fits(f"the host tier's {cfg.kv_offload_blocks:,} blocks of {per_block:,} B",
                                cfg.kv_offload_blocks * per_block)

    # ------------------------------------------------------------------ the prefix cache
    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Forget every cached block, so that no later request hits (vLLM's `reset_prefix_cache`);
        reset_connector also empties the host tier. False, changing nothing, while requests run."""
        return self.scheduler.reset_prefix_cache(reset_host=reset_connector)

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> tuple[str | None, int]:
        """(why the request is refused or None, tokens it may generate): kvjax.engine.processor."""
        return processor.check_request(prompt, params, self.limits)

    def num_logprobs(self, params: SamplingParams) -> int:
        return processor.num_logprobs(params, self.vocab_size)

    # ------------------------------------------------------------------ the loop
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 *, priorities: Sequence[int] | None = None,
                 progress: Callable[[int], None] | None = None) -> EngineRun:
        """Generate for every prompt (token id lists). params: one SamplingParams for all, or one
        per prompt; a prompt's n samples run as n requests that share its blocks (vLLM's parallel
        sampling). priorities (policy "priority" only): lower runs first, as in vLLM. A request
        that breaks a rule gets an error in its result and the others still run. progress(n) is
        called with the number of tokens each device call generated. The results and the
        Summary are this call's; the pool and its cache carry over to the next call."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise EngineError(f"give one SamplingParams for all prompts or one per prompt; got {len(params)} "
                              f"for {len(prompts)} prompts")
        if priorities is not None and len(priorities) != len(prompts):
            raise EngineError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        if priorities is not None and self.config.policy != "priority" and any(int(p) != 0 for p in priorities):
            # vLLM ignores them silently; 0, the neutral value, is accepted
            raise EngineError("priorities need policy='priority' (the scheduler would ignore them)")
        sched = self.scheduler
        if sched.has_unfinished():
            raise EngineError("generate is already running: it cannot be called from its own progress callback")
        # Every check first (a seed + j out of range raises here), then the requests go in.
        samples = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            prompt = [int(t) for t in prompt]
            error, new = self.check_request(prompt, sp)
            for j in range(sp.n):
                child = sp if sp.n == 1 else dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j)
                samples.append((i, j, prompt, child, error, new))
        results, self._active = [], {}
        for i, j, prompt, child, error, new in samples:
            rid = str(self._next_request)
            self._next_request += 1
            res = RequestResult(i, j, rid, len(prompt), [], None if child.logprobs is None else [], error)
            results.append(res)
            if error is None:
                sched.add_request(rid, prompt, new, priority=0 if priorities is None else int(priorities[i]),
                                  stop_ids=child.stop_ids(self.eos_token_ids))
                self._active[rid] = _Active(child, sampling.request_key(self.config.seed, int(rid), child.seed),
                                            res)
        try:
            return self._run(results, progress)
        except BaseException:  # an interrupt or a bug: leave no request behind in the long-lived scheduler
            sched.abort_all()
            raise

    def _run(self, results: list[RequestResult], progress) -> EngineRun:
        """generate's loop over engine steps, once its requests are in the scheduler."""
        sched, host = self.scheduler, self.host_pages
        by_id = {r.request_id: r for r in results}
        stats = RunStats(self.usable_blocks)
        # the scheduler's and the tier's counters run over the engine's life: this call's are differences
        preemptions, host_hits = sched.num_preemptions, sched.host_hit_tokens
        stored, loaded = (host.bytes_stored, host.bytes_loaded) if host is not None else (0, 0)
        start = time.perf_counter()
        while sched.has_unfinished():
            t0 = time.perf_counter()
            plan = sched.schedule()
            if plan.num_requests == 0:
                raise SchedulerError("the scheduler planned an empty step with requests unfinished")
            stats.admissions(plan, by_id)
            if len(plan.loads):  # host tier hits: copied in before the step that reads them
                self.cache = host.load(self.cache, plan.loads[:, 0], plan.loads[:, 1])
                sched.loads_done(plan)
            prefill = np.flatnonzero(plan.prefill)
            if plan.is_decode:
                steps, used, finished = self._decode_call(sched, plan)
            else:
                (steps, finished), used = self._ragged_call(sched, plan), [stats.used(sched)]
            finished += self._stop_strings(sched, plan, finished)
            if host is not None:  # blocks this step computed in full, copied out without waiting
                stores = sched.take_stores()
                host.store(self.cache, [b for b, _ in stores], [s for _, s in stores])
            now = time.perf_counter() - start
            for res in (by_id[rid] for rid, do in zip(plan.req_ids, plan.sample) if do):
                res.ttft_s, res.last_token_s = now if res.ttft_s is None else res.ttft_s, now
            generated = int(plan.sample.sum()) + (steps - 1) * plan.num_requests
            decode_tokens = plan.num_requests * steps - len(prefill) if plan.is_decode else \
                plan.num_requests - len(prefill)
            stats.call(time.perf_counter() - t0, steps, used,
                       prefill_tokens=int(sum(plan.num_scheduled[i] for i in prefill)), decode_tokens=decode_tokens)
            if progress is not None:
                progress(generated)
        wall = time.perf_counter() - start
        for rid, a in self._active.items():
            req, res = sched.forget(rid), a.result  # finished: the scheduler forgets it (vLLM does)
            res.output, res.preemptions = list(req.output), req.num_preemptions
            res.finish_reason = res.finish_reason or req.finish_reason
            if res.stop_reason is None and req.finish_reason == "stop" and (
                    not self.eos_token_ids or req.output[-1] != self.eos_token_ids[0]):
                res.stop_reason = req.output[-1]  # a stop token id (the primary EOS gives None)
            if res.text is None and self.tokenizer is not None and a.params.detokenize:
                res.text = self.tokenizer.decode(res.output)
        tier = None if host is None else dict(
            host_blocks=host.num_slots, host_memory_kind=host.memory_kind,
            host_hit_tokens=sched.host_hit_tokens - host_hits,
            host_bytes_stored=host.bytes_stored - stored, host_bytes_loaded=host.bytes_loaded - loaded,
            host_blocks_in_use=sched.host_blocks_in_use())
        return EngineRun(results, stats.summary(results, sched.num_preemptions - preemptions, wall, tier))

    def _stop_strings(self, sched: Scheduler, plan: StepPlan, finished: list[str]) -> list[str]:
        """vLLM's stop-string check after each sampled token: a stop string in the text ends the
        request ("stop", stop_reason the string; also after a length finish), the text cut before
        it (after it with include_stop_str_in_output). Returns the requests it finished."""
        ended = []
        for rid, do in zip(plan.req_ids, plan.sample):
            a = self._active[rid]
            if not do or not a.params.stop or (rid in finished and sched.finish_reason(rid) == "stop"):
                continue
            # One token came since the last check (a request with stop strings decodes one step
            # per device call), so the new characters start where the last check's text ended.
            text = self.tokenizer.decode(sched.output(rid))
            start, a.text_chars = a.text_chars, len(text)
            hit = find_stop_string(text, start, a.params.stop, a.params.include_stop_str_in_output)
            if hit is None:
                continue
            a.result.text, a.result.stop_reason = hit
            a.result.finish_reason = "stop"
            if rid not in finished:
                sched.finish_request(rid, "stop")
                ended.append(rid)
        return ended

    def _sampling_rows(self, plan: StepPlan, rows: list[int]) -> sampling.SamplingRows:
        """The plan's requests' sampling parameters laid out by row (empty rows: greedy, unused)."""
        b = self.config.max_num_seqs
        params, keys, prompts, outputs = [None] * b, [None] * b, [()] * b, [()] * b
        for rid, row in zip(plan.req_ids, rows):
            a = self._active[rid]
            params[row], keys[row] = a.params, a.key
            prompts[row], outputs[row] = self.scheduler.prompt(rid), self.scheduler.output(rid)
        return sampling.SamplingRows.build(params, keys, prompts, outputs, self.eos_token_ids, self.vocab_size)

    def _plan_logprobs(self, plan: StepPlan) -> int:
        """The step's static J: the most log-probabilities any of its requests asks for, bucketed."""
        k = max(self.num_logprobs(self._active[r].params) for r in plan.req_ids)
        return 0 if k == 0 else min(pow2_bucket(k), self.vocab_size)

    def _record(self, rid: str, sampled, row: int, steps=slice(None)) -> None:
        """Keep request rid's reported log-probabilities from sampling.Sampled arrays (host copies)."""
        res = self._active[rid].result
        if res.logprobs is not None:
            res.logprobs += token_logprobs(sampled, row, steps, self.num_logprobs(self._active[rid].params))

    def _ragged_call(self, sched: Scheduler, plan: StepPlan) -> tuple[int, list[str]]:
        cfg, z = self.config, self.config.block_size
        total = int(plan.num_scheduled.sum())
        budget = self.scheduler_config.max_num_batched_tokens
        rows = plan.rows.tolist()
        width = _table_width(plan, int(plan.seq_lens.max()), z)
        tokens_bucket = pow2_bucket(total, MIN_STEP_TOKENS, budget)
        grouped = plan.group_tables is not None
        md = build_metadata(plan.seq_lens - plan.num_scheduled, plan.num_scheduled,
                            list(plan.group_tables if grouped else plan.block_tables),
                            block_size=z, max_tokens=tokens_bucket, max_seqs=cfg.max_num_seqs, max_blocks_per_seq=width,
                            rows=rows, max_query_len=pow2_bucket(int(plan.num_scheduled.max()), 1, tokens_bucket),
                            windows=self.kv_groups if grouped else None, layer_groups=self.layer_groups)
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
        return 1, sched.update(plan, sampled.tokens[rows])

    def _decode_call(self, sched: Scheduler, plan: StepPlan) -> tuple[int, list[int], list[str]]:
        cfg, z, k = self.config, self.config.block_size, self.config.steps_per_call
        b = cfg.max_num_seqs
        # A step that preempted skipped admission (vLLM does too): the next one may admit. Stop
        # strings are checked on the host after every token.
        one = plan.preempted or any(self._active[r].params.stop for r in plan.req_ids)
        max_steps = 1 if one else k
        width = _table_width(plan, int(plan.seq_lens.max()) + max_steps - 1, z)
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
            return pool, out.tokens[:steps][:, rows], finish[rows], (out, int(steps), used)

        finished, (out, steps, used) = sched.decode_steps(plan, run)
        for rid, row in zip(plan.req_ids, rows):
            self._record(rid, out, row, slice(0, steps))
        return steps, [int(u) for u in used[:steps]], finished


def _table_width(plan: StepPlan, tokens: int, z: int) -> int:
    """The block-table width a step is given: the blocks of its longest row (`tokens`), bucketed
    to a power of two of at least MIN_TABLE_TOKENS tokens, at most the tables' width."""
    return pow2_bucket(cdiv(tokens, z), cdiv(MIN_TABLE_TOKENS, z), plan.block_tables.shape[1])
