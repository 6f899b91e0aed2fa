"""The seed's latency inferences (推断), each measured under load on the engine.

The seed states five things about serving without data behind them; each section here runs the
engine under requests arriving over time (kvjax.benchmarks.serve: vLLM's `bench serve` arrivals
and metrics, in-process on an AsyncLLM) with the scheduler's view of every step recorded
(kvjax.engine.stats.StepLog: running, waiting, preempted, blocks in use, recomputed tokens), and
ends with the seed's sentence and what the data says:

1. preemption: a fixed arrival rate over pools from roomy to tight: recompute tax (tokens
   recomputed / tokens computed), TTFT / TPOT / ITL p50 and p99, throughput, and the gap each
   preempted request sees against everyone's ITL (spike or smooth decline?);
2. block size 16 / 32 / 64 / 128 at one KV budget in tokens: peak and mean running requests,
   tail waste measured from the pool, decode step time;
3. prefix caching on unique prompts vs off (the cost of hashing), and on a shared system prompt
   (the gain), runs alternated on and off;
4. host offload on returning multi-turn conversations: TTFT of returning turns with the host tier
   vs recompute, peak running requests with and without it, bytes moved;
5. planned vs observed: `kvjax plan`'s concurrency for the pool (kvjax.accounting.budget.plan) and
   vLLM's reported maximum concurrency against the peak of running requests under saturating load.

Compile time is kept out: every engine runs its workload once unmeasured, then the measured run
(the same requests and arrival times; the prefix cache and host tier reset in between); steps
during which JAX still compiled are counted and left out of step times. Greedy, ignore_eos,
steps_per_call 1 (one engine step per output token, as vLLM). Each model's sections share no
engine, so nothing one leaves in a cache helps another.

Writes seed_inferences.{json,md} and seed_inferences_<model>.png to --out (default $OUT, else
experiments/results). Run: python -m kvjax.experiments.seed_inferences [--models small-gqa,smollm2-135m] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import math
import time

import jax
import numpy as np

from kvjax import AsyncEngineArgs, AsyncLLM
from kvjax.accounting import budget
from kvjax.benchmarks import serve as B
from kvjax.engine.sampling_params import RequestOutputKind, SamplingParams
from kvjax.engine.stats import COMPILE_S, StepLog
from kvjax.experiments import results_dir
from kvjax.experiments.decode_bench import _meta, _write
from kvjax.experiments.seed_inferences_report import markdown, plot
from kvjax.math_utils import cdiv

# Per model: the workload sizes (full, quick). in/out: prompt and output tokens; n: requests.
SIZES = {
    "small-gqa": dict(full=dict(n=64, inp=96, out=64, seqs=16, bs=16), quick=dict(n=12, inp=24, out=12, seqs=4, bs=16)),
    "smollm2-135m": dict(full=dict(n=24, inp=96, out=48, seqs=8, bs=16), quick=dict(n=8, inp=24, out=8, seqs=4, bs=16)),
}


# ----------------------------------------------------------------------------- running one engine
def make_engine(model: str, **kw) -> AsyncLLM:
    return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, use_tqdm_on_load=False, **kw))


def close(engine: AsyncLLM) -> None:
    """Shut the engine down and drop every compiled program: each engine's pool shape compiles its
    own, and XLA:CPU keeps each one's code mapped (a whole run would exhaust the process's memory
    maps, vm.max_map_count)."""
    engine.shutdown()
    jax.clear_caches()
    gc.collect()


def config_of(model: str, **kw):
    """The resolved engine config (no weights loaded): the KV spec, max_model_len."""
    return AsyncEngineArgs(model=model, num_gpu_blocks_override=2, **kw).create_engine_config()


def vocab_of(engine: AsyncLLM) -> tuple[int, list[int]]:
    tok = engine.get_tokenizer()
    return tok.vocab_size, list(getattr(tok, "all_special_ids", ()))


def _reset(engine: AsyncLLM) -> None:
    if not asyncio.run(engine.reset_prefix_cache(reset_connector=True)):
        raise RuntimeError("the prefix cache was not reset: a request is still running")


def measured(engine: AsyncLLM, workload, warm: bool = True) -> tuple[object, StepLog, dict]:
    """workload(engine) → result, run twice (once with warm=False: it ran before): the first
    compiles, the second is measured with a StepLog on the engine → (its result, the log,
    {compile_s: seconds JAX compiled during it, and with a host tier the bytes it stored and loaded})."""
    if warm:
        workload(engine)
    _reset(engine)
    core = engine.llm_engine.engine
    tier = core.host_pages
    moved = (tier.bytes_stored, tier.bytes_loaded) if tier is not None else (0, 0)
    core.step_log, compile0 = log, _ = StepLog(), COMPILE_S[0]
    try:
        result = workload(engine)
    finally:
        core.step_log = None
    info = {"compile_s": COMPILE_S[0] - compile0}
    if tier is not None:
        info.update(host_blocks=tier.num_slots, host_bytes_stored=tier.bytes_stored - moved[0],
                    host_bytes_loaded=tier.bytes_loaded - moved[1])
    return result, log, info


def serve(requests, rate: float, seed: int = 0):
    """A workload: the requests sent at vLLM's arrival times for rate (Poisson), streamed back."""
    def run(engine):
        outputs, duration = asyncio.run(B.benchmark(B.InProcessTarget(engine), requests, request_rate=rate, disable_tqdm=True,
                                                    seed=seed))
        return outputs, duration
    return run


