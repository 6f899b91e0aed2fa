"""`kvjax bench serve` (kvjax.benchmarks.serve, kvjax.commands.bench): vLLM's metric definitions
checked on hand-timed outputs worked out by hand; the arrival process's moments; the random
dataset; a run in-process (its progress bar on stderr) and the same prompts over HTTP against
`kvjax serve` in a thread. The other datasets: test_datasets.py, test_bench_datasets_cli.py."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from serving import serving

from kvjax.benchmarks.serve import (HTTPTarget, InProcessTarget, RequestFuncOutput, arrival_times,
                                    calculate_metrics, random_requests, request_intervals, result_dict,
                                    run_benchmark)
from kvjax.commands.main import build_parser, main


def _fake_outputs():
    """Three completed requests and one failed, timed by hand (seconds).

        A  start 0.0  ttft 0.1  itl 0.2 0.3  latency 0.6  3 tokens  prompt 10  tokens at 0.1 0.3 0.6
        B  start 0.5  ttft 0.2  itl 0.4      latency 0.6  2 tokens  prompt 20  tokens at 0.7 1.1
        C  start 1.2  ttft 0.3  itl -        latency 0.3  1 token   prompt 30  token  at 1.5
        D  start 0.2  failed                                        prompt 40
    """
    return [RequestFuncOutput(True, 10, 3, 0.1, [0.2, 0.3], 0.6, 0.0, "abc"),
            RequestFuncOutput(True, 20, 2, 0.2, [0.4], 0.6, 0.5, "de"),
            RequestFuncOutput(True, 30, 1, 0.3, [], 0.3, 1.2, "f"),
            RequestFuncOutput(False, 40, 0, 0.0, [], 0.0, 0.2, "", "boom")]


def test_calculate_metrics_by_hand():
    m, lens = calculate_metrics(_fake_outputs(), 2.0, [50, 99])
    assert lens == [3, 2, 1, 0]  # a failed request counts 0 output tokens
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 60, 6)  # input 10+20+30, output 3+2+1
    assert m.request_throughput == pytest.approx(1.5)       # 3 completed / 2 s
    assert m.output_throughput == pytest.approx(3.0)        # 6 tokens / 2 s
    assert m.total_token_throughput == pytest.approx(33.0)  # (60 + 6) / 2 s
    s = m.stats
    # TTFT [0.1, 0.2, 0.3]: mean 0.2; median 0.2; std sqrt((0.01 + 0 + 0.01) / 3) = 0.08165;
    # p99 (numpy's linear): rank 0.99 * 2 = 1.98 → 0.2 + 0.98 * 0.1 = 0.298; p50 rank 1 → 0.2
    assert s["ttft"]["mean"] == pytest.approx(200) and s["ttft"]["median"] == pytest.approx(200)
    assert s["ttft"]["std"] == pytest.approx(1000 * math.sqrt(0.02 / 3))
    assert s["ttft"]["percentiles"] == [(50, pytest.approx(200)), (99, pytest.approx(298))]
    # TPOT, only requests of > 1 token: A (0.6 - 0.1) / (3 - 1) = 0.25, B (0.6 - 0.2) / (2 - 1) = 0.4;
    # mean = median = 0.325; p99 rank 0.99 → 0.25 + 0.99 * 0.15 = 0.3985
    assert s["tpot"]["mean"] == pytest.approx(325) and s["tpot"]["median"] == pytest.approx(325)
    assert s["tpot"]["percentiles"][1] == (99, pytest.approx(398.5))
    # ITL: every gap, [0.2, 0.3, 0.4]: mean = median = 0.3; p99 rank 1.98 → 0.3 + 0.98 * 0.1 = 0.398
    assert s["itl"]["mean"] == pytest.approx(300) and s["itl"]["median"] == pytest.approx(300)
    assert s["itl"]["percentiles"][1] == (99, pytest.approx(398))
    # E2EL [0.6, 0.6, 0.3]: mean 0.5, median 0.6, p99 (sorted 0.3 0.6 0.6) rank 1.98 → 0.6
    assert s["e2el"]["mean"] == pytest.approx(500) and s["e2el"]["median"] == pytest.approx(600)
    assert s["e2el"]["percentiles"][1] == (99, pytest.approx(600))
    # vLLM's peaks, in one-second buckets from the first successful start (0.0); 3 buckets
    # (ceil(last end 1.5) + 1). A is active in bucket 0, B in 0..1 (0.5 → 1.1), C in 1 (1.2 → 1.5):
    # [2, 2, 0] → 2 (B and C never overlap in time, but share bucket 1: vLLM's coarse count).
    # Tokens by bucket: A 0.1 0.3 0.6 and B 0.7 → bucket 0 (4), B 1.1 and C 1.5 → bucket 1 (2).
    assert m.max_concurrent_requests == 2 and m.max_output_tokens_per_s == 4.0
    assert m.request_goodput == 0.0  # no SLOs: no goodput


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 250, "tpot": 300}, 1),   # A (0.1, 0.25) good; B tpot 0.4 > 0.3; C ttft 0.3 > 0.25
    ({"ttft": 300, "tpot": 450}, 3),   # every one; C's TPOT is 0 (one token)
    ({"e2el": 500}, 1),                # only C (0.3 s); A and B take 0.6 s
    ({"tpot": 0}, 1),                  # only C, whose TPOT counts as 0
    ({"ttft": 100, "e2el": 1000}, 1),  # only A (ttft 0.1 <= 0.1)
])
def test_goodput_by_hand(slos, good):
    m, _ = calculate_metrics(_fake_outputs(), 2.0, [99], slos)
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_result_dict_has_vllms_keys():
    outputs = _fake_outputs()
    m, lens = calculate_metrics(outputs, 2.0, [99, 99.9], {"ttft": 250})
    r = result_dict(m, outputs, lens, 2.0, ("ttft", "tpot", "itl", "e2el"), {"ttft": 250})
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "max_concurrent_requests", "max_output_tokens_per_s", "input_lens", "output_lens", "ttfts", "itls",
                "latencies", "errors"):
        assert key in r, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99", "p99.9"):
            assert f"{stat}_{metric}_ms" in r
    assert r["request_goodput"] == pytest.approx(1.0) and r["errors"][3] == "boom"  # A, B: ttft <= 0.25; 2 / 2 s
    r = result_dict(m, outputs, lens, 2.0)
    assert r["request_goodput"] is None and "mean_e2el_ms" not in r and "p99_ttft_ms" in r


def test_request_intervals():
    assert np.array_equal(request_intervals(5, math.inf), np.zeros(5))
    assert np.allclose(request_intervals(3, 4.0, math.inf), 0.25)
    x = request_intervals(20_000, 4.0, 1.0, seed=1)       # exponential: mean 1/4, CV 1
    assert x.mean() == pytest.approx(0.25, rel=0.03) and x.std() / x.mean() == pytest.approx(1.0, rel=0.05)
    for b in (0.25, 4.0):                                  # gamma: mean still 1/rate, CV 1/sqrt(b)
        x = request_intervals(20_000, 4.0, b, seed=2)
        assert x.mean() == pytest.approx(0.25, rel=0.05)
        assert x.std() / x.mean() == pytest.approx(1 / math.sqrt(b), rel=0.05)
    assert np.array_equal(request_intervals(10, 2.0, 1.0, seed=3), request_intervals(10, 2.0, 1.0, seed=3))
    t = arrival_times(10, 2.0, 1.0, seed=3)                # vLLM rescales: the last arrives at n / rate
    assert t[-1] == pytest.approx(5.0) and np.all(np.diff(t) >= 0)
    with pytest.raises(ValueError):
        request_intervals(3, 1.0, 0.0)


def test_random_requests():
    reqs = random_requests(50, 20, 8, range_ratio=0.5, prefix_len=4, vocab_size=100, special_ids=[0, 1], seed=7)
    assert all(10 + 4 <= r.prompt_len <= 30 + 4 and r.prompt_len == len(r.prompt_token_ids) for r in reqs)
    assert all(4 <= r.expected_output_len <= 12 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:4]) for r in reqs}) == 1  # the shared prefix
    assert all(0 not in r.prompt_token_ids and 1 not in r.prompt_token_ids for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5
    again = random_requests(50, 20, 8, range_ratio=0.5, prefix_len=4, vocab_size=100, special_ids=[0, 1], seed=7)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    fixed = random_requests(6, 16, 4, vocab_size=100)
    assert [(r.prompt_len, r.expected_output_len) for r in fixed] == [(16, 4)] * 6
    with pytest.raises(ValueError):
        random_requests(1, 16, 4, range_ratio=1.0, vocab_size=100)


def test_cli_parsing():
    args = build_parser("bench").parse_args(
        ["bench", "serve", "--json", "--num-prompts", "6", "--request-rate", "2.5", "--burstiness", "0.5",
         "--max-concurrency", "2", "--goodput", "ttft:100", "tpot:20", "--metric-percentiles", "50,99",
         "--base-url", "http://x:1", "--num-gpu-blocks-override", "64"])
    assert (args.command, args.bench_command, args.json, args.num_prompts) == ("bench", "serve", True, 6)
    assert (args.request_rate, args.burstiness, args.max_concurrency) == (2.5, 0.5, 2)
    assert args.goodput == [("ttft", 100.0), ("tpot", 20.0)] and args.num_gpu_blocks_override == 64
    d = build_parser("bench").parse_args(["bench", "serve"])
    assert math.isinf(d.request_rate) and d.burstiness == 1.0 and d.percentile_metrics == "ttft,tpot,itl"
    assert d.base_url is None and d.model == "small-gqa" and d.seed == 0
    assert main(["bench"]) == 2 and main(["bench", "serve", "--goodput", "ttfx:1"]) == 2
    assert main(["bench", "serve", "--request-rate", "0"]) == 2


# ---------------------------------------------------------------- on the engine

COMMON = dict(model="small-gqa", num_gpu_blocks_override=64, max_num_seqs=4, use_tqdm_on_load=False)


@pytest.fixture(scope="module")
def server():
    with serving(**COMMON) as served:
        yield served


def test_in_process_and_http(server, capsys):
    engine, url = server
    tok = engine.get_tokenizer()
    reqs = random_requests(6, 16, 4, vocab_size=tok.vocab_size, special_ids=tok.all_special_ids, seed=0)
    local = run_benchmark(InProcessTarget(engine, record_steps=True), reqs, num_warmups=2,
                          percentile_metrics=("ttft", "tpot", "itl", "e2el"))
    out, err = capsys.readouterr()
    assert out == "" and "6/6" in err  # vLLM's progress bar over completed requests, on stderr only
    assert (local["completed"], local["failed"], local["total_input_tokens"]) == (6, 0, 96)
    assert local["total_output_tokens"] == 24 and local["output_lens"] == [4] * 6
    assert all(t > 0 for t in local["ttfts"]) and all(len(itl) == 3 for itl in local["itls"])
    assert 1 <= local["max_concurrent_requests"] <= 6 and local["mean_e2el_ms"] >= local["mean_ttft_ms"] > 0
    # the scheduler's view, after the warm-up: a roomy pool computes each prompt and output token once
    # (the last output token is sampled, never computed), never preempts, and runs max_num_seqs at most
    assert local["computed_tokens"] == 6 * (16 + 4 - 1) and local["recomputed_tokens"] == local["preemptions"] == 0
    assert 1 <= local["peak_running_requests"] <= 4 and engine.llm_engine.engine.step_log is None
    assert sum(s["decode_tokens"] for s in local["scheduler_steps"]) == 6 * 3

    remote = run_benchmark(HTTPTarget(url, "small-gqa"), reqs, max_concurrency=2, disable_tqdm=True)
    assert remote["errors"] == [""] * 6 and capsys.readouterr().err == ""
    assert (remote["completed"], remote["total_input_tokens"], remote["total_output_tokens"]) == (6, 96, 24)
    assert all(t > 0 for t in remote["ttfts"])

    # the command over HTTP (no engine to build): JSON out, the same counts
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "3", "--random-input-len", "8",
                 "--random-output-len", "2", "--request-rate", "50", "--json", "--goodput", "e2el:600000",
                 "--vocab-size", str(tok.vocab_size)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["completed"], r["total_output_tokens"], r["num_prompts"]) == (3, 6, 3)
    assert r["request_goodput"] > 0 and "p99_itl_ms" in r and r["backend"] == "openai"


def test_in_process_tight_pool_reports_its_recompute_tax(capsys):
    """A pool of 5 usable blocks of 16 for requests of 28 + 8 tokens (3 blocks each at the end): two
    are admitted with 2 blocks each and cannot both grow, so one is preempted and recomputed (no prefix
    caching, which would serve its freed blocks back). Every
    token computed is needed once or recomputed: recomputed = computed - sum(prompt + output - 1)."""
    assert main(["bench", "serve", "--model", "small-gqa", "--num-gpu-blocks-override", "6", "--max-num-seqs", "4",
                 "--num-prompts", "4", "--random-input-len", "28", "--random-output-len", "8", "--json", "--no-enable-prefix-caching",
                 "--disable-tqdm"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["completed"] == 4 and r["preemptions"] > 0 and r["peak_blocks_in_use"] <= 5
    assert r["recomputed_tokens"] == r["computed_tokens"] - 4 * (28 + 8 - 1) > 0
    assert r["recompute_tax"] == r["recomputed_tokens"] / r["computed_tokens"]
