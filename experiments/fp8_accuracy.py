"""How much accuracy does a quantized KV cache cost against bf16, and how much do scales win back?

For one model and one held-out text, every variant below runs the same teacher-forced windows
and the same greedy decodes through the paged cache; only the cache's dtype and scales change:

    bf16                          the baseline (what vLLM stores with kv_cache_dtype auto, bf16 model)
    fp32                          a control: wider than the baseline, so its distance is rounding only
    fp8_e4m3 unit                 vLLM's default `--kv-cache-dtype fp8`: every scale 1.0
    fp8_e4m3 per_tensor           one calibrated scale per layer for K and for V (amax / 448)
    fp8_e4m3 per_head             one calibrated scale per layer per kv head
    fp8_e5m2 unit                 the wider-range, coarser format at scale 1.0
    int8_per_token_head           a scale per token per head, computed at write time
    fp8_e4m3 per_tensor skip 0,L-1  the first and last layers kept in bf16 (the model dtype in vLLM)

Metrics per variant: perplexity per token, mean KL(bf16 ‖ variant) of the next-token
distributions, top-1 agreement with bf16, and greedy-decode agreement (tokens until the first
divergence from bf16's continuation, over N prompts). `--outlier-channels` inflates a few cached
K channels (models.stress, the function is unchanged) to mimic the outliers of large models.

    python -m experiments.fp8_accuracy --model small-gqa
    kvjax accuracy --model small-mla --outlier-channels
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import corpus
from kvjax.cache import PagedCache
from kvjax.commands.calibrate import calibrate
from kvjax.commands.common import load_model, read_tokens, resolve_model, windows
from models.generate import greedy_generate
from models.scoring import sequence_logits

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def variants(num_layers: int) -> list[dict]:
    return [
        dict(name="bf16", kv_dtype="bf16"),
        dict(name="fp32", kv_dtype="fp32"),
        dict(name="fp8_e4m3 unit", kv_dtype="fp8_e4m3", mode="unit"),
        dict(name="fp8_e4m3 per_tensor", kv_dtype="fp8_e4m3", mode="per_tensor"),
        dict(name="fp8_e4m3 per_head", kv_dtype="fp8_e4m3", mode="per_head"),
        dict(name="fp8_e5m2 unit", kv_dtype="fp8_e5m2", mode="unit"),
        dict(name="int8_per_token_head", kv_dtype="int8_per_token_head"),
        dict(name=f"fp8_e4m3 per_tensor skip 0,{num_layers - 1}", kv_dtype="fp8_e4m3", mode="per_tensor",
             skip=(0, num_layers - 1)),
    ]


def _scales(v: dict, calibrated: dict, config):
    if v.get("mode", "unit") == "unit":
        return None  # no scales: the cache's default, vLLM's 1.0 everywhere
    key = (v["kv_dtype"], v["mode"])
    if key not in calibrated:
        calibrated[key] = calibrate(config, *calibrated["_model"], calibrated["_windows"], v["kv_dtype"], v["mode"])
    return calibrated[key]


def evaluate(model_name: str, data: str | None = None, calib: str | None = None, *, seq_len: int = 256,
             max_windows: int = 32, prompts: int = 8, prompt_len: int = 64, decode_tokens: int = 32,
             outlier_channels: bool = False, outlier_factor: float = 200.0, block_size: int = 16) -> dict:
    """Run every variant; returns the results dict that `write_outputs` turns into files."""
    start = time.time()
    config, model, params = load_model(model_name)
    folder = resolve_model(model_name)
    data = data or corpus.HELDOUT
    calib = calib or corpus.CALIB
    if outlier_channels:
        from models.stress import inflate_k_channels
        params = jax.tree_util.tree_map(jnp.asarray, inflate_k_channels(config, params, (0, 5), outlier_factor))
    tokens = read_tokens(folder, data)
    eval_windows = jnp.asarray(windows(tokens, seq_len, max_windows))
    calib_windows = windows(read_tokens(folder, calib), seq_len, max_windows)
    # greedy prompts: from the held-out text after the scored windows (or its start if short)
    rest = tokens[len(eval_windows) * seq_len:]
    rest = rest if len(rest) >= prompts * prompt_len else tokens
    prompt_list = [rest[i * prompt_len:(i + 1) * prompt_len].tolist() for i in range(prompts)]
    calibrated = {"_model": (model, params), "_windows": calib_windows}

    results, base_logp, base_greedy = [], None, None
    for v in variants(config.num_layers):
        # skipped layers stay at the baseline's bf16 (vLLM keeps them in the model dtype, bf16 there)
        spec = config.kv_spec(v["kv_dtype"], skip_layers=v.get("skip", ())).replace(model_dtype="bf16")
        scales = _scales(v, calibrated, config)
        make_cache = lambda n, z, spec=spec, scales=scales: PagedCache.create(spec, n, z, scales)  # noqa: E731
        score = jax.jit(lambda p, t, spec=spec, mk=make_cache: jax.nn.log_softmax(
            sequence_logits(model, p, t, spec, block_size, mk), axis=-1))
        logp = jnp.concatenate([score(params, eval_windows[i:i + 8]) for i in range(0, len(eval_windows), 8)])
        logp = logp[:, :-1]  # [W, S-1, V] predicting tokens 1..S-1
        target = eval_windows[:, 1:]
        nll = float(-jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1)))
        greedy = greedy_generate(model, params, prompt_list, decode_tokens, spec, block_size, scales)
        if base_logp is None:
            base_logp, base_greedy = logp, greedy
        kl = float(jnp.mean(jnp.sum(jnp.exp(base_logp) * (base_logp - logp), axis=-1)))
        top1 = float(jnp.mean(jnp.argmax(logp, -1) == jnp.argmax(base_logp, -1)))
        same = greedy == base_greedy
        until = np.where(same.all(1), decode_tokens, np.argmin(same, axis=1))
        results.append(dict(variant=v["name"], kv_dtype=v["kv_dtype"], scale_mode=v.get("mode", "-"),
                            skip_layers=list(v.get("skip", ())), bytes_per_token=spec.bytes_per_token,
                            perplexity=math.exp(nll), nll=nll, kl_vs_bf16=max(kl, 0.0), top1_agreement=top1,
                            greedy_tokens_until_divergence=float(until.mean()),
                            greedy_identical=int(same.all(1).sum())))
    return dict(model=model_name, data=os.path.relpath(data), calibration=os.path.relpath(calib),
                windows=int(len(eval_windows)), seq_len=seq_len, scored_tokens=int(len(eval_windows) * (seq_len - 1)),
                prompts=prompts, prompt_len=prompt_len, decode_tokens=decode_tokens,
                outlier_channels=outlier_channels, outlier_factor=outlier_factor if outlier_channels else None,
                machine=f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}",
                seconds=round(time.time() - start, 1), results=results)


def markdown(res: dict) -> str:
    head = (f"**{res['model']}**{' with inflated K channels ×' + str(res['outlier_factor']) if res['outlier_channels'] else ''}: "
            f"{res['scored_tokens']:,} held-out tokens ({res['windows']} windows of {res['seq_len']}), "
            f"{res['prompts']} greedy prompts × {res['decode_tokens']} tokens; {res['machine']}.\n\n")
    rows = ["| KV variant | bytes/token | perplexity | KL(bf16‖variant) | top-1 agree | greedy tokens to divergence |",
            "|---|---:|---:|---:|---:|---:|"]
    for r in res["results"]:
        rows.append(f"| {r['variant']} | {r['bytes_per_token']:,} | {r['perplexity']:.4f} | {r['kl_vs_bf16']:.2e} | "
                    f"{100 * r['top1_agreement']:.2f}% | {r['greedy_tokens_until_divergence']:.1f} / "
                    f"{res['decode_tokens']} |")
    return head + "\n".join(rows) + "\n"


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


def write_outputs(res: dict, out_dir: str = RESULTS) -> dict:
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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="small-gqa", help="small-gqa | small-mla | a Hugging Face folder")
    ap.add_argument("--data", help="held-out text (default: the shipped stdlib held-out split)")
    ap.add_argument("--calib", help="calibration text (default: the shipped calibration excerpt)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--outlier-channels", action="store_true", help="inflate K channels 0 and 5 (and RoPE partners)")
    ap.add_argument("--outlier-factor", type=float, default=200.0)
    ap.add_argument("--out", default=RESULTS, help="output folder")


def run_from_args(args) -> dict:
    for name in ("seq_len", "max_windows", "prompts", "decode_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    res = evaluate(args.model, args.data, args.calib, seq_len=args.seq_len, max_windows=args.max_windows,
                   prompts=args.prompts, decode_tokens=args.decode_tokens, outlier_channels=args.outlier_channels,
                   outlier_factor=args.outlier_factor)
    res["outputs"] = write_outputs(res, args.out)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    res = run_from_args(ap.parse_args(argv))
    print(markdown(res))
    print("wrote " + ", ".join(res["outputs"].values()))


if __name__ == "__main__":
    main()
