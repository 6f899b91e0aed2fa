"""`kvjax decode`: batched generation through the scheduler, block pool, paged cache and a model.

    kvjax decode --model small-gqa --prompts prompts.txt --max-tokens 64
    kvjax decode --model small-gqa --synthetic 32 --shared-prefix 64 --max-tokens 32 --num-blocks 48 --json

It runs `kvjax.LLM(...).generate` and prints what came back. Prompts: `--prompts FILE` holds
one prompt per line (an empty line is an empty prompt, which fails alone); a `.jsonl` file
holds one JSON object per line, {"prompt": text} or {"tokens": [ids]}, with an optional
per-request "max_tokens" (and "priority" with --priority). Text becomes tokens through the
checkpoint's tokenizer (tokenizer.json, or a GGUF's vocabulary), else as UTF-8 bytes (the
built-in models' 256-token vocabulary); with --chat each line is a user message rendered with
the model's chat template first (SmolLM2's adds the same system prompt to every request:
prefix-cache hits). `--synthetic N` makes N random prompts of --prompt-len/2 .. --prompt-len
tokens (seeded by --seed), each after the same --shared-prefix tokens (a fixed system prompt:
prefix-cache hits).

Stopping: a request ends at --max-tokens, at the model's max length, or when it samples the
model's EOS (config.json / generation_config.json `eos_token_id`; --ignore-eos generates past
it) or one of --stop-token-ids; the stop token is part of the output, as in vLLM.

Pool size: `--num-blocks K`; or `--util U`, which sizes it the way vLLM does
(kvjax.sizing.profile_and_size: profile one prefill, then blocks = (ceil(total × U) − weights −
activations) // bytes per block, with total = --total-gib, default 1 GiB since a CPU has no
device memory to profile); else enough blocks for --max-num-seqs requests of the longest prompt
+ --max-tokens, so nothing is preempted.

A request that breaks a rule (empty prompt, prompt at or over the model's max length,
max_tokens <= 0, more blocks than the pool has) gets an error in its result and the others
still run. Bad flags exit with status 2 and one line. The progress bar (tokens generated) goes
to stderr; results and the summary to stdout, as text or, with --json, one JSON object.
Rates and latencies leave out device calls that compiled (see kvjax.stats.Summary); with
--warmup the workload runs once before the measured run so that every step is timed.
"""
from __future__ import annotations

import json
import math
import sys

import numpy as np

from kvjax.errors import (INT32_MAX, MAX_GIB, InputFileError, KvjaxError, UsageError, check_int, float_arg,
                          int_arg, json_type, read_jsonl, read_text)

PROMPT_LEN = 32  # --prompt-len's default (given with --prompts, it would be ignored)


