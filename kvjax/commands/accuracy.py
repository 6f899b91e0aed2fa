"""`kvjax accuracy`: quantized KV variants against bf16 on held-out text (kvjax.evaluation.accuracy).

    kvjax accuracy --model small-gqa
    kvjax accuracy --model small-mla --outlier-channels --out results/
    kvjax accuracy --model smollm2-135m --out experiments/results     # the full suite (docs/accuracy.md: its time)

Writes accuracy_<model>[_outliers].json, .md and .png to --out and prints the table (with
--json: the results as JSON); the full suite (a real LLM) also writes _positions.png (KL by
context position), _layers.png (layer sensitivity), _amax.png (the outlier heatmap) and
_tradeoff.png (KL against Llama-3-70B concurrency, passkey success, greedy agreement). Its
phases show on a progress bar on stderr when that is a terminal (--no-progress: never). The
evaluation is the library's; this module parses the flags, runs it and renders its results
(`markdown`, the plots).

--suite picks the defaults of every option left unset: "basic" (the built-in byte-level models:
one stdlib window set, the fixed skip 0,L-1 variant) or "full" (kvjax.evaluation.accuracy.FULL_SUITE: code
and prose, outlier map, layer sensitivity choosing the skip variants, a long window for KL by
position, passkey retrieval, 128-token greedy generations); "auto" is basic for small-gqa /
small-mla and full for every other model.
"""
from __future__ import annotations

import argparse
import math
import os

from kvjax.commands import accuracy_lab as lab
from kvjax.commands.accuracy_lab import save_plot
from kvjax.commands.common import add_progress_flag, progress_enabled
from kvjax.engine.cli_args import add_engine_flags
from kvjax.errors import UsageError
from kvjax.markdown import markdown_table
from kvjax.progress import Phases
from kvjax.utils.checks import float_arg, int_arg
from kvjax.utils.input_files import check_input_file
from kvjax.utils.output_files import write_json, write_text
from kvjax.utils.output_folders import check_output_dir, output_folder
from kvjax.utils.plotting import pyplot
from kvjax.utils.strict_json import dumps

DEFAULT_OUT = "results"
SMALL_MODELS = ("small-gqa", "small-mla")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_engine_flags(ap, ("model",), None)  # the engine's --model (default small-gqa); the rest is the evaluation's
    ap.add_argument("--suite", choices=("auto", "basic", "full"), default="auto",
                    help="defaults for unset options (auto: basic for the built-in small models, else full)")
    ap.add_argument("--data", nargs="+", help="held-out text files (basic: the shipped stdlib held-out split; "
                                              "full: that and the shipped English prose)")
    ap.add_argument("--calib", help="calibration text (default: the shipped calibration split)")
    ap.add_argument("--seq-len", type=int_arg(1), help="tokens per scored window (256)")
    ap.add_argument("--max-windows", type=int_arg(1),
                    help="scored windows, split between the --data files (basic 32, full 64)")
    ap.add_argument("--calib-windows", type=int_arg(1), help="calibration windows (basic: --max-windows, full 8)")
    ap.add_argument("--prompts", type=int_arg(1, 4096), help="greedy prompts (8)")
    ap.add_argument("--decode-tokens", type=int_arg(1), help="greedy tokens per prompt (basic 32, full 128)")
    ap.add_argument("--outlier-channels", action="store_true", help="inflate K channels 0 and 5 (and RoPE partners)")
    ap.add_argument("--outlier-factor", type=float_arg(0, 1e6, lo_open=True),
                    help="with --outlier-channels: the factor (200)")
    ap.add_argument("--outlier-map", action=argparse.BooleanOptionalAction,
                    help="per layer × kv head max |K|, |V| and channel ratios on the calibration text (full: on)")
    ap.add_argument("--sensitivity-windows", type=int_arg(0),
                    help="calibration windows for layer sensitivity, 0 = off (basic 0, full 2)")
    ap.add_argument("--sensitivity-variant", help="the format whose per-layer KL is measured (fp8_e4m3 unit)")
    ap.add_argument("--skip-counts", type=int_arg(1), nargs="+",
                    help="one skip variant per count: that many most sensitive layers in bf16 (1 3)")
    ap.add_argument("--long-windows", type=int_arg(0), help="windows of the model's context for KL by position, "
                                                     "0 = off (basic 0, full 1)")
    ap.add_argument("--long-len", type=int_arg(2), help="tokens per long window, up to the model's context "
                                                         "(default: its context, at most 8192)")
    ap.add_argument("--long-chunk", type=int_arg(1), help="prefill chunk of the long windows (basic 512, full 2048)")
    ap.add_argument("--long-variants", nargs="+", help="variants scored on the long windows besides bf16, or "
                                                       "'all' (basic fp8_e4m3 unit, full all)")
    ap.add_argument("--passkey-lengths", type=int_arg(0), nargs="+",
                    help="passkey prompt lengths up to the model's context, 0 = off (basic off, full 1024)")
    ap.add_argument("--passkey-depths", type=float_arg(0, 1), nargs="+", help="needle depths (0.1 0.5 0.9)")
    ap.add_argument("--passkey-trials", type=int_arg(1), help="passkey trials per length × depth cell (12)")
    ap.add_argument("--passkey-per-haystack", type=int_arg(1),
                    help="trials sharing one haystack offset, served by the prefix cache (3)")
    ap.add_argument("--variants", nargs="+", help="score only these variants (bf16, the baseline, always; "
                                                  "default: all)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT}/)")
    add_progress_flag(ap)


