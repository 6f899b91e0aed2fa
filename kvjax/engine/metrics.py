"""vLLM's engine metrics: what `llm.get_metrics()` returns and what a `/metrics` endpoint serves.

The reader types are those of vLLM 0.33's `vllm/v1/metrics/reader.py` as `get_metrics_snapshot()`
builds them from prometheus_client samples: a counter named without `_total`, its value an int;
a gauge's value a float; a histogram's buckets cumulative, keyed by `le` as prometheus_client
writes it ("0.3", "1.0", "1e+06", "+Inf"). `EngineMetrics` records the metrics vLLM's
`PrometheusStatLogger` (`vllm/v1/metrics/loggers.py`) registers, with its names, HELP strings,
labels, bucket bounds (`vllm/v1/metrics/buckets.py`) and registration order (get_metrics()'s
order), from the quantities of `vllm/v1/metrics/stats.py` (each `record_*` says which), and
renders them as prometheus_client's `generate_latest` does (text format 0.0.4).

Left out (kvjax has no such feature, or vLLM registers them only when one is enabled):
speculative decoding (vllm:spec_decode_*), LoRA (vllm:lora_requests_info), the multimodal cache
(vllm:mm_cache_*), KV connectors (vllm:external_prefix_cache_*, vllm:prompt_tokens_cached_by_source,
vllm:num_requests_kv_fetch_by_stage and the connectors' own), frontend admission limits
(vllm:admission_rejections), MFU estimates (vllm:estimated_*_per_gpu_total), NaN-logit and
watermark counts (vllm:corrupted_requests, vllm:watermark_requests), the opt-in KV block residency
histograms (vllm:kv_block_*_seconds) and `--custom-histogram-buckets`.

vllm:cache_config_info (vLLM's `log_metrics_info`, registered once the pool is sized, so after every
other family) is a gauge fixed at 1 whose labels are the cache config as strings and the engine
index, without model_name: `cache_config_info(config)` computes them, `EngineMetrics.log_metrics_info`
records them, and both get_metrics() and render_prometheus() report it last.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import numbers
import threading
import time

# The Content-Type of render_prometheus()'s text, as prometheus_client serves format 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's FinishReason labels in its enum order (vllm/v1/engine/__init__.py FINISH_REASON_STRINGS):
# vllm:request_success carries all five from the start, at 0 until one is counted.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


@dataclasses.dataclass
class Metric:
    """vLLM's base reader type: a metric's name and its label values."""
    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""
    value: int


@dataclasses.dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM's spec-decoding positions; kvjax reports none)."""
    values: list[int]


@dataclasses.dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""
    value: float


@dataclasses.dataclass
class Histogram(Metric):
    """Observations in buckets keyed by upper bound ("+Inf" always present), cumulative;
    count is the "+Inf" bucket, sum the total of the observed values."""
    count: int
    sum: float
    buckets: dict[str, int]


# Bucket bounds, vllm/v1/metrics/buckets.py.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count buckets (build_1_2_5_buckets): 1, 2, 5, 10, 20, 50, ... <= max_model_len."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclasses.dataclass(frozen=True)
class _Family:
    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    label: str | None = None  # the one label vLLM adds to model_name and engine, if any
    label_values: tuple[str, ...] = ()  # its children, in the order vLLM creates them
    buckets: tuple[float, ...] | str = ()  # histograms: the bounds, or _TOKENS (made per engine)


def _hist(name: str, help: str, buckets) -> _Family:
    return _Family(name, "histogram", help, buckets=buckets)


_INFO_NAME, _INFO_HELP = "vllm:cache_config_info", "Information of the LLMEngine CacheConfig"