def add_parser(sub) -> None:
    p = sub.add_parser("decode", help="batched generation through scheduler, pool, paged cache and model",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="small-gqa | small-mla | smollm2-135m | a Hugging Face folder | PATH.gguf | preset:NAME")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE", help="one prompt per line (or .jsonl objects)")
    p.add_argument("--chat", action="store_true",
                   help="each text prompt is a user message, rendered with the model's chat template")
    src.add_argument("--synthetic", type=int_arg(1, 2**20), metavar="N", help="N random prompts")
    p.add_argument("--shared-prefix", type=int_arg(0), default=0, metavar="LEN", help="synthetic: shared first LEN tokens")
    p.add_argument("--prompt-len", type=int_arg(1), default=PROMPT_LEN,
                   help=f"synthetic: longest prompt after the prefix ({PROMPT_LEN})")
    p.add_argument("--max-tokens", type=int_arg(1), required=True, help="tokens to generate per request")
    p.add_argument("--kv-dtype", help="KV cache dtype (default: the model's): bf16, fp8_e4m3, fp8_e5m2, "
                                      "int8_per_token_head, ...")
    p.add_argument("--scales", metavar="FILE", help="fp8 scales from `kvjax calibrate` (default 1.0)")
    p.add_argument("--block-size", type=int_arg(1), default=16, help="tokens per block (16)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int_arg(2), help="pool size, null block included")
    size.add_argument("--util", type=float_arg(0, 1, lo_open=True), help="size the pool from --total-gib × U (vLLM's gpu_memory_utilization)")
    p.add_argument("--total-gib", type=float_arg(0, MAX_GIB, lo_open=True), default=1.0, help="memory total for --util (default 1)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-offload-gib", metavar="GIB", default="0",
                   help="host-memory offload tier for evicted KV blocks, in GiB (vLLM's kv_offloading_size; 0: none)")
    p.add_argument("--kv-offload-policy", choices=["lru", "arc"], default="lru", help="its eviction policy (lru)")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt in one step (vLLM enable_chunked_prefill=False); the budget then "
                        "covers the longest prompt")
    p.add_argument("--max-num-seqs", type=int_arg(1, 2**16), default=8, help="requests running at once (8)")
    p.add_argument("--max-model-len", type=int_arg(1), help="prompt + generated tokens (default: the model's maximum)")
    p.add_argument("--max-num-batched-tokens", type=int_arg(1), metavar="N",
                   help="tokens per engine step (default 2048; with --no-chunked-prefill at least max_model_len); "
                        "--util profiles a step this size")
    p.add_argument("--attn-impl", choices=["reference", "pallas"],
                   help="decode attention (default: pallas on GPU, except for int8_per_token_head KV; reference elsewhere)")
    sampling = p.add_mutually_exclusive_group()
    sampling.add_argument("--greedy", action="store_true", help="argmax sampling (the default)")
    sampling.add_argument("--temperature", type=float_arg(0, 1e4, lo_open=True), help="sample from softmax(logits / T)")
    p.add_argument("--top-k", type=int_arg(0), default=0, help="with --temperature: keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float_arg(0, 1, lo_open=True), default=1.0, help="with --temperature: keep the nucleus of probability p")
    p.add_argument("--seed", type=int_arg(0, 2**32 - 1), default=0, help="sampling and --synthetic seed (0)")
    p.add_argument("--stop-token-ids", metavar="IDS", help="comma-separated token ids that end a request, e.g. 1,2")
    p.add_argument("--ignore-eos", action="store_true", help="generate past the model's EOS token")
    p.add_argument("--logprobs", action="store_true", help="report each generated token's log-probability (--json)")
    p.add_argument("--priority", action="store_true",
                   help="priority scheduling: .jsonl requests' \"priority\" (lower first; default 0) orders "
                        "admission and preemption")
    p.add_argument("--steps-per-call", type=int_arg(1, 1024), default=1, help="decode steps per device call (1)")
    p.add_argument("--warmup", action="store_true", help="run the workload once first (compiles out of the timings)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from kvjax import budget
    from kvjax.llm import LLM
    from kvjax.sampling import SamplingParams, SamplingParamsError
    from kvjax.spec import kv_dtype
    from kvjax.models.hub import load_model

    _check_flags(args)  # everything that needs no model is checked before loading one
    stop_ids = _stop_token_ids(args.stop_token_ids)
    raw = read_prompts(args.prompts, allow_priority=args.priority) if args.prompts else None
    scales = _scales(args)
    loaded = load_model(args.model, attn_impl=args.attn_impl, seed=args.seed)
    if args.max_model_len is not None and args.max_model_len > loaded.config.max_position_embeddings:
        raise UsageError(f"--max-model-len {args.max_model_len} exceeds the model's maximum length "
                         f"{loaded.config.max_position_embeddings}")
    encode = loaded.tokenizer.encode
    if args.chat:
        from kvjax.models.tokenizer import render_chat

        if not loaded.chat_template:
            raise UsageError(f"--chat: model {args.model!r} has no chat template")
        encode = lambda text: loaded.tokenizer.encode(  # noqa: E731
            render_chat(loaded.chat_template, [{"role": "user", "content": text}]))
    limit = args.max_model_len or loaded.config.max_position_embeddings
    if args.synthetic is not None and args.shared_prefix + args.prompt_len >= limit:
        raise UsageError(f"--shared-prefix {args.shared_prefix} + --prompt-len {args.prompt_len} leave no room to "
                         f"generate within the max length {limit}")
    requests = _synthetic(args, loaded.config.vocab_size) if raw is None else [
        dict(r, tokens=encode(r["prompt"]) if r["prompt"] is not None else r["tokens"]) for r in raw]
    for r in requests:
        r["max_tokens"] = args.max_tokens if r["max_tokens"] is None else r["max_tokens"]
    max_len = args.max_model_len or loaded.config.max_position_embeddings
    z = args.block_size
    num_blocks = args.num_blocks
    if num_blocks is None and args.util is None:
        most = max((r["max_tokens"] for r in requests if isinstance(r["max_tokens"], int)), default=1)
        longest = min(max((len(r["tokens"]) for r in requests), default=1) + most, max_len)
        num_blocks = 1 + args.max_num_seqs * math.ceil(longest / z)
    from kvjax.offload import host_blocks

    host_blocks(args.kv_offload_gib, loaded.config.kv_spec(args.kv_dtype).bytes_per_block(z), "--kv-offload-gib")
    llm = LLM(loaded, kv_dtype=args.kv_dtype, scales=scales, block_size=z, num_blocks=num_blocks,
              gpu_memory_utilization=args.util, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              enable_prefix_caching=not args.no_prefix_caching, attn_impl=args.attn_impl,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=not args.no_chunked_prefill,
              steps_per_call=args.steps_per_call, seed=args.seed, scheduling_policy="priority" if args.priority
              else "fcfs", total_memory_bytes=budget.gib(args.total_gib, "--total-gib") if args.util is not None
              else None, kv_offload_gib=args.kv_offload_gib, kv_offload_policy=args.kv_offload_policy)
    errors, runnable = {}, []
    for i, r in enumerate(requests):  # a request's bad sampling parameters fail it alone
        try:
            sp = SamplingParams(max_tokens=r["max_tokens"], temperature=args.temperature or 0.0, top_k=args.top_k,
                                top_p=args.top_p, stop_token_ids=stop_ids, ignore_eos=args.ignore_eos,
                                logprobs=0 if args.logprobs else None)
        except SamplingParamsError as e:
            errors[i] = str(e)
            continue
        runnable.append((i, r["tokens"], sp, r["priority"]))
    prompts, params = [r[1] for r in runnable], [r[2] for r in runnable]
    priority = [r[3] for r in runnable] if args.priority else None
    if args.warmup:
        llm.generate(prompts, params, priority=priority)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        total = sum(llm.engine.check_request(p, sp)[1] for p, sp in zip(prompts, params))  # refused ones: 0
        bar = tqdm(total=total, unit="tok", file=sys.stderr, desc="decode")
    try:
        outs = llm.generate(prompts, params, priority=priority, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    by_index = {i: out for (i, *_), out in zip(runnable, outs)}
    rows = []
    for i, r in enumerate(requests):
        out = by_index.get(i)
        row = dict(index=i, prompt_tokens=len(r["tokens"]), output_tokens=out.token_ids if out else [],
                   text=out.text if out else "", finish_reason=out.finish_reason if out else None,
                   error=out.error if out else errors[i], preemptions=out.num_preemptions if out else 0,
                   num_cached_tokens=out.num_cached_tokens if out else 0)
        if args.logprobs:
            row["logprobs"] = out.logprobs if out else None
        rows.append(row)
    summary = _with_refused(outs.summary, len(requests))
    setup = dict(model=args.model, kv_dtype=kv_dtype(llm.kv_spec.kv_dtype).name, block_size=z,
                 num_blocks=llm.num_blocks, max_num_seqs=args.max_num_seqs, max_model_len=llm.engine.max_model_len,
                 prefix_caching=not args.no_prefix_caching, attn_impl=llm.model.module.attn_impl,
                 chunked_prefill=not args.no_chunked_prefill,
                 max_num_batched_tokens=llm.engine.scheduler_config.max_num_batched_tokens,
                 steps_per_call=args.steps_per_call,
                 temperature=args.temperature or 0.0, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                 eos_token_ids=list(llm.engine.eos_token_ids), stop_token_ids=list(stop_ids),
                 ignore_eos=args.ignore_eos, policy="priority" if args.priority else "fcfs",
                 kv_offload_gib=float(args.kv_offload_gib), kv_offload_policy=args.kv_offload_policy)
    if args.json:
        print(json.dumps({"config": setup, "requests": rows, "summary": summary.to_json()}, indent=1))
    else:
        print(format_run(rows, summary, setup))
    return 0


def _with_refused(summary, requests: int):
    """The run's summary counting the requests refused before the run (bad sampling parameters) too."""
    import dataclasses

    refused = requests - summary.requests
    return dataclasses.replace(summary, requests=requests, failed=summary.failed + refused)


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


def _check_flags(args) -> None:
    """Flag rules that need no model: conflicts are refused, never ignored."""
    if args.shared_prefix and args.synthetic is None:
        raise UsageError("--shared-prefix applies to --synthetic prompts")
    if args.prompt_len != PROMPT_LEN and args.synthetic is None:
        raise UsageError("--prompt-len applies to --synthetic prompts")
    if args.chat and args.synthetic is not None:
        raise UsageError("--chat applies to --prompts text, not --synthetic token ids")
    if args.temperature is None and (args.top_k != 0 or args.top_p != 1.0):
        raise UsageError("--top-k and --top-p filter what --temperature samples; greedy decoding ignores them")
    from kvjax import budget

    budget.gib(args.kv_offload_gib, "--kv-offload-gib")  # a number of GiB >= 0; below one block: LLM says
    if args.no_prefix_caching and budget.gib(args.kv_offload_gib):
        raise UsageError("--kv-offload-gib needs prefix caching: host blocks are found by their hashes")
    if args.total_gib != 1.0 and args.util is None:
        raise UsageError("--total-gib is the memory --util takes a share of; without --util it would be ignored")
    if args.scales and not (args.kv_dtype and kv_dtype_name(args.kv_dtype).startswith("fp8")):
        kv = kv_dtype_name(args.kv_dtype) if args.kv_dtype else "the model's dtype"
        raise UsageError(f"--scales are fp8 dequantization scales, but the kv dtype is {kv}")


def kv_dtype_name(name: str) -> str:
    from kvjax.spec import kv_dtype

    return kv_dtype(name).name


def _scales(args):
    """The --scales file, read and checked against --kv-dtype before any model is loaded."""
    if not args.scales:
        return None
    from kvjax.quant import KVScales

    scales = KVScales.load(args.scales)
    try:
        scales.check_kv_dtype(kv_dtype_name(args.kv_dtype))
    except KvjaxError as e:
        raise UsageError(f"--scales {args.scales}: {e}") from None
    return scales


_JSONL_KEYS = {"prompt", "tokens", "max_tokens", "priority"}


def read_prompts(path: str, allow_priority: bool = False) -> list[dict]:
    """A prompts file, checked line by line before any model is loaded. One dict per request:
    prompt (text, or None), tokens (ids, or None), max_tokens (None: the flag's), priority.

    Plain text: one prompt per line. `.jsonl`: one object per non-blank line with exactly one of
    "prompt" (a string) and "tokens" (a list of ints in [0, 2**31)), optional "max_tokens" (an
    int; one ≤ 0 fails that request alone, as vLLM's would) and "priority" (an int, with
    --priority). Anything else is an InputFileError naming the line."""
    if not path.endswith(".jsonl"):
        return [dict(prompt=line, tokens=None, max_tokens=None, priority=0)
                for line in read_text(path, "prompts file").splitlines()]
    requests = []
    for n, obj in read_jsonl(path, "prompts file"):
        bad = lambda msg: InputFileError(path, msg, n)  # noqa: E731
        if not isinstance(obj, dict):
            raise bad(f"expected a JSON object, got a JSON {json_type(obj)}")
        unknown = sorted(set(obj) - _JSONL_KEYS)
        if unknown:
            raise bad(f"unknown key(s) {unknown}; a request has {', '.join(sorted(_JSONL_KEYS))}")
        if ("prompt" in obj) == ("tokens" in obj):
            raise bad('need exactly one of "prompt" and "tokens"')
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise bad(f'"prompt" must be a string, got a JSON {json_type(obj["prompt"])}')
        tokens = obj.get("tokens")
        if "tokens" in obj:
            if not isinstance(tokens, list):
                raise bad(f'"tokens" must be a list of token ids, got a JSON {json_type(tokens)}')
            for i, t in enumerate(tokens):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX:
                    raise bad(f'token {i} is {json.dumps(t)[:40]}: token ids are ints in [0, 2**31)')
        if "priority" in obj and not allow_priority:
            raise bad('a "priority" needs --priority (it would be ignored)')
        try:
            max_tokens = None if "max_tokens" not in obj else \
                check_int(obj["max_tokens"], '"max_tokens"', -INT32_MAX, INT32_MAX)
            priority = check_int(obj.get("priority", 0), '"priority"', -INT32_MAX, INT32_MAX)
        except KvjaxError as e:
            raise bad(str(e)) from None
        requests.append(dict(prompt=obj.get("prompt"), tokens=tokens, max_tokens=max_tokens, priority=priority))
    return requests


def _synthetic(args, vocab_size: int) -> list[dict]:
    """--synthetic N random prompts after the same --shared-prefix tokens (seeded by --seed)."""
    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(0, vocab_size, args.shared_prefix).tolist()
    lengths = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, args.synthetic)
    return [dict(tokens=prefix + rng.integers(0, vocab_size, n).tolist(), max_tokens=None, priority=0)
            for n in lengths]


def _rate(x) -> str:
    return "n/a (every such call compiled; try --warmup)" if x is None or x != x else f"{x:,.1f}"


def format_run(rows: list[dict], s, setup: dict) -> str:
    """The human readout: one line per request, then the summary."""
    lines = []
    for r in rows:
        if r["error"]:
            lines.append(f"[{r['index']}] error: {r['error']}")
        else:
            lines.append(f"[{r['index']}] {r['prompt_tokens']} prompt → {len(r['output_tokens'])} tokens "
                         f"({r['finish_reason']}): {r['text']!r}")
    hit = f"{s.prefix_hit_tokens:,} of {s.prefix_queried_tokens:,} looked up ({100 * s.prefix_hit_rate:.1f}%)"
    summary = [
        ("model", f"{setup['model']}, kv {setup['kv_dtype']}, attn {setup['attn_impl']}, "
                  f"{setup['steps_per_call']} step(s)/call"),
        ("requests", f"{s.requests} ({s.failed} failed)"),
        ("prompt tokens", f"{s.prompt_tokens:,}"),
        ("prefix-cache hits", hit if setup["prefix_caching"] else "off"),
        ("generated tokens", f"{s.generated_tokens:,}"),
        ("prefill tokens/s", _rate(s.prefill_tokens_per_s) + f"  ({s.prefill_tokens:,} computed)"),
        ("decode tokens/s", _rate(s.decode_tokens_per_s)),
        ("step latency", f"p50 {s.step_latency_p50_ms:.2f} ms, p99 {s.step_latency_p99_ms:.2f} ms"
                         if s.step_latency_p50_ms == s.step_latency_p50_ms else "n/a"),
        ("steps", f"{s.steps} in {s.device_calls} device calls ({s.untimed_calls} compiled, {s.compile_s:.1f} s)"),
        ("peak blocks used", f"{s.peak_blocks_used} of {s.usable_blocks} usable (block size {setup['block_size']})"),
        ("preemptions", f"{s.preemptions}"),
        ("time to first token", f"p50 {s.ttft_p50_ms:.1f} ms, p99 {s.ttft_p99_ms:.1f} ms"
                                if s.ttft_p50_ms == s.ttft_p50_ms else "n/a"),
        ("wall time", f"{s.wall_s:.2f} s"),
    ]
    if s.host_blocks:
        summary[4:4] = [
            ("host tier", f"{s.host_blocks:,} blocks ({setup['kv_offload_gib']:g} GiB, {setup['kv_offload_policy']}, "
                          f"{s.host_memory_kind}), {s.host_blocks_in_use:,} in use at the end"),
            ("host hits", f"{s.host_hit_tokens:,} tokens loaded instead of prefilled"),
            ("host transfers", f"{s.host_bytes_stored:,} B stored, {s.host_bytes_loaded:,} B loaded")]
    width = max(len(k) for k, _ in summary)
    return "\n".join(lines + [""] + [f"{k:<{width}}  {v}" for k, v in summary])
