"""`kvjax bench serve --plot-dir`'s figures, drawn from the result dict alone (kvjax's addition;
vLLM's bench serve draws none):

    latency_cdf.png  the empirical CDF of TTFT, TPOT, ITL and E2EL (ms), the distributions whose
                     mean / median / percentiles the table prints
    throughput.png   output tokens per second over the run: the one-second buckets in which
                     calculate_metrics finds max_output_tokens_per_s

Each sample is computed as calculate_metrics computes it (kvjax.benchmarks.serve), from the
result's per-request lists: a request completed when its output_lens entry is > 0; its token
times are start + ttft, then + each itl gap; TPOT = (latency - ttft) / (output_len - 1) for a
request of more than one token. The files are written together (kvjax.utils.output_folders.output_folder:
a failure leaves the folder's previous plots whole), each by kvjax.utils.output_files.save_figure.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from kvjax.utils.output_files import save_figure
from kvjax.utils.output_folders import output_folder
from kvjax.utils.plotting import pyplot

MS = 1000.0
PLOTS = ("latency_cdf.png", "throughput.png")
_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def _completed(result: dict[str, Any]) -> list[int]:
    """Indices of the completed requests (calculate_metrics counts a failed one as 0 tokens)."""
    return [i for i, n in enumerate(result["output_lens"]) if n > 0]


def latency_samples(result: dict[str, Any]) -> dict[str, np.ndarray]:
    """metric → its samples in seconds, f64[samples]: ttft and e2el per completed request, tpot
    per completed request of > 1 token, itl every gap of every completed request."""
    done = _completed(result)
    n, ttft, lat = result["output_lens"], result["ttfts"], result["latencies"]
    return {"ttft": np.array([ttft[i] for i in done], dtype=float),
            "tpot": np.array([(lat[i] - ttft[i]) / (n[i] - 1) for i in done if n[i] > 1], dtype=float),
            "itl": np.array([g for i in done for g in result["itls"][i]], dtype=float),
            "e2el": np.array([lat[i] for i in done], dtype=float)}


def throughput_series(result: dict[str, Any]) -> np.ndarray:
    """Output tokens in each one-second bucket from the first completed request's start, f64[buckets]
    (ceil(last end - first start) + 1 buckets): one per streamed output, in the bucket of its
    arrival, as calculate_metrics counts them; that is one per token when each output carries one
    (kvjax's engine streams one token per step). Empty when no request completed."""
    done = _completed(result)
    if not done:
        return np.zeros(0)
    starts = [result["start_times"][i] for i in done]
    t0 = min(starts)
    buckets = int(np.ceil(max(s + result["latencies"][i] for s, i in zip(starts, done)) - t0)) + 1
    tokens = np.zeros(buckets)
    for i in done:
        times = result["start_times"][i] + result["ttfts"][i] + np.concatenate([[0.0], np.cumsum(result["itls"][i])])
        for t in times:
            b = int(t - t0)
            if 0 <= b < buckets:
                tokens[b] += 1
    return tokens


def _cdf_figure(plt, samples: dict[str, np.ndarray]):
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for ax, (metric, values) in zip(axes.flat, samples.items()):
        ms = np.sort(values) * MS
        if len(ms):
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
            ax.axvline(np.median(ms), color="gray", ls=":", lw=1, label=f"median {np.median(ms):.1f} ms")
            ax.legend(fontsize=8, loc="lower right")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{_LABELS[metric]} ({len(ms)} samples)")
        ax.ticklabel_format(axis="x", useOffset=False)  # 7729.4 ms, not 0.4 + 7.729e3
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Latency CDFs (kvjax bench serve)")
    return fig


def _throughput_figure(plt, tokens: np.ndarray, result: dict[str, Any]):
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(np.arange(len(tokens)), tokens, width=1.0, align="edge", alpha=0.8, label="output tokens in the second")
    dur = result.get("duration") or 0
    if dur > 0:
        ax.axhline(result["total_output_tokens"] / dur, color="C1", ls="--",
                   label=f"mean {result['total_output_tokens'] / dur:.1f} tok/s over {dur:.2f} s")
    ax.set_xlabel("seconds since the first request was sent")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Output token throughput (peak {tokens.max() if len(tokens) else 0:.0f} tok/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def write_plots(result: dict[str, Any], out_dir: str, flag: str = "--plot-dir") -> list[str]:
    """Write PLOTS into out_dir (created if need be), together → their paths."""
    plt = pyplot()
    with output_folder(out_dir, flag) as stage:
        for name, fig in (("latency_cdf.png", _cdf_figure(plt, latency_samples(result))),
                          ("throughput.png", _throughput_figure(plt, throughput_series(result), result))):
            fig.tight_layout()
            save_figure(fig, os.path.join(stage, name), flag, dpi=110)
            plt.close(fig)
    return [os.path.join(out_dir, name) for name in PLOTS]