# PrometheusStatLogger.__init__'s registration order, which is get_metrics()'s order.
_LATENCY, _ITL, _TOKENS = REQUEST_LATENCY_BUCKETS, INTER_TOKEN_LATENCY_BUCKETS, "request_tokens"
_FAMILIES = (
    _Family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    _Family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    _Family("vllm:num_requests_waiting_by_reason", "gauge",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.", "reason", ("capacity", "deferred")),
    _Family("vllm:engine_sleep_state", "gauge",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "sleep_state", ("awake", "weights_offloaded", "discard_all")),
    _Family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    _Family("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens."),
    _Family("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    _Family("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."),
    _Family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    _Family("vllm:prompt_tokens_by_source", "counter", "Number of prompt tokens by source.",
            "source", ("local_compute", "local_cache_hit", "external_kv_transfer")),
    _Family("vllm:prompt_tokens_cached", "counter", "Number of cached prompt tokens (local + external)."),
    _Family("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    _Family("vllm:request_success", "counter", "Count of successfully processed requests.",
            "finished_reason", FINISH_REASONS),
    _hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKENS),
    _hist("vllm:request_generation_tokens", "Number of generation tokens processed.", _TOKENS),
    _hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS),
    _hist("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
          _TOKENS),
    _hist("vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS),
    _hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", _TOKENS),
    _hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
          TIME_TO_FIRST_TOKEN_BUCKETS),
    _hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL),
    _hist("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
          _ITL),
    _hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LATENCY),
    _hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _LATENCY),
    _hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", _LATENCY),
    _hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _LATENCY),
    _hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _LATENCY),
    _hist("vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
          REQUEST_NUM_PREEMPTIONS_BUCKETS),
    _hist("vllm:request_prefill_kv_computed_tokens",
          "Histogram of new KV tokens computed during prefill (excluding cached tokens).", _TOKENS),
)


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
    """One finished sequence (one of a prompt's n samples), as vLLM's FinishedRequestStats
    holds it. Times in seconds; `from_timestamps` derives them by vLLM's rules."""

    finish_reason: str  # one of FINISH_REASONS
    e2e_latency: float  # arrival -> finish
    queued_time: float  # queued -> first scheduled
    prefill_time: float  # first scheduled -> first token (preemptions in between included)
    inference_time: float  # first scheduled -> last token
    decode_time: float  # first token -> last token
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int = 0  # its prefix-cache hit when first scheduled
    num_preemptions: int = 0
    max_tokens_param: int | None = None  # SamplingParams.max_tokens; None or 0: not observed, as in vLLM

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of vLLM's {FINISH_REASONS}")
        _check_counts(**{k: getattr(self, k) for k in ("num_prompt_tokens", "num_generation_tokens",
                                                        "num_cached_tokens", "num_preemptions")})
        for k in ("e2e_latency", "queued_time", "prefill_time", "inference_time", "decode_time"):
            _check_time(k, getattr(self, k))

    @property
    def mean_time_per_output_token(self) -> float:
        """decode_time over the tokens after the first (the prefill's token does not count); 0 with
        fewer than two tokens (vLLM's IterationStats.update_from_finished_request)."""
        n = self.num_generation_tokens - 1
        return self.decode_time / n if n > 0 else 0.0

    @classmethod
    def from_timestamps(cls, finish_reason: str, *, arrival: float, queued: float, scheduled: float,
                        first_token: float, last_token: float, finished: float, **counts) -> FinishedRequest:
        """The intervals from one clock's timestamps, by vLLM's rules: `scheduled` is the first
        scheduling (re-scheduling after a preemption does not move it), `first_token` and `last_token`
        when those came out of a step, `finished` when the finish was processed. counts: the count
        fields (num_prompt_tokens, num_generation_tokens, ...) as keywords."""
        return cls(finish_reason, e2e_latency=finished - arrival, queued_time=scheduled - queued,
                   prefill_time=first_token - scheduled, inference_time=last_token - scheduled,
                   decode_time=last_token - first_token, **counts)


