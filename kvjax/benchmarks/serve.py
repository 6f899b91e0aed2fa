"""`kvjax bench serve`: online serving latency and throughput, with `vllm bench serve`'s definitions
(vLLM 0.33, vllm/benchmarks/serve.py and datasets/).

    requests  vLLM's datasets as token-id prompts (kvjax.benchmarks.datasets: random,
              prefix_repetition, sharegpt, and kvjax's corpus)
    arrivals  all at once (request_rate inf), else gamma intervals (request_intervals), scaled so
              the n-th arrives at n / request_rate (arrival_times, as vLLM's get_request)
    targets   an AsyncLLM in this process (InProcessTarget) or an OpenAI-compatible server's
              streaming /v1/completions (HTTPTarget); --max-concurrency caps requests in flight
    metrics   calculate_metrics, vLLM's: per request TTFT (first token), TPOT = (latency - TTFT) /
              (output_len - 1), every inter-token gap (ITL), E2EL = latency; reported in ms
    progress  vLLM's tqdm bar over completed requests, on stderr (disable_tqdm turns it off)

Times are time.perf_counter seconds: a request's start_time when it is sent, ttft at its first
output with tokens, an itl entry at each later output, latency at the last.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvjax.benchmarks.datasets import SampleRequest, random_requests  # noqa: F401  (re-exported: the old names)

MS = 1000.0  # seconds → milliseconds
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": ("TTFT", "Time to First Token"),
                "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                "itl": ("ITL", "Inter-token Latency"),
                "e2el": ("E2EL", "End-to-end Latency")}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vLLM's SLO keys


@dataclass
class RequestFuncOutput:
    """What one request measured (vLLM's RequestFuncOutput), in seconds."""
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                                 # send → first output with tokens
    itl: list[float] = field(default_factory=list)    # gaps between later outputs
    latency: float = 0.0                              # send → last output
    start_time: float = 0.0                           # time.perf_counter() at send
    generated_text: str = ""
    error: str = ""


@dataclass
class BenchmarkMetrics:
    """vLLM's BenchmarkMetrics (the fields kvjax computes); *_ms lists hold (percentile, value)."""
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, dict[str, Any]]  # metric → {"mean", "median", "std", "percentiles": [(p, ms)]}


# ---------------------------------------------------------------- metrics

def _stats(values: list[float], percentiles: Sequence[float]) -> dict[str, Any]:
    """mean / median / std / percentiles in ms; an empty list counts as [0] (vLLM's `values or 0`)."""
    v = values or 0
    return {"mean": float(np.mean(v)) * MS, "median": float(np.median(v)) * MS, "std": float(np.std(v)) * MS,
            "percentiles": [(p, float(np.percentile(v, p)) * MS) for p in percentiles]}


