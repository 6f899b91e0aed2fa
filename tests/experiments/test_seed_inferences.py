"""experiments/seed_inferences.py without an engine: its per-run figures on hand-timed requests and a
hand-written step log, and each section's verdict rule on numbers chosen to fall on either side of
it. (The measured run is the experiment's own: `python -m kvjax.experiments.seed_inferences`.)"""
from __future__ import annotations

import pytest

from kvjax.benchmarks.serve import RequestFuncOutput
from kvjax.engine.stats import StepLog, StepRecord
from kvjax.experiments import seed_inferences as si
from kvjax.experiments import seed_inferences_report as rep


def step(start, end, *, running=2, prefill=0, decode=2, recomputed=0, preempted=(), compiled=False):
    # the requests below start at 1.0 s
    return StepRecord(start=1.0 + start, end=1.0 + end, steps=1, num_scheduled=running, num_running=running, num_waiting=0,
                      num_preempted=len(preempted), blocks_in_use=4, tokens_held=40, prefill_tokens=prefill,
                      decode_tokens=decode, recomputed_tokens=recomputed, compiled=compiled, preempted=preempted)


def log_of(records):
    log = StepLog()
    log.records = records
    return log


def two_requests():
    """bench-1 streams every 10 ms; bench-2 is preempted and waits 100 ms once."""
    a = RequestFuncOutput(success=True, prompt_len=8, output_tokens=4, ttft=0.05, itl=[0.01, 0.01, 0.01],
                          latency=0.08, start_time=1.0)
    b = RequestFuncOutput(success=True, prompt_len=8, output_tokens=3, ttft=0.05, itl=[0.1, 0.01],
                          latency=0.16, start_time=1.0)
    return [a, b]


def test_metrics_and_stalls_by_hand():
    recs = [step(0.0, 0.05, prefill=16, decode=0, compiled=True), step(0.05, 0.06), step(0.06, 0.07, preempted=("bench-2",)),
            step(0.07, 0.09, prefill=11, decode=1, recomputed=9), step(0.09, 0.1)]
    outs = two_requests()
    m = si.metrics_of(outs, 0.2, log_of(recs))
    assert (m["computed_tokens"], m["recomputed_tokens"], m["prefill_tokens"]) == (34, 9, 27)
    assert m["recompute_tax"] == pytest.approx(9 / 34) and m["preemptions"] == 1
    assert (m["steps"], m["compiled_steps"]) == (5, 1)
    assert m["decode_step_ms"] == pytest.approx(10.0)  # the three decode-only timed steps, 10 ms each
    assert m["output_throughput"] == pytest.approx(7 / 0.2)
    s = si.stalls(outs, log_of(recs))
    assert s["preempted_requests"] == 1 and s["preempted_max_gap_p50_ms"] == pytest.approx(100.0)
    assert s["itl_p50_ms"] == pytest.approx(10.0) and s["recompute_step_p50_ms"] == pytest.approx(20.0)
    tl = si.timeline(outs, log_of(recs))
    assert tl["token_time_s"][:3] == pytest.approx([0.06, 0.07, 0.08]) and tl["preempt_s"] == pytest.approx([0.07])


def preemption_rows(gap, itl, roomy_itl=10.0, tput=(100.0, 80.0)):
    base = dict(ttft_p50_ms=1.0, ttft_p99_ms=2.0, tpot_p50_ms=1.0, tpot_p99_ms=1.0, itl_p99_ms=50.0,
                recompute_step_p50_ms=20.0, decode_step_p50_ms=10.0, longest_requests_held=1)
    return [dict(base, num_blocks=100, preemptions=0, recompute_tax=0.0, itl_p50_ms=roomy_itl,
                 output_throughput=tput[0], preempted_max_gap_p50_ms=None),
            dict(base, num_blocks=20, preemptions=5, recompute_tax=0.3, itl_p50_ms=itl,
                 output_throughput=tput[1], preempted_max_gap_p50_ms=gap)]


@pytest.mark.parametrize("gap, itl, says", [(100.0, 11.0, "**spikes**"), (200.0, 30.0, "**not only spikes**"),
                                            (20.0, 11.0, "**no clear spike**")])
def test_preemption_verdict_follows_its_rule(gap, itl, says):
    r = {"rate_req_s": 1.0, "requests": 8, "input_len": 8, "output_len": 8, "max_num_seqs": 2, "block_size": 16,
         "rows": preemption_rows(gap, itl)}
    text = "\n".join(rep.preemption_md(r))
    assert f"Verdict: {says}" in text and "throughput drops (20.0%)" in text and "30.0% of the work redone" in text


def test_block_size_and_offload_and_plan_verdicts():
    rows = [dict(block_size=b, num_blocks=n, usable_tokens=u, peak_running=p, mean_running=m, preemptions=0,
                 tail_waste_tokens_per_request=w, tail_waste_share=0.1, decode_step_ms=1.0, output_throughput=1.0)
            for b, n, u, p, m, w in ((16, 64, 1008, 8, 7.0, 8.0), (128, 8, 896, 8, 6.9, 64.0))]
    r = {"budget_tokens": 1024, "requests": 8, "input_len": 8, "output_len": 8, "rows": rows}
    assert "**concurrency holds**" in "\n".join(rep.block_size_md(r))
    rows[1]["peak_running"] = 6
    assert "**concurrency changes" in "\n".join(rep.block_size_md(r))

    ho = [dict(host_tier=h, num_blocks=10, returning_ttft_p50_ms=t, returning_ttft_p99_ms=t, first_turn_ttft_p50_ms=1.0,
               prefill_tokens=p, peak_running=4, mean_running=3.0, preemptions=0, **extra)
          for h, t, p, extra in ((False, 100.0, 900, {}), (True, 25.0, 300,
                                                           dict(host_bytes_stored=1000, host_bytes_loaded=24)))]
    r = {"conversations": 4, "turns": 2, "first": 8, "new": 4, "output_len": 4, "distinct_blocks": 20, "rows": ho}
    text = "\n".join(rep.host_offload_md(r))
    assert "**confirmed**" in text and "+75%" in text and "1,024 bytes" in text
    ho[1]["peak_running"] = 5
    assert "**refuted**" in "\n".join(rep.host_offload_md(r))

    plan = [dict(num_blocks=13, request_len=36, planned_concurrency=4, vllm_reported_concurrency=4.33, max_model_len=36,
                 observed_peak_running=p, observed_mean_running=4.0, preemptions=0, recompute_tax=0.0) for p in (6, 4)]
    assert "**the plan holds**" in "\n".join(rep.planned_md({"rows": plan}))
    plan[1]["observed_peak_running"] = 5
    assert "**the peak exceeds both figures**" in "\n".join(rep.planned_md({"rows": plan}))


def test_prefix_caching_verdict():
    def side(step_ms, tput, prefill):
        return dict(output_throughput=tput, mean_step_ms=step_ms, ttft_p50_ms=1.0, prefill_tokens=prefill)
    r = {"requests": 8, "input_len": 8, "output_len": 8, "repeats": 2,
         "unique": {"prefix_len": 0, "on": side(10.2, 100.0, 64), "off": side(10.0, 100.0, 64)},
         "shared_prefix": {"prefix_len": 6, "on": side(9.0, 150.0, 16), "off": side(10.0, 100.0, 64)}}
    text = "\n".join(rep.prefix_caching_md(r))
    assert "**a cost too small to see**" in text and "+50.0% throughput" in text
    r["unique"]["on"]["mean_step_ms"] = 11.0
    assert "**a measurable cost** (+10.0% per step)" in "\n".join(rep.prefix_caching_md(r))