def _check_counts(**counts) -> None:
    for name, value in counts.items():  # an int first: the ABC check costs microseconds, every step
        if (type(value) is not int and not isinstance(value, numbers.Integral)) or value < 0:
            raise ValueError(f"{name} = {value!r}: a count must be a non-negative int")


def _check_time(name: str, value: float) -> None:
    if math.isnan(value):  # it would land in no bucket yet poison the sum
        raise ValueError(f"{name} is NaN")


class EngineMetrics:
    """vLLM's Prometheus metrics of one engine, recorded by the engine thread and read by any other.
    Every method takes one lock, so a snapshot never sees half of a step. Every metric carries the
    labels model_name (vLLM's served_model_name) and engine (the engine index as a string, "0")."""

    def __init__(self, model_name: str, max_model_len: int, engine_index: int = 0):
        if max_model_len < 1:
            raise ValueError(f"max_model_len = {max_model_len}: the request-token buckets need at least 1")
        self.model_name = model_name
        self.engine_index = engine_index
        self._lock = threading.Lock()
        self._created = time.time()  # the `_created` series: when prometheus_client made each child
        # (name, extra label value or None) -> value;
        # histogram name -> [bounds, per-bucket counts (the last for +Inf; not cumulative), sum]
        self._values: dict[tuple[str, str | None], float] = {}
        self._hists: dict[str, list] = {}
        for f in _FAMILIES:
            if f.kind == "histogram":
                bounds = request_tokens_buckets(max_model_len) if f.buckets == _TOKENS else f.buckets
                self._hists[f.name] = [bounds, [0] * (len(bounds) + 1), 0.0]
            for v in f.label_values or (None,):
                self._values[(f.name, v)] = 0
        # vLLM's record_sleep_state() default; kvjax never sleeps.
        self._values[("vllm:engine_sleep_state", "awake")] = 1
        self._info: dict[str, str] | None = None  # vllm:cache_config_info's labels, once logged

    def log_metrics_info(self, cache_config_labels: dict[str, str]) -> None:
        """vLLM's log_metrics_info("cache_config", ...): vllm:cache_config_info set to 1 with these labels
        (`cache_config_info(config)`) and the engine index."""
        with self._lock:
            self._info = {**{k: str(v) for k, v in cache_config_labels.items()}, "engine": str(self.engine_index)}

    # ---- recording (the engine thread) ------------------------------------------------------

    def record(self, scheduler_stats, *, num_prompt_tokens: int = 0, num_cached_prompt_tokens: int = 0,
               num_generation_tokens: int = 0) -> None:
        """One engine step as vLLM's PrometheusStatLogger.record takes it: the scheduler's stats
        (kvjax.core.sched.stats.SchedulerStats: queues, usage, the first lookups of the prefix
        cache, preemptions) and the step's IterationStats counts (`record_step`)."""
        prefix = scheduler_stats.prefix_cache_stats
        self.record_step(num_running=scheduler_stats.num_running_reqs, num_waiting=scheduler_stats.num_waiting_reqs,
                         kv_cache_usage=scheduler_stats.kv_cache_usage, prefix_cache_queries=prefix.queries,
                         prefix_cache_hits=prefix.hits, num_preemptions=scheduler_stats.num_preempted_reqs,
                         num_prompt_tokens=num_prompt_tokens, num_cached_prompt_tokens=num_cached_prompt_tokens,
                         num_generation_tokens=num_generation_tokens)

    def record_step(self, *, num_running: int, num_waiting: int, kv_cache_usage: float,
                    prefix_cache_queries: int = 0, prefix_cache_hits: int = 0, num_preemptions: int = 0,
                    num_prompt_tokens: int = 0, num_cached_prompt_tokens: int = 0,
                    num_generation_tokens: int = 0) -> None:
        """One engine step: vLLM's SchedulerStats and the counts of its IterationStats.

        num_running, num_waiting: the scheduler's queues after the step (kvjax defers no waiting
        request: vllm:num_requests_waiting_by_reason{reason="deferred"} stays 0).
        kv_cache_usage: 1 - free / usable blocks, the null block not usable, evictable cached blocks
        free (BlockPool.get_usage). num_preemptions: requests preempted this step.
        prefix_cache_queries, prefix_cache_hits: tokens looked up and found by the requests admitted
        this step for the first time (vLLM leaves re-admissions after a preemption out).
        num_prompt_tokens, num_cached_prompt_tokens: the whole prompts, and their prefix-cache hits
        when first scheduled, of the requests whose first token came out of this step: vLLM counts
        a prompt once, when its prefill completes, not chunk by chunk.
        num_generation_tokens: tokens generated this step, first tokens included.
        vllm:iteration_tokens_total observes (prompt - cached) + generated tokens."""
        _check_counts(num_running=num_running, num_waiting=num_waiting, prefix_cache_queries=prefix_cache_queries,
                      prefix_cache_hits=prefix_cache_hits, num_preemptions=num_preemptions,
                      num_prompt_tokens=num_prompt_tokens, num_cached_prompt_tokens=num_cached_prompt_tokens,
                      num_generation_tokens=num_generation_tokens)
        if not 0.0 <= kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage = {kv_cache_usage}: a fraction of the usable blocks, in [0, 1]")
        if prefix_cache_hits > prefix_cache_queries:
            raise ValueError(f"prefix_cache_hits = {prefix_cache_hits} > prefix_cache_queries = {prefix_cache_queries}")
        if num_cached_prompt_tokens > num_prompt_tokens:
            raise ValueError(f"num_cached_prompt_tokens = {num_cached_prompt_tokens} > "
                             f"num_prompt_tokens = {num_prompt_tokens}")
        computed = num_prompt_tokens - num_cached_prompt_tokens
        v = self._values
        with self._lock:
            v[("vllm:num_requests_running", None)] = num_running
            v[("vllm:num_requests_waiting", None)] = num_waiting
            v[("vllm:num_requests_waiting_by_reason", "capacity")] = num_waiting
            v[("vllm:kv_cache_usage_perc", None)] = float(kv_cache_usage)
            v[("vllm:prefix_cache_queries", None)] += prefix_cache_queries
            v[("vllm:prefix_cache_hits", None)] += prefix_cache_hits
            v[("vllm:num_preemptions", None)] += num_preemptions
            v[("vllm:prompt_tokens", None)] += num_prompt_tokens
            v[("vllm:prompt_tokens_by_source", "local_compute")] += computed
            v[("vllm:prompt_tokens_by_source", "local_cache_hit")] += num_cached_prompt_tokens
            v[("vllm:prompt_tokens_cached", None)] += num_cached_prompt_tokens
            v[("vllm:generation_tokens", None)] += num_generation_tokens
            self._observe("vllm:iteration_tokens_total", computed + num_generation_tokens)

    def record_idle(self) -> None:
        """The gauges once the engine has no request left (AsyncLLM calls it before it waits for work):
        nothing running or waiting, no KV block held (cached blocks are free, as vLLM counts them), as
        vLLM's gauges read after its last request finished or was aborted."""
        with self._lock:
            for key in (("vllm:num_requests_running", None), ("vllm:num_requests_waiting", None),
                        ("vllm:num_requests_waiting_by_reason", "capacity")):
                self._values[key] = 0
            self._values[("vllm:kv_cache_usage_perc", None)] = 0.0

    def record_first_token(self, ttft: float) -> None:
        """A request's first token: seconds from its arrival to the step that produced it. Once per
        request; a preemption does not make a second one."""
        self.record_latencies((ttft,), ())

    def record_inter_token_latency(self, itl: float) -> None:
        """A later output of a request: seconds since its previous output (vLLM observes one per
        output, however many tokens it carries)."""
        self.record_latencies((), (itl,))

    def record_latencies(self, ttfts, itls) -> None:
        """One step's first-token and inter-token latencies, as the two methods above, under one lock."""
        for name, values in (("ttft", ttfts), ("itl", itls)):
            for v in values:
                _check_time(name, v)
        with self._lock:
            for v in ttfts:
                self._observe("vllm:time_to_first_token_seconds", v)
            for v in itls:
                self._observe("vllm:inter_token_latency_seconds", v)

    def record_finished(self, req: FinishedRequest) -> None:
        """One sequence finished (PrometheusStatLogger.record's loop over finished_requests)."""
        with self._lock:
            self._values[("vllm:request_success", req.finish_reason)] += 1
            self._observe("vllm:e2e_request_latency_seconds", req.e2e_latency)
            self._observe("vllm:request_queue_time_seconds", req.queued_time)
            self._observe("vllm:request_prefill_time_seconds", req.prefill_time)
            self._observe("vllm:request_inference_time_seconds", req.inference_time)
            self._observe("vllm:request_decode_time_seconds", req.decode_time)
            self._observe("vllm:request_num_preemptions", req.num_preemptions)
            self._observe("vllm:request_prefill_kv_computed_tokens", req.num_prompt_tokens - req.num_cached_tokens)
            self._observe("vllm:request_prompt_tokens", req.num_prompt_tokens)
            self._observe("vllm:request_generation_tokens", req.num_generation_tokens)
            self._observe("vllm:request_time_per_output_token_seconds", req.mean_time_per_output_token)
            if req.max_tokens_param:
                self._observe("vllm:request_params_max_tokens", req.max_tokens_param)

    def record_prompt_finished(self, n: int, max_num_generation_tokens: int) -> None:
        """The last of a prompt's n samples finished (vLLM's ParentRequest.observe_finished_request;
        n=1: the request itself): n and the most tokens any of its samples generated."""
        _check_counts(n=n, max_num_generation_tokens=max_num_generation_tokens)
        with self._lock:
            self._observe("vllm:request_params_n", n)
            self._observe("vllm:request_max_num_generation_tokens", max_num_generation_tokens)

    def _observe(self, name: str, x: float) -> None:
        # prometheus_client's Histogram.observe: the first bucket whose bound is >= x (le is inclusive).
        h = self._hists[name]
        h[1][bisect.bisect_left(h[0], x)] += 1
        h[2] += x

    # ---- reading (any thread) ---------------------------------------------------------------

    def snapshot(self) -> list[Metric]:
        """Every metric as vLLM's `LLM.get_metrics()` returns it, in its order."""
        base = {"model_name": self.model_name, "engine": str(self.engine_index)}
        out: list[Metric] = []
        with self._lock:
            for f in _FAMILIES:
                if f.kind == "histogram":
                    bounds, counts, total = self._hists[f.name]
                    keys = [_go_float(b) for b in bounds] + ["+Inf"]
                    buckets = dict(zip(keys, itertools.accumulate(counts)))
                    out.append(Histogram(f.name, dict(base), count=buckets["+Inf"], sum=float(total), buckets=buckets))
                    continue
                for lv in f.label_values or (None,):
                    labels = dict(base) if lv is None else {**base, f.label: lv}
                    value = self._values[(f.name, lv)]
                    out.append(Counter(f.name, labels, int(value)) if f.kind == "counter"
                               else Gauge(f.name, labels, float(value)))
            if self._info is not None:
                out.append(Gauge(_INFO_NAME, dict(self._info), 1.0))
        return out

    def gauge(self, name: str) -> float:
        """An unlabelled gauge's value now (kvjax.engine.data_parallel's router reads queues and usage)."""
        with self._lock:
            return float(self._values[(name, None)])

    def render_prometheus(self) -> str:
        """The metrics in Prometheus text format 0.0.4 (serve with CONTENT_TYPE), line for line what
        prometheus_client's generate_latest writes for vLLM's: counters as `<name>_total`, and each
        counter's and histogram's `<name>_created` series after it."""
        return render_prometheus([self.snapshot()], self._created)


