"""`kvjax simulate`: `kvjax bench serve`'s workload through vLLM's scheduling, on a cost model.

    kvjax simulate --preset llama-3-8b --device h200 --device-memory-gib 141 --max-model-len 8192 \\
        --num-prompts 1000 --random-input-len 1024 --random-output-len 128 --request-rate 8

The model and the memory flags are `kvjax plan`'s, read by its code, so the budget → blocks
arithmetic is plan's: the scheduler gets plan's blocks per rank (block 0 the null block; a model
with sliding-window layers vLLM's hybrid KV cache groups on that budget; --kv-offloading-size a
host tier: kvjax.simulator.deployment), --block-size, --max-model-len, --max-num-batched-tokens
and --max-num-seqs. The requests are `kvjax bench serve`'s datasets (--dataset-name random,
prefix_repetition; sharegpt and corpus with --tokenizer; kvjax.benchmarks.datasets) arriving as
its requests do (--request-rate, --burstiness, --max-concurrency, --seed). Each step's time comes
from a cost model (kvjax.simulator.cost): the roofline of --device (h100, h200, b200 presets; cpu
measured here) for the model and its --tensor-parallel-size (and --decode-context-parallel-size D: an MLA
model's scheduler blocks of block_size × D tokens, a rank reading 1/D of the KV), or --profile FILE, a step profile
fitted from recorded steps. It prints the cost model's numbers, then `kvjax bench serve`'s table
(simulated seconds), or one JSON object with --json. Simulated, not measured: the roofline
leaves out what a real step also spends (kernel efficiency, launch gaps beyond --overhead-ms).
"""
from __future__ import annotations

import math
import time

from kvjax.commands import bench as bench_cmd
from kvjax.commands import plan as plan_cmd
from kvjax.commands import plan_dcp
from kvjax.engine.cli_args import add_engine_flags
from kvjax.errors import KvjaxError, UsageError
from kvjax.utils.checks import int_arg
from kvjax.utils.strict_json import dumps, read_json

DEVICE_NAMES = ("h100", "h200", "b200", "cpu")


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="vLLM's scheduling on a cost model: serving latency without a model",
                       description=__doc__.split("\n")[0])
    plan_cmd.add_sizing_arguments(p)
    w = p.add_argument_group("workload (kvjax bench serve's datasets and arrivals)")
    w.add_argument("--num-prompts", type=int_arg(1), default=1000, help="requests (1000)")
    bench_cmd._add_dataset_flags(p, "sharegpt, corpus: the model (a folder or hub id) whose tokenizer tokenizes the "
                                    "dataset")
    w.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the intervals (1: Poisson)")
    w.add_argument("--max-concurrency", type=int_arg(1), default=None, help="requests in flight at most")
    add_engine_flags(w, ["seed"], None, helps={"seed": "the dataset's and the arrivals' seed (0)"})
    s = p.add_argument_group("scheduler and cost")
    add_engine_flags(s, ["max_num_seqs", "enable_prefix_caching"], None, defaults={"max_num_seqs": 256},
                     helps={"max_num_seqs": "requests running at once (256, vLLM's on a GPU)"})
    s.add_argument("--device", choices=DEVICE_NAMES, default="h200", help="the roofline's device (h200)")
    s.add_argument("--overhead-ms", type=float, default=1.0, help="fixed cost per step in the roofline (1 ms)")
    s.add_argument("--profile", metavar="FILE", help="a fitted step profile (JSON) instead of the roofline")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(plot=None)


