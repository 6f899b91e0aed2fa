"""kvjax.engine.metrics against hand-worked events and vLLM 0.33's own definitions.

vLLM is not importable here, so its definitions are copied below as literals, each with the
file and line it comes from (the wheel's `vllm/v1/metrics/loggers.py`, `buckets.py`,
`vllm/v1/engine/__init__.py`). A short sequence of engine steps and finished requests is
recorded and every counter, gauge and histogram bucket is checked against values worked out by
hand. When prometheus_client is installed (a dependency of orbax-checkpoint, not of kvjax), the
same events also go through a reference built from prometheus_client itself the way vLLM's
PrometheusStatLogger builds and records its metrics: its `generate_latest` text must equal
`render_prometheus()` line for line, and vLLM's reader.py conversion of its samples (restated
below) must equal `snapshot()`.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
import time

import pytest

from kvjax.engine.metrics import (CONTENT_TYPE, FINISH_REASONS, Counter, EngineMetrics, FinishedRequest, Gauge,
                                  Histogram, Metric, Vector, request_tokens_buckets)

# ---- vLLM's definitions, copied ---------------------------------------------------------------

# vllm/v1/metrics/buckets.py lines 30-54, 57-80, 84-104, 107-121, 125, 128.
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N = [1, 2, 5, 10, 20]
NUM_PREEMPTIONS = [1, 2, 3, 4, 5, 10, 20]
# build_1_2_5_buckets(100), its docstring's example (buckets.py line 195-202).
REQUEST_TOKENS_100 = [1, 2, 5, 10, 20, 50, 100]

# vllm/v1/engine/__init__.py line 37; vllm/v1/metrics/stats.py line 441 (PromptTokenStats.ALL_SOURCES);
# loggers.py line 606 (sleep states) and 559 (waiting reasons).
REASONS = ["stop", "length", "abort", "error", "repetition"]
SOURCES = ["local_compute", "local_cache_hit", "external_kv_transfer"]
SLEEP = ["awake", "weights_offloaded", "discard_all"]
WAITING = ["capacity", "deferred"]

# vllm/v1/metrics/loggers.py, PrometheusStatLogger.__init__, in its registration order (the line of
# each `name=`): name, type, documentation, extra label (name, values) and buckets. The ones kvjax
# leaves out (connector, multimodal, admission, LoRA, opt-in) are skipped.
TR = "request_tokens"
VLLM = [
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", None, None),  # 528
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", None, None),  # 538
    ("vllm:num_requests_waiting_by_reason", "gauge",  # 548
     "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
     "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
     "Sum of all reasons equals vllm:num_requests_waiting.", ("reason", WAITING), None),
    ("vllm:engine_sleep_state", "gauge",  # 594
     "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
     "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", ("sleep_state", SLEEP), None),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", None, None),  # 620
    ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
     None, None),  # 662
    ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", None, None),  # 673
    ("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.", None, None),  # 739
    ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", None, None),  # 748
    ("vllm:prompt_tokens_by_source", "counter", "Number of prompt tokens by source.", ("source", SOURCES), None),  # 758
    ("vllm:prompt_tokens_cached", "counter", "Number of cached prompt tokens (local + external).", None, None),  # 773
    ("vllm:generation_tokens", "counter", "Number of generation tokens processed.", None, None),  # 799
    ("vllm:request_success", "counter", "Count of successfully processed requests.",
     ("finished_reason", REASONS), None),  # 809
    ("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.", None, TR),  # 865
    ("vllm:request_generation_tokens", "histogram", "Number of generation tokens processed.", None, TR),  # 875
    ("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.", None,
     ITERATION_TOKENS),  # 888
    ("vllm:request_max_num_generation_tokens", "histogram",
     "Histogram of maximum number of requested generation tokens.", None, TR),  # 898
    ("vllm:request_params_n", "histogram", "Histogram of the n request parameter.", None, PARAMS_N),  # 908
    ("vllm:request_params_max_tokens", "histogram", "Histogram of the max_tokens request parameter.", None, TR),  # 918
    ("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.", None,
     TTFT),  # 931
    ("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.", None, ITL),  # 941
    ("vllm:request_time_per_output_token_seconds", "histogram",
     "Histogram of time_per_output_token_seconds per request.", None, ITL),  # 951
    ("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.", None,
     REQUEST_LATENCY),  # 961
    ("vllm:request_queue_time_seconds", "histogram", "Histogram of time spent in WAITING phase for request.",
     None, REQUEST_LATENCY),  # 971
    ("vllm:request_inference_time_seconds", "histogram", "Histogram of time spent in RUNNING phase for request.",
     None, REQUEST_LATENCY),  # 981
    ("vllm:request_prefill_time_seconds", "histogram", "Histogram of time spent in PREFILL phase for request.",
     None, REQUEST_LATENCY),  # 991
    ("vllm:request_decode_time_seconds", "histogram", "Histogram of time spent in DECODE phase for request.",
     None, REQUEST_LATENCY),  # 1001
    ("vllm:request_num_preemptions", "histogram", "Histogram of the number of times a request was preempted.",
     None, NUM_PREEMPTIONS),  # 1011
    ("vllm:request_prefill_kv_computed_tokens", "histogram",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", None, TR),  # 1021
]

BASE = {"model_name": "tiny", "engine": "0"}


# ---- the hand-worked events -------------------------------------------------------------------

REQ_A = FinishedRequest("stop", e2e_latency=1.25, queued_time=0.25, prefill_time=0.5, inference_time=1.0,
                        decode_time=0.5, num_prompt_tokens=12, num_generation_tokens=3, num_cached_tokens=8,
                        num_preemptions=1, max_tokens_param=16)
REQ_B = FinishedRequest("length", e2e_latency=8000.0, queued_time=0.0, prefill_time=0.0, inference_time=0.0,
                        decode_time=0.0, num_prompt_tokens=8, num_generation_tokens=1)


def record_events(m):
    """Three steps of two requests (A: 12-token prompt, 8 cached; B: 8 tokens) and their finish."""
    m.record_step(num_running=2, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=20,
                  prefix_cache_hits=8, num_prompt_tokens=20, num_cached_prompt_tokens=8, num_generation_tokens=2)
    m.record_first_token(0.03125)
    m.record_first_token(0.5)
    m.record_step(num_running=1, num_waiting=0, kv_cache_usage=0.5, num_preemptions=1, num_generation_tokens=1)
    m.record_inter_token_latency(0.01)
    m.record_step(num_running=0, num_waiting=0, kv_cache_usage=0.0)
    m.record_inter_token_latency(100.0)
    m.record_finished(REQ_A)
    m.record_finished(REQ_B)
    m.record_prompt_finished(n=2, max_num_generation_tokens=3)


def keys(bounds):
    """The `le` keys prometheus_client writes for these bounds (ints written as floats)."""
    return [str(float(b)) for b in bounds] + ["+Inf"]


def cumulative(bounds, placed):
    """Cumulative buckets from the hand-placed observations {le key: how many landed in that bucket}."""
    out, acc = {}, 0
    for k in keys(bounds):
        acc += placed.pop(k, 0)
        out[k] = acc
    assert not placed, f"keys not among the bounds: {placed}"
    return out


def by_name(metrics):
    out = {}
    for m in metrics:
        extra = tuple(v for k, v in m.labels.items() if k not in BASE)
        out[(m.name, extra[0] if extra else None)] = m
    return out


# Worked out by hand from record_events: (bucket key an observation falls in, le inclusive), count, sum.
# iteration tokens: step 1 (20 - 8) + 2 = 14 -> 16; step 2: 1 -> 1; step 3: 0 -> 1.
# mean time per output token: A 0.5 / (3 - 1) = 0.25 -> 0.3; B (one token) 0 -> 0.01.
EXPECTED_HIST = {
    "vllm:request_prompt_tokens": (REQUEST_TOKENS_100, {"20.0": 1, "10.0": 1}, 20),  # 12, 8
    "vllm:request_generation_tokens": (REQUEST_TOKENS_100, {"5.0": 1, "1.0": 1}, 4),  # 3, 1
    "vllm:iteration_tokens_total": (ITERATION_TOKENS, {"16.0": 1, "1.0": 2}, 15),
    "vllm:request_max_num_generation_tokens": (REQUEST_TOKENS_100, {"5.0": 1}, 3),
    "vllm:request_params_n": (PARAMS_N, {"2.0": 1}, 2),
    "vllm:request_params_max_tokens": (REQUEST_TOKENS_100, {"20.0": 1}, 16),  # B's None is not observed
    "vllm:time_to_first_token_seconds": (TTFT, {"0.04": 1, "0.5": 1}, 0.53125),
    "vllm:inter_token_latency_seconds": (ITL, {"0.01": 1, "+Inf": 1}, 100.01),
    "vllm:request_time_per_output_token_seconds": (ITL, {"0.3": 1, "0.01": 1}, 0.25),
    "vllm:e2e_request_latency_seconds": (REQUEST_LATENCY, {"1.5": 1, "+Inf": 1}, 8001.25),
    "vllm:request_queue_time_seconds": (REQUEST_LATENCY, {"0.3": 2}, 0.25),
    "vllm:request_inference_time_seconds": (REQUEST_LATENCY, {"1.0": 1, "0.3": 1}, 1.0),
    "vllm:request_prefill_time_seconds": (REQUEST_LATENCY, {"0.5": 1, "0.3": 1}, 0.5),
    "vllm:request_decode_time_seconds": (REQUEST_LATENCY, {"0.5": 1, "0.3": 1}, 0.5),
    "vllm:request_num_preemptions": (NUM_PREEMPTIONS, {"1.0": 2}, 1),  # 1 and 0
    "vllm:request_prefill_kv_computed_tokens": (REQUEST_TOKENS_100, {"5.0": 1, "10.0": 1}, 12),  # 12-8, 8-0
}
EXPECTED_SCALAR = {
    ("vllm:num_requests_running", None): 0.0, ("vllm:num_requests_waiting", None): 0.0,
    ("vllm:num_requests_waiting_by_reason", "capacity"): 0.0,
    ("vllm:num_requests_waiting_by_reason", "deferred"): 0.0,
    ("vllm:engine_sleep_state", "awake"): 1.0, ("vllm:engine_sleep_state", "weights_offloaded"): 0.0,
    ("vllm:engine_sleep_state", "discard_all"): 0.0, ("vllm:kv_cache_usage_perc", None): 0.0,
    ("vllm:prefix_cache_queries", None): 20, ("vllm:prefix_cache_hits", None): 8,
    ("vllm:num_preemptions", None): 1, ("vllm:prompt_tokens", None): 20,
    ("vllm:prompt_tokens_by_source", "local_compute"): 12, ("vllm:prompt_tokens_by_source", "local_cache_hit"): 8,
    ("vllm:prompt_tokens_by_source", "external_kv_transfer"): 0, ("vllm:prompt_tokens_cached", None): 8,
    ("vllm:generation_tokens", None): 3,
    ("vllm:request_success", "stop"): 1, ("vllm:request_success", "length"): 1,
    ("vllm:request_success", "abort"): 0, ("vllm:request_success", "error"): 0,
    ("vllm:request_success", "repetition"): 0,
}


# ---- tests ------------------------------------------------------------------------------------

def test_reader_types_are_vllms_dataclasses():
    # A vLLM script (examples/observability/metrics/offline.py) isinstance-checks these.
    c, g = Counter("vllm:x", {"a": "b"}, 3), Gauge("vllm:y", {}, 0.5)
    h, v = Histogram("vllm:z", {}, count=2, sum=1.5, buckets={"1.0": 1, "+Inf": 2}), Vector("vllm:w", {}, [1, 2])
    for m in (c, g, h, v):
        assert isinstance(m, Metric)
    assert (c.name, c.labels, c.value) == ("vllm:x", {"a": "b"}, 3)
    assert not isinstance(g, Counter) and not isinstance(c, Gauge)
    assert [f for f in Histogram.__dataclass_fields__] == ["name", "labels", "count", "sum", "buckets"]
    assert Counter("n", {}, 1) == Counter("n", {}, 1)
    assert FINISH_REASONS == tuple(REASONS)


def test_metric_list_names_types_labels_and_order():
    m = EngineMetrics("tiny", max_model_len=100)
    snap = m.snapshot()
    expected = []
    for name, kind, _, extra, _ in VLLM:
        cls = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[kind]
        for value in (extra[1] if extra else [None]):
            expected.append((name, cls, BASE if value is None else {**BASE, extra[0]: value}))
    assert [(s.name, type(s), s.labels) for s in snap] == expected
    # Counters are named without `_total`, as reader.py reports the family name.
    assert not any(s.name.endswith("_total") for s in snap if isinstance(s, Counter))
    # Label order as prometheus_client builds them: model_name, engine, then the extra one.
    assert list(by_name(snap)[("vllm:request_success", "stop")].labels) == ["model_name", "engine", "finished_reason"]


def test_bucket_bounds_equal_vllms():
    assert list(request_tokens_buckets(100)) == REQUEST_TOKENS_100
    assert list(request_tokens_buckets(1)) == [1]
    assert list(request_tokens_buckets(4096)) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    snap = by_name(EngineMetrics("tiny", max_model_len=100).snapshot())
    for name, kind, _, _, buckets in VLLM:
        if kind == "histogram":
            bounds = REQUEST_TOKENS_100 if buckets == TR else buckets
            assert list(snap[(name, None)].buckets) == keys(bounds), name
    # prometheus_client writes 1e6 and up in Go's exponent form: a long-context model's `le` keys.
    long = by_name(EngineMetrics("big", max_model_len=2_000_000).snapshot())[("vllm:request_prompt_tokens", None)]
    assert list(long.buckets)[-4:] == ["500000.0", "1e+06", "2e+06", "+Inf"]


def test_fresh_metrics_are_zero():
    snap = EngineMetrics("tiny", max_model_len=100).snapshot()
    for s in snap:
        if isinstance(s, Histogram):
            assert s.count == 0 and s.sum == 0.0 and set(s.buckets.values()) == {0}
        else:
            assert s.value == (1 if s.labels.get("sleep_state") == "awake" else 0)


def test_recorded_events_match_hand_worked_values():
    m = EngineMetrics("tiny", max_model_len=100)
    record_events(m)
    snap = by_name(m.snapshot())
    for key, value in EXPECTED_SCALAR.items():
        got = snap[key]
        assert got.value == value and type(got.value) is type(value), (key, got.value)
    for name, (bounds, placed, total) in EXPECTED_HIST.items():
        h = snap[(name, None)]
        assert h.buckets == cumulative(bounds, dict(placed)), name
        assert list(h.buckets) == keys(bounds)
        assert h.count == sum(placed.values()) == h.buckets["+Inf"], name
        assert h.sum == pytest.approx(total, rel=1e-12), name
        assert isinstance(h.count, int) and isinstance(h.sum, float)
    assert len(snap) == len(EXPECTED_SCALAR) + len(EXPECTED_HIST)


def test_gauges_hold_the_last_step():
    m = EngineMetrics("tiny", max_model_len=100)
    m.record_step(num_running=3, num_waiting=5, kv_cache_usage=0.75)
    snap = by_name(m.snapshot())
    assert snap[("vllm:num_requests_running", None)].value == 3.0
    assert snap[("vllm:num_requests_waiting", None)].value == 5.0
    assert snap[("vllm:num_requests_waiting_by_reason", "capacity")].value == 5.0
    assert snap[("vllm:kv_cache_usage_perc", None)].value == 0.75


def test_finished_request_from_timestamps_and_time_per_output_token():
    # vLLM's stats.py update_from_finished_request: queued -> scheduled -> first token -> last token.
    r = FinishedRequest.from_timestamps("stop", arrival=10.0, queued=10.0, scheduled=10.5, first_token=11.0,
                                        last_token=13.0, finished=13.25, num_prompt_tokens=7,
                                        num_generation_tokens=5, max_tokens_param=9)
    assert (r.e2e_latency, r.queued_time, r.prefill_time, r.decode_time, r.inference_time) == (
        3.25, 0.5, 0.5, 2.0, 2.5)
    assert r.mean_time_per_output_token == 0.5  # 2.0 over the 4 tokens after the first
    assert FinishedRequest("abort", 1.0, 0.0, 0.0, 0.0, 0.0, 3, 0).mean_time_per_output_token == 0.0


@pytest.mark.parametrize("call, message", [
    (lambda m: m.record_step(num_running=-1, num_waiting=0, kv_cache_usage=0.0), "num_running = -1"),
    (lambda m: m.record_step(num_running=0, num_waiting=0, kv_cache_usage=1.5), "kv_cache_usage = 1.5"),
    (lambda m: m.record_step(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=2,
                             prefix_cache_hits=3), "prefix_cache_hits = 3 > prefix_cache_queries = 2"),
    (lambda m: m.record_step(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_prompt_tokens=2,
                             num_cached_prompt_tokens=3), "num_cached_prompt_tokens = 3"),
    (lambda m: m.record_step(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_generation_tokens=1.5),
     "num_generation_tokens = 1.5"),
    (lambda m: m.record_first_token(float("nan")), "ttft is NaN"),
    (lambda m: m.record_prompt_finished(n=0.5, max_num_generation_tokens=1), "n = 0.5"),
    (lambda m: FinishedRequest("eos", 1.0, 0.0, 0.0, 0.0, 0.0, 1, 1), "finish_reason 'eos'"),
    (lambda m: FinishedRequest("stop", 1.0, 0.0, 0.0, 0.0, 0.0, 1, -2), "num_generation_tokens = -2"),
    (lambda m: EngineMetrics("x", max_model_len=0), "max_model_len = 0"),
])
def test_bad_input_names_the_value(call, message):
    m = EngineMetrics("tiny", max_model_len=100)
    with pytest.raises(ValueError, match=re.escape(message)):
        call(m)
    assert m.snapshot() == EngineMetrics("tiny", max_model_len=100).snapshot()  # nothing half-recorded


# ---- the text format --------------------------------------------------------------------------

def parse_text(text):
    """A small parser of the 0.0.4 text format: {(sample name, sorted label items): value}, and
    {family: (type, help)}. Label values are unescaped (\\\\, \\", \\n)."""
    samples, families = {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, doc = line[7:].split(" ", 1)
            families.setdefault(name, [None, None])[1] = doc.replace(r"\n", "\n").replace("\\\\", "\\")
            continue
        if line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            families.setdefault(name, [None, None])[0] = kind
            continue
        name, rest = (line.split("{", 1) + [""])[:2] if "{" in line else (line.split(" ")[0], "")
        labels, i = {}, 0
        if rest:
            while rest[i] != "}":
                eq = rest.index("=", i)
                key, j, value = rest[i:eq], eq + 2, []
                while rest[j] != '"':
                    if rest[j] == "\\":
                        value.append({"n": "\n", "\\": "\\", '"': '"'}[rest[j + 1]])
                        j += 2
                    else:
                        value.append(rest[j])
                        j += 1
                labels[key] = "".join(value)
                i = j + 1 + (rest[j + 1] == ",")
            value = rest[i + 2:]
        else:
            value = line.split(" ")[1]
        samples[(name, tuple(sorted(labels.items())))] = float(value)
    return samples, {k: tuple(v) for k, v in families.items()}


def test_rendered_text_parses_back_to_the_snapshot():
    start = time.time()
    m = EngineMetrics("tiny", max_model_len=100)
    record_events(m)
    text = m.render_prometheus()
    samples, families = parse_text(text)
    key = lambda name, labels: (name, tuple(sorted(labels.items())))  # noqa: E731
    expected = set()
    for s in m.snapshot():
        if isinstance(s, Histogram):
            assert families[s.name][0] == "histogram"
            for le, c in s.buckets.items():
                assert samples[key(s.name + "_bucket", {**s.labels, "le": le})] == c
                expected.add(key(s.name + "_bucket", {**s.labels, "le": le}))
            assert samples[key(s.name + "_count", s.labels)] == s.count
            assert samples[key(s.name + "_sum", s.labels)] == s.sum
            expected |= {key(s.name + "_count", s.labels), key(s.name + "_sum", s.labels)}
        elif isinstance(s, Counter):
            assert families[s.name + "_total"][0] == "counter"
            assert samples[key(s.name + "_total", s.labels)] == s.value
            expected.add(key(s.name + "_total", s.labels))
        else:
            assert families[s.name][0] == "gauge"
            assert samples[key(s.name, s.labels)] == s.value
            expected.add(key(s.name, s.labels))
        if not isinstance(s, Gauge):  # prometheus_client's `_created` series: a gauge family of its own
            assert families[s.name + "_created"][0] == "gauge"
            assert start <= samples[key(s.name + "_created", s.labels)] <= time.time()
            expected.add(key(s.name + "_created", s.labels))
    assert set(samples) == expected
    for name, kind, doc, _, _ in VLLM:
        assert families[name + "_total" if kind == "counter" else name] == (kind, doc)
    # Exact lines, worked out by hand: labels sorted by name, every value written as a float.
    lines = text.splitlines()
    assert lines[:3] == ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                         "# TYPE vllm:num_requests_running gauge",
                         'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0']
    i = lines.index("# TYPE vllm:request_success_total counter")
    assert lines[i + 1:i + 3] == [
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0',
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1.0']
    assert lines[i + 6] == "# HELP vllm:request_success_created Count of successfully processed requests."
    i = lines.index("# TYPE vllm:request_params_n histogram")
    assert lines[i + 1:i + 9] == [
        'vllm:request_params_n_bucket{engine="0",le="1.0",model_name="tiny"} 0.0',
        'vllm:request_params_n_bucket{engine="0",le="2.0",model_name="tiny"} 1.0',
        'vllm:request_params_n_bucket{engine="0",le="5.0",model_name="tiny"} 1.0',
        'vllm:request_params_n_bucket{engine="0",le="10.0",model_name="tiny"} 1.0',
        'vllm:request_params_n_bucket{engine="0",le="20.0",model_name="tiny"} 1.0',
        'vllm:request_params_n_bucket{engine="0",le="+Inf",model_name="tiny"} 1.0',
        'vllm:request_params_n_count{engine="0",model_name="tiny"} 1.0',
        'vllm:request_params_n_sum{engine="0",model_name="tiny"} 2.0']
    assert text.endswith("\n") and CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_label_values_are_escaped():
    name = 'org/"quoted"\\path\nline2'
    m = EngineMetrics(name, max_model_len=10, engine_index=3)
    text = m.render_prometheus()
    assert 'vllm:prompt_tokens_total{engine="3",model_name="org/\\"quoted\\"\\\\path\\nline2"} 0.0' in text.splitlines()
    samples, _ = parse_text(text)
    assert samples[("vllm:prompt_tokens_total", (("engine", "3"), ("model_name", name)))] == 0.0
    assert all(s.labels["model_name"] == name and s.labels["engine"] == "3" for s in m.snapshot())


def test_numbers_are_written_as_prometheus_client_writes_them():
    # utils.floatToGoString: Python's repr, but Go's exponent form from 1e+06 up; every value a float.
    m = EngineMetrics("tiny", max_model_len=10)
    m.record_first_token(1234567.0)
    m.record_inter_token_latency(0.1)
    m.record_inter_token_latency(0.2)
    m.record_step(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_generation_tokens=5)
    lines = m.render_prometheus().splitlines()
    for line in ['vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 1.234567e+06',
                 'vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="tiny"} 0.0',
                 'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 1.0',
                 'vllm:inter_token_latency_seconds_sum{engine="0",model_name="tiny"} 0.30000000000000004',
                 'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 1.0',
                 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 5.0',
                 'vllm:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="tiny"} 1.0']:
        assert line in lines, line


def test_no_jax_import():
    code = "import sys, kvjax.engine.metrics; assert 'jax' not in sys.modules, 'metrics imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- against prometheus_client, built and fed as vLLM does ------------------------------------

class VllmReference:
    """PrometheusStatLogger's metrics in a private prometheus_client registry, recorded the way
    its record() records them (loggers.py lines 1138-1343)."""

    def __init__(self, prom, model_name, max_model_len):
        self.registry = prom.CollectorRegistry()
        self.m = {}
        for name, kind, doc, extra, buckets in VLLM:
            labelnames = ["model_name", "engine"] + ([extra[0]] if extra else [])
            if kind == "histogram":
                b = request_tokens_buckets(max_model_len) if buckets == TR else buckets
                metric = prom.Histogram(name, doc, labelnames, buckets=b, registry=self.registry)
            else:
                cls = prom.Gauge if kind == "gauge" else prom.Counter
                metric = cls(name, doc, labelnames, registry=self.registry)
            values = extra[1] if extra else [None]
            self.m[name] = {v: metric.labels(model_name, "0", *([v] if v else [])) for v in values}
        self.m["vllm:engine_sleep_state"]["awake"].set(1)  # record_sleep_state()'s default

    def step(self, running, waiting, usage, queries=0, hits=0, preempted=0, prompt=0, cached=0, generated=0):
        m = self.m
        m["vllm:num_requests_running"][None].set(running)
        m["vllm:num_requests_waiting"][None].set(waiting)
        m["vllm:num_requests_waiting_by_reason"]["capacity"].set(waiting)
        m["vllm:num_requests_waiting_by_reason"]["deferred"].set(0)
        m["vllm:kv_cache_usage_perc"][None].set(usage)
        m["vllm:prefix_cache_queries"][None].inc(queries)
        m["vllm:prefix_cache_hits"][None].inc(hits)
        m["vllm:num_preemptions"][None].inc(preempted)
        m["vllm:prompt_tokens"][None].inc(prompt)
        m["vllm:prompt_tokens_by_source"]["local_compute"].inc(prompt - cached)
        m["vllm:prompt_tokens_by_source"]["local_cache_hit"].inc(cached)
        m["vllm:prompt_tokens_by_source"]["external_kv_transfer"].inc(0)
        m["vllm:prompt_tokens_cached"][None].inc(cached)
        m["vllm:generation_tokens"][None].inc(generated)
        m["vllm:iteration_tokens_total"][None].observe(prompt - cached + generated)

    def finished(self, r):
        m = self.m
        m["vllm:request_success"][r.finish_reason].inc()
        for name, x in [("e2e_request_latency_seconds", r.e2e_latency), ("request_queue_time_seconds", r.queued_time),
                        ("request_prefill_time_seconds", r.prefill_time),
                        ("request_inference_time_seconds", r.inference_time),
                        ("request_decode_time_seconds", r.decode_time),
                        ("request_num_preemptions", r.num_preemptions),
                        ("request_prefill_kv_computed_tokens", r.num_prompt_tokens - max(r.num_cached_tokens, 0)),
                        ("request_prompt_tokens", r.num_prompt_tokens),
                        ("request_generation_tokens", r.num_generation_tokens),
                        ("request_time_per_output_token_seconds",
                         r.decode_time / (r.num_generation_tokens - 1) if r.num_generation_tokens > 1 else 0)]:
            m["vllm:" + name][None].observe(x)
        if r.max_tokens_param:
            m["vllm:request_params_max_tokens"][None].observe(r.max_tokens_param)

    def log_metrics_info(self, prom, labels):
        """vLLM's log_metrics_info("cache_config", ...): a gauge registered after the others, set to 1."""
        info = {**labels, "engine": ""}
        gauge = prom.Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                           labelnames=info.keys(), registry=self.registry)
        gauge.labels(**{**labels, "engine": "0"}).set(1)

    def snapshot(self):
        """vLLM's reader.py get_metrics_snapshot() over this registry, restated."""
        out = []
        for metric in self.registry.collect():
            samples = lambda suffix: [s for s in metric.samples if s.name == metric.name + suffix]  # noqa: E731
            if metric.type == "gauge":
                out += [Gauge(metric.name, s.labels, s.value) for s in samples("")]
            elif metric.type == "counter":
                out += [Counter(metric.name, s.labels, int(s.value)) for s in samples("_total")]
            else:
                (count,), (total,) = samples("_count"), samples("_sum")
                buckets = {s.labels["le"]: int(s.value) for s in samples("_bucket")}
                out.append(Histogram(metric.name, count.labels, int(count.value), total.value, buckets))
        return out


def feed_reference(ref):
    ref.step(2, 1, 0.25, queries=20, hits=8, prompt=20, cached=8, generated=2)
    ref.m["vllm:time_to_first_token_seconds"][None].observe(0.03125)
    ref.m["vllm:time_to_first_token_seconds"][None].observe(0.5)
    ref.step(1, 0, 0.5, preempted=1, generated=1)
    ref.m["vllm:inter_token_latency_seconds"][None].observe(0.01)
    ref.step(0, 0, 0.0)
    ref.m["vllm:inter_token_latency_seconds"][None].observe(100.0)
    ref.finished(REQ_A)
    ref.finished(REQ_B)
    ref.m["vllm:request_params_n"][None].observe(2)
    ref.m["vllm:request_max_num_generation_tokens"][None].observe(3)


@pytest.mark.parametrize("model_name, max_model_len", [("tiny", 100), ('a"b\\c\nd', 1_000_000)])
def test_same_text_and_snapshot_as_prometheus_client(model_name, max_model_len):
    prom = pytest.importorskip("prometheus_client")
    ref = VllmReference(prom, model_name, max_model_len)
    feed_reference(ref)
    m = EngineMetrics(model_name, max_model_len=max_model_len)
    record_events(m)
    info = {"block_size": "16", "cache_dtype": "auto", "kv_cache_max_concurrency": "2.5", "num_cpu_blocks": "None"}
    ref.log_metrics_info(prom, info)
    m.log_metrics_info(info)
    # The `_created` lines carry each side's own creation time; everything else must match exactly.
    strip = lambda text: [ln for ln in text.splitlines() if "_created" not in ln]  # noqa: E731
    ours, theirs = m.render_prometheus(), prom.generate_latest(ref.registry).decode()
    assert strip(ours) == strip(theirs)
    created = lambda text: [ln.rsplit(" ", 1)[0] for ln in text.splitlines() if "_created" in ln]  # noqa: E731
    assert created(ours) == created(theirs)
    assert m.snapshot() == ref.snapshot()
    assert [list(h.buckets) for h in m.snapshot() if isinstance(h, Histogram)] == [
        list(h.buckets) for h in ref.snapshot() if isinstance(h, Histogram)]
    parser = pytest.importorskip("prometheus_client.parser")
    parsed = {f.name: f for f in parser.text_string_to_metric_families(ours)}
    assert parsed["vllm:request_success"].type == "counter"
    assert {s.labels["model_name"] for s in parsed["vllm:prompt_tokens"].samples} == {model_name}


# ---- thread safety ----------------------------------------------------------------------------

def read_until_done(m, workers):
    """Snapshot and render until the workers finish (three times at least); how many reads."""
    reads = 0
    labels = (("engine", "0"), ("model_name", "tiny"))
    while any(w.is_alive() for w in workers) or reads < 3:
        snap = by_name(m.snapshot())
        generated = snap[("vllm:generation_tokens", None)].value
        # Within one snapshot every step is either wholly in or wholly out.
        assert snap[("vllm:prompt_tokens", None)].value == 3 * generated
        assert snap[("vllm:prefix_cache_queries", None)].value == 2 * snap[("vllm:prefix_cache_hits", None)].value
        iteration = snap[("vllm:iteration_tokens_total", None)]
        assert iteration.count == generated and iteration.sum == 3 * generated
        assert iteration.buckets["8.0"] == iteration.count
        samples, _ = parse_text(m.render_prometheus())
        assert samples[("vllm:prompt_tokens_total", labels)] == 3 * samples[("vllm:generation_tokens_total", labels)]
        reads += 1
    return reads


def test_recording_from_threads_while_reading_keeps_totals_consistent():
    m = EngineMetrics("tiny", max_model_len=100)
    threads, steps = 4, 400
    req = FinishedRequest("stop", 1.0, 0.1, 0.2, 0.7, 0.5, num_prompt_tokens=3, num_generation_tokens=2)

    def engine():
        for _ in range(steps):
            # One step: 3 prompt tokens (1 cached) finish prefill, 1 token generated: iteration tokens 3.
            m.record_step(num_running=1, num_waiting=2, kv_cache_usage=0.5, prefix_cache_queries=4,
                          prefix_cache_hits=2, num_prompt_tokens=3, num_cached_prompt_tokens=1,
                          num_generation_tokens=1)
            m.record_first_token(0.05)
            m.record_finished(req)

    workers = [threading.Thread(target=engine) for _ in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that a missing lock shows within the test
    try:
        for w in workers:
            w.start()
        assert read_until_done(m, workers) >= 3
    finally:
        for w in workers:
            w.join()
        sys.setswitchinterval(interval)
    snap = by_name(m.snapshot())
    total = threads * steps
    assert snap[("vllm:generation_tokens", None)].value == total
    assert snap[("vllm:prompt_tokens_by_source", "local_compute")].value == 2 * total
    assert snap[("vllm:request_success", "stop")].value == total
    ttft = snap[("vllm:time_to_first_token_seconds", None)]
    assert ttft.count == total and ttft.buckets["0.04"] == 0 and ttft.buckets["0.06"] == total
    assert snap[("vllm:request_time_per_output_token_seconds", None)].sum == pytest.approx(0.5 * total)
    assert math.isclose(snap[("vllm:e2e_request_latency_seconds", None)].sum, float(total))