def render_prometheus(snapshots: list[list[Metric]], created_s: float) -> str:
    """Several engines' snapshots (the same families in the same order, told apart by their `engine` label) in
    one Prometheus text, each family's samples together, as prometheus_client writes several label sets."""
    lines: list[str] = []
    grouped = [[list(group) for _, group in itertools.groupby(snap, key=lambda m: m.name)] for snap in snapshots]
    for i, f in enumerate(_FAMILIES):
        mine = [m for groups in grouped for m in groups[i]]
        name = f.name + "_total" if f.kind == "counter" else f.name
        lines += [f"# HELP {name} {_escape(f.help, quote=False)}", f"# TYPE {name} {f.kind}"]
        for m in mine:
            if isinstance(m, Histogram):
                lines += [_sample(f.name + "_bucket", {**m.labels, "le": le}, c) for le, c in m.buckets.items()]
                lines += [_sample(f.name + "_count", m.labels, m.count), _sample(f.name + "_sum", m.labels, m.sum)]
            else:
                lines.append(_sample(name, m.labels, m.value))
        if f.kind != "gauge":
            created = f.name + "_created"
            lines += [f"# HELP {created} {_escape(f.help, quote=False)}", f"# TYPE {created} gauge"]
            lines += [_sample(created, m.labels, created_s) for m in mine]
    info = [m for snap in snapshots for m in snap if m.name == _INFO_NAME]
    if info:
        lines += [f"# HELP {_INFO_NAME} {_INFO_HELP}", f"# TYPE {_INFO_NAME} gauge"]
        lines += [_sample(_INFO_NAME, m.labels, m.value) for m in info]
    return "\n".join(lines) + "\n"


