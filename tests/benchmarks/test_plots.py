"""kvjax.benchmarks.plots (`kvjax bench serve --plot-dir`) on a result timed by hand: the latency
samples and the per-second output-token buckets worked out by hand, the PNGs valid images, the
folder committed whole. No engine."""
from __future__ import annotations

import os

import pytest

from kvjax.benchmarks.plots import PLOTS, latency_samples, throughput_series, write_plots
from kvjax.errors import OutputPathError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 1000.25  # perf_counter seconds: the buckets count from the first completed request's start


def hand_result() -> dict:
    """Three completed requests and one failed (as tests/benchmarks/test_serve_bench.py's), seconds:

        A  start 0.0  ttft 0.1  itl 0.2 0.3  latency 0.6  3 tokens at 0.1 0.3 0.6
        B  start 0.5  ttft 0.2  itl 0.4      latency 0.6  2 tokens at 0.7 1.1
        C  start 1.2  ttft 0.3  itl -        latency 0.3  1 token  at 1.5
        D  start 0.2  failed (0 output tokens)
    """
    return {"output_lens": [3, 2, 1, 0], "ttfts": [0.1, 0.2, 0.3, 0.0], "itls": [[0.2, 0.3], [0.4], [], []],
            "latencies": [0.6, 0.6, 0.3, 0.0], "start_times": [T0, T0 + 0.5, T0 + 1.2, T0 + 0.2],
            "duration": 2.0, "total_output_tokens": 6}


def test_latency_samples_by_hand():
    s = latency_samples(hand_result())
    assert s["ttft"] == pytest.approx([0.1, 0.2, 0.3])
    assert s["tpot"] == pytest.approx([0.25, 0.4])  # A (0.6 - 0.1) / 2, B (0.6 - 0.2) / 1; C has one token
    assert s["itl"] == pytest.approx([0.2, 0.3, 0.4])
    assert s["e2el"] == pytest.approx([0.6, 0.6, 0.3])  # D, failed, is in none


def test_throughput_series_by_hand():
    # buckets from A's start: ceil(C's end 1.5) + 1 = 3; tokens at 0.1 0.3 0.6 0.7 | 1.1 1.5 | -
    tokens = throughput_series(hand_result())
    assert tokens.tolist() == [4, 2, 0]
    assert tokens.sum() == 3 + 2 + 1
    assert throughput_series({**hand_result(), "output_lens": [0, 0, 0, 0]}).size == 0


def _assert_png(path: str) -> None:
    from PIL import Image

    with open(path, "rb") as fh:
        assert fh.read(8) == PNG_SIGNATURE, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200


def test_write_plots(tmp_path):
    out = tmp_path / "plots"
    paths = write_plots(hand_result(), str(out))
    assert sorted(os.listdir(out)) == sorted(PLOTS) and paths == [str(out / p) for p in PLOTS]
    for p in paths:
        _assert_png(p)
    # no completed request: the figures still draw (an empty CDF, no bars)
    write_plots({**hand_result(), "output_lens": [0, 0, 0, 0], "total_output_tokens": 0}, str(tmp_path / "empty"))
    assert sorted(os.listdir(tmp_path / "empty")) == sorted(PLOTS)


def test_write_plots_refuses_a_folder_under_a_file(tmp_path):
    """The writes go through output_folder: a folder that cannot be made is one error naming the flag."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputPathError, match="--plot-dir"):
        write_plots(hand_result(), str(blocker / "sub"))
    assert os.listdir(tmp_path) == ["file"]
