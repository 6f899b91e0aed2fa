"""`kvjax decode`: batched generation through the scheduler, block pool, paged cache and a model.

    kvjax decode --model small-gqa --prompts prompts.txt --max-tokens 64 --temperature 0
    kvjax decode --model small-gqa --synthetic 32 --shared-prefix 64 --max-tokens 32 \\
        --kv-cache-dtype fp8 --num-gpu-blocks-override 48 --max-num-seqs 8 --json

It runs `kvjax.LLM(...).generate` and prints what came back. Engine flags are vLLM's engine
args, from the one table of kvjax.engine.cli_args (EngineArgs.add_cli_args: --kv-cache-dtype,
--block-size, --num-gpu-blocks-override, --gpu-memory-utilization, --kv-cache-memory-bytes,
--[no-]enable-prefix-caching, --[no-]enable-chunked-prefill, --max-num-seqs, --max-model-len,
--max-num-batched-tokens, --scheduling-policy, --attention-backend, --kv-offloading-size,
--kv-transfer-config, --disable-hybrid-kv-cache-manager, --enforce-eager, --hf-overrides, --seed,
--dtype, --max-logprobs, ...), read back with EngineArgs.from_cli_args and resolved once
(create_engine_config: every engine rule is checked on the model's config before its weights
are read); sampling flags are SamplingParams' fields with vLLM's defaults (temperature 1.0:
--greedy or --temperature 0 for argmax).

Prompts: `--prompts FILE` (lines, or `.jsonl` requests) or `--synthetic N` (kvjax/commands/prompts.py).

Stopping: a request ends at --max-tokens, at the model's max length, when it samples the
model's EOS (config.json / generation_config.json `eos_token_id`; --ignore-eos generates past
it) or one of --stop-token-ids (the token stays in the output, as in vLLM), or when its text
ends in a --stop string (cut from the text).

Pool size: `--num-gpu-blocks-override K`; or `--kv-cache-memory-bytes B` (blocks = B // bytes
per block, + the null block); or `--gpu-memory-utilization U`, which sizes it the way vLLM does
(kvjax.accounting.sizing.profile_and_size: profile one prefill, then blocks = (ceil(total × U) − weights −
activations) // bytes per block, total = the device's memory, a CPU's memory node's as vLLM's CPU
platform takes it, or --device-memory-gib); with none of them, enough blocks for the requests (each
sample's prompt + --max-tokens), at most --max-num-seqs of them at once, in every KV cache group, so
nothing is preempted (on a CPU at most a quarter of its memory node: the resolver's rule,
kvjax.config.engine.resolve_num_blocks; KVJAX_CPU_KVCACHE_SPACE or VLLM_CPU_KVCACHE_SPACE, in GiB,
sets the pool's bytes as vLLM's does).

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

import dataclasses
import re
import sys

from kvjax.commands.common import add_model_flags, add_progress_flag, progress_enabled
from kvjax.commands.prompts import build_requests, read_prompts, refused_output, sampling_params
from kvjax.config.scheduler import check_host_tier
from kvjax.engine.arg_utils import EngineArgs
from kvjax.engine.cli_args import add_engine_flags, as_flags
from kvjax.errors import KvjaxError, UsageError
from kvjax.progress import Phases
from kvjax.utils.checks import INT32_MAX, float_arg, int_arg
from kvjax.utils.strict_json import dumps

PROMPT_LEN = 32  # --prompt-len's default (given with --prompts, it would be ignored)
# The engine flags decode takes, from the one table (kvjax.engine.cli_args); --model and --dtype come with the model.
ENGINE_FLAGS = ("kv_cache_dtype", "kv_cache_dtype_skip_layers", "scales", "block_size", "num_gpu_blocks_override",
                "gpu_memory_utilization", "kv_cache_memory_bytes", "total_memory_bytes", "enable_prefix_caching",
                "kv_offloading_size", "kv_transfer_config", "disable_hybrid_kv_cache_manager", "enable_chunked_prefill",
                "max_num_seqs", "max_model_len", "max_num_batched_tokens", "scheduling_policy", "attention_backend",
                "tensor_parallel_size", "seed", "max_logprobs", "steps_per_call", "enforce_eager", "hf_overrides",
                "generation_config", "decode_context_parallel_size", "nnodes", "node_rank", "master_addr", "master_port",
                "distributed_timeout_seconds")  # the last five: one job over processes (docs/distributed.md)


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

    add_engine_flags(p, ENGINE_FLAGS, "KV cache and engine (vLLM's engine args: kvjax.engine.cli_args)")

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
    from kvjax.models.hub import load_model

    base = _check_flags(args)  # everything that needs no model is checked before loading one
    raw = read_prompts(args.prompts, allow_priority=args.scheduling_policy == "priority", chat=args.chat) \
        if args.prompts else None
    engine_args = EngineArgs.from_cli_args(args)
    show = progress_enabled(args)
    try:  # every engine rule, on the model's config: no weights read yet
        config = engine_args.create_engine_config()
    except KvjaxError as e:  # the engine's words for its arguments: said in flags
        raise UsageError(as_flags(str(e))) from None
    loaded = load_model(args.model, config=config.model_config, attn_impl=config.attention_backend, seed=args.seed,
                        progress=show)  # its own bar: fetch, read the weights, build
    requests = build_requests(args, loaded, raw)
    with Phases("decode", 2 if args.warmup else 1, show) as phases:
        phases.start("build the engine" + (" (profiling a step)" if args.gpu_memory_utilization else ""))
        try:
            llm = _llm(engine_args, loaded, requests, base.n)
        except KvjaxError as e:
            raise UsageError(as_flags(str(e))) from None
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
    config = _config_json(args, llm, base)
    if args.json:
        print(dumps({"config": config, "outputs": rows, "summary": summary.to_json()}, indent=1))
    else:
        print(format_run(rows, summary, config))
    return 0


def _llm(engine_args: EngineArgs, loaded, requests: list[dict], n: int):
    """The LLM the flags describe. With no pool-size flag, the resolver sizes the pool for the
    requests (each of its n samples a prompt + its max_tokens, capped at the max length), at most
    --max-num-seqs of them at once, in every KV cache group, so nothing is preempted
    (kvjax.config.engine.resolve_num_blocks)."""
    from kvjax.engine.llm import LLM

    lens = [len(r["tokens"]) + r["max_tokens"] for r in requests for _ in range(n)]
    # a multi-process job loads the model on every rank from its name (kvjax.engine.llm_engine), not from `loaded`
    model = loaded if engine_args.nnodes == 1 else engine_args.model
    return LLM.from_engine_args(dataclasses.replace(engine_args, model=model), request_lens=lens)


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


def _config_json(args, llm, base) -> dict:
    """The run's engine arguments as the LLM resolved them (vLLM's names) and its SamplingParams."""
    engine = llm.engine
    return dict(model=args.model, dtype=llm.config.dtype, kv_cache_dtype=llm.kv_spec.kv_dtype,
                kv_cache_dtype_skip_layers=list(llm.kv_spec.skip_layers),
                block_size=llm.block_size,  # as resolved: a Mamba hybrid's grows until a page holds a state
                num_gpu_blocks=llm.num_blocks, max_num_seqs=args.max_num_seqs,
                max_model_len=engine.max_model_len,
                max_num_batched_tokens=engine.scheduler_config.max_num_batched_tokens,
                enable_prefix_caching=llm.vllm_config.cache_config.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
                scheduling_policy=args.scheduling_policy, attention_backend=llm.model.module.attn_impl,
                kv_offloading_size=args.kv_offloading_size or None, kv_transfer_config=args.kv_transfer_config,
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
    check_host_tier(args.kv_offloading_size, args.enable_prefix_caching is not False, UsageError, "--kv-offloading-size")
    if args.kv_transfer_config is not None and not args.kv_offloading_size:
        raise UsageError("--kv-transfer-config configures the host tier of --kv-offloading-size; without one it "
                         "would be ignored")
    if args.total_memory_bytes is not None and args.gpu_memory_utilization is None:
        raise UsageError("--device-memory-gib is the memory --gpu-memory-utilization takes a share of; without it "
                         "it would be ignored")
    values = {name: getattr(args, name) for name in _SAMPLING_FLAGS}
    try:
        return SamplingParams(**values, stop_token_ids=_stop_token_ids(args.stop_token_ids))
    except SamplingParamsError as e:  # a rule across fields: say it in flags
        raise UsageError(re.sub(r"\b(" + "|".join(_SAMPLING_FLAGS) + r")\b",
                                lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None


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