def cache_config_info(config) -> dict[str, str]:
    """vllm:cache_config_info's labels of a resolved EngineConfig (vLLM's CacheConfig.metrics_info: each
    field as a string), with the capacity vLLM fills in after sizing the pool
    (kv_cache_utils.get_kv_cache_capacity): kv_cache_max_concurrency = usable blocks / the blocks a
    max_model_len request holds (summed over the KV cache groups), kv_cache_size_tokens = that x
    max_model_len, floored."""
    cache, m = config.cache_config, config.max_model_len
    concurrency = (config.num_blocks - 1) / config.request_blocks(m)  # the null block is not usable
    labels = {"block_size": cache.block_size, "cache_dtype": cache.kv_spec.kv_dtype,
              "enable_prefix_caching": cache.enable_prefix_caching,
              "gpu_memory_utilization": cache.gpu_memory_utilization, "kv_offloading_size": cache.kv_offloading_size,
              "num_cpu_blocks": cache.num_host_blocks or None, "num_gpu_blocks": config.num_blocks,
              "kv_cache_size_tokens": int(concurrency * m), "kv_cache_max_concurrency": concurrency}
    return {k: str(v) for k, v in labels.items()}


def _go_float(x: float) -> str:
    """A number as prometheus_client writes it (utils.floatToGoString): Python's repr, but with
    Go's exponent form from 1e+06 up, and +Inf / -Inf / NaN."""
    x = float(x)
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if math.isnan(x):
        return "NaN"
    s = repr(x)
    dot = s.find(".")
    if x > 0 and dot > 6:  # repr keeps 1234567.0 positional where Go writes 1.234567e+06
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _escape(text: str, quote: bool = True) -> str:
    """The text format's escapes: a backslash and a newline everywhere, a double quote in label values."""
    text = text.replace("\\", r"\\").replace("\n", r"\n")
    return text.replace('"', r'\"') if quote else text


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    # prometheus_client writes a sample's labels sorted by name.
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{body}}} {_go_float(value)}" if body else f"{name} {_go_float(value)}"
