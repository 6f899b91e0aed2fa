"""The GPU check's one page: every figure experiments/gpu_check.sh measured, beside its target.

Reads the step outputs in a work folder (device_peaks.json, kernel_tests_*.xml, kernel_bench.md,
gpu_model_bench*.json, step_profile.json, memory.json) and the steps' status table, and writes
summary.md. Targets are issue 52's and 53's acceptance points: a decode step at batch 32 and 128
within 1.25× of its roofline and ahead of transformers at every batch, prefill tokens/s at least
transformers', fp8 KV faster than bf16 at 8K, the Mosaic GPU decode kernel at ≥ 85% of the read
bandwidth, KV measured / analytic within 0.1%. A missing input leaves its section saying so.

    python -m kvjax.experiments.gpu_summary WORK_DIR --status status.tsv --out DIR
"""
from __future__ import annotations

import argparse
import json
import pathlib
import xml.etree.ElementTree as ET

from kvjax.markdown import markdown_table
from kvjax.utils.output_files import write_text


def _load(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _f(x, fmt=",.2f") -> str:
    return "—" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def _key(row: dict) -> tuple:
    return row.get("kind"), row.get("batch"), row.get("context")


def model_section(model: dict | None, hf: dict | None, cb: dict | None) -> list[str]:
    if not model:
        return ["No whole-model results (the `model` step did not write gpu_model_bench.json)."]
    peaks = model.get("peaks") or {}
    hf_rows = {_key(r): r for r in (hf or {}).get("rows", []) if "error" not in r}
    cb_rows = {(r.get("case")): r for r in (cb or {}).get("rows", []) if "error" not in r}
    lines = [f"{model['model']} ({model['layers']} layers, random bf16 weights, {model['weight_bytes'] / 1e9:.2f} GB; "
             f"init {model['init_s']:.1f} s) on {model['device']}, jax {model['jax']}. Roofline: bytes a step reads / "
             f"{_f(peaks.get('read_gb_s'), ',.0f')} GB/s; prefill: FLOPs / {_f(peaks.get('matmul_tflop_s'), ',.0f')} "
             "TFLOP/s. Targets: decode ≤ 1.25× roofline at B 32 and 128 (bf16), faster than transformers at every "
             "batch; prefill tok/s ≥ transformers'. (Batch 128 at 8K runs with fp8 KV only: its bf16 pages "
             "would be 128 × 8,192 tokens × 128 KiB = 137 GB beside 16 GB of weights, more than the card holds.)", ""]
    rows = []
    for r in model["rows"]:
        if "error" in r:
            rows.append([r["case"], "—", "—", "—", "—", "—", r["error"][:60]])
            continue
        t = hf_rows.get(_key(r)) if r.get("impl") == "pallas" and r.get("kv") == "bf16" else None
        if r["kind"] == "decode":
            ours, theirs = r["step_ms"], t and t.get("step_ms")
            cb = cb_rows.get(r["case"])
            note = f"with KVJAX_XLA_FLAGS=1 {cb['step_ms']:.2f} ms" if cb else ""
            rows.append([r["case"], _f(ours), _f(r["roofline_ms"]), _f(r["vs_roofline"]), _f(theirs),
                         _f(theirs / ours if theirs else None), note])
        else:
            ours, theirs = r["ttft_ms"], t and t.get("ttft_ms")
            rows.append([r["case"], _f(ours), _f(r["roofline_ms"]), _f(r["vs_roofline"]), _f(theirs),
                         _f(theirs / ours if theirs else None),
                         f"{r['prefill_tok_s']:,.0f} tok/s" + (f" (transformers {t['prefill_tok_s']:,.0f})" if t else "")])
    lines += markdown_table(["case (kind:B:context:KV:attention:K)", "kvjax ms (step / TTFT)", "roofline ms",
                             "× roofline", "transformers ms", "transformers / kvjax", "note"], rows, "lrrrrrl")
    bf16 = {(r["batch"], r["context"]): r for r in model["rows"]
            if r.get("kind") == "decode" and r.get("kv") == "bf16" and r.get("impl") == "pallas" and "error" not in r}
    fp8 = [r for r in model["rows"] if r.get("kind") == "decode" and r.get("kv", "").startswith("fp8") and "error" not in r]
    for r in fp8:
        b = bf16.get((r["batch"], r["context"]))
        if b:
            lines += ["", f"fp8 vs bf16 KV at B {r['batch']}, context {r['context']}: {b['step_ms']:.2f} → "
                          f"{r['step_ms']:.2f} ms a step ({b['step_ms'] / r['step_ms']:.2f}× faster; target > 1)."]
    return lines


def profile_section(profile: dict | None) -> list[str]:
    if not profile:
        return ["No profile."]
    s = profile["steps"]
    lines = [f"{s} decode steps traced: kernels by kind, ms per step (the trace slows the host; read the kernel "
             "times, not the span):", ""]
    lines += markdown_table(["kind", "ms / step"], [[k, f"{v / s:.3f}"] for k, v in profile["kernel_ms_by_kind"].items()],
                            "lr")
    stream = next((t for t in profile["top"] if t.lower().startswith("stream")), None)
    if stream:
        lines += ["", "Top kernels:", ""]
        lines += markdown_table(["kernel", "calls", "ms / step"],
                                [[x["name"][:80], str(x["calls"]), f"{x['ms_per_step']:.3f}"]
                                 for x in profile["top"][stream][:12]], "lrr")
    return lines


def tests_section(work: pathlib.Path) -> list[str]:
    lines = []
    for xml_path in sorted(work.glob("kernel_tests*.xml")):
        try:
            root = ET.parse(xml_path).getroot()
        except (OSError, ET.ParseError):
            continue
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        failed = [c.get("name") for c in root.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
        lines.append(f"{xml_path.stem}: {suite.get('tests')} run, {suite.get('failures')} failed, {suite.get('errors')} "
                     f"errors, {suite.get('skipped')} skipped in {float(suite.get('time', 0)):.0f} s (target: none failed)"
                     + (". Failed: " + ", ".join(failed[:8]) if failed else "."))
    return lines or ["No compiled kernel test results."]


def moe_section(work: pathlib.Path) -> list[str]:
    lines = []
    for stem in ("gpu_model_bench_moe.json", "gpu_model_bench_moe_mla.json", "gpu_model_bench_70b.json"):
        r = _load(work / stem)
        if not r:
            continue
        rows = [[x["case"], _f(x.get("step_ms", x.get("ttft_ms"))), _f(x.get("roofline_ms")), _f(x.get("vs_roofline")),
                 x.get("error", "")[:60]] for x in r["rows"]]
        lines += ["", f"{r['model']}, {r['layers']} layers:", ""]
        lines += markdown_table(["case", "step / TTFT ms", "roofline ms", "× roofline", "error"], rows, "lrrrl")
    return lines or ["No MoE or 70B results."]


def simulator_section(model: dict | None) -> list[str]:
    """`kvjax simulate`'s step cost against this run's steps (experiments/simulate_gpu_fit.py: fitted on
    batch 32's cases, the others held back and predicted)."""
    from kvjax.experiments import simulate_gpu_fit

    rows = [r for r in (model or {}).get("rows", []) if "error" not in r]
    if not rows or not (model.get("peaks") or {}).get("read_gb_s"):
        return ["No simulator check (it needs the `model` step's cases and the `peaks` step's ceilings)."]
    try:
        text = simulate_gpu_fit.render(simulate_gpu_fit.evaluate(model))
    except Exception as e:  # noqa: BLE001  the summary must still be written
        return [f"The simulator check failed: {type(e).__name__}: {str(e)[:200]}"]
    return text.split("\n", 2)[2].strip().splitlines()  # its table without its title


def memory_section(mem: dict | None) -> list[str]:
    if not mem:
        return ["No memory results."]
    ratio = mem.get("kv_measured_over_analytic")
    return [f"kvjax memory on {mem.get('model', '?')}: KV measured / analytic {_f(ratio, '.6f')} (target within 0.1%), "
            f"{mem.get('num_blocks', '?')} blocks, profiled non-KV {mem.get('non_kv_bytes', 0) / 2**30:.2f} GiB."]


def summarise(work: pathlib.Path, status: pathlib.Path | None) -> str:
    peaks = _load(work / "device_peaks.json")
    lines = ["# kvjax GPU check", ""]
    if peaks:
        lines += [f"{peaks['device']}: read {peaks['read_gb_s']:,.0f} GB/s, copy (read + write) {peaks['copy_gb_s']:,.0f} "
                  f"GB/s over {peaks['array_bytes'] / 2**30:.1f} GiB; bf16 matmul {peaks['matmul_n']}³ "
                  f"{peaks['matmul_tflop_s']:,.0f} TFLOP/s (jax {peaks['jax']}).", ""]
    if status and status.exists():
        rows = [line.split("\t") for line in status.read_text().splitlines()[1:] if line.strip()]
        lines += ["## Steps", ""] + markdown_table(["step", "exit", "seconds", "limit"], rows, "lrrr") + [""]
    lines += ["## Whole model", ""] + model_section(_load(work / "gpu_model_bench.json"),
                                                     _load(work / "gpu_model_bench_transformers.json"),
                                                     _load(work / "gpu_model_bench_cb.json"))
    lines += ["", "## Where a decode step's time goes", ""] + profile_section(_load(work / "step_profile.json"))
    lines += ["", "## Kernels", ""] + tests_section(work)
    bench = work / "kernel_bench.md"
    if bench.exists():
        lines += ["", bench.read_text().strip()]
    lines += ["", "## The simulator against this run", ""] + simulator_section(_load(work / "gpu_model_bench.json"))
    lines += ["", "## MoE and Llama-3-70B slices"] + moe_section(work)
    lines += ["", "## Memory", ""] + memory_section(_load(work / "memory.json"))
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("work")
    p.add_argument("--status", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = summarise(pathlib.Path(args.work), pathlib.Path(args.status) if args.status else None)
    write_text(out / "summary.md", text, "--out")
    return text


if __name__ == "__main__":
    main()
