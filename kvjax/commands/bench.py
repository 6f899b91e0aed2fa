"""`kvjax bench serve`: online serving latency and throughput (vLLM's `vllm bench serve`).

    kvjax bench serve --num-prompts 32 --random-input-len 128 --random-output-len 32 \\
        --num-gpu-blocks-override 256 --max-num-seqs 8            # an AsyncLLM in this process
    kvjax bench serve --base-url http://127.0.0.1:8000 --model small-gqa --request-rate 4
    kvjax bench serve --dataset-name sharegpt --dataset-path ShareGPT_V3.json --plot-dir plots/

Without --base-url the engine is built here from the engine flags (kvjax.engine.cli_args, as
`kvjax serve` takes them) and its tokenizer tokenizes the dataset; with it, requests go to that
server's streaming /v1/completions, and a dataset of text is tokenized with --tokenizer (else
--model) as vLLM's client does. In-process, the result also has the scheduler's view of every
step after the warm-up (kvjax.engine.stats.StepLog: running, waiting, preempted, blocks in use,
recomputed tokens; peaks, preemptions and the recompute tax in the table). Definitions, arrivals, targets: kvjax.benchmarks.serve; the
datasets: kvjax.benchmarks.datasets; --plot-dir's figures: kvjax.benchmarks.plots. Every file and
flag is checked before the engine is built or a request is sent.
"""
from __future__ import annotations

import math

from kvjax.engine.cli_args import FLAGS, add_engine_flags, as_flags
from kvjax.errors import KvjaxError, UsageError
from kvjax.utils.checks import float_arg, int_arg
from kvjax.utils.input_files import check_input_file
from kvjax.utils.output_files import check_output_file, write_file
from kvjax.utils.output_folders import check_output_dir
from kvjax.utils.strict_json import dumps

DATASETS = ("random", "prefix_repetition", "sharegpt", "corpus")  # datasets.DATASETS; parsing flags loads no numpy


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
    _add_dataset_flags(s)
    s.add_argument("--seed", type=int_arg(0), default=0,
                   help="the dataset's and the arrivals' seed (0); the engine keeps its own default")
    s.add_argument("--disable-tqdm", action="store_true", help="no progress bar (it is drawn on stderr)")
    s.add_argument("--num-warmups", type=int_arg(0), default=0,
                   help="warm-up requests first (copies of the first request, untimed; in-process they "
                        "compile the engine's steps) (0)")
    s.add_argument("--plot-dir", default=None, metavar="DIR",
                   help="kvjax: also draw latency_cdf.png (TTFT, TPOT, ITL, E2EL) and throughput.png "
                        "(output tokens per second over the run) into DIR")
    s.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated metrics to report among ttft,tpot,itl,e2el (ttft,tpot,itl)")
    s.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (99)")
    s.add_argument("--goodput", nargs="+", type=goodput_arg, default=None, metavar="KEY:VALUE",
                   help="SLOs in ms (ttft:500 tpot:50 e2el:2000) for request_goodput")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id sent with --base-url (default: --model)")
    s.add_argument("--json", action="store_true", help="print the result JSON instead of the table")
    s.add_argument("--save-result", default=None, metavar="FILE", help="also write the result JSON to FILE")
    s.add_argument("--data-parallel-routing", choices=("prefix", "load"), default="prefix",  # data_parallel.ROUTINGS
                   help="with --data-parallel-size > 1 in this process: route to the replica that may hold a prompt's "
                        "first block (prefix, default) or by load alone, as vLLM does (load)")
    add_engine_flags(s, tuple(f for f in FLAGS if f != "seed"), "engine arguments, without --base-url (vLLM's EngineArgs)",
                     defaults={"model": "small-gqa"})


