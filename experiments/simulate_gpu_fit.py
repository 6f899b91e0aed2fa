"""`kvjax simulate`'s step cost against the steps measured on an H200 (issue 52, part 5).

Input: experiments/gpu_model_bench.py's JSON from a GPU run (the engine's decode steps at batch
B and context S, and prefill steps of B prompts; Llama-3-8B's shapes, random weights). Each
measured case becomes the simulator's StepFeatures (a decode step of B rows ending at S; a prefill
step of B × S tokens) and is predicted three ways:

* datasheet roofline — kvjax.simulator.cost.Roofline with the `h200` preset (4.8 TB/s, 989 TFLOP/s
  dense bf16, 1 ms overhead assumed): what `kvjax simulate --device h200` and the 8×H200
  predictions (experiments/simulate_h200.py) use;
* measured roofline — the same formula with the bandwidth and matmul rate the run measured
  (experiments/device_peaks.py) and its overhead per step fitted: the median of (measured −
  roofline) over the fitting decode cases;
* fitted profile — kvjax.simulator.cost.FittedProfile over three of the plan's features (a
  constant, prefill tokens, context tokens: a handful of cases cannot pin down all five of
  FEATURES, and in these the other two move with them), least squares on the fitting cases.

The fitting cases are batch 32's (decode at 512 and 8K, prefill 32 × 512); every other case is held
back and only predicted: the table gives each case's error and the mean absolute error over the
held-back ones. Writes simulate_gpu_fit.{json,md} to --out.

    python -m kvjax.experiments.simulate_gpu_fit experiments/results/gpu/run2/gpu_model_bench.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics

import numpy as np

from kvjax.experiments import results_dir
from kvjax.markdown import markdown_table
from kvjax.simulator.cost import DEVICES, Device, FittedProfile, ModelCost, Roofline, StepFeatures
from kvjax.utils.output_files import write_json, write_text

FIT_FEATURES = ("1", "prefill_tokens", "context_tokens")


def features(row: dict) -> StepFeatures:
    b, s = row["batch"], row["context"]
    if row["kind"] == "decode":
        return StepFeatures.decoding([s] * b)
    pairs = b * s * (s + 1) // 2
    return StepFeatures(b, b * s, 0, b * s, pairs)


def model_cost(result: dict, kv: str) -> ModelCost:
    from kvjax.config.presets import preset

    config = preset(result["model"]).replace(num_layers=result["layers"])
    return ModelCost.from_config(config, config.kv_spec(kv), weight_bytes=result["weight_bytes"])


def seconds(row: dict) -> float:
    return (row["step_ms"] if row["kind"] == "decode" else row["ttft_ms"]) / 1e3


def fit_cases(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    fit = [r for r in rows if r["batch"] == 32 and r.get("impl") == "pallas" and r.get("k", 8) == 8]
    return fit, [r for r in rows if r not in fit]


def evaluate(result: dict) -> dict:
    rows = [r for r in result["rows"] if "error" not in r and not str(r.get("impl", "")).startswith("no-")
            and r.get("k", 8) == 8 and r["kind"] in ("decode", "prefill")]
    fit, held = fit_cases(rows)
    peaks = result["peaks"]
    sheet = DEVICES["h200"]
    measured = dataclasses.replace(sheet, name="H200 (measured)", hbm_bytes_per_s=peaks["read_gb_s"] * 1e9,
                                   bf16_flops=peaks["matmul_tflop_s"] * 1e12,
                                   source="experiments/device_peaks.py on the run's H200")
    costs = {r["kv"]: model_cost(result, r["kv"]) for r in rows}

    def roof(device: Device, r: dict, overhead: float) -> float:
        return Roofline(device, costs[r["kv"]], overhead).step_seconds(features(r))

    fit_decode = [seconds(r) - roof(measured, r, 0.0) for r in fit if r["kind"] == "decode"]
    overhead = statistics.median(fit_decode) if fit_decode else 0.0  # no batch-32 decode case: none fitted
    profile = FittedProfile.fit([(features(r), seconds(r)) for r in fit], FIT_FEATURES) if len(fit) >= 3 else None
    table = []
    for r in rows:
        t = seconds(r)
        preds = {"datasheet": roof(sheet, r, 1e-3), "measured_roofline": roof(measured, r, max(overhead, 0.0))}
        if profile:
            preds["fitted_profile"] = profile.step_seconds(features(r))
        table.append({"case": r["case"], "held_back": r in held, "measured_s": t, "predicted_s": preds,
                      "error": {k: v / t - 1 for k, v in preds.items()}})
    mae = {k: float(np.mean([abs(x["error"][k]) for x in table if x["held_back"]])) if held else None
           for k in table[0]["predicted_s"]} if table else {}
    return {"model": result["model"], "layers": result["layers"], "device": result["device"], "peaks": peaks,
            "fit_cases": [r["case"] for r in fit], "overhead_s": overhead,
            "profile": profile.to_json() if profile else None, "rows": table, "held_back_mean_abs_error": mae}


def render(r: dict) -> str:
    names = list(r["rows"][0]["predicted_s"]) if r["rows"] else []
    lines = [f"# The simulator's step cost against {r['device']} ({r['model']}, {r['layers']} layers)", "",
             f"Fitted on {', '.join(r['fit_cases']) or 'no case (none at batch 32)'}; the other cases held back. Measured roofline: "
             f"{r['peaks']['read_gb_s']:,.0f} GB/s, {r['peaks']['matmul_tflop_s']:,.0f} TFLOP/s, overhead "
             f"{r['overhead_s'] * 1e3:.2f} ms a step (fitted). Datasheet: 4,800 GB/s, 989 TFLOP/s, 1 ms.", ""]
    rows = [[x["case"] + (" (held back)" if x["held_back"] else ""), f"{x['measured_s'] * 1e3:.2f}",
             *[f"{x['predicted_s'][n] * 1e3:.2f} ({x['error'][n]:+.0%})" for n in names]] for x in r["rows"]]
    lines += markdown_table(["case", "measured ms", *[f"{n} ms (error)" for n in names]], rows, "lr" + "r" * len(names))
    lines += ["", "Mean absolute error over the held-back cases: " + ", ".join(
        f"{n} {v:.0%}" for n, v in r["held_back_mean_abs_error"].items() if v is not None)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench_json", help="gpu_model_bench.json of a GPU run")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    r = evaluate(json.loads(pathlib.Path(args.bench_json).read_text()))
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "simulate_gpu_fit.json", r, "--out", indent=1)
    write_text(out / "simulate_gpu_fit.md", render(r), "--out")
    print(render(r))
    return r


if __name__ == "__main__":
    main()
