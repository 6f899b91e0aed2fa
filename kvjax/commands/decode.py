"""`kvjax decode`: batched generation through the scheduler, block pool, paged cache and a model.

    kvjax decode --model small-gqa --prompts prompts.txt --max-tokens 64 --temperature 0
    kvjax decode --model small-gqa --synthetic 32 --shared-prefix 64 --max-tokens 32 \\
        --kv-cache-dtype fp8 --num-gpu-blocks-override 48 --max-num-seqs 8 --json

It runs `kvjax.LLM(...).generate` and prints what came back. Engine flags are vLLM's engine
args (--kv-cache-dtype, --block-size, --num-gpu-blocks-override, --gpu-memory-utilization,
--kv-cache-memory-bytes, --[no-]enable-prefix-caching, --[no-]enable-chunked-prefill, --max-num-seqs,
--max-model-len, --max-num-batched-tokens, --scheduling-policy, --attention-backend, --kv-offloading-size,
--kv-transfer-config, --disable-hybrid-kv-cache-manager, --seed, --dtype, --max-logprobs); sampling flags
are SamplingParams' fields with vLLM's defaults (temperature 1.0: --greedy or --temperature 0 for argmax).

Prompts: `--prompts FILE` (lines, or `.jsonl` requests) or `--synthetic N` (kvjax/commands/prompts.py).

Stopping: a request ends at --max-tokens, at the model's max length, when it samples the
model's EOS (config.json / generation_config.json `eos_token_id`; --ignore-eos generates past
it) or one of --stop-token-ids (the token stays in the output, as in vLLM), or when its text
ends in a --stop string (cut from the text).

Pool size: `--num-gpu-blocks-override K`; or `--kv-cache-memory-bytes B` (blocks = B // bytes
per block, + the null block); or `--gpu-memory-utilization U`, which sizes it the way vLLM does
(kvjax.accounting.sizing.profile_and_size: profile one prefill, then blocks = (ceil(total × U) − weights −
activations) // bytes per block, total = the device's memory, or --device-memory-gib, which a
CPU needs); with none of them, enough blocks for --max-num-seqs requests of the longest prompt
+ --max-tokens, so nothing is preempted.

A request that breaks a rule (empty prompt, prompt at or over the model's max length,
max_tokens <= 0, more blocks than the pool has) gets an error in its output and the others
still run. Bad flags exit with status 2 and one line. Progress (loading, building the engine,
the warm-up, tokens generated) goes to stderr when it is a terminal; results and the summary
to stdout, as text or, with --json, one JSON object: {"config", "outputs", "summary"}, where
outputs are vLLM's RequestOutputs field for field (outputs[i].outputs[j].text, token_ids,
finish_reason, stop_reason, logprobs as {token id: {logprob, rank, decoded_token}}).
Rates and latencies leave out device calls that compiled (see kvjax.engine.stats.Summary); with
--warmup the workload runs once first (then the prefix cache is reset, so the measured run
starts cold) and every step of the measured run is timed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from kvjax.commands.common import (add_model_flags, add_progress_flag, human_int_arg, kv_cache_dtype_arg,
                                   progress_enabled)
from kvjax.commands.prompts import build_requests, read_prompts, refused_output, sampling_params
from kvjax.accounting.hybrid import kv_cache_groups
from kvjax.config.scheduler import check_host_tier
from kvjax.errors import INT32_MAX, MAX_GIB, KvjaxError, UsageError, float_arg, int_arg, json_type, loads
from kvjax.math_utils import cdiv
from kvjax.progress import Phases

PROMPT_LEN = 32  # --prompt-len's default (given with --prompts, it would be ignored)
BYTES_MAX = MAX_GIB * 2**30  # --kv-cache-memory-bytes at most


def add_parser(sub) -> None:
    p = sub.add_parser("decode", help="batched generation through scheduler, pool, paged cache and model",
                       description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE", help="one prompt per line (or .jsonl objects)")
    src.add_argument("--synthetic", type=int_arg(1, 2**20), metavar="N", help="N random prompts")
    p.add_argument("--chat", action="store_true",
                   help="each text prompt is a user message, rendered with the model's chat template")
    p.add_argument("--shared-prefix", type=int_arg(0), default=0, metavar="LEN",
                   help="synthetic: shared first LEN tokens")
    p.add_argument("--prompt-len", type=int_arg(1), default=PROMPT_LEN,
                   help=f"synthetic: longest prompt after the prefix ({PROMPT_LEN})")

    cache = p.add_argument_group("KV cache and engine (vLLM's engine args)")
    cache.add_argument("--kv-cache-dtype", type=kv_cache_dtype_arg, default="auto",
                       help="auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2, bf16, int8_per_token_head, ...")
    cache.add_argument("--kv-cache-dtype-skip-layers", type=int_arg(0), nargs="+", default=[], metavar="LAYER",
                       help="layers that keep the model's dtype (vLLM's; layer indices)")
    cache.add_argument("--scales", metavar="FILE", help="kvjax: fp8 scales from `kvjax calibrate` (default 1.0)")
    cache.add_argument("--block-size", type=int_arg(1), default=16, help="tokens per block (16)")
    size = cache.add_mutually_exclusive_group()
    size.add_argument("--num-gpu-blocks-override", type=int_arg(2), metavar="K", help="pool size, null block included")
    size.add_argument("--gpu-memory-utilization", type=float_arg(0, 1, lo_open=True), metavar="U",
                      help="size the pool from a profiled budget of U × the device's memory")
    size.add_argument("--kv-cache-memory-bytes", type=human_int_arg(1, BYTES_MAX), metavar="BYTES",
                      help="the KV budget in bytes (4G = 4 GiB, 4g = 4e9)")
    cache.add_argument("--device-memory-gib", type=float_arg(0, MAX_GIB, lo_open=True), metavar="GIB",
                       help="kvjax: the device memory --gpu-memory-utilization takes a share of (default: the "
                            "device's; a CPU has none to read)")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="share the KV blocks of common prompt prefixes (default on)")
    cache.add_argument("--kv-offloading-size", type=float_arg(0, MAX_GIB), metavar="GIB",
                       help="host-memory tier for evicted KV blocks, in GiB (default: none)")
    cache.add_argument("--kv-transfer-config", metavar="JSON",
                       help='the host tier\'s connector settings, e.g. \'{"kv_connector_extra_config": '
                            '{"eviction_policy": "arc"}}\' (default lru)')
    cache.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", help="a model with sliding "
                       "windows keeps every layer full (default: vLLM's hybrid KV cache, a block table per group)")
    cache.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="split long prompts over steps (default on; off: the step budget covers the longest "
                            "prompt)")
    cache.add_argument("--max-num-seqs", type=int_arg(1, 2**16), default=8, help="requests running at once (8)")
    cache.add_argument("--max-model-len", type=human_int_arg(1), metavar="TOKENS",
                       help="prompt + generated tokens (default: the model's maximum)")
    cache.add_argument("--max-num-batched-tokens", type=human_int_arg(1), metavar="N",
                       help="tokens per engine step (default 2048; without chunked prefill at least max_model_len); "
                            "--gpu-memory-utilization profiles a step this size")
    cache.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                       help="priority: .jsonl requests' \"priority\" (lower first; default 0) orders admission and "
                            "preemption")
    cache.add_argument("--attention-backend", choices=["reference", "pallas"],
                       help="decode attention (default: pallas on GPU, except for int8_per_token_head KV; reference "
                            "elsewhere)")
    cache.add_argument("--tensor-parallel-size", "-tp", type=int_arg(1, 256), default=1, metavar="N",
                       help="devices the weights and KV pages are split over (a JAX mesh; default 1)")
    cache.add_argument("--seed", type=int_arg(0, 2**32 - 1), default=0, help="sampling and --synthetic seed (0)")
    cache.add_argument("--max-logprobs", type=int_arg(-1), default=20,
                       help="the most --logprobs a request may ask for (20; -1: no limit)")
    cache.add_argument("--steps-per-call", type=int_arg(1, 1024), default=1, help="kvjax: decode steps per device "
                                                                                   "call (1)")

    sp = p.add_argument_group("sampling (SamplingParams, vLLM's defaults)")
    sp.add_argument("--max-tokens", type=int_arg(1), default=16, help="tokens to generate per request (16)")
    temp = sp.add_mutually_exclusive_group()
    temp.add_argument("--temperature", type=float_arg(0, 2), default=1.0, help="softmax temperature (1.0; 0: greedy)")
    temp.add_argument("--greedy", action="store_true", help="argmax decoding: --temperature 0")
    sp.add_argument("--top-k", type=int_arg(-1), default=0, help="keep the k most likely tokens (0 or -1: all)")
    sp.add_argument("--top-p", type=float_arg(0, 1, lo_open=True), default=1.0,
                    help="keep the nucleus of probability p (1.0)")
    sp.add_argument("--min-p", type=float_arg(0, 1), default=0.0, help="drop tokens below min_p × the top probability")
    sp.add_argument("--presence-penalty", type=float_arg(-2, 2), default=0.0, help="in [-2, 2] (0)")
    sp.add_argument("--frequency-penalty", type=float_arg(-2, 2), default=0.0, help="in [-2, 2] (0)")
    sp.add_argument("--repetition-penalty", type=float_arg(0, 1e4, lo_open=True), default=1.0, help="> 0 (1: off)")
    sp.add_argument("--min-tokens", type=int_arg(0), default=0, help="no stop token before this many tokens (0)")
    sp.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeatable)")
    sp.add_argument("--stop-token-ids", metavar="IDS", help="comma-separated token ids that end a request, e.g. 1,2")
    sp.add_argument("--ignore-eos", action="store_true", help="generate past the model's EOS token")
    sp.add_argument("--n", type=int_arg(1, 16384), default=1, help="samples per prompt (1)")
    sp.add_argument("--logprobs", type=int_arg(-1), metavar="K",
                    help="log-probabilities of each generated token and the K most likely (-1: all)")

    p.add_argument("--warmup", action="store_true",
                   help="run the workload once first (compiles out of the timings), then reset the prefix cache")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_flag(p)


def run(args) -> int:
    import jax

    from kvjax.models.hub import load_model

    base = _check_flags(args)  # everything that needs no model is checked before loading one
    transfer = _transfer_config(args)
    raw = read_prompts(args.prompts, allow_priority=args.scheduling_policy == "priority", chat=args.chat) \
        if args.prompts else None
    scales = _scales(args)
    if args.gpu_memory_utilization is not None and args.device_memory_gib is None and jax.default_backend() == "cpu":
        raise UsageError("--gpu-memory-utilization: the cpu device reports no memory limit: pass --device-memory-gib")
    show = progress_enabled(args)
    loaded = load_model(args.model, dtype=args.dtype, attn_impl=args.attention_backend, seed=args.seed,
                        progress=show)  # its own bar: fetch, read the weights, build
    requests = build_requests(args, loaded, raw)
    with Phases("decode", 2 if args.warmup else 1, show) as phases:
        phases.start("build the engine" + (" (profiling a step)" if args.gpu_memory_utilization else ""))
        llm = _llm(args, loaded, requests, scales, transfer)
        runnable, refused = _check_requests(llm, *sampling_params(requests, base))
        if args.warmup:
            phases.start("warm-up run (compiles every step)")
            _generate(llm, runnable, args, show=False)
            llm.reset_prefix_cache()  # the measured run starts cold, as vLLM's benchmarks do
    outs = _generate(llm, runnable, args, show)
    by_index = {i: out for (i, _, _), out in zip(runnable, outs)}
    rows = [dict(index=i, **dataclasses.asdict(by_index.get(i) or refused_output(r, refused[i])))
            for i, r in enumerate(requests)]
    summary = _with_refused(outs.summary, len(refused) * base.n)
    config = _config_json(args, llm, base, transfer)
    if args.json:
        print(json.dumps({"config": config, "outputs": rows, "summary": summary.to_json()}, indent=1))
    else:
        print(format_run(rows, summary, config))
    return 0


def _llm(args, loaded, requests: list[dict], scales, transfer: dict | None):
    """The LLM the flags describe. With no pool-size flag, the pool holds --max-num-seqs requests
    of the longest prompt + its max_tokens (capped at the max length): nothing is preempted."""
    from kvjax.accounting.budget import gib
    from kvjax.engine.llm import LLM
    from kvjax.kv_offload.host_pages import host_blocks

    z = args.block_size
    if args.kv_offloading_size:  # named by its flag, before the LLM checks it again
        host_blocks(str(args.kv_offloading_size), loaded.config.kv_spec(args.kv_cache_dtype).bytes_per_block(z),
                    "--kv-offloading-size")
    num_blocks = args.num_gpu_blocks_override
    if num_blocks is None and args.gpu_memory_utilization is None and args.kv_cache_memory_bytes is None:
        limit = args.max_model_len or loaded.config.max_position_embeddings
        longest = min(max((len(r["tokens"]) + r["max_tokens"] for r in requests), default=1), limit)
        c = loaded.config  # on the hybrid KV cache a request takes its blocks in every group
        groups = 1 if args.disable_hybrid_kv_cache_manager or not any(c.layer_windows) else len(
            kv_cache_groups(c.kv_spec(), c.layer_windows, z))
        num_blocks = 1 + args.max_num_seqs * groups * cdiv(longest, z)
    return LLM(loaded, kv_cache_dtype=args.kv_cache_dtype, kv_cache_dtype_skip_layers=args.kv_cache_dtype_skip_layers,
               scales=scales, block_size=z,
               num_gpu_blocks_override=num_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
               kv_cache_memory_bytes=args.kv_cache_memory_bytes,
               total_memory_bytes=None if args.device_memory_gib is None else gib(args.device_memory_gib),
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
               enable_chunked_prefill=args.enable_chunked_prefill, scheduling_policy=args.scheduling_policy,
               attention_backend=args.attention_backend, seed=args.seed, max_logprobs=args.max_logprobs,
               kv_offloading_size=args.kv_offloading_size or None, kv_transfer_config=transfer,
               steps_per_call=args.steps_per_call, tensor_parallel_size=args.tensor_parallel_size,
               disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager)


def _check_requests(llm, runnable: list, refused: dict) -> tuple[list, dict]:
    """The requests the engine takes, and why it refuses the others: a request that breaks a rule
    (an empty prompt, one at or over the max length, more blocks than the pool has) gets an error
    in its output and the others still run, as vLLM's batch runner reports per request (the
    library raises for the whole call)."""
    from kvjax.engine.arg_utils import LLMError

    ok = []
    for i, r, sp in runnable:
        try:
            llm.llm_engine.check_request(r["tokens"], sp)
            ok.append((i, r, sp))
        except LLMError as e:
            refused[i] = str(e)
    return ok, refused


def _generate(llm, runnable: list, args, show: bool):
    """llm.generate over the runnable requests, with a bar of generated tokens on stderr if show."""
    prompts = [dict(prompt_token_ids=r["tokens"], **({} if r["prompt"] is None else dict(prompt=r["prompt"])))
               for _, r, _ in runnable]
    params = [sp for _, _, sp in runnable]
    priority = [r["priority"] for _, r, _ in runnable] if args.scheduling_policy == "priority" else None
    bar = None
    if show:
        from tqdm import tqdm

        total = sum(llm.engine.check_request(r["tokens"], sp)[1] * sp.n for _, r, sp in runnable)  # refused: 0
        bar = tqdm(total=total, unit="tok", file=sys.stderr, desc="decode: generate", leave=False)
    try:
        return llm.generate(prompts, params, priority=priority, use_tqdm=False, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()


def _config_json(args, llm, base, transfer: dict | None) -> dict:
    """The run's engine arguments as the LLM resolved them (vLLM's names) and its SamplingParams."""
    engine = llm.engine
    return dict(model=args.model, dtype=llm.config.dtype, kv_cache_dtype=llm.kv_spec.kv_dtype,
                kv_cache_dtype_skip_layers=list(llm.kv_spec.skip_layers), block_size=args.block_size, num_gpu_blocks=llm.num_blocks, max_num_seqs=args.max_num_seqs,
                max_model_len=engine.max_model_len,
                max_num_batched_tokens=engine.scheduler_config.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
                scheduling_policy=args.scheduling_policy, attention_backend=llm.model.module.attn_impl,
                kv_offloading_size=args.kv_offloading_size or None, kv_transfer_config=transfer,
                eviction_policy=llm.vllm_config.cache_config.host_policy if args.kv_offloading_size else None,
                seed=args.seed, steps_per_call=args.steps_per_call, tensor_parallel_size=args.tensor_parallel_size,
                max_logprobs=args.max_logprobs,
                eos_token_ids=list(engine.eos_token_ids), warmup=args.warmup,
                sampling_params=dataclasses.asdict(dataclasses.replace(base, max_tokens=args.max_tokens)))


def _with_refused(summary, refused: int):
    """The run's summary counting the requests refused before the run (bad sampling parameters) too."""
    return dataclasses.replace(summary, requests=summary.requests + refused, failed=summary.failed + refused)


