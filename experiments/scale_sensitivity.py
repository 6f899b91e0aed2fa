"""What an fp8 e4m3 KV scale buys when nothing overflows: KL against bf16 as the scale moves
(markdown + JSON + PNG).

For one model, held-out windows of code and of prose are scored teacher-forced through a paged
cache whose K/V pages are e4m3 with scale s = m × amax / 448, for multipliers m from 1/16 to 16,
per tensor (one scale per layer for K and for V) and per head, with amax calibrated on code (the
accuracy suite's calibration split) and, apart, on prose (windows of the prose file after the
scored ones), and at vLLM's unit scale s = 1. At every point it also reads, from the bf16 K/V of
the scored windows (the values that get quantized), three fractions for K and for V:

    clipped     |x| / s > 448, saturated at ±448
    subnormal   0 < |x| / s < 2^-6, below e4m3's smallest normal (fewer mantissa bits; < 2^-10 → 0)
    rel. error  mean |e4m3(x/s) − x/s| / |x/s| over the rest (normal, unclipped)

so KL can be read against what the scale did: no scale changes the relative rounding error of
normal values much (e4m3 keeps 3 mantissa bits at any exponent); a smaller scale clips the
largest values, a larger one pushes the smallest into the subnormals. The same sweep on the
built-in small-gqa model with inflated K channels (models.stress, the accuracy suite's outlier
case: |K| far above 448 at unit scale) shows when calibration wins.

    python experiments/scale_sensitivity.py                      # SmolLM2-135M and the outlier case
    python experiments/scale_sensitivity.py --model small-gqa --windows 4 --quick   # a smoke run
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvjax.data import CALIB, HELDOUT, PROSE  # noqa: E402
from kvjax.evaluation.metrics import Tally, compare  # noqa: E402
from kvjax.evaluation.scoring import prefill_layout, windows  # noqa: E402
from kvjax.quant import formats as quant  # noqa: E402
from kvjax.quant.calibration import cache_amax  # noqa: E402
from kvjax.utils.output_files import save_figure, write_json, write_text  # noqa: E402
from kvjax.utils.plotting import pyplot  # noqa: E402
from kvjax.worker.model_runner import forward  # noqa: E402
from kvjax.worker.paged_cache import PagedCache  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
MULTIPLIERS = tuple(2.0 ** e for e in range(-4, 5))  # 1/16 .. 16
E4M3 = quant.FORMATS["fp8_e4m3"]
MIN_NORMAL = 2.0 ** -6
Z = 16


def scorer(module, seq_len: int):
    """jit of (params, tokens i32[B, S], one row's empty cache) → (log-probs f32[B, S, V], the
    rows' caches): every row prefilled alone, as kvjax.evaluation.scoring.prefill. The scales are
    leaves of the cache, so every scale setting of one kv dtype runs the same compiled program."""
    md, num_blocks = prefill_layout(seq_len, Z)

    @jax.jit
    def run(params, tokens, cache):
        logits, caches = jax.vmap(lambda row: forward(module, params, row, md, cache))(tokens)
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), caches

    return run, num_blocks


def scales_at(amax_k, amax_v, mode: str, m: float) -> quant.KVScales:
    """m × the calibrated scales of `mode` (per_tensor | per_head)."""
    base = quant.scales_from_amax(amax_k, amax_v, E4M3, mode)
    return quant.KVScales("fp8_e4m3", mode, tuple(np.float32(m) * k for k in base.k),
                          tuple(np.float32(m) * v for v in base.v))


@jax.jit
def _fractions(x, scale):
    """x [B, P, Z, K, H] (bf16 K or V of written blocks), scale f32[K] → (clipped, subnormal,
    counted normal values, their summed relative rounding error, all values)."""
    y = jnp.abs(x.astype(jnp.float32)) / scale[:, None]
    clipped = y > E4M3.max
    sub = (y > 0) & (y < MIN_NORMAL)
    normal = (y >= MIN_NORMAL) & ~clipped
    q = y.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    rel = jnp.where(normal, jnp.abs(q - y) / jnp.where(normal, y, 1.0), 0.0)
    return clipped.sum(), sub.sum(), normal.sum(), rel.sum(), y.size


def fraction_sums(caches, scales: quant.KVScales | None) -> dict[str, np.ndarray]:
    """Per side ("k", "v"): [clipped, subnormal, normal, summed relative error, values] over every
    layer's written blocks (block 0, the null block, left out) at these scales (None: unit)."""
    out = {}
    for side in ("k", "v"):
        total = np.zeros(5)
        for i, layer in enumerate(caches.layers):
            x = getattr(layer, side)[:, 1:]
            s = jnp.ones((x.shape[3],), jnp.float32) if scales is None else jnp.asarray(getattr(scales, side)[i])
            total += np.asarray([float(a) for a in _fractions(x, s)])
        out[side] = total
    return out


def run_model(name: str, *, n_windows: int, seq_len: int, calib_windows: int, multipliers, outliers: bool,
              log) -> dict:
    from kvjax.models.hub import load_model

    t0 = time.time()
    loaded = load_model(name)
    if outliers:
        from kvjax.models.stress import inflate_k_channels
        params = inflate_k_channels(loaded.config, loaded.params, (0, 5), 200.0)
        loaded = loaded.replace(params=jax.tree_util.tree_map(jnp.asarray, params))
    cfg, tok = loaded.config, loaded.tokenizer
    code, prose = tok.encode_file(HELDOUT), tok.encode_file(PROSE)
    half = n_windows // 2
    eval_sets = {"code": windows(code, seq_len, half), "prose": windows(prose, seq_len, n_windows - half)}
    used = len(eval_sets["prose"]) * seq_len
    calib_sets = {"code": windows(tok.encode_file(CALIB), seq_len, calib_windows),
                  "prose": windows(prose[used:], seq_len, calib_windows)}  # after the scored prose
    run, num_blocks = scorer(loaded.module, seq_len)
    spec_bf16, spec_fp8 = cfg.kv_spec("bf16"), cfg.kv_spec("fp8_e4m3")

    def caches_of(tokens):
        return run(loaded.params, jnp.asarray(tokens), PagedCache.create(spec_bf16, num_blocks, Z))

    amax = {}
    for src, toks in calib_sets.items():
        stats = [cache_amax(caches_of(toks[i:i + 4])[1]) for i in range(0, len(toks), 4)]
        amax[src] = ([np.max([np.asarray(s[0][i]) for s in stats], axis=0) for i in range(cfg.num_layers)],
                     [np.max([np.asarray(s[1][i]) for s in stats], axis=0) for i in range(cfg.num_layers)])
    settings = [("unit", "-", 1.0, None)] + [(mode, src, m, scales_at(*amax[src], mode, m))
                                             for src in calib_sets for mode in ("per_tensor", "per_head")
                                             for m in multipliers]
    log(f"{name}: {len(settings)} scale settings × {n_windows} windows of {seq_len}")
    tallies = {(i, src): Tally((0, seq_len)) for i in range(len(settings)) for src in eval_sets}
    sums = [dict(k=np.zeros(5), v=np.zeros(5)) for _ in settings]
    for src, toks in eval_sets.items():
        for b in range(0, len(toks), 4):
            part = jnp.asarray(toks[b:b + 4])
            base, caches = caches_of(part)
            targets, positions = part[:, 1:], np.arange(seq_len - 1)
            for i, (_, _, _, scales) in enumerate(settings):
                logp, _ = run(loaded.params, part, PagedCache.create(spec_fp8, num_blocks, Z, scales))
                tallies[i, src].add(positions, *compare(base[:, :-1], logp[:, :-1], targets))
                for side, counted in fraction_sums(caches, scales).items():
                    sums[i][side] += counted
    rows = []
    for i, (mode, src, m, _) in enumerate(settings):
        kl = {s: tallies[i, s].overall()["kl_vs_bf16"] for s in eval_sets}
        rows.append(dict(mode=mode, calibrated_on=src, multiplier=m, kl=float(np.mean(list(kl.values()))),
                         kl_code=kl["code"], kl_prose=kl["prose"],
                         top1=float(np.mean([tallies[i, s].overall()["top1_agreement"] for s in eval_sets])),
                         **{f"{side}_{what}": value for side in ("k", "v")
                            for what, value in _ratios(sums[i][side]).items()}))
    return dict(model=loaded.name + (" (K channels 0, 5 × 200)" if outliers else ""), seq_len=seq_len,
                windows={s: int(len(t)) for s, t in eval_sets.items()},
                calib_windows={s: int(len(t)) for s, t in calib_sets.items()},
                amax={s: dict(k=float(max(a.max() for a in amax[s][0])), v=float(max(a.max() for a in amax[s][1])))
                      for s in amax}, rows=rows, seconds=round(time.time() - t0, 1))


def _ratios(total: np.ndarray) -> dict[str, float]:
    clipped, sub, normal, rel, n = total
    return dict(clipped=float(clipped / n), subnormal=float(sub / n), rel_error=float(rel / max(normal, 1)))


# ------------------------------------------------------------------------------------ output
def _markdown(results: list[dict]) -> str:
    lines = ["# fp8 e4m3 KV: KL against bf16 as the scale moves", "",
             "`python experiments/scale_sensitivity.py`. s = multiplier × amax / 448 (calibrated on code or on "
             "prose), or 1.0 (vLLM's unit scale). Fractions are of the scored windows' K and V; rel. error is the "
             "mean relative rounding error of the values neither clipped nor subnormal.", ""]
    for r in results:
        lines += [f"## {r['model']}", "", f"{sum(r['windows'].values())} windows of {r['seq_len']} "
                  f"({r['windows']['code']} code, {r['windows']['prose']} prose); max |K|, |V| on the calibration "
                  + ", ".join(f"{s}: {a['k']:.3g}, {a['v']:.3g}" for s, a in r["amax"].items())
                  + f"; {r['seconds']:.0f} s.", "",
                  "| scale | calibrated on | × | KL code | KL prose | top-1 | K clipped | K subnormal | K rel. err "
                  "| V clipped | V subnormal | V rel. err |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in r["rows"]:
            lines.append(f"| {row['mode']} | {row['calibrated_on']} | {row['multiplier']:g} | {row['kl_code']:.3e} | "
                         f"{row['kl_prose']:.3e} | {100 * row['top1']:.2f}% | {row['k_clipped']:.2e} | "
                         f"{row['k_subnormal']:.2e} | {row['k_rel_error']:.4f} | {row['v_clipped']:.2e} | "
                         f"{row['v_subnormal']:.2e} | {row['v_rel_error']:.4f} |")
        lines.append("")
    return "\n".join(lines)


def _plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4.2 * len(results)), squeeze=False)
    for r, (ax_kl, ax_f) in zip(results, axes):
        unit = r["rows"][0]
        for src, style in (("code", "-"), ("prose", "--")):
            for mode, color in (("per_tensor", "C0"), ("per_head", "C1")):
                rows = [x for x in r["rows"] if x["mode"] == mode and x["calibrated_on"] == src]
                ax_kl.plot([x["multiplier"] for x in rows], [x["kl"] for x in rows], style, color=color, marker="o",
                           label=f"{mode}, calibrated on {src}")
        ax_kl.axhline(unit["kl"], color="k", lw=1, label="unit scale (1.0)")
        ax_kl.set(xscale="log", yscale="log", xlabel="scale multiplier (× amax / 448)", ylabel="KL(bf16 ‖ fp8)",
                  title=r["model"])
        ax_kl.legend(fontsize=7)
        rows = [x for x in r["rows"] if x["mode"] == "per_tensor" and x["calibrated_on"] == "code"]
        ms = [x["multiplier"] for x in rows]
        for side, style in (("k", "-"), ("v", "--")):
            for what, color in (("clipped", "C3"), ("subnormal", "C2"), ("rel_error", "C4")):
                ax_f.plot(ms, [max(x[f"{side}_{what}"], 1e-9) for x in rows], style, color=color, marker=".",
                          label=f"{side.upper()} {what.replace('_', '. ')}")
        ax_f.set(xscale="log", yscale="log", xlabel="scale multiplier (per_tensor, calibrated on code)",
                 ylabel="fraction (rel. error: mean)", title="what the scale does to K and V")
        ax_f.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, "--out", dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the model swept (then the outlier case on small-gqa)")
    p.add_argument("--windows", type=int, default=16, help="scored windows, half code, half prose (16)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--calib-windows", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="three multipliers, no outlier case (a smoke run)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    multipliers = (0.25, 1.0, 4.0) if args.quick else MULTIPLIERS
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    kw = dict(n_windows=args.windows, seq_len=args.seq_len, calib_windows=args.calib_windows,
              multipliers=multipliers, log=log)
    results = [run_model(args.model, outliers=False, **kw)]
    if not args.quick:
        results.append(run_model("small-gqa", outliers=True, **kw))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "scale_sensitivity.json", dict(results=results), "--out", indent=1)
    write_text(out / "scale_sensitivity.md", _markdown(results), "--out")
    _plot(results, out / "scale_sensitivity.png")
    log(f"wrote {out}/scale_sensitivity.{{md,json,png}}")
    return dict(results=results)


if __name__ == "__main__":
    main()
