"""How fast `kvjax simulate` runs (issue 41, part 5): 10,000 requests on the 8×H200 deployment.

The deployment is simulate_h200.py's first: Llama-3-70B, TP 8, fp8 weights, bf16 KV, 8K context,
194,455 blocks of 16 per rank, max_num_seqs 256; vLLM's random dataset (3,072 in / 512 out,
±25%), Poisson arrivals at 16 req/s (the rate at that deployment's SLO edge). Measured here:

- the whole run's wall time on this machine, the compiles included (a fresh process);
- side by side on the first N requests: the simulator as shipped (runs of decode steps in one device
  call, kvjax.simulator.decode) against every step through the host loop (decode_runs=False),
  with their results checked equal step by step.

Writes simulate_speed.{json,md} to --out (default $OUT, else experiments/results).

    python experiments/simulate_speed.py                 # 10,000 requests, 1,000 side by side
    python experiments/simulate_speed.py --requests 500 --side-by-side 100
"""
from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from kvjax.benchmarks import serve as B  # noqa: E402
from kvjax.benchmarks.datasets import random_requests  # noqa: E402
from kvjax.experiments import results_dir  # noqa: E402
from kvjax.experiments import simulate_h200 as deployments  # noqa: E402
from kvjax.markdown import markdown_table  # noqa: E402
from kvjax.simulator.clock import simulate  # noqa: E402
from kvjax.utils.output_files import write_json, write_text  # noqa: E402

RATE = 16.0


def run(config, cost, requests, arrivals, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    sim = simulate(config, [r.prompt_token_ids for r in requests], [r.expected_output_len for r in requests], arrivals,
                   cost.step_seconds, **kw)
    return time.perf_counter() - t0, sim


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--side-by-side", type=int, default=1_000, help="requests simulated both ways")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    d = deployments.DEPLOYMENTS[0]
    config, cost, _ = deployments.sized(d)
    requests = random_requests(args.requests, d.input_len, d.output_len, range_ratio=0.25, vocab_size=32000, seed=0)
    arrivals = B.arrival_times(len(requests), RATE, 1.0, 0)
    whole, sim = run(config, cost, requests, arrivals)
    res = sim.bench_result(("ttft", "tpot"), (90,))
    print(f"{args.requests:,} requests: {len(sim.steps):,} steps in {whole:.1f} s", flush=True)
    n = args.side_by_side
    fast_s, fast = run(config, cost, requests[:n], arrivals[:n])
    slow_s, slow = run(config, cost, requests[:n], arrivals[:n], decode_runs=False)
    if fast.steps != slow.steps or fast.outputs != slow.outputs:
        raise SystemExit("the two ways disagree: a bug in kvjax.simulator.decode")
    print(f"{n:,} requests both ways: {fast_s:.1f} s shipped, {slow_s:.1f} s host loop", flush=True)
    out = dict(command="python experiments/simulate_speed.py" + (
        f" --requests {args.requests} --side-by-side {n}" if (args.requests, n) != (10_000, 1_000) else ""),
        machine=f"{os.cpu_count()} CPU cores, {platform.machine()}", deployment=d.label, blocks=config.num_blocks,
        rate=RATE, requests=args.requests, steps=len(sim.steps), wall_s=round(whole, 1),
        steps_per_s=round(len(sim.steps) / whole), p90_ttft_ms=res["p90_ttft_ms"], p90_tpot_ms=res["p90_tpot_ms"],
        side_by_side=dict(requests=n, steps=len(fast.steps), shipped_s=round(fast_s, 1), host_loop_s=round(slow_s, 1),
                          speedup=round(slow_s / fast_s, 2)))
    lines = ["# How fast `kvjax simulate` runs", "", f"`{out['command']}` ({out['machine']}). Deployment: "
             f"{d.label} on 8×H200 ({config.num_blocks:,} blocks per rank, max_num_seqs 256), vLLM's random dataset "
             f"{d.input_len:,} in / {d.output_len} out ±25%, Poisson arrivals at {RATE:g} req/s.", "",
             *markdown_table(["run", "requests", "engine steps", "wall s (compiles included)", "steps/s"],
                             [["the whole run", f"{args.requests:,}", f"{len(sim.steps):,}", f"{whole:.1f}",
                               f"{len(sim.steps) / whole:,.0f}"],
                              ["as shipped (decode runs on the device)", f"{n:,}", f"{len(fast.steps):,}",
                               f"{fast_s:.1f}", f"{len(fast.steps) / fast_s:,.0f}"],
                              ["every step through the host loop", f"{n:,}", f"{len(slow.steps):,}", f"{slow_s:.1f}",
                               f"{len(slow.steps) / slow_s:,.0f}"]], "lrrrr"), "",
             f"The two ways give the same steps and token times (checked). Simulated p90 TTFT "
             f"{res['p90_ttft_ms']:,.0f} ms, p90 TPOT {res['p90_tpot_ms']:,.1f} ms."]
    folder = results_dir(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "simulate_speed.json", out, "--out")
    write_text(folder / "simulate_speed.md", "\n".join(lines) + "\n", "--out")
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    main()