def metrics_of(outputs, duration: float, log: StepLog) -> dict:
    """vLLM's metrics (ms; p50 and p99) and the step log's totals."""
    m, _ = B.calculate_metrics(outputs, duration, percentiles=(50, 99))
    recs = log.records
    computed = sum(r.prefill_tokens + r.decode_tokens for r in recs)
    recomputed = sum(r.recomputed_tokens for r in recs)
    timed = [r for r in recs if not r.compiled]
    decode = [r.end - r.start for r in timed if r.prefill_tokens == 0]
    out = {"completed": m.completed, "failed": m.failed, "duration_s": duration,
           "output_throughput": m.output_throughput, "request_throughput": m.request_throughput,
           "steps": len(recs), "compiled_steps": len(recs) - len(timed),
           "computed_tokens": computed, "recomputed_tokens": recomputed,
           "recompute_tax": recomputed / computed if computed else 0.0,
           "prefill_tokens": sum(r.prefill_tokens for r in recs),
           "preemptions": sum(r.num_preempted for r in recs),
           "peak_running": max((r.num_running for r in recs), default=0),
           "peak_scheduled": max((r.num_scheduled for r in recs), default=0),
           "mean_running": float(np.mean([r.num_scheduled for r in recs])) if recs else 0.0,
           "decode_step_ms": 1e3 * float(np.median(decode)) if decode else None,
           "mean_step_ms": 1e3 * float(np.mean([r.end - r.start for r in timed])) if timed else None}
    for k in ("ttft", "tpot", "itl", "e2el"):
        st = m.stats[k]
        out[f"{k}_p50_ms"], out[f"{k}_p99_ms"] = (v for _, v in st["percentiles"])
        out[f"{k}_mean_ms"] = st["mean"]
    return out


def stalls(outputs, log: StepLog) -> dict:
    """The spike test: each preempted request's longest gap between outputs, against the ITL of the
    outputs of every request (InProcessTarget numbers requests bench-1, bench-2, ... in send order)."""
    preempted = {int(rid.split("-")[1]) - 1 for r in log.records for rid in r.preempted}
    gaps = [max(o.itl, default=0.0) for i, o in enumerate(outputs) if i in preempted and o.success]
    all_itl = [g for o in outputs for g in o.itl]
    recompute_steps = [r.end - r.start for r in log.records if r.recomputed_tokens and not r.compiled]
    decode_steps = [r.end - r.start for r in log.records if not r.prefill_tokens and not r.compiled]
    med = lambda x: 1e3 * float(np.median(x)) if x else None  # noqa: E731
    return {"preempted_requests": len(preempted), "preempted_max_gap_p50_ms": med(gaps),
            "itl_p50_ms": med(all_itl), "recompute_step_p50_ms": med(recompute_steps),
            "decode_step_p50_ms": med(decode_steps)}


def timeline(outputs, log: StepLog) -> dict:
    """For the plot: every output's time and gap, and the steps' times, preemptions and recomputes."""
    t0 = min((o.start_time for o in outputs), default=0.0)
    tok_t, tok_gap = [], []
    for o in outputs:
        t = o.start_time + o.ttft
        for gap in o.itl:
            t += gap
            tok_t.append(t - t0)
            tok_gap.append(gap * 1e3)
    recs = log.records
    return {"token_time_s": tok_t, "itl_ms": tok_gap, "step_end_s": [r.end - t0 for r in recs],
            "step_ms": [(r.end - r.start) * 1e3 for r in recs], "running": [r.num_running for r in recs],
            "preempt_s": [r.end - t0 for r in recs if r.num_preempted],
            "recomputed": [r.recomputed_tokens for r in recs]}


