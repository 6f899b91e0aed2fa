"""`kvjax accuracy`: quantized KV variants against bf16 on held-out text (kvjax.accuracy).

    kvjax accuracy --model small-gqa
    kvjax accuracy --model small-mla --outlier-channels --out results/

Writes accuracy_<model>[_outliers].json, .md and .png to --out and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os

from kvjax.data import CALIB, HELDOUT

DEFAULT_OUT = "results"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="small-gqa", help="small-gqa | small-mla | a Hugging Face folder")
    ap.add_argument("--data", default=HELDOUT, help="held-out text (default: the shipped stdlib held-out split)")
    ap.add_argument("--calib", default=CALIB, help="calibration text (default: the shipped calibration excerpt)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--outlier-channels", action="store_true", help="inflate K channels 0 and 5 (and RoPE partners)")
    ap.add_argument("--outlier-factor", type=float, default=200.0)
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT}/)")


def add_parser(sub) -> None:
    p = sub.add_parser("accuracy", help="fp8 / int8 KV against bf16: perplexity, KL, agreement",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in res["results"] if r["variant"] != "bf16"]
    names = [r["variant"] for r in rs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].barh(names, [max(r["kl_vs_bf16"], 1e-12) for r in rs], color="tab:blue")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("mean KL(bf16 ‖ variant), nats")
    axes[1].barh(names, [100 * (1 - r["top1_agreement"]) for r in rs], color="tab:orange")
    axes[1].set_xlabel("top-1 disagreement with bf16 (%)")
    axes[1].set_yticks([])
    fig.suptitle(f"{res['model']}: quantized KV vs bf16" + (" (outlier K channels)" if res["outlier_channels"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(res: dict, out_dir: str) -> dict:
    """accuracy_<model>[_outliers].{json,md,png} in out_dir; returns their paths."""
    from kvjax.accuracy import markdown

    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"accuracy_{os.path.basename(res['model'].rstrip('/'))}"
                        + ("_outliers" if res["outlier_channels"] else ""))
    paths = {"json": stem + ".json", "md": stem + ".md", "png": stem + ".png"}
    with open(paths["json"], "w") as fh:
        json.dump(res, fh, indent=2)
    with open(paths["md"], "w") as fh:
        fh.write(markdown(res))
    plot(res, paths["png"])
    return paths


def run_from_args(args) -> dict:
    from kvjax.accuracy import evaluate

    for name in ("seq_len", "max_windows", "prompts", "decode_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    res = evaluate(args.model, args.data, args.calib, seq_len=args.seq_len, max_windows=args.max_windows,
                   prompts=args.prompts, decode_tokens=args.decode_tokens, outlier_channels=args.outlier_channels,
                   outlier_factor=args.outlier_factor)
    res["outputs"] = write_outputs(res, args.out)
    return res


def run(args) -> int:
    from kvjax.accuracy import markdown

    res = run_from_args(args)
    print(json.dumps(res, indent=2) if args.json else markdown(res) + "\nwrote " + ", ".join(res["outputs"].values()))
    return 0