def calculate_metrics(outputs: Sequence[RequestFuncOutput], dur_s: float, percentiles: Sequence[float] = (99,),
                      goodput: dict[str, float] | None = None) -> tuple[BenchmarkMetrics, list[int]]:
    """vLLM's calculate_metrics → (metrics, each request's output length, 0 for a failed one).

    goodput: SLOs in ms by key ("ttft", "tpot", "e2el"); a completed request is good when every
    SLO given is >= its value (a request of <= 1 output token has TPOT 0 here)."""
    output_lens: list[int] = []
    total_input = completed = good = 0
    ttfts: list[float] = []
    tpots: list[float] = []       # requests with > 1 output token only (the TPOT statistics)
    all_tpots: list[float] = []   # every completed request, 0 for <= 1 token (for goodput)
    itls: list[float] = []
    e2els: list[float] = []
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens or 1  # vLLM without a tokenizer: a success that counted no tokens is one
        output_lens.append(n)
        total_input += o.prompt_len
        tpot = 0.0
        if n > 1:
            tpot = (o.latency - o.ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1

    if goodput:
        by_key = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        keys = [k for k in GOODPUT_METRICS if k in goodput]
        slos = [goodput[k] / MS for k in keys]
        for values in zip(*(by_key[k] for k in keys)):
            good += all(s >= v for s, v in zip(slos, values))

    # vLLM's peaks: one-second buckets from the first successful start; a request counts as
    # concurrent in every bucket from its start's to its end's, a token in its arrival's bucket.
    max_tokens_per_s, max_concurrent = 0.0, 0
    ok = [o for o in outputs if o.success]
    if ok:
        t0 = min(o.start_time for o in ok)
        buckets = int(np.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1
        tokens = np.zeros(buckets)
        concurrent = np.zeros(buckets)
        for o in ok:
            t = o.start_time + o.ttft
            times = [t]
            for gap in o.itl:
                t += gap
                times.append(t)
            for t in times:
                b = int(t - t0)
                if 0 <= b < buckets:
                    tokens[b] += 1
            for b in range(int(o.start_time - t0), int(o.start_time + o.latency - t0) + 1):
                concurrent[b] += 1
        max_tokens_per_s, max_concurrent = float(tokens.max()), int(concurrent.max())

    total_output = sum(output_lens)
    metrics = BenchmarkMetrics(
        completed=completed, failed=len(outputs) - completed, total_input=total_input, total_output=total_output,
        request_throughput=completed / dur_s, request_goodput=good / dur_s,
        output_throughput=total_output / dur_s, total_token_throughput=(total_input + total_output) / dur_s,
        max_output_tokens_per_s=max_tokens_per_s, max_concurrent_requests=max_concurrent,
        stats={"ttft": _stats(ttfts, percentiles), "tpot": _stats(tpots, percentiles),
               "itl": _stats(itls, percentiles), "e2el": _stats(e2els, percentiles)})
    return metrics, output_lens


# ---------------------------------------------------------------- arrivals

def request_intervals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """n gaps (s) before each request: 0 for rate inf; 1/rate for burstiness inf; else
    gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate, coefficient of variation
    1/sqrt(burstiness) (burstiness 1 is a Poisson process; < 1 burstier, > 1 more even)."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / request_rate)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Each request's send time (s after the start): the cumulative intervals, rescaled as vLLM's
    get_request does so that the last is at n / request_rate (steadier throughput across seeds)."""
    t = np.cumsum(request_intervals(n, request_rate, burstiness, seed))
    if n and t[-1] != 0:
        t = t * (n / request_rate / t[-1])
    return t


# ---------------------------------------------------------------- targets

class InProcessTarget:
    """Requests to an AsyncLLM in this process, streamed with RequestOutputKind.DELTA. With
    record_steps, `begin()` (benchmark calls it after the warm-up) puts a fresh StepLog
    (kvjax.engine.stats) on the engine, which records the scheduler's view of every step until
    `end()`; `scheduler_view` sums it up. It also counts, from `begin()` on, the prompt tokens sent and those
    the prefix cache held when each request was first scheduled (RequestOutput.num_cached_tokens): `hit_rate`.
    The engine may be a data-parallel front end (kvjax.engine.data_parallel.DPAsyncLLM; no step record then)."""

    def __init__(self, engine, record_steps: bool = False):
        self.engine = engine
        self._next = 0
        self.record_steps, self.steps = record_steps, None
        self.prompt_tokens = self.cached_tokens = 0

    def hit_rate(self) -> dict[str, Any]:
        """The prefix cache's share of the measured requests' prompt tokens."""
        rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None
        return {"prefix_cache_hit_rate": rate, "prompt_tokens_cached": self.cached_tokens}

    def begin(self) -> None:
        self.prompt_tokens = self.cached_tokens = 0
        if self.record_steps:
            from kvjax.engine.stats import StepLog

            self.steps = self.engine.llm_engine.engine.step_log = StepLog()

    def end(self) -> None:
        self.engine.llm_engine.engine.step_log = None

    async def __call__(self, req: SampleRequest) -> RequestFuncOutput:
        from kvjax.engine.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(max_tokens=req.expected_output_len, ignore_eos=True, temperature=0.0,
                                output_kind=RequestOutputKind.DELTA)
        self._next += 1
        out = RequestFuncOutput(prompt_len=req.prompt_len)
        text: list[str] = []
        st = most_recent = time.perf_counter()
        out.start_time = st
        try:
            async for ro in self.engine.generate({"prompt_token_ids": req.prompt_token_ids}, params,
                                                 f"bench-{self._next}"):
                now = time.perf_counter()
                c = ro.outputs[0]
                if not c.token_ids:
                    continue
                if out.output_tokens == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - most_recent)
                most_recent = now
                out.output_tokens += len(c.token_ids)
                text.append(c.text)
                if ro.finished:
                    self.prompt_tokens += req.prompt_len
                    self.cached_tokens += ro.num_cached_tokens or 0
            out.latency = most_recent - st
            out.generated_text = "".join(text)
            out.success = out.output_tokens > 0
            if not out.success:
                out.error = "no tokens were generated"
        except Exception as e:  # noqa: BLE001 (a failed request is a result, as in vLLM)
            out.error = f"{type(e).__name__}: {e}"
        return out


class HTTPTarget:
    """Requests to an OpenAI-compatible server's /v1/completions with stream=true (vLLM's
    openai-completions backend): the prompt as token ids, max_tokens = output length, ignore_eos,
    temperature 0. Neither httpx nor aiohttp is in kvjax's environment, so each request is
    urllib's, read in a worker thread; the timestamps are taken in that thread as chunks arrive.
    Output tokens: the stream's usage when a chunk carries one, else one per content chunk (the
    kvjax server sends one chunk per engine step, one token each)."""

    def __init__(self, base_url: str, model: str, timeout: float = 6 * 3600):
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.timeout = timeout

    async def __call__(self, req: SampleRequest) -> RequestFuncOutput:
        return await asyncio.to_thread(self._post, req)

    def _post(self, req: SampleRequest) -> RequestFuncOutput:
        body = {"model": self.model, "prompt": req.prompt_token_ids, "max_tokens": req.expected_output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        out = RequestFuncOutput(prompt_len=req.prompt_len)
        text: list[str] = []
        chunks, usage_tokens = 0, None
        http = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"})
        st = most_recent = time.perf_counter()
        out.start_time = st
        try:
            with urllib.request.urlopen(http, timeout=self.timeout) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"].get("message", chunk["error"]))
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    if not chunk.get("choices"):
                        continue
                    if chunks == 0:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - most_recent)
                    most_recent = now
                    chunks += 1
                    text.append(chunk["choices"][0].get("text") or "")
            out.latency = most_recent - st
            out.generated_text = "".join(text)
            out.output_tokens = usage_tokens if usage_tokens is not None else chunks
            out.success = chunks > 0
            if not out.success:
                out.error = "the stream carried no completion"
        except Exception as e:  # noqa: BLE001 (a failed request is a result, as in vLLM)
            detail = e.read().decode(errors="replace")[:200] if hasattr(e, "read") else ""
            out.error = f"{type(e).__name__}: {e} {detail}".strip()
        return out


# ---------------------------------------------------------------- the run

async def benchmark(target, requests: Sequence[SampleRequest], *, request_rate: float = math.inf,
                    burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                    disable_tqdm: bool = False, num_warmups: int = 0) -> tuple[list[RequestFuncOutput], float]:
    """Send every request at its arrival time (at most max_concurrency in flight) → (outputs in
    request order, duration s from the first send to the last finish). Unless disable_tqdm, a
    tqdm bar on stderr counts the requests completed, as vLLM's does (stdout stays the caller's).
    num_warmups: vLLM's warm-up first, that many copies of the first request at once (at most
    max_concurrency in flight), untimed; then the target's `begin()`, if it has one."""
    times = arrival_times(len(requests), request_rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    if num_warmups > 0 and requests:
        async def warm():
            if sem is None:
                return await target(requests[0])
            async with sem:
                return await target(requests[0])
        await asyncio.gather(*(warm() for _ in range(num_warmups)))
    if hasattr(target, "begin"):
        target.begin()
    pbar = None
    if not disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=len(requests), file=sys.stderr, dynamic_ncols=True)

    async def one(req):
        if sem is None:
            out = await target(req)
        else:
            async with sem:
                out = await target(req)
        if pbar is not None:
            pbar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    try:
        for req, t in zip(requests, times):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
    finally:
        if pbar is not None:
            pbar.close()
    return list(outputs), time.perf_counter() - start


def result_dict(metrics: BenchmarkMetrics, outputs: Sequence[RequestFuncOutput], output_lens: list[int],
                duration: float, percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's result JSON (its keys; the per-request lists as vLLM saves them)."""
    result: dict[str, Any] = {
        "duration": duration, "completed": metrics.completed, "failed": metrics.failed,
        "total_input_tokens": metrics.total_input, "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput, "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    for m in METRICS:
        if m not in percentile_metrics:
            continue
        s = metrics.stats[m]
        result[f"mean_{m}_ms"], result[f"median_{m}_ms"], result[f"std_{m}_ms"] = s["mean"], s["median"], s["std"]
        for p, value in s["percentiles"]:
            result[f"p{p_word(p)}_{m}_ms"] = value
    return result


def p_word(p: float) -> str:
    """vLLM's percentile key: 99 → "99", 99.9 → "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def scheduler_view(log) -> dict[str, Any]:
    """A StepLog summed up (kvjax's additions to vLLM's result): the peaks of running and waiting
    requests and of blocks in use, preemptions, tokens computed and recomputed, the recompute tax
    (recomputed / computed), and every step's record under "scheduler_steps"."""
    recs = log.records
    computed = sum(r.prefill_tokens + r.decode_tokens for r in recs)
    recomputed = sum(r.recomputed_tokens for r in recs)
    peak = lambda f: max((getattr(r, f) for r in recs), default=0)  # noqa: E731
    return {"engine_steps": len(recs), "peak_running_requests": peak("num_running"),
            "peak_waiting_requests": peak("num_waiting"), "peak_blocks_in_use": peak("blocks_in_use"),
            "preemptions": sum(r.num_preempted for r in recs), "computed_tokens": computed,
            "recomputed_tokens": recomputed, "recompute_tax": recomputed / computed if computed else 0.0,
            "scheduler_steps": log.to_json()}


def run_benchmark(target, requests: Sequence[SampleRequest], *, request_rate: float = math.inf,
                  burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                  percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"), percentiles: Sequence[float] = (99,),
                  goodput: dict[str, float] | None = None, disable_tqdm: bool = False,
                  num_warmups: int = 0) -> dict[str, Any]:
    """Run the benchmark to the end (its own event loop) → vLLM's result dict, with the
    scheduler's view (scheduler_view) when the target recorded the steps."""
    try:
        outputs, duration = asyncio.run(benchmark(target, requests, request_rate=request_rate, burstiness=burstiness,
                                                  max_concurrency=max_concurrency, seed=seed,
                                                  disable_tqdm=disable_tqdm, num_warmups=num_warmups))
    finally:
        if hasattr(target, "end"):
            target.end()
    metrics, output_lens = calculate_metrics(outputs, duration, percentiles, goodput)
    result = result_dict(metrics, outputs, output_lens, duration, percentile_metrics, goodput)
    if getattr(target, "steps", None) is not None:
        result.update(scheduler_view(target.steps))
    if isinstance(target, InProcessTarget):
        result.update(target.hit_rate())
    return result


# vLLM's table: (label, result key, format)
_TABLE_ROWS = (("Successful requests:", "completed", ""), ("Failed requests:", "failed", ""),
               ("Maximum request concurrency:", "max_concurrency", ""), ("Benchmark duration (s):", "duration", ".2f"),
               ("Total input tokens:", "total_input_tokens", ""), ("Total generated tokens:", "total_output_tokens", ""),
               ("Request throughput (req/s):", "request_throughput", ".2f"),
               ("Request goodput (req/s):", "request_goodput", ".2f"),
               ("Output token throughput (tok/s):", "output_throughput", ".2f"),
               ("Peak output token throughput (tok/s):", "max_output_tokens_per_s", ".2f"),
               ("Peak concurrent requests:", "max_concurrent_requests", ".2f"),
               ("Total token throughput (tok/s):", "total_token_throughput", ".2f"),
               ("Prefix cache hit rate:", "prefix_cache_hit_rate", ".4f"),  # in-process: cached / prompt tokens
               # in-process only: the scheduler's view (scheduler_view)
               ("Peak running requests (scheduler):", "peak_running_requests", ""),
               ("Preemptions:", "preemptions", ""), ("Recompute tax:", "recompute_tax", ".4f"))


def format_table(result: dict[str, Any], percentile_metrics: Sequence[str], percentiles: Sequence[float],
                 title: str = "Serving Benchmark Result") -> str:
    """vLLM's printed table, from the result dict."""
    lines = ["{s:{c}^{n}}".format(s=f" {title} ", n=50, c="=")]
    rowf = "{:<40} {:<10.2f}".format
    for label, key, fmt in _TABLE_ROWS:  # a row whose value is None (no --max-concurrency, no --goodput) is left out
        if result.get(key) is not None:
            lines.append(("{:<40} {:<10" + fmt + "}").format(label, result[key]))
    for m in METRICS:
        if m not in percentile_metrics:
            continue
        name, header = METRIC_NAMES[m]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(rowf(f"Mean {name} (ms):", result[f"mean_{m}_ms"]))
        lines.append(rowf(f"Median {name} (ms):", result[f"median_{m}_ms"]))
        for p in percentiles:
            lines.append(rowf(f"P{p_word(p)} {name} (ms):", result[f"p{p_word(p)}_{m}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