def add_parser(sub) -> None:
    p = sub.add_parser("accuracy", help="fp8 / int8 KV against bf16: perplexity, KL, agreement",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")


def evaluate_kwargs(args) -> dict:
    """evaluate()'s keyword arguments: what the user gave, the suite's defaults for the rest."""
    from kvjax.data import CALIB, HELDOUT
    from kvjax.evaluation.accuracy import FULL_SUITE, variants

    suite = args.suite if args.suite != "auto" else ("basic" if args.model in SMALL_MODELS else "full")
    defaults = dict(FULL_SUITE) if suite == "full" else dict(data=(HELDOUT,), seq_len=256, max_windows=32)
    given = dict(data=args.data, seq_len=args.seq_len, max_windows=args.max_windows, calib_windows=args.calib_windows,
                 outlier_map=args.outlier_map, sensitivity_windows=args.sensitivity_windows,
                 sensitivity_variant=args.sensitivity_variant, skip_counts=args.skip_counts,
                 long_windows=args.long_windows, long_len=args.long_len, long_chunk=args.long_chunk,
                 long_variants=args.long_variants, only=args.variants, passkey_lengths=args.passkey_lengths,
                 passkey_depths=args.passkey_depths,
                 passkey_trials=args.passkey_trials, passkey_per_haystack=args.passkey_per_haystack,
                 prompts=args.prompts, decode_tokens=args.decode_tokens)
    kw = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    if args.outlier_factor is not None and not args.outlier_channels:
        raise UsageError("--outlier-factor applies with --outlier-channels (it would be ignored)")
    for path in kw["data"]:
        check_input_file(path, "--data")
    check_input_file(args.calib or CALIB, "--calib")
    names = [v["name"] for v in variants(2) if "skip" not in v]
    for name in args.variants or ():
        if name not in names:
            raise UsageError(f"--variants: unknown variant {name!r}; choose from {', '.join(repr(n) for n in names)}")
    if args.long_len is not None and not kw.get("long_windows"):
        raise UsageError(f"--long-len {args.long_len} applies with --long-windows above 0 (it would be ignored)")
    if kw.get("passkey_lengths") == [0]:
        kw["passkey_lengths"] = ()
    elif 0 in kw.get("passkey_lengths", ()):
        raise UsageError(f"--passkey-lengths: 0 (off) stands alone, got {' '.join(map(str, kw['passkey_lengths']))}")
    if kw.get("long_variants") == ["all"]:
        kw["long_variants"] = "all"
    for name in ("skip_counts", "long_variants", "only", "passkey_lengths", "passkey_depths"):
        if name in kw and not isinstance(kw[name], str):
            kw[name] = tuple(kw[name])
    return dict(kw, calib=args.calib or CALIB, outlier_channels=args.outlier_channels,
                outlier_factor=200.0 if args.outlier_factor is None else args.outlier_factor)


# ------------------------------------------------------------------ markdown
def markdown(res: dict) -> str:
    """The results as markdown: a one-line header saying what was measured, the variant table,
    and (when measured) KL by context position, layer sensitivity, the outlier map, the passkey
    tables and the trade-off table."""
    from kvjax.evaluation.tradeoff import table

    head = (f"**{res['model']}**{' with inflated K channels ×' + str(res['outlier_factor']) if res['outlier_channels'] else ''}: "
            f"{res['scored_tokens']:,} held-out tokens ({res['windows']} windows of {res['seq_len']}), "
            f"{res['prompts']} greedy prompts × {res['decode_tokens']} tokens; {res['machine']}.\n\n")
    replayed = all("replay_nll" in r for r in res["results"])  # results written before trace replay lack it
    rows = markdown_table(
        ["KV variant", "bytes/token", "perplexity", "KL(bf16‖variant)", "top-1 agree", "greedy tokens to divergence"]
        + (["bf16's greedy replayed: NLL, top-1"] if replayed else []),
        [[r["variant"], f"{r['bytes_per_token']:,}", f"{r['perplexity']:.4f}", f"{r['kl_vs_bf16']:.2e}",
          f"{100 * r['top1_agreement']:.2f}%", f"{r['greedy_tokens_until_divergence']:.1f} / {res['decode_tokens']}"]
         + ([f"{r['replay_nll']:.4f}, {100 * r['replay_top1']:.1f}%"] if replayed else [])
         for r in res["results"]], align="lrrrrr" + "r" * replayed)
    out = head + "\n".join(rows) + "\n"
    if "long" in res:
        out += "\n" + _positions_markdown(res)
    if "sensitivity" in res or "outliers" in res:
        out += "\n" + _layers_markdown(res)
    if "passkey" in res:
        out += "\n" + lab.passkey_markdown(res)
    if "passkey" in res or "long" in res:
        out += "\n" + lab.tradeoff_markdown(res, table(res))
    return out


def _bucket_name(b: dict) -> str:
    k = lambda x: f"{x // 1024}K" if x >= 2048 and x % 1024 == 0 else str(x)  # noqa: E731
    return f"{k(b['start'])}–{k(b['end'])}"


def _positions_markdown(res: dict) -> str:
    from kvjax.evaluation.metrics import BUCKETS

    long = res["long"]
    measured = {(b["start"], b["end"]) for v in long["variants"].values() for b in v["buckets"]}
    measured |= {(b["start"], b["end"]) for buckets in res["positions"]["variants"].values() for b in buckets}
    edges = [e for e in zip(BUCKETS, BUCKETS[1:]) if e in measured]  # the buckets the windows reach
    names = ["window", "variant"] + [_bucket_name(dict(start=a, end=b)) for a, b in edges] + ["all"]
    caption = (f"KL(bf16‖variant) by context position (the predicting token's position); top-1 agreement in "
               f"parentheses. Long: {long['windows']} windows of {long['seq_len']:,} tokens prefilled "
               f"{long['chunk']:,} at a time ({long['scored_tokens']:,} positions); short: the table's windows.\n")
    rows = []

    def row(label, name, buckets, overall):
        got = {(b["start"], b["end"]): b for b in buckets}
        cells = [f"{got[e]['kl_vs_bf16']:.2e} ({100 * got[e]['top1_agreement']:.1f}%)" if e in got else "–"
                 for e in edges]
        return [label, name, *cells, f"{overall:.2e}"]

    for name, v in long["variants"].items():
        if name != "bf16":
            rows.append(row(f"{long['seq_len']:,}", name, v["buckets"], v["kl_vs_bf16"]))
    by = {r["variant"]: r for r in res["results"]}
    for name, buckets in res["positions"]["variants"].items():
        if name != "bf16":
            rows.append(row(f"{res['seq_len']}", name, buckets, by[name]["kl_vs_bf16"]))
    ppl = " / ".join(f"{_bucket_name(b)}: {b['perplexity']:.2f}" for b in long["variants"]["bf16"]["buckets"])
    table = markdown_table(names, rows, align="ll" + "r" * (len(edges) + 1))
    return "\n".join([caption, *table]) + f"\n\nbf16 perplexity by position (long windows): {ppl}.\n"


def _layers_markdown(res: dict) -> str:
    sens, outl = res.get("sensitivity"), res.get("outliers")
    parts = []
    if sens:
        skips = ", ".join(map(str, sens["skip_sets"]))
        parts.append(f"Layer sensitivity: KL(bf16‖only layer i in {sens['variant']}) on {sens['windows']} "
                     f"calibration windows of {sens['seq_len']}; skip variants keep layers {skips} in bf16.")
    if outl:
        sat = outl["saturated_layers"]
        parts.append(f"Outlier map on {outl['tokens']:,} calibration tokens: max |K|, max |V| over kv heads, and the "
                     f"largest channel's amax over the median channel's (max over heads). Layers where unit-scale "
                     f"{outl['format']} saturates (|K| or |V| > {outl['format_max']:g}): "
                     f"{', '.join(map(str, sat)) if sat else 'none'}.")
    cols = (["sensitivity KL", "top-1 agree"] if sens else []) + \
        (["max abs K", "max abs V", "K channel ratio", "V channel ratio"] if outl else [])
    rows = []
    num_layers = len(sens["layers"]) if sens else len(outl["k_amax"])
    for i in range(num_layers):
        cells = []
        if sens:
            r = sens["layers"][i]
            cells += [f"{r['kl_vs_bf16']:.2e}", f"{100 * r['top1_agreement']:.2f}%"]
        if outl:
            cells += [f"{max(outl['k_amax'][i]):.1f}", f"{max(outl['v_amax'][i], default=math.nan):.2f}",
                      f"{max(outl['k_channel_ratio'][i]):.1f}",
                      f"{max(outl['v_channel_ratio'][i], default=math.nan):.1f}"]
        rows.append([i, *cells])
    table = markdown_table(["layer", *cols], rows, align="r" * (len(cols) + 1))
    return " ".join(parts) + "\n\n" + "\n".join(table) + "\n"


# ------------------------------------------------------------------ plots
def plot(res: dict, path: str) -> None:
    plt = pyplot()
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
    save_plot(plt, fig, path)


def plot_positions(res: dict, path: str) -> None:
    """KL by position bucket: long windows solid, the short windows of the main table dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for label, per_variant, style in ((f"{res['long']['seq_len']:,}-token windows",
                                       {k: v["buckets"] for k, v in res["long"]["variants"].items()}, "-o"),
                                      (f"{res['seq_len']}-token windows", res["positions"]["variants"], "--x")):
        for name, buckets in per_variant.items():
            if name == "bf16":
                continue
            mids = [(b["start"] + b["end"]) / 2 for b in buckets]
            ax.plot(mids, [max(b["kl_vs_bf16"], 1e-12) for b in buckets], style, label=f"{name} ({label})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context position (bucket midpoint)")
    ax.set_ylabel("mean KL(bf16 ‖ variant), nats")
    ax.set_title(f"{res['model']}: quantized-KV error by context position")
    ax.legend(fontsize=7)
    save_plot(plt, fig, path)


def plot_layers(res: dict, path: str) -> None:
    """Layer sensitivity: KL when only layer i's KV is quantized; skipped layers highlighted."""
    plt = pyplot()
    sens = res["sensitivity"]
    skipped = set(max(sens["skip_sets"], key=len)) if sens["skip_sets"] else set()
    rows = sens["layers"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.bar([r["layer"] for r in rows], [max(r["kl_vs_bf16"], 1e-12) for r in rows],
           color=["tab:red" if r["layer"] in skipped else "tab:blue" for r in rows])
    ax.set_yscale("log")
    ax.set_xlabel("layer (red: kept in bf16 by the largest skip variant)")
    ax.set_ylabel("KL(bf16 ‖ only this layer quantized)")
    ax.set_title(f"{res['model']}: layer sensitivity of {sens['variant']}")
    save_plot(plt, fig, path)


def plot_amax(res: dict, path: str) -> None:
    """The outlier map: four layer × kv head heatmaps (max |K|, max |V|, channel ratios)."""
    import numpy as np

    plt = pyplot()
    o = res["outliers"]
    panels = [("max |K|", o["k_amax"]), ("max |V|", o["v_amax"]),
              ("K: top channel / median channel", o["k_channel_ratio"]),
              ("V: top channel / median channel", o["v_channel_ratio"])]
    panels = [(t, np.asarray(m, float)) for t, m in panels if m and len(m[0])]
    fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels) + 1, 0.22 * len(o["k_amax"]) + 2),
                             squeeze=False)
    for ax, (title, m) in zip(axes[0], panels):
        im = ax.imshow(m, aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("kv head")
        ax.set_xticks(range(m.shape[1]))
        fig.colorbar(im, ax=ax, fraction=0.08)
    axes[0][0].set_ylabel("layer")
    sat = o["saturated_layers"]
    where = "layers " + ", ".join(map(str, sat)) if sat else "no layer"
    fig.suptitle(f"{res['model']}: K/V outlier map on calibration text; unit-scale {o['format']} saturates "
                 f"(> {o['format_max']:g}) in {where}", fontsize=9)
    save_plot(plt, fig, path)


def write_outputs(res: dict, out_dir: str) -> dict:
    """accuracy_<model>[_outliers].{json,md,png} in out_dir, plus the full suite's
    _positions.png, _layers.png, _amax.png and _tradeoff.png when measured, moved into out_dir
    together (kvjax.utils.output_folders: a failure midway leaves the previous run's files whole);
    returns their paths."""
    stem = f"accuracy_{os.path.basename(res['model'].rstrip('/'))}" + ("_outliers" if res["outlier_channels"] else "")
    names = {"json": f"{stem}.json", "md": f"{stem}.md", "png": f"{stem}.png"}
    plots = [(key, fn) for key, fn, needs in (("positions", plot_positions, "long"),
                                              ("layers", plot_layers, "sensitivity"), ("amax", plot_amax, "outliers"))
             if needs in res]
    names.update((key, f"{stem}_{key}.png") for key, _ in plots)
    if "passkey" in res or "long" in res:
        names["tradeoff"] = f"{stem}_tradeoff.png"
    with output_folder(out_dir) as stage:
        at = lambda key: os.path.join(stage, names[key])  # noqa: E731
        write_json(at("json"), res, "--out")
        write_text(at("md"), markdown(res), "--out")
        plot(res, at("png"))
        for key, fn in plots:
            fn(res, at(key))
        if "tradeoff" in names:
            from kvjax.evaluation.tradeoff import table

            lab.plot_tradeoff(res, table(res), at("tradeoff"))
    return {key: os.path.join(out_dir, name) for key, name in names.items()}


def run_from_args(args) -> dict:
    """evaluate() with the flags' arguments, its phases on a progress bar (stderr), and the
    outputs written to --out; the results with their paths under "outputs"."""
    from kvjax.evaluation.accuracy import evaluate

    kw = evaluate_kwargs(args)
    check_output_dir(args.out, "--out")
    with Phases("accuracy", None, progress_enabled(args)) as phases:
        phases.start(f"load {args.model}")
        res = evaluate(args.model, kw.pop("data"), kw.pop("calib"), progress=phases.start, **kw)
        phases.start(f"write {args.out}")
        res["outputs"] = write_outputs(res, args.out)
    return res


def run(args) -> int:
    res = run_from_args(args)
    print(dumps(res, indent=2) if args.json else markdown(res) + "\nwrote " + ", ".join(res["outputs"].values()))
    return 0