def run(args) -> int:
    import numpy as np

    from kvjax.accounting import budget as bud
    from kvjax.benchmarks.serve import arrival_times, format_table
    from kvjax.config.hf import from_hf_config
    from kvjax.config.presets import preset
    from kvjax.simulator import cost
    from kvjax.simulator.clock import simulate
    from kvjax.commands import plan_mamba
    from kvjax.simulator.deployment import mamba_scheduler_config, scheduler_config

    if not (args.preset or args.hf_config):
        raise UsageError("kvjax simulate needs the model's shapes: --preset NAME or --hf-config FILE")
    if not (args.request_rate > 0) or not (args.burstiness > 0):
        raise UsageError(f"--request-rate {args.request_rate} and --burstiness {args.burstiness} must be > 0")
    if args.dataset_name in ("sharegpt", "corpus") and args.tokenizer is None:
        raise UsageError(f"--dataset-name {args.dataset_name} needs --tokenizer: kvjax simulate runs no model, so "
                         "the dataset's text is tokenized by the tokenizer named there")
    source = bench_cmd._check_dataset(args, engine_tokenizes=False)
    inputs = plan_cmd._resolve_plan_inputs(args)
    pl = bud.plan(inputs["spec"], **inputs["kw"])
    config = preset(args.preset) if args.preset else from_hf_config(args.hf_config)
    tokens = args.max_num_batched_tokens or plan_cmd.DEFAULT_BATCHED_TOKENS
    dcp = args.decode_context_parallel_size or 1
    plan_dcp.dcp_section(pl, dcp)  # vLLM's rule and kvjax's (MLA only), refused by flag
    try:
        if inputs["mamba"] is not None:  # vLLM's attention + Mamba groups, without prefix caching (mode "none")
            sched = mamba_scheduler_config(plan_mamba.mamba_plan(pl, inputs["mamba"], tokens),
                                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=tokens)
        else:
            sched = scheduler_config(pl, inputs["windows"], max_num_seqs=args.max_num_seqs,
                                     max_num_batched_tokens=tokens, prefix_caching=args.enable_prefix_caching is not False, dcp=dcp)
    except KvjaxError as e:
        raise UsageError(str(e)) from None
    if args.profile:
        model = cost.FittedProfile.from_json(read_json(args.profile, "--profile"))
    else:
        device = cost.measure_cpu() if args.device == "cpu" else cost.DEVICES[args.device]
        model = cost.Roofline(device, cost.ModelCost.from_config(
            config, inputs["spec"], weight_bytes=inputs["kw"]["weights_bytes"], weight_dtype=args.weight_dtype or "bf16",
            tp=pl.tp, dcp=dcp), overhead_s=args.overhead_ms / 1e3)
    requests = _requests(args, config, source)
    arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    t0 = time.perf_counter()
    result = simulate(sched, [r.prompt_token_ids for r in requests], [r.expected_output_len for r in requests],
                      np.asarray(arrivals, np.float64), model.step_seconds,
                      max_concurrency=args.max_concurrency, windows=config.layer_windows)
    wall = time.perf_counter() - t0
    out = result.bench_result(("ttft", "tpot", "itl", "e2el"), (50, 90, 99))
    out.update(simulated=True, cost_model=model.describe(), blocks=sched.num_blocks, kv_cache_groups=list(sched.windows),
               host_blocks=sched.num_host_blocks, engine_steps=len(result.steps),
               preemptions=result.preemptions, prefilled_tokens=sum(s.features.prefill_tokens for s in result.steps),
               recomputed_tokens=result.recomputed_tokens, recompute_tax=result.recompute_tax,
               peak_running_requests=max((s.num_running for s in result.steps),
                                                                         default=0),
               simulation_wall_s=round(wall, 2), max_concurrency=args.max_concurrency)
    if args.json:
        print(dumps(out, indent=2))
        return 0
    print(f"cost model: {model.describe()}")
    groups = "" if sched.windows == (None,) else f" in {len(sched.windows)} KV cache groups (windows {sched.windows})"
    host = f", a host tier of {sched.num_host_blocks:,} blocks" if sched.num_host_blocks else ""
    print(f"scheduler: {sched.num_blocks:,} blocks of {sched.block_size} (plan's budget per rank){groups}{host}, "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {tokens:,}, max_model_len {sched.max_model_len:,}")
    print(format_table(out, ("ttft", "tpot", "itl", "e2el"), (50, 90, 99), title="Simulated Serving Result"))
    print(f"{len(result.steps):,} steps simulated in {wall:.1f} s")
    return 0


def _requests(args, config, source) -> list:
    """kvjax bench serve's requests for its dataset flags; a synthetic dataset draws ids from the
    model's vocabulary (or --vocab-size)."""
    tok = None
    if args.tokenizer is not None:
        from kvjax.models.hub import load_tokenizer

        try:
            tok = load_tokenizer(args.tokenizer)
        except KvjaxError as e:
            raise UsageError(f"--tokenizer {args.tokenizer!r} gives no tokenizer: {e}") from None
    vocab = args.vocab_size or (tok.vocab_size if tok is not None else config.vocab_size or 32000)
    return bench_cmd._requests(args, source, tok, vocab, list(getattr(tok, "all_special_ids", ())))