def _add_dataset_flags(s, tokenizer_help: str | None = None) -> None:
    """vLLM's dataset flags, for the datasets kvjax has (kvjax.benchmarks.datasets); kvjax simulate
    takes them too (tokenizer_help: what --tokenizer is for there)."""
    s.add_argument("--dataset-name", choices=DATASETS, default="random",
                   help="random (synthetic ids), prefix_repetition (shared prefixes + unique suffixes), "
                        "sharegpt (a ShareGPT JSON file), corpus (kvjax: slices of a real text) (random)")
    s.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="sharegpt: the JSON file (required); corpus: a UTF-8 text file "
                        "(default: the Python Language Reference prose kvjax ships)")
    s.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help=tokenizer_help or "with --base-url: the model whose tokenizer the client uses: it tokenizes "
                                          "a sharegpt or corpus dataset (default: --model's) and gives random's "
                                          "vocabulary")
    s.add_argument("--no-oversample", action="store_true",
                   help="keep fewer requests than --num-prompts when the dataset has fewer")
    s.add_argument("--disable-shuffle", action="store_true",
                   help="keep the dataset's order (sharegpt, prefix_repetition)")
    r = s.add_argument_group("random and corpus dataset options")
    r.add_argument("--random-input-len", type=int_arg(1), default=1024, help="prompt tokens (1024)")
    r.add_argument("--random-output-len", type=int_arg(1), default=128, help="output tokens (128)")
    r.add_argument("--random-range-ratio", type=float_arg(0, 1), default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (0; must be < 1)")
    r.add_argument("--random-prefix-len", type=int_arg(0), default=0,
                   help="random: tokens of a prefix every prompt shares")
    r.add_argument("--vocab-size", type=int_arg(1), default=None,
                   help="random, prefix_repetition: token ids to draw from (default: the tokenizer's; "
                        "256 with --base-url and no --tokenizer)")
    g = s.add_argument_group("sharegpt dataset options")
    g.add_argument("--sharegpt-output-len", type=int_arg(1), default=None,
                   help="output tokens of every request (default: the second turn's token count)")
    p = s.add_argument_group("prefix repetition dataset options")
    p.add_argument("--prefix-repetition-prefix-len", type=int_arg(0), default=256, help="prefix tokens (256)")
    p.add_argument("--prefix-repetition-suffix-len", type=int_arg(0), default=256, help="suffix tokens (256)")
    p.add_argument("--prefix-repetition-num-prefixes", type=int_arg(1), default=10,
                   help="prefixes; each is shared by num-prompts // num-prefixes prompts (10)")
    p.add_argument("--prefix-repetition-output-len", type=int_arg(1), default=128, help="output tokens (128)")


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


def _check_dataset(args, engine_tokenizes: bool = True):
    """The dataset's flags and file, before any work → its source: the conversations of a sharegpt
    file, the text of a corpus, else None. engine_tokenizes: without --base-url the engine's own
    tokenizer does, and --tokenizer is refused (kvjax simulate: False)."""
    from kvjax.benchmarks import datasets as D

    name = args.dataset_name
    if args.dataset_path is not None and name not in ("sharegpt", "corpus"):
        raise UsageError(f"--dataset-path is for --dataset-name sharegpt or corpus, not {name}")
    if engine_tokenizes and args.tokenizer is not None and not args.base_url:
        raise UsageError("--tokenizer is for --base-url: in this process the engine's own tokenizer "
                         "(--model's) tokenizes the dataset")
    if name in ("random", "corpus"):
        if args.random_range_ratio >= 1:
            raise UsageError(f"--random-range-ratio must be < 1, got {args.random_range_ratio:g}")
        prefix = args.random_prefix_len if name == "random" else 0
        if prefix + D.min_input_len(args.random_input_len, args.random_range_ratio) < 1:
            raise UsageError(f"--random-input-len {args.random_input_len} is too small: with --random-range-ratio "
                             f"{args.random_range_ratio:g} a prompt could have no token")
    if name == "prefix_repetition":
        if args.num_prompts < args.prefix_repetition_num_prefixes:
            raise UsageError(f"--num-prompts ({args.num_prompts}) must be at least --prefix-repetition-num-prefixes "
                             f"({args.prefix_repetition_num_prefixes}): each prefix is shared by "
                             "num-prompts // num-prefixes prompts")
        if args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len < 1:
            raise UsageError("--prefix-repetition-prefix-len + --prefix-repetition-suffix-len must be at least 1")
    if name == "sharegpt":
        if args.dataset_path is None:
            raise UsageError("--dataset-name sharegpt needs --dataset-path, a ShareGPT JSON file")
        check_input_file(args.dataset_path, "--dataset-path")
        return D.load_sharegpt(args.dataset_path, seed=args.seed, shuffle=not args.disable_shuffle)
    if name == "corpus":
        return D.load_corpus(args.dataset_path)
    return None


def _client_tokenizer(args):
    """With --base-url, the tokenizer of --tokenizer, else of --model, loaded without weights;
    None where none is needed (a synthetic dataset and no --tokenizer)."""
    from kvjax.models.hub import load_tokenizer

    if args.tokenizer is None and args.dataset_name not in ("sharegpt", "corpus"):
        return None
    flag, name = ("--tokenizer", args.tokenizer) if args.tokenizer is not None else ("--model", args.model)
    try:
        return load_tokenizer(name)
    except KvjaxError as e:
        raise UsageError(f"--dataset-name {args.dataset_name} with --base-url tokenizes with --tokenizer (else "
                         f"--model): {flag} {name!r} gives no tokenizer: {e}") from None


def _requests(args, source, tokenizer, vocab: int, special) -> list:
    from kvjax.benchmarks import datasets as D

    n, name = args.num_prompts, args.dataset_name
    try:
        if name == "random":
            return D.random_requests(n, args.random_input_len, args.random_output_len,
                                     range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len,
                                     vocab_size=vocab, special_ids=special, seed=args.seed)
        if name == "prefix_repetition":
            return D.prefix_repetition_requests(
                n, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, vocab_size=vocab,
                seed=args.seed, shuffle=not args.disable_shuffle)
        if name == "sharegpt":
            try:
                return D.sharegpt_requests(source, n, tokenizer, output_len=args.sharegpt_output_len, seed=args.seed,
                                           no_oversample=args.no_oversample)
            except ValueError as e:
                raise UsageError(f"--dataset-path {args.dataset_path!r}: {e}") from None
        return D.corpus_requests(source, n, args.random_input_len, args.random_output_len, tokenizer,
                                 range_ratio=args.random_range_ratio, seed=args.seed)
    except KvjaxError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None


def run(args) -> int:
    from kvjax.benchmarks import serve as B

    metrics, percentiles = _metric_list(args.percentile_metrics), _percentiles(args.metric_percentiles)
    goodput = dict(args.goodput) if args.goodput else None
    if args.save_result:
        check_output_file(args.save_result, "--save-result")
    if args.plot_dir:
        check_output_dir(args.plot_dir, "--plot-dir")
    source = _check_dataset(args)
    engine = None
    if args.base_url:
        target = B.HTTPTarget(args.base_url, args.served_model_name or args.model)
        tok = _client_tokenizer(args)
    else:
        from kvjax.engine.arg_utils import AsyncEngineArgs
        from kvjax.engine.data_parallel import serving_engine

        try:
            engine_args = AsyncEngineArgs.from_cli_args(args)
            engine_args.create_engine_config()
        except KvjaxError as e:
            raise UsageError(as_flags(str(e))) from None
        engine = serving_engine(engine_args, args.data_parallel_routing)  # -dp N: replicas behind one router
        target = B.InProcessTarget(engine, record_steps=engine_args.data_parallel_size == 1)
        tok = engine.get_tokenizer()
    vocab = args.vocab_size or (tok.vocab_size if tok is not None else 256)
    special = list(getattr(tok, "all_special_ids", ()))
    try:
        requests = _requests(args, source, tok, vocab, special)
        result = B.run_benchmark(target, requests, request_rate=args.request_rate, burstiness=args.burstiness,
                                 max_concurrency=args.max_concurrency, seed=args.seed,
                                 percentile_metrics=metrics, percentiles=percentiles, goodput=goodput,
                                 disable_tqdm=args.disable_tqdm, num_warmups=args.num_warmups)
    finally:
        if engine is not None:
            engine.shutdown()
    result.update({"backend": "openai" if args.base_url else "kvjax-inprocess", "model_id": args.model,
                   "tokenizer_id": args.tokenizer or args.model, "num_prompts": args.num_prompts,
                   "request_rate": args.request_rate, "burstiness": args.burstiness,
                   "max_concurrency": args.max_concurrency})
    if getattr(engine, "routed", None) is not None:  # -dp N in this process: how the router split the requests
        result.update(data_parallel_routing=args.data_parallel_routing, routed=list(engine.routed))  # warm-ups too
    if args.save_result:
        with write_file(args.save_result, "--save-result") as f:
            f.write(dumps(result))
    if args.plot_dir:
        from kvjax.benchmarks.plots import write_plots

        write_plots(result, args.plot_dir, "--plot-dir")
    print(dumps(result) if args.json else B.format_table(result, metrics, percentiles))
    return 0
