"""Where a step's time goes, without hardware counters: a `jax.profiler` trace, summarised.

`jax.profiler.trace(DIR)` writes DIR/plugins/profile/<run>/<host>.trace.json.gz (Chrome trace
events). On a GPU its device process holds one thread per CUDA stream (the kernels, by name)
and XLA's "XLA Ops" / "XLA Modules" threads (the HLO op each kernel came from, and each
executable run); the host process holds Python's and the runtime's threads. This summarises:

* per device thread, the events with the most total time (name, calls, total ms, ms per step);
* the device's busy time — the union of the kernels' intervals on its stream threads — against
  the span from the first to the last kernel: the rest is the device waiting on the host
  (launch gaps, the host's work between calls);
* the kernels grouped by kind (matmul, attention kernel, fusion, copy/memset, sort, other), so a
  decode step's split between GEMMs, attention and everything else reads at a glance.

    python -m kvjax.experiments.step_profile TRACE_DIR [--steps N] [--out DIR]   # step_profile.{json,md}

experiments/gpu_model_bench.py --profile calls `summarise` on the decode calls it traced.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re

from kvjax.experiments import results_dir
from kvjax.markdown import markdown_table
from kvjax.utils.output_files import write_json, write_text

TOP = 20
_KINDS = (("matmul", re.compile(r"gemm|cublas|cutlass|matmul|dot|sm90_xmma|nvjet|wgmma", re.I)),
          ("attention", re.compile(r"paged|ragged|decode|attention|mosaic|_gqa|_mla|pallas", re.I)),
          ("sort/top-k", re.compile(r"sort|topk|top_k|radix", re.I)),
          ("copy/memset", re.compile(r"memcpy|memset|copy|dynamic.update.slice|scatter", re.I)),
          ("reduce", re.compile(r"reduce|reduction", re.I)),
          ("fusion", re.compile(r"fusion|loop_|input_", re.I)))


def kind_of(name: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def load(trace_dir: str | pathlib.Path) -> dict:
    files = sorted(pathlib.Path(trace_dir).glob("plugins/profile/*/*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}/plugins/profile")
    with gzip.open(files[-1], "rb") as fh:
        return json.load(fh)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise(trace_dir: str | pathlib.Path, out: str | pathlib.Path | None = None, steps: int = 1) -> dict:
    """The summary dict (and step_profile.json / .md in `out` when given)."""
    trace = load(trace_dir)
    events = trace.get("traceEvents", [])
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    device = {pid for pid, name in procs.items() if "/device:" in name and "CPU" not in name}
    per_thread = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    kernels, by_kind = [], collections.defaultdict(float)
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device:
            continue
        thread = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        cell = per_thread[thread][e["name"]]
        cell[0] += 1
        cell[1] += e.get("dur", 0.0) / 1e3
        if thread.lower().startswith("stream"):
            kernels.append((e["ts"], e["ts"] + e.get("dur", 0.0)))
            by_kind[kind_of(e["name"])] += e.get("dur", 0.0) / 1e3
    busy = _union(kernels) / 1e3
    span = (max(b for _, b in kernels) - min(a for a, _ in kernels)) / 1e3 if kernels else 0.0
    result = {"steps": steps, "device_threads": sorted(per_thread), "busy_ms": busy, "span_ms": span,
              "busy_fraction": busy / span if span else None,
              "kernel_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
              "top": {t: [{"name": n, "calls": c, "total_ms": ms, "ms_per_step": ms / steps}
                          for n, (c, ms) in sorted(cells.items(), key=lambda kv: -kv[1][1])[:TOP]]
                      for t, cells in per_thread.items()}}
    if out is not None:
        out = pathlib.Path(out)
        write_json(out / "step_profile.json", result, "--out", indent=1)
        write_text(out / "step_profile.md", markdown(result), "--out")
    return result


def markdown(r: dict) -> str:
    lines = ["# Where the decode step's time goes (jax.profiler trace)", "",
             f"{r['steps']} steps traced; device busy {r['busy_ms']:.2f} ms of a {r['span_ms']:.2f} ms span "
             f"({(r['busy_fraction'] or 0) * 100:.1f}%): the rest the device waited on the host.", "",
             "Kernel time by kind (ms per step):", ""]
    lines += markdown_table(["kind", "ms / step"], [[k, f"{v / r['steps']:.3f}"] for k, v in r["kernel_ms_by_kind"].items()],
                            "lr")
    for thread, rows in r["top"].items():
        lines += ["", f"## {thread}", ""]
        lines += markdown_table(["name", "calls", "ms / step"],
                                [[x["name"][:90], str(x["calls"]), f"{x['ms_per_step']:.3f}"] for x in rows], "lrr")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace_dir")
    p.add_argument("--steps", type=int, default=1, help="steps in the trace (per-step columns divide by it)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = summarise(args.trace_dir, out, args.steps)
    print(markdown(r))
    return r


if __name__ == "__main__":
    main()