# ----------------------------------------------------------------------------- the sections
def preemption(model: str, z: dict, seed: int) -> dict:
    """A fixed Poisson rate over pools of S, S/2, S/4 and S/8 longest requests' blocks (S = max_num_seqs).
    The rate: 70% of the roomy pool's request throughput when every request arrives at once."""
    full = cdiv(math.ceil(z["inp"] * 1.25) + math.ceil(z["out"] * 1.25), z["bs"])  # a longest request's blocks
    pools = [z["seqs"] * full // d + 1 for d in (1, 2, 4, 8) if z["seqs"] * full // d >= full]
    common = dict(block_size=z["bs"], max_num_seqs=z["seqs"], seed=seed)
    rows, rate, tl = [], None, None
    for blocks in pools:
        engine = make_engine(model, num_gpu_blocks_override=blocks, **common)
        try:
            vocab, special = vocab_of(engine)
            reqs = B.random_requests(z["n"], z["inp"], z["out"], range_ratio=0.25, vocab_size=vocab,
                                     special_ids=special, seed=seed)
            if rate is None:  # the roomy pool, all at once: its capacity sets the rate
                (outs, dur), _, _ = measured(engine, serve(reqs, math.inf, seed))
                rate = 0.7 * sum(o.success for o in outs) / dur
                _reset(engine)
            (outs, dur), log, comp = measured(engine, serve(reqs, rate, seed))
        finally:
            close(engine)
        rows.append({"num_blocks": blocks, "pool_tokens": (blocks - 1) * z["bs"],
                     "longest_requests_held": (blocks - 1) // full, **metrics_of(outs, dur, log),
                     **stalls(outs, log), **comp})
        if tl is None or rows[-1]["preemptions"] >= tl[0]:  # the plot's: the pool that preempted most
            tl = (rows[-1]["preemptions"], rows[-1]["num_blocks"], timeline(outs, log))
    return {"rate_req_s": rate, "requests": z["n"], "input_len": z["inp"], "output_len": z["out"],
            "range_ratio": 0.25, "max_num_seqs": z["seqs"], "block_size": z["bs"], "rows": rows,
            "timeline_blocks": tl[1], "timeline": tl[2]}


def block_sizes(model: str, z: dict, seed: int) -> dict:
    """Block sizes 16..128 at one budget of tokens (the blocks: budget // block size, the null block
    among them, as vLLM sizes a pool), every request at once, max_num_seqs not binding, no prefix caching."""
    longest = math.ceil(z["inp"] * 1.25) + math.ceil(z["out"] * 1.25)
    budget_tokens = 128 * max(cdiv(z["seqs"] * (z["inp"] + z["out"]) // 2, 128), 1 + 2 * cdiv(longest, 128))
    rows = []
    for bs in (16, 32, 64, 128):
        engine = make_engine(model, block_size=bs, num_gpu_blocks_override=budget_tokens // bs,
                             max_num_seqs=4 * z["seqs"], enable_prefix_caching=False, seed=seed)
        try:
            vocab, special = vocab_of(engine)
            reqs = B.random_requests(z["n"], z["inp"], z["out"], range_ratio=0.25, vocab_size=vocab,
                                     special_ids=special, seed=seed)
            (outs, dur), log, comp = measured(engine, serve(reqs, math.inf, seed))
        finally:
            close(engine)
        busy = [r for r in log.records if max(r.num_scheduled, r.num_running) > 0]
        waste = [(r.blocks_in_use * bs - r.tokens_held) / max(r.num_scheduled, r.num_running) for r in busy]
        rows.append({"block_size": bs, "num_blocks": budget_tokens // bs, "usable_tokens": (budget_tokens // bs - 1) * bs,
                     **metrics_of(outs, dur, log), "tail_waste_tokens_per_request": float(np.mean(waste)),
                     "tail_waste_share": float(np.mean([(r.blocks_in_use * bs - r.tokens_held) / (r.blocks_in_use * bs)
                                                        for r in busy if r.blocks_in_use])), **comp})
    return {"budget_tokens": budget_tokens, "requests": z["n"], "input_len": z["inp"], "output_len": z["out"],
            "rows": rows}


def prefix_caching(model: str, z: dict, seed: int, repeats: int) -> dict:
    """Caching on and off, runs alternated (on, off, on, off, ...): unique random prompts, then the
    same with three quarters of every prompt a shared system prompt; every request at once."""
    blocks = z["seqs"] * cdiv(2 * (z["inp"] + z["out"]), z["bs"]) + 1  # roomy: no preemption
    engines = {on: make_engine(model, block_size=z["bs"], num_gpu_blocks_override=blocks, max_num_seqs=z["seqs"],
                               enable_prefix_caching=on, seed=seed) for on in (True, False)}
    try:
        vocab, special = vocab_of(engines[True])
        out = {}
        for name, prefix in (("unique", 0), ("shared_prefix", 3 * z["inp"] // 4)):
            reqs = B.random_requests(z["n"], z["inp"] - prefix, z["out"], prefix_len=prefix, vocab_size=vocab,
                                     special_ids=special, seed=seed)
            if not prefix:  # fully unique: a distinct first token each, so that no block hash can repeat
                allowed = sorted(set(range(vocab)) - set(special))
                for i, r in enumerate(reqs):
                    r.prompt_token_ids[0] = allowed[i % len(allowed)]
            runs = {True: [], False: []}
            for engine in engines.values():  # compile first
                serve(reqs, math.inf, seed)(engine)
            for _ in range(repeats):
                for on, engine in engines.items():
                    (outs, dur), log, comp = measured(engine, serve(reqs, math.inf, seed), warm=False)
                    runs[on].append({**metrics_of(outs, dur, log), **comp})
            out[name] = {"prefix_len": prefix, **{("on" if on else "off"): _median_rows(rs) for on, rs in runs.items()}}
    finally:
        for e in engines.values():
            close(e)
    return {"requests": z["n"], "input_len": z["inp"], "output_len": z["out"], "repeats": repeats, **out}


def _median_rows(rows: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in rows])) if rows[0][k] is not None else None for k in rows[0]}


def conversations(c: int, turns: int, first: int, new: int, out: int, think_s: float, vocab: int, seed: int):
    """A workload of c conversations: each sends its first `first` tokens, streams `out` tokens back,
    waits think_s, then sends its whole history plus `new` tokens, `turns` times; conversation i
    starts i × think_s / c seconds in. Returns each turn's (conversation, turn, TTFT s, prompt length)."""
    rng = np.random.default_rng(seed)
    texts = [[rng.integers(1, vocab, first if t == 0 else new).tolist() for t in range(turns)] for _ in range(c)]

    def run(engine):
        async def talk(i):
            await asyncio.sleep(i * think_s / c)
            history, rows = [], []
            for t in range(turns):
                history = history + texts[i][t]
                params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True,
                                        output_kind=RequestOutputKind.DELTA)
                st, ttft, got = time.perf_counter(), None, []
                async for ro in engine.generate({"prompt_token_ids": history}, params, f"conv-{i}-{t}"):
                    if ttft is None and ro.outputs[0].token_ids:
                        ttft = time.perf_counter() - st
                    got += ro.outputs[0].token_ids
                rows.append((i, t, ttft, len(history)))
                history = history + got
                await asyncio.sleep(think_s)
            return rows

        async def all_of():
            return [r for rows in await asyncio.gather(*(talk(i) for i in range(c))) for r in rows]
        return asyncio.run(all_of())
    return run


def host_offload(model: str, z: dict, seed: int) -> dict:
    """Returning conversations with a device pool of about half their distinct blocks, without a host
    tier (a returning turn recomputes what was evicted) and with one holding all of them."""
    c, turns, first, new = 2 * z["seqs"], 3, z["inp"], z["inp"] // 4
    distinct = c * cdiv(first + (turns - 1) * (new + z["out"]) + z["out"], z["bs"])
    blocks = distinct // 2 + 1
    rows = []
    spec = config_of(model, block_size=z["bs"]).cache_config.kv_spec
    for host in (False, True):
        kw = dict(block_size=z["bs"], num_gpu_blocks_override=blocks, max_num_seqs=z["seqs"], seed=seed)
        if host:  # a host tier of twice the distinct blocks: it never evicts
            kw["kv_offloading_size"] = 2 * distinct * spec.bytes_per_block(z["bs"]) / 2**30
        engine = make_engine(model, **kw)
        try:
            vocab, _ = vocab_of(engine)
            think = 0.5 if z["n"] > 16 else 0.1
            turn_rows, log, comp = measured(engine, conversations(c, turns, first, new, z["out"], think, vocab, seed))
        finally:
            close(engine)
        returning = [r[2] for r in turn_rows if r[1] > 0]
        firsts = [r[2] for r in turn_rows if r[1] == 0]
        rows.append({"host_tier": host, "num_blocks": blocks,
                     "returning_ttft_p50_ms": 1e3 * float(np.median(returning)),
                     "returning_ttft_p99_ms": 1e3 * float(np.percentile(returning, 99)),
                     "first_turn_ttft_p50_ms": 1e3 * float(np.median(firsts)),
                     "prefill_tokens": sum(r.prefill_tokens for r in log.records),
                     "peak_running": max(r.num_running for r in log.records),
                     "mean_running": float(np.mean([r.num_scheduled for r in log.records])),
                     "preemptions": sum(r.num_preempted for r in log.records), **comp})
    return {"conversations": c, "turns": turns, "first": first, "new": new, "output_len": z["out"],
            "distinct_blocks": distinct, "rows": rows}


def planned_vs_observed(model: str, z: dict, seed: int) -> dict:
    """Fixed-length requests (in + out = L), all at once, three times as many as the plan says fit,
    max_num_seqs far above it: kvjax plan's concurrency for L, vLLM's reported maximum concurrency
    (num_blocks / blocks of max_model_len), the peak of running requests observed."""
    length = z["inp"] + z["out"]
    rows = []
    for per_req in (4, 8):
        spec = config_of(model, block_size=z["bs"]).cache_config.kv_spec
        blocks = per_req * cdiv(length, z["bs"]) + 1
        plan = budget.plan(spec, context=length, block_size=z["bs"],
                           kv_cache_memory_bytes=blocks * spec.bytes_per_block(z["bs"]))
        n = 3 * plan.concurrency_blocks
        engine = make_engine(model, block_size=z["bs"], num_gpu_blocks_override=blocks, max_model_len=length,
                             max_num_seqs=8 * plan.concurrency_blocks, seed=seed)
        try:
            vocab, special = vocab_of(engine)
            reqs = B.random_requests(n, z["inp"], z["out"], vocab_size=vocab, special_ids=special, seed=seed)
            (outs, dur), log, comp = measured(engine, serve(reqs, math.inf, seed))
        finally:
            close(engine)
        m = metrics_of(outs, dur, log)
        rows.append({"num_blocks": blocks, "request_len": length, "planned_concurrency": plan.concurrency_blocks,
                     "vllm_reported_concurrency": blocks / cdiv(length, z["bs"]), "max_model_len": length,
                     "observed_peak_running": m["peak_running"], "observed_mean_running": m["mean_running"],
                     "preemptions": m["preemptions"], "recompute_tax": m["recompute_tax"], "requests": n,
                     **comp})
    return {"rows": rows}


def run_model(model: str, quick: bool, seed: int, repeats: int) -> dict:
    z = SIZES.get(model, SIZES["small-gqa"])["quick" if quick else "full"]
    sections = {}
    for name, fn in (("preemption", lambda: preemption(model, z, seed)),
                     ("block_size", lambda: block_sizes(model, z, seed)),
                     ("prefix_caching", lambda: prefix_caching(model, z, seed, repeats)),
                     ("host_offload", lambda: host_offload(model, z, seed)),
                     ("planned_vs_observed", lambda: planned_vs_observed(model, z, seed))):
        t = time.perf_counter()
        sections[name] = fn()
        sections[name]["wall_s"] = time.perf_counter() - t
        print(f"  {model} {name}: {sections[name]['wall_s']:.0f} s", flush=True)
    return sections


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="small-gqa,smollm2-135m", help="comma-separated (small-gqa,smollm2-135m)")
    ap.add_argument("--quick", action="store_true", help="small workloads (a smoke run; its figures mean little)")
    ap.add_argument("--repeats", type=int, default=3, help="alternated on/off runs per prefix-caching workload (3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else experiments/results)")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    result = {"meta": _meta(), "quick": args.quick, "seed": args.seed, "models": {}}
    start = time.perf_counter()
    out = results_dir(args.out)
    stem = "seed_inferences" + ("_quick" if args.quick else "")
    for model in models:  # the files are written again after each model: a later failure keeps the earlier ones
        result["models"][model] = run_model(model, args.quick, args.seed, args.repeats)
        result["wall_s"] = time.perf_counter() - start
        _write(out, stem, result, markdown(result))
        plot(model, result["models"][model], out / f"{stem}_{model}.png")
    print(f"wrote {out / stem}.md")
    return result


if __name__ == "__main__":
    main()
