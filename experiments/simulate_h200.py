"""Simulated serving on H200s (issue 41, part 4): `kvjax simulate`'s roofline, predictions only.

SIMULATED, NOT MEASURED. For each deployment, the pool comes from kvjax plan's arithmetic
(141 GiB per H200, gpu_memory_utilization 0.9, blocks of 16, the weights at their dtype divided
over the ranks) and each step's time from kvjax.simulator.cost.Roofline (the H200 datasheet's
bandwidth and dense peaks, ring all-reduces over NVLink, 1 ms per step assumed): a lower bound on
a real step, which also spends kernel inefficiency and launch gaps. The requests are vLLM's random
dataset with Poisson arrivals at a sweep of rates; per rate: p90 TTFT and TPOT, preemptions.
The SLO (p90 TTFT <= 2 s, p90 TPOT <= 100 ms) gives each deployment's max sustainable rate.

    Llama-3-70B, TP 8, fp8 weights: bf16 vs fp8 KV, 8K and 32K contexts; at 32K also host tiers
        (256 GiB and 1 TiB over the 8 ranks, vLLM's --kv-offloading-size), where the pool fills and preempts
    DeepSeek-V3 (MLA, its latent replicated on every rank), TP 8, fp8 weights: bf16 vs fp8 KV, 8K
    Gemma-3-27B (bf16 weights) and gpt-oss-120b (4-bit weights: MXFP4's 4.25 bits per parameter
        taken as 4) on ONE H200, with vLLM's hybrid KV cache groups (sliding-window layers in their
        own groups, reading only their window): bf16 vs fp8 KV at 8K, bf16 KV at 32K

Per point also: preemptions, the recompute tax (prefilled tokens beyond the prompts, over the
prompts; below 0 where prefix hits saved more prompt tokens than preemption recomputed) and the
host tier's loaded tokens.

Writes simulate_h200.{json,md,png} to --out (default $OUT, else experiments/results).

    python experiments/simulate_h200.py            # every deployment (about 50 min on 2 cores)
    python experiments/simulate_h200.py --quick    # two rates of one, fewer requests
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from kvjax.accounting import budget as bud  # noqa: E402
from kvjax.benchmarks import serve as B  # noqa: E402
from kvjax.benchmarks.datasets import random_requests  # noqa: E402
from kvjax.config.engine import resolve_kv_dtype  # noqa: E402
from kvjax.config.presets import preset  # noqa: E402
from kvjax.experiments import results_dir  # noqa: E402
from kvjax.markdown import markdown_table  # noqa: E402
from kvjax.simulator.clock import simulate  # noqa: E402
from kvjax.simulator.cost import DEVICES, ModelCost, Roofline  # noqa: E402
from kvjax.simulator.deployment import scheduler_config  # noqa: E402
from kvjax.utils.output_files import save_figure, write_json, write_text  # noqa: E402
from kvjax.utils.plotting import pyplot  # noqa: E402
from kvjax.utils.strict_json import read_json_object  # noqa: E402

GiB = 1 << 30
SLO = {"p90_ttft_ms": 2000.0, "p90_tpot_ms": 100.0}
BLOCK = 16  # vLLM's block size on CUDA


@dataclasses.dataclass(frozen=True)
class Deployment:
    label: str
    preset: str
    kv: str  # kv cache dtype
    context: int  # max_model_len
    input_len: int
    output_len: int
    tp: int = 8
    weight_dtype: str = "fp8"
    rates: tuple = (2, 4, 8, 16, 32)
    requests: int = 120  # per point (a low rate's run is long: n / rate simulated seconds of steps)
    host_gib: int = 0  # a host tier over all ranks (vLLM's --kv-offloading-size); 0: none


DEPLOYMENTS = (
    Deployment("Llama-3-70B, 8K, bf16 KV", "llama-3-70b", "bf16", 8192, 3072, 512),
    Deployment("Llama-3-70B, 8K, fp8 KV", "llama-3-70b", "fp8", 8192, 3072, 512),
    Deployment("Llama-3-70B, 32K, bf16 KV", "llama-3-70b", "bf16", 32768, 16384, 1024, rates=(1, 2, 4, 8),
               requests=200),
    Deployment("Llama-3-70B, 32K, fp8 KV", "llama-3-70b", "fp8", 32768, 16384, 1024, rates=(1, 2, 4, 8),
               requests=200),
    Deployment("DeepSeek-V3, 8K, bf16 KV", "deepseek-v3", "bf16", 8192, 3072, 512),
    Deployment("DeepSeek-V3, 8K, fp8 KV", "deepseek-v3", "fp8", 8192, 3072, 512),
    # One H200 with hybrid groups: the most expensive points to simulate here (7 groups' block tables per step),
    # so fewer requests and rates.
    Deployment("Gemma-3-27B, 1 H200, 8K, bf16 KV", "gemma-3-27b", "bf16", 8192, 3072, 512, tp=1, weight_dtype="bf16",
               rates=(0.5, 2), requests=48),
    Deployment("Gemma-3-27B, 1 H200, 8K, fp8 KV", "gemma-3-27b", "fp8", 8192, 3072, 512, tp=1, weight_dtype="bf16",
               rates=(0.5, 2), requests=48),
    Deployment("Gemma-3-27B, 1 H200, 32K, bf16 KV", "gemma-3-27b", "bf16", 32768, 16384, 1024, tp=1,
               weight_dtype="bf16", rates=(0.125, 0.5), requests=24),
    Deployment("gpt-oss-120b, 1 H200, 8K, bf16 KV", "gpt-oss-120b", "bf16", 8192, 3072, 512, tp=1,
               weight_dtype="int4", rates=(1, 4), requests=48),
    Deployment("gpt-oss-120b, 1 H200, 8K, fp8 KV", "gpt-oss-120b", "fp8", 8192, 3072, 512, tp=1,
               weight_dtype="int4", rates=(1, 4), requests=48),
    Deployment("gpt-oss-120b, 1 H200, 32K, bf16 KV", "gpt-oss-120b", "bf16", 32768, 16384, 1024, tp=1,
               weight_dtype="int4", rates=(0.25, 1), requests=24),
    # The host tier where the pool fills (no tier: preemption from 4 req/s): 256 GiB and 1 TiB of host memory over
    # the 8 ranks (32 GiB each, 52,428 slots; 128 GiB, 209,715; an 8×H200 node has 2 TiB). Its index work per
    # offered block makes these the slowest points to simulate (1 TiB: about 5 minutes a point on one core), so
    # only the rates that preempt.
    Deployment("Llama-3-70B, 32K, bf16 KV, 256 GiB host tier", "llama-3-70b", "bf16", 32768, 16384, 1024,
               rates=(4, 8), requests=200, host_gib=256),
    Deployment("Llama-3-70B, 32K, bf16 KV, 1 TiB host tier", "llama-3-70b", "bf16", 32768, 16384, 1024,
               rates=(4, 8), requests=200, host_gib=1024),
)


def sized(d: Deployment):
    """(scheduler config, roofline, plan) of a deployment: kvjax plan's arithmetic, the roofline's model."""
    config = preset(d.preset)
    spec = config.kv_spec(resolve_kv_dtype(d.kv, config.dtype))
    weights = bud.weight_bytes(config.num_params, d.weight_dtype)
    pl = bud.plan(spec, context=d.context, block_size=BLOCK, total_bytes=141 * GiB, util=0.9, weights_bytes=weights,
                  tp=d.tp, host_offload_bytes=d.host_gib * GiB or None)
    sched = scheduler_config(pl, config.layer_windows, max_num_seqs=256, max_num_batched_tokens=8192)
    cost = Roofline(DEVICES["h200"], ModelCost.from_config(config, spec, weight_bytes=weights,
                                                          weight_dtype=d.weight_dtype, tp=d.tp))
    return sched, cost, pl


def point(d: Deployment, rate: float, n: int, seed: int = 0) -> dict:
    sched, cost, pl = sized(d)
    requests = random_requests(n, d.input_len, d.output_len, range_ratio=0.25, vocab_size=32000, seed=seed)
    arrivals = B.arrival_times(n, rate, 1.0, seed)
    sim = simulate(sched, [r.prompt_token_ids for r in requests], [r.expected_output_len for r in requests], arrivals,
                   cost.step_seconds, windows=preset(d.preset).layer_windows)
    res = sim.bench_result(("ttft", "tpot", "e2el"), (90,))
    prompts = sum(len(r.prompt_token_ids) for r in requests)
    prefilled = sum(s.features.prefill_tokens for s in sim.steps)
    return dict(rate=rate, blocks=sched.num_blocks, groups=len(sched.windows), host_blocks=sched.num_host_blocks,
                steps=len(sim.steps), preemptions=sim.preemptions,
                recompute_tax=round((prefilled - prompts) / prompts, 4),
                host_loaded_tokens=sum(s.features.loaded_tokens for s in sim.steps),
                peak_running=max(s.num_running for s in sim.steps),
                **{k: res[k] for k in ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p90_tpot_ms", "mean_e2el_ms",
                                       "output_throughput")})


def meets_slo(p: dict) -> bool:
    return all(p[k] <= v for k, v in SLO.items())


def render(res: dict) -> str:
    lines = ["# SIMULATED serving on H200s (kvjax simulate's roofline; predictions, not measurements)", "",
             f"`{res['command']}` ({res['seconds']} s on this CPU" + (f"; {res['note']}" if res.get("note") else "")
             + f"). {res['assumptions']}", "",
             f"SLO: p90 TTFT <= {SLO['p90_ttft_ms']:,.0f} ms and p90 TPOT <= {SLO['p90_tpot_ms']:,.0f} ms.", ""]
    summary = []
    for d in res["deployments"]:
        ok = [p["rate"] for p in d["points"] if meets_slo(p)]
        pre = [p["rate"] for p in d["points"] if p["preemptions"]]
        p0 = d["points"][0]
        pool = f"{p0['blocks']:,}" + (f" ({p0['groups']} groups)" if p0.get("groups", 1) > 1 else "") + (
            f" + {p0['host_blocks']:,} host" if p0.get("host_blocks") else "")
        summary.append([d["label"], pool, f"{max(ok)} req/s" if ok else "none",
                        f"{min(pre)} req/s" if pre else "none in the sweep"])
    lines += markdown_table(["deployment", "blocks per rank", "max rate meeting the SLO", "preemption from"],
                            summary, "lrll") + [""]
    for d in res["deployments"]:
        lines += [f"## {d['label']}", "", f"{d['requests']} requests per point. {d['cost_model']}", "",
                  *markdown_table(["req/s", "p90 TTFT ms", "p90 TPOT ms", "mean E2EL ms", "output tok/s", "preemptions",
                                   "recompute tax", "host-loaded tokens", "peak running", "SLO"],
                                  [[p["rate"], f"{p['p90_ttft_ms']:,.0f}", f"{p['p90_tpot_ms']:,.1f}",
                                    f"{p['mean_e2el_ms']:,.0f}", f"{p['output_throughput']:,.0f}", p["preemptions"],
                                    f"{p['recompute_tax']:.1%}", f"{p['host_loaded_tokens']:,}",
                                    p["peak_running"], "yes" if meets_slo(p) else "no"] for p in d["points"]],
                                  "rrrrrrrrrl"), ""]
        lines += _tier_buys(d, res["deployments"])
    return "\n".join(lines)


def _tier_buys(d: dict, deployments: list) -> list[str]:
    """What a host-tier deployment buys over the same one without a tier, rate by rate."""
    if not d["deployment"].get("host_gib"):
        return []
    base = d["label"].rsplit(", ", 1)[0]
    without = {p["rate"]: p for x in deployments if x["label"] == base for p in x["points"]}
    lines = [f"What the tier buys, against \"{base}\" at the same rates (same requests):", ""]
    for p in d["points"]:
        q = without.get(p["rate"])
        if q is not None:
            lines.append(f"- {p['rate']} req/s: preemptions {q['preemptions']} → {p['preemptions']}, recompute tax "
                         f"{q['recompute_tax']:.1%} → {p['recompute_tax']:.1%} ({p['host_loaded_tokens']:,} tokens "
                         f"loaded from host instead), p90 TTFT {q['p90_ttft_ms']:,.0f} → {p['p90_ttft_ms']:,.0f} ms, "
                         f"mean E2EL {q['mean_e2el_ms']:,.0f} → {p['mean_e2el_ms']:,.0f} ms, output "
                         f"{q['output_throughput']:,.0f} → {p['output_throughput']:,.0f} tok/s")
    if any(p["recompute_tax"] < 0 for p in d["points"]):
        lines += ["", "(A recompute tax below 0: prefix hits, on the device and in the host tier, saved more prompt "
                      "tokens than preemption made the engine compute again.)"]
    return lines + [""] if len(lines) > 2 else []


def plot(res: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for d in res["deployments"]:
        rates = [p["rate"] for p in d["points"]]
        axes[0].plot(rates, [p["p90_ttft_ms"] for p in d["points"]], marker="o", label=d["label"])
        axes[1].plot(rates, [p["p90_tpot_ms"] for p in d["points"]], marker="o", label=d["label"])
    for ax, key, name in ((axes[0], "p90_ttft_ms", "p90 TTFT (ms)"), (axes[1], "p90_tpot_ms", "p90 TPOT (ms)")):
        ax.axhline(SLO[key], color="grey", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
    axes[0].legend(fontsize=7)
    fig.suptitle("SIMULATED on H200s (kvjax simulate, roofline; 8 ranks unless labelled 1 H200): not measured")
    fig.tight_layout()
    save_figure(fig, path, "--out")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=None, help="requests per point (default: the deployment's)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default=None, metavar="TEXT,...",
                   help="the deployments whose label contains one of these (default: all)")
    p.add_argument("--skip", default=None, metavar="TEXT,...", help="leave out the deployments whose label contains one")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="combine simulate_h200.json files of runs in parts (--only / --skip) into one result, the "
                        "deployments in this script's order, a later file's deployment replacing an earlier's")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.merge:
        return write(merged(args.merge), args.out)
    t0 = time.perf_counter()
    deployments = DEPLOYMENTS[:1] if args.quick else DEPLOYMENTS
    if args.only:
        deployments = tuple(d for d in deployments if any(t in d.label for t in args.only.split(",")))
    if args.skip:
        deployments = tuple(d for d in deployments if not any(t in d.label for t in args.skip.split(",")))
    if not deployments:
        raise SystemExit(f"--only {args.only!r} --skip {args.skip!r}: no deployment left")
    out_rows = []
    for d in deployments:
        rates = d.rates[:2] if args.quick else d.rates
        n = 40 if args.quick else args.num_prompts or d.requests
        points = []
        for rate in rates:
            points.append(point(d, rate, n))
            print(f"{d.label} at {rate} req/s: p90 TTFT {points[-1]['p90_ttft_ms']:,.0f} ms, p90 TPOT "
                  f"{points[-1]['p90_tpot_ms']:,.1f} ms, preemptions {points[-1]['preemptions']}", flush=True)
        out_rows.append(dict(label=d.label, deployment=dataclasses.asdict(d), cost_model=sized(d)[1].describe(),
                             requests=n, points=points))
    res = dict(command="python experiments/simulate_h200.py" + (" --quick" if args.quick else "")
               + (f" --only {args.only!r}" if args.only else "") + (f" --skip {args.skip!r}" if args.skip else ""),
               assumptions="vLLM's random dataset (lengths ±25%; requests per point in each section), Poisson "
                           "arrivals; pools "
                           "from kvjax plan at 141 GiB × 0.9 per H200, blocks of 16, max_num_seqs 256, "
                           "max_num_batched_tokens 8,192, prefix caching on (vLLM's default); hybrid models in "
                           "vLLM's KV cache groups; the host tier's copies at PCIe Gen5's 64 GB/s each way, not "
                           "overlapped with the step; the roofline's 1 ms per step is assumed.",
               slo=SLO, deployments=out_rows, seconds=round(time.perf_counter() - t0, 1))
    return write(res, args.out)


def merged(paths) -> dict:
    """One result of parts run side by side: their deployments in DEPLOYMENTS' order (a later file's
    replacing an earlier's of the same label), their seconds summed, the parts' arguments in `parts`
    (a merged file's own parts carried over) and in a note."""
    parts = [read_json_object(path, "--merge") for path in paths]
    by_label = {d["label"]: d for part in parts for d in part["deployments"]}
    known = [d.label for d in DEPLOYMENTS]
    unknown = sorted(set(by_label) - set(known))
    if unknown:
        raise SystemExit(f"--merge: deployments {unknown} are not this script's (renamed or removed since the run)")
    runs = [run for p in parts for run in p.get("parts") or [
        p["command"].removeprefix("python experiments/simulate_h200.py").strip() or "all"]]
    note = "run here in parts side by side, their seconds summed: " + "; ".join(runs)
    missing = [x for x in known if x not in by_label]
    if missing:
        note += f"; not run: {', '.join(missing)}"
    return dict(parts[-1], command="python experiments/simulate_h200.py", note=note, parts=runs,
                deployments=[by_label[x] for x in known if x in by_label],
                seconds=round(sum(p["seconds"] for p in parts), 1))


def write(res: dict, out_dir) -> dict:
    out = results_dir(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "simulate_h200.json", res, "--out")
    write_text(out / "simulate_h200.md", render(res) + "\n", "--out")
    plot(res, out / "simulate_h200.png")
    print(f"wrote {out / 'simulate_h200.md'}")
    return res


if __name__ == "__main__":
    main()