def _stop_token_ids(text: str | None) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        ids = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UsageError(f"--stop-token-ids must be comma-separated integers, got {text[:60]!r}") from None
    if any(not 0 <= t <= INT32_MAX for t in ids):
        raise UsageError(f"--stop-token-ids must be in [0, {INT32_MAX}], got {text[:60]!r}")
    return ids


_SAMPLING_FLAGS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                   "top_k", "min_p", "stop", "ignore_eos", "max_tokens", "min_tokens", "logprobs")


def _check_flags(args):
    """Flag rules that need no model: conflicts are refused, never ignored. Returns the
    SamplingParams the flags describe (each request then takes its own max_tokens)."""
    from kvjax.engine.sampling import SamplingParams, SamplingParamsError

    if args.shared_prefix and args.synthetic is None:
        raise UsageError("--shared-prefix applies to --synthetic prompts")
    if args.prompt_len != PROMPT_LEN and args.synthetic is None:
        raise UsageError("--prompt-len applies to --synthetic prompts")
    if args.chat and args.synthetic is not None:
        raise UsageError("--chat applies to --prompts text, not --synthetic token ids")
    if args.greedy:
        args.temperature = 0.0
    if args.temperature == 0:
        ignored = [f for f, v, off in (("--top-k", args.top_k, (0, -1)), ("--top-p", args.top_p, (1.0,)),
                                       ("--min-p", args.min_p, (0.0,))) if v not in off]
        if ignored:
            raise UsageError(f"{ignored[0]} filters what --temperature samples; greedy decoding ignores it")
        if args.n > 1:
            raise UsageError(f"--n {args.n} needs sampling (--temperature > 0): greedy decoding gives one output")
    if args.kv_cache_dtype_skip_layers and args.kv_cache_dtype == "auto":
        raise UsageError("--kv-cache-dtype-skip-layers keeps layers in the model's dtype, which --kv-cache-dtype auto "
                         "already gives every layer: it would be ignored")
    if args.logprobs is not None and not args.json:
        raise UsageError(f"--logprobs {args.logprobs}: only --json prints log-probabilities (the text output "
                         "would drop them); add --json")
    if args.min_tokens > args.max_tokens:
        raise UsageError(f"--min-tokens {args.min_tokens} exceeds --max-tokens {args.max_tokens}")
    check_host_tier(args.kv_offloading_size, args.enable_prefix_caching, UsageError, "--kv-offloading-size")
    if args.kv_transfer_config is not None and not args.kv_offloading_size:
        raise UsageError("--kv-transfer-config configures the host tier of --kv-offloading-size; without one it "
                         "would be ignored")
    if args.device_memory_gib is not None and args.gpu_memory_utilization is None:
        raise UsageError("--device-memory-gib is the memory --gpu-memory-utilization takes a share of; without it "
                         "it would be ignored")
    if args.scales and not kv_dtype_name(args.kv_cache_dtype).startswith("fp8"):
        raise UsageError(f"--scales are fp8 dequantization scales, but the kv cache dtype is "
                         f"{args.kv_cache_dtype}")
    values = {name: getattr(args, name) for name in _SAMPLING_FLAGS}
    try:
        return SamplingParams(**values, stop_token_ids=_stop_token_ids(args.stop_token_ids))
    except SamplingParamsError as e:  # a rule across fields: say it in flags
        raise UsageError(re.sub(r"\b(" + "|".join(_SAMPLING_FLAGS) + r")\b",
                                lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None


def kv_dtype_name(name: str) -> str:
    """The kv dtype a --kv-cache-dtype names ("auto": "auto", the model's, not known yet)."""
    from kvjax.quant.kv_formats import kv_format

    return "auto" if name == "auto" else kv_format(name).name


def _transfer_config(args) -> dict | None:
    """--kv-transfer-config: a JSON object, checked by the LLM's own rule before any model is loaded."""
    if args.kv_transfer_config is None:
        return None
    from kvjax.engine.arg_utils import eviction_policy

    try:
        config = loads(args.kv_transfer_config)
        if not isinstance(config, dict):
            raise KvjaxError(f"a JSON {json_type(config)}, not an object")
        eviction_policy(config, args.kv_offloading_size)
    except KvjaxError as e:
        raise UsageError(f"--kv-transfer-config {args.kv_transfer_config[:60]!r}: {e}") from None
    return config


def _scales(args):
    """The --scales file, read and checked against --kv-cache-dtype before any model is loaded."""
    if not args.scales:
        return None
    from kvjax.quant.formats import KVScales

    scales = KVScales.load(args.scales)
    try:
        scales.check_kv_dtype(kv_dtype_name(args.kv_cache_dtype))
    except KvjaxError as e:
        raise UsageError(f"--scales {args.scales}: {e}") from None
    return scales


def _rate(x) -> str:
    return "n/a (every such call compiled; try --warmup)" if x is None or x != x else f"{x:,.1f}"


def format_run(rows: list[dict], s, config: dict) -> str:
    """The human readout: one line per completion, then the summary."""
    lines = []
    for r in rows:
        if r["error"]:
            lines.append(f"[{r['index']}] error: {r['error']}")
        for c in r["outputs"] if not r["error"] else ():
            name = f"{r['index']}" if len(r["outputs"]) == 1 else f"{r['index']}.{c['index']}"
            why = c["finish_reason"] + (f" at {c['stop_reason']!r}" if c["stop_reason"] is not None else "")
            lines.append(f"[{name}] {len(r['prompt_token_ids'])} prompt → {len(c['token_ids'])} tokens ({why}): "
                         f"{c['text']!r}")
    hit = f"{s.prefix_hit_tokens:,} of {s.prefix_queried_tokens:,} looked up ({100 * s.prefix_hit_rate:.1f}%)"
    summary = [
        ("model", f"{config['model']}, kv {config['kv_cache_dtype']}, attention {config['attention_backend']}, "
                  f"{config['steps_per_call']} step(s)/call"),
        ("requests", f"{s.requests} ({s.failed} failed)"),
        ("prompt tokens", f"{s.prompt_tokens:,}"),
        ("prefix-cache hits", hit if config["enable_prefix_caching"] else "off"),
        ("generated tokens", f"{s.generated_tokens:,}"),
        ("prefill tokens/s", _rate(s.prefill_tokens_per_s) + f"  ({s.prefill_tokens:,} computed)"),
        ("decode tokens/s", _rate(s.decode_tokens_per_s)),
        ("step latency", f"p50 {s.step_latency_p50_ms:.2f} ms, p99 {s.step_latency_p99_ms:.2f} ms"
                         if s.step_latency_p50_ms == s.step_latency_p50_ms else "n/a"),
        ("steps", f"{s.steps} in {s.device_calls} device calls ({s.untimed_calls} compiled, {s.compile_s:.1f} s)"),
        ("peak blocks used", f"{s.peak_blocks_used} of {s.usable_blocks} usable (block size {config['block_size']})"),
        ("preemptions", f"{s.preemptions}"),
        ("time to first token", f"p50 {s.ttft_p50_ms:.1f} ms, p99 {s.ttft_p99_ms:.1f} ms"
                                if s.ttft_p50_ms == s.ttft_p50_ms else "n/a"),
        ("wall time", f"{s.wall_s:.2f} s"),
    ]
    if s.host_blocks:
        summary[4:4] = [
            ("host tier", f"{s.host_blocks:,} blocks ({config['kv_offloading_size']:g} GiB, "
                          f"{config['eviction_policy']}, {s.host_memory_kind}), {s.host_blocks_in_use:,} in use at "
                          "the end"),
            ("host hits", f"{s.host_hit_tokens:,} tokens loaded instead of prefilled"),
            ("host transfers", f"{s.host_bytes_stored:,} B stored, {s.host_bytes_loaded:,} B loaded")]
    width = max(len(k) for k, _ in summary)
    return "\n".join(lines + [""] + [f"{k:<{width}}  {v}" for k, v in summary])
