"""`kvjax bench serve`: online serving latency and throughput (vLLM's `vllm bench serve`).

    kvjax bench serve --num-prompts 32 --random-input-len 128 --random-output-len 32 \\
        --num-gpu-blocks-override 256 --max-num-seqs 8            # an AsyncLLM in this process
    kvjax bench serve --base-url http://127.0.0.1:8000 --model small-gqa --request-rate 4

Without --base-url the engine is built here from the engine flags (kvjax.engine.cli_args, as
`kvjax serve` takes them); with it, requests go to that server's streaming /v1/completions.
Definitions, arrivals and the random dataset: kvjax.benchmarks.serve.
"""
from __future__ import annotations

import math

from kvjax.engine.cli_args import FLAGS, add_engine_flags, as_flags
from kvjax.errors import KvjaxError, UsageError, dumps, float_arg, int_arg, write_file


def goodput_arg(text: str) -> tuple[str, float]:
    """One --goodput KEY:VALUE (vLLM's keys ttft, tpot, e2el; the value in ms, >= 0)."""
    import argparse

    from kvjax.benchmarks.serve import GOODPUT_METRICS

    key, sep, value = text.partition(":")
    if not sep or key not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(f"must be KEY:VALUE with KEY one of {', '.join(GOODPUT_METRICS)}, "
                                         f"got {text[:40]!r}")
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not (ms >= 0 and math.isfinite(ms)):
        raise argparse.ArgumentTypeError(f"{key}'s SLO must be a finite number of ms >= 0, got {value[:40]!r}")
    return key, ms


def positive_or_inf(text: str) -> float:
    """--request-rate / --burstiness: a number > 0, or inf (vLLM's default rate)."""
    import argparse

    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 or inf, got {text[:40]!r}")
    return x


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks with vLLM's definitions (`vllm bench`)",
                       description="benchmarks with vLLM's definitions (vLLM's `vllm bench`)")
    bench = p.add_subparsers(dest="bench_command", required=True, parser_class=type(p))
    s = bench.add_parser("serve", help="online serving latency and throughput (`vllm bench serve`)",
                         description=__doc__.split("\n\n")[0])
    s.add_argument("--base-url", default=None, metavar="URL",
                   help="an OpenAI-compatible server to benchmark (default: an AsyncLLM in this process)")
    s.add_argument("--num-prompts", type=int_arg(1), default=1000, help="requests to send (1000)")
    s.add_argument("--request-rate", type=positive_or_inf, default=math.inf,
                   help="requests per second (inf: all at once)")
    s.add_argument("--burstiness", type=positive_or_inf, default=1.0,
                   help="the gamma shape of the arrival intervals (1: Poisson)")
    s.add_argument("--max-concurrency", type=int_arg(1), default=None, help="requests in flight at most")
    s.add_argument("--random-input-len", type=int_arg(1), default=1024, help="prompt tokens (1024)")
    s.add_argument("--random-output-len", type=int_arg(1), default=128, help="output tokens (128)")
    s.add_argument("--random-range-ratio", type=float_arg(0, 1), default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (0; must be < 1)")
    s.add_argument("--random-prefix-len", type=int_arg(0), default=0, help="tokens of a prefix every prompt shares")
    s.add_argument("--vocab-size", type=int_arg(1), default=None,
                   help="token ids to draw prompts from (default: the engine's tokenizer; 256 with --base-url)")
    s.add_argument("--seed", type=int_arg(0), default=0,
                   help="the dataset's and the arrivals' seed (0); the engine keeps its own default")
    s.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated metrics to report among ttft,tpot,itl,e2el (ttft,tpot,itl)")
    s.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (99)")
    s.add_argument("--goodput", nargs="+", type=goodput_arg, default=None, metavar="KEY:VALUE",
                   help="SLOs in ms (ttft:500 tpot:50 e2el:2000) for request_goodput")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id sent with --base-url (default: --model)")
    s.add_argument("--json", action="store_true", help="print the result JSON instead of the table")
    s.add_argument("--save-result", default=None, metavar="FILE", help="also write the result JSON to FILE")
    add_engine_flags(s, tuple(f for f in FLAGS if f != "seed"), "engine arguments, without --base-url (vLLM's EngineArgs)",
                     defaults={"model": "small-gqa"})


def _metric_list(text: str) -> list[str]:
    from kvjax.benchmarks.serve import METRICS

    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise UsageError(f"--percentile-metrics: {bad or text!r} not among {','.join(METRICS)}")
    return names


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        ps = []
    if not ps or not all(0 <= p <= 100 for p in ps):
        raise UsageError(f"--metric-percentiles: want comma-separated numbers in [0, 100], got {text[:40]!r}")
    return ps


def run(args) -> int:
    from kvjax.benchmarks import serve as B

    metrics, percentiles = _metric_list(args.percentile_metrics), _percentiles(args.metric_percentiles)
    goodput = dict(args.goodput) if args.goodput else None
    engine = None
    if args.base_url:
        target = B.HTTPTarget(args.base_url, args.served_model_name or args.model)
        vocab, special = args.vocab_size or 256, ()
    else:
        from kvjax.engine.arg_utils import AsyncEngineArgs
        from kvjax.engine.async_llm import AsyncLLM

        try:
            engine_args = AsyncEngineArgs.from_cli_args(args)
            engine_args.create_engine_config()
        except KvjaxError as e:
            raise UsageError(as_flags(str(e))) from None
        engine = AsyncLLM.from_engine_args(engine_args)
        target = B.InProcessTarget(engine)
        tok = engine.get_tokenizer()
        vocab, special = args.vocab_size or tok.vocab_size, list(getattr(tok, "all_special_ids", ()))
    try:
        try:
            requests = B.random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                         range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len,
                                         vocab_size=vocab, special_ids=special, seed=args.seed)
        except ValueError as e:
            raise UsageError(str(e)) from None
        result = B.run_benchmark(target, requests, request_rate=args.request_rate, burstiness=args.burstiness,
                                 max_concurrency=args.max_concurrency, seed=args.seed,
                                 percentile_metrics=metrics, percentiles=percentiles, goodput=goodput)
    finally:
        if engine is not None:
            engine.shutdown()
    result.update({"backend": "openai" if args.base_url else "kvjax-inprocess", "model_id": args.model,
                   "num_prompts": args.num_prompts, "request_rate": args.request_rate,
                   "burstiness": args.burstiness, "max_concurrency": args.max_concurrency})
    if args.save_result:
        with write_file(args.save_result, "--save-result") as f:
            f.write(dumps(result))
    print(dumps(result) if args.json else B.format_table(result, metrics, percentiles))
    return 0
