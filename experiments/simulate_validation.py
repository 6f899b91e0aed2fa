"""`kvjax simulate` against measured serving runs on this CPU (issue 41, part 3).

One workload is measured to fit a step profile; other workloads (other request rates, prompt
lengths, a pool small enough to preempt) are then both measured and simulated, and the table
gives the simulation's error on TTFT, TPOT and E2EL (mean and p90).

- Measured: `kvjax bench serve`'s in-process target (an AsyncLLM, steps_per_call 1 so that one
  engine step is one model step, as the simulator steps) on the model given, each workload run
  again until a run compiles nothing (the engine compiles once per shape bucket, and which
  buckets a run meets depends on its timing; at most MAX_RUNS runs): that run is the measurement.
- Fitted: each recorded step's time against its features (kvjax.simulator.cost.FittedProfile):
  from the previous step's end to its own end while the engine was busy (the host's work
  between steps belongs to the step it leads to), from its start when the engine had been idle.
- Simulated: the same requests, arrival times and scheduler config through kvjax.simulator.clock
  with the fitted profile.

Writes simulate_validation.{json,md} to --out (default $OUT, else experiments/results).

    python experiments/simulate_validation.py                  # small-gqa (a few minutes on 2 cores)
    python experiments/simulate_validation.py --model smollm2-135m
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from kvjax.benchmarks import serve as B  # noqa: E402
from kvjax.benchmarks.datasets import random_requests  # noqa: E402
from kvjax.errors import write_json, write_text  # noqa: E402
from kvjax.experiments import results_dir  # noqa: E402
from kvjax.markdown import markdown_table  # noqa: E402
from kvjax.simulator.clock import simulate  # noqa: E402
from kvjax.simulator.cost import FittedProfile, StepFeatures  # noqa: E402

IDLE_GAP_S = 2e-3  # a gap longer than this between steps: the engine was waiting for requests
MAX_RUNS = 6


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    rate: float  # requests/s
    blocks: int  # the pool, num_gpu_blocks_override
    range_ratio: float = 0.5


def workloads(scale: float) -> tuple[Workload, list[Workload]]:
    """(the fitting workload, the validation ones); scale multiplies the request rates (a faster
    model takes more)."""
    fit = Workload("fit: 96 × 128 in / 32 out at r", 96, 128, 32, 16 * scale, 256)
    return fit, [
        Workload("rate ÷ 2", 64, 128, 32, 8 * scale, 256),
        Workload("rate × 2", 96, 128, 32, 32 * scale, 256),
        Workload("long prompts (384)", 64, 384, 32, 8 * scale, 256),
        Workload("long outputs (96)", 48, 128, 96, 8 * scale, 256),
        Workload("tight pool (preempts)", 64, 128, 64, 16 * scale, 40),
    ]


def engine_for(model: str, w: Workload):
    from kvjax.engine.arg_utils import AsyncEngineArgs
    from kvjax.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, block_size=16, num_gpu_blocks_override=w.blocks, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=1024, steps_per_call=1, enable_prefix_caching=True, seed=0, use_tqdm_on_load=False))


def measure(model: str, w: Workload, seed: int) -> tuple[dict, list, object, list]:
    """Run w twice on a fresh engine, the second recorded → (bench serve's result, its step records,
    the scheduler config, the requests)."""
    engine = engine_for(model, w)
    try:
        vocab = engine.llm_engine.vllm_config.model_config.vocab_size
        requests = random_requests(w.num_prompts, w.input_len, w.output_len, range_ratio=w.range_ratio,
                                   vocab_size=vocab, seed=seed)
        for run in range(MAX_RUNS):
            target = B.InProcessTarget(engine, record_steps=True)
            result = B.run_benchmark(target, requests, request_rate=w.rate, seed=seed, disable_tqdm=True,
                                     percentile_metrics=("ttft", "tpot", "itl", "e2el"), percentiles=(90,))
            records = list(target.steps.records)
            compiled = sum(r.compiled for r in records)
            print(f"  {w.name}, run {run + 1}: {len(records)} steps, {compiled} compiled", flush=True)
            if not compiled:
                break
        result["runs"], result["compiled_steps"] = run + 1, compiled
        config = engine.llm_engine.engine.scheduler.config
        return result, records, config, requests
    finally:
        engine.shutdown()


def step_samples(records) -> list[tuple[StepFeatures, float]]:
    """(features, seconds) per recorded step that did not compile (module docstring)."""
    out, prev_end = [], None
    for r in records:
        busy = prev_end is not None and r.start - prev_end < IDLE_GAP_S
        seconds = r.end - (prev_end if busy else r.start)
        prev_end = r.end
        if r.compiled or r.steps != 1:
            continue
        out.append((StepFeatures(r.num_scheduled, r.prefill_tokens, r.decode_tokens, r.context_tokens,
                                 r.attention_pairs), seconds))
    return out


METRICS = ("ttft", "tpot", "e2el")


def summary(result: dict) -> dict:
    return {f"{s}_{m}_ms": result[f"{s}_{m}_ms"] for m in METRICS for s in ("mean", "p90")}


def simulated(config, requests, w: Workload, seed: int, profile: FittedProfile) -> dict:
    arrivals = B.arrival_times(len(requests), w.rate, 1.0, seed)
    sim = simulate(config, [r.prompt_token_ids for r in requests], [r.expected_output_len for r in requests],
                   arrivals, profile.step_seconds)
    result = sim.bench_result(METRICS, (90,))
    return dict(summary(result), preemptions=sim.preemptions, steps=len(sim.steps))


def render(res: dict) -> str:
    lines = ["# `kvjax simulate` against measured runs (CPU)", "",
             f"`{res['command']}` ({res['machine']}, {res['seconds']} s). Model `{res['model']}`; step profile "
             f"fitted on \"{res['fit']['workload']}\": {res['fit']['profile']}.", "",
             "Error = simulated / measured − 1. The fitting workload is shown first; the others were not used "
             "for fitting.", ""]
    rows = []
    for v in res["validation"]:
        m, s = v["measured"], v["simulated"]
        rows.append([v["workload"] + (f" ({m['compiled_steps']} steps compiled)" if m["compiled_steps"] else ""),
                     f"{m['preemptions']} / {s['preemptions']}"]
                    + [f"{m[k]:,.1f} / {s[k]:,.1f} ({s[k] / m[k] - 1:+.0%})" if m[k] else "—"
                       for k in (f"{st}_{mt}_ms" for mt in METRICS for st in ("mean", "p90"))])
    lines += markdown_table(["workload", "preemptions (meas. / sim.)"]
                            + [f"{st} {mt.upper()} ms meas. / sim. (error)" for mt in METRICS for st in ("mean", "p90")],
                            rows, "ll" + "r" * 6)
    rr = res["run_to_run"]["difference"]
    lines += ["", "Run to run: the fitting workload measured again on a fresh engine differs from its first "
              "measurement by " + ", ".join(f"{k.replace('_ms', '').replace('_', ' ')} {v:+.0%}" for k, v in rr.items())
              + ": this machine's own spread, the floor under any simulation error here."]
    errs = [abs(v["simulated"][f"mean_{m}_ms"] / v["measured"][f"mean_{m}_ms"] - 1) for v in res["validation"][1:]
            for m in METRICS if v["measured"][f"mean_{m}_ms"]]
    lines += ["", f"Largest error on a mean over the validation workloads: {max(errs):.0%} (goal: 10%)." if errs else ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small-gqa")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every request rate")
    p.add_argument("--quick", action="store_true", help="the fit and one validation workload, fewer requests")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    fit_w, checks = workloads(args.rate_scale)
    if args.quick:
        fit_w, checks = dataclasses.replace(fit_w, num_prompts=32), [dataclasses.replace(checks[0], num_prompts=16)]
    result, records, config, requests = measure(args.model, fit_w, 0)
    samples = step_samples(records)
    profile = FittedProfile.fit(samples)
    rows = [dict(workload=fit_w.name, measured=dict(summary(result), preemptions=result["preemptions"],
                                                     compiled_steps=result["compiled_steps"]),
                 simulated=simulated(config, requests, fit_w, 0, profile))]
    print(f"fitted: {profile.describe()}", flush=True)
    again, _, _, _ = measure(args.model, fit_w, 0)  # the same workload on a fresh engine: the machine's own spread
    noise = {k: again[k] / result[k] - 1 for k in summary(result)}
    for i, w in enumerate(checks, start=1):
        result, _, config, requests = measure(args.model, w, i)
        rows.append(dict(workload=w.name, measured=dict(summary(result), preemptions=result["preemptions"],
                                                        compiled_steps=result["compiled_steps"]),
                         simulated=simulated(config, requests, w, i, profile)))
        print(f"{w.name}: measured {rows[-1]['measured']}, simulated {rows[-1]['simulated']}", flush=True)
    res = dict(command="python experiments/simulate_validation.py" + (f" --model {args.model}"
                                                                       if args.model != "small-gqa" else "")
               + (" --quick" if args.quick else ""),
               machine=f"{os.cpu_count()} CPU cores, {platform.machine()}", model=args.model,
               fit=dict(workload=fit_w.name, profile=profile.describe(), coefficients=profile.to_json()),
               run_to_run=dict(first=summary(result), again=summary(again), difference=noise),
               validation=rows, seconds=round(time.perf_counter() - t0, 1))
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "simulate_validation" + ("" if args.model == "small-gqa" else f"_{args.model}")
    write_json(out / f"{stem}.json", res, "--out")
    write_text(out / f"{stem}.md", render(res) + "\n", "--out")
    print(render(res))
    return res


if __name__ == "__main__":
    main()
