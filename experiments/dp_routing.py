"""Data-parallel routing, prefix-aware against load-only, in one run: `kvjax bench serve` on the same
shared-prefix workload twice, in this process, with two engine replicas behind one front end
(kvjax.engine.data_parallel.DPAsyncLLM), once with --data-parallel-routing prefix (kvjax's default: a request
goes to the replica that may hold its first block unless that replica is a full batch busier) and once with
--data-parallel-routing load (vLLM's coordinator: the least loaded replica, idle ones in turn).

The workload is bench serve's prefix_repetition dataset: --num-prefixes shared prefixes, each request one of
them plus a unique suffix. Each replica's pool is sized (--blocks) to hold about half of the prefixes: routed by
load, both replicas see every prefix and evict one another's; routed by prefix, each keeps its own. Reported per
routing, from bench serve's result: the prefix cache hit rate (prompt tokens the cache held when each request
was first scheduled, over all prompt tokens), mean and median TTFT, output throughput, and the split of the
requests over the replicas.

    python -m kvjax.experiments.dp_routing [--num-prompts 96] [--blocks 80] [--out DIR]

Writes dp_routing.json and dp_routing.md to --out (default $OUT, else experiments/results). On CPU it asks JAX
for 2 host devices (one per replica) before JAX starts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import tempfile
import time

from kvjax.experiments import results_dir
from kvjax.markdown import markdown_table
from kvjax.utils.output_files import write_json, write_text

ROUTINGS = ("prefix", "load")


def bench_argv(args, routing: str, result_file: str) -> list[str]:
    """The `kvjax bench serve` command of one routing (the same workload and engine for both)."""
    return ["bench", "serve", "--model", args.model, "--data-parallel-size", "2", "--data-parallel-routing", routing,
            "--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len",
            str(args.suffix_len), "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
            "--max-concurrency", str(args.max_concurrency), "--block-size", "16",
            "--num-gpu-blocks-override", str(args.blocks), "--max-num-seqs", str(args.max_concurrency),
            "--seed", "0", "--num-warmups", "2", "--disable-tqdm", "--save-result", result_file]


def _bench(cli, command: list[str]) -> dict:
    """Run `kvjax bench serve` in this process (its table on stdout) → its saved result."""
    if cli.main(command):
        raise SystemExit(f"kvjax {shlex.join(command)} failed")
    with open(command[-1], encoding="utf-8") as f:
        return json.load(f)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small-gqa")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=160)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--request-rate", type=float, default=8.0)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=80, help="each replica's KV blocks of 16 tokens (80: about half "
                                                           "of the 8 prefixes of 10 blocks, beside the running requests)")
    ap.add_argument("--out", default=None, help="output dir (default $OUT, else ./experiments/results)")
    args = ap.parse_args(argv)
    import jax

    if (os.environ.get("JAX_PLATFORMS") or "cpu") == "cpu":
        jax.config.update("jax_num_cpu_devices", 2)  # one host device per replica
    from kvjax.commands import main as cli

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        for routing in ROUTINGS:  # unmeasured: compile every program both routings run, so neither pays for it
            _bench(cli, bench_argv(args, routing, path))
        for routing in ROUTINGS:
            command = bench_argv(args, routing, path)
            start = time.time()
            result = _bench(cli, command)
            runs[routing] = {"command": "kvjax " + shlex.join(command[:-2]), "wall_s": round(time.time() - start, 1),
                             **{k: result.get(k) for k in ("completed", "prefix_cache_hit_rate", "prompt_tokens_cached",
                                                            "total_input_tokens", "mean_ttft_ms", "median_ttft_ms",
                                                            "p99_ttft_ms", "output_throughput", "routed")}}
    result = {"experiment": "dp_routing", "args": vars(args), "platform": platform.platform(),
              "devices": [str(d) for d in jax.devices()], "runs": runs}
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "dp_routing.json", result, "--out", indent=1)
    write_text(out / "dp_routing.md", render(result), "--out")
    print(render(result))
    return result


def render(result: dict) -> str:
    runs = result["runs"]
    rows = [[r, f"{v['prefix_cache_hit_rate']:.3f}", f"{v['mean_ttft_ms']:.1f}", f"{v['median_ttft_ms']:.1f}",
             f"{v['output_throughput']:.1f}", " / ".join(map(str, v["routed"] or [])), v["completed"]]
            for r, v in runs.items()]
    table = markdown_table(["routing", "prefix cache hit rate", "mean TTFT ms", "median TTFT ms", "output tok/s",
                            "requests per replica", "completed"], rows)
    a = result["args"]
    return "\n".join([
        "# Data-parallel routing: prefix-aware vs load-only (one run)", "",
        f"Two replicas of {a['model']} behind one front end, {a['blocks']} blocks of 16 tokens each; "
        f"{a['num_prompts']} requests of one of {a['num_prefixes']} shared {a['prefix_len']}-token prefixes plus a "
        f"{a['suffix_len']}-token suffix, {a['output_len']} tokens out, {a['request_rate']:g} req/s, at most "
        f"{a['max_concurrency']} in flight. Devices: {', '.join(result['devices'])}. Every program was compiled by an "
        "unmeasured run of both routings first; then the measured runs in the order listed. Hit rate: prompt tokens the "
        "prefix cache held when each request was first scheduled, over all prompt tokens; requests per replica: the "
        "router's split, bench serve's 2 warm-up requests included.", "", *table, "",
        "Commands (run one after the other by `python -m kvjax.experiments.dp_routing`, in one process):", "",
        *[f"    {v['command']}" for v in runs.values()], ""])


if __name__ == "__main__":
    main()
