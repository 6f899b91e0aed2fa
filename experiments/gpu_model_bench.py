"""The whole model on a GPU: kvjax's engine against its roofline and against transformers, side by side.

Random weights in a real model's shapes (Llama-3-8B's 32 layers by default; `--layers 2` of
Llama-3-70B for its per-layer numbers; MoE presets for a few layers), made by
`models.random_params` in seconds. Three measurements, each a row of one JSON / markdown table:

* decode: the engine's decode calls (`Engine.step`, `steps_per_call` K steps a call, sampling and
  the block pool inside) at batch B with every request at `context` tokens. The contexts are
  filled without computing them: the requests are admitted and scheduled as usual, their
  prompts marked computed (`Scheduler.update` with placeholder tokens, what a finished prefill
  step would do), and the pages filled with random values (never time on zeros). What is timed
  is exactly the engine's decode path from there: `calls` calls after one that compiles, each
  call's wall time over its steps. Roofline: the bytes one step must read (every weight but
  the embedding table, of which only B rows are gathered, plus every request's K/V up to its
  context) over the measured read bandwidth (experiments/device_peaks.py).
* prefill: B prompts of `context` tokens through `LLM.generate(max_tokens=1)` (one ragged step
  when they fit max_num_batched_tokens), the second of two runs timed: TTFT of the batch and
  prefill tokens/s, against FLOPs (2 × params-ish per token + attention) / the measured peak.
* transformers (`--transformers`, its own process: torch and JAX do not share the card well):
  `LlamaForCausalLM` of the same shapes built on the GPU in bf16, sdpa attention, static cache:
  the prefill forward (TTFT) and `generate` of `new_tokens` greedy tokens (TPOT = the time after
  the prefill over the tokens).

`--profile [CASE]` wraps the timed decode calls of one decode case (the first, or the first whose label
starts with CASE) in `jax.profiler.trace` and
summarises the trace (experiments/step_profile.py) into step_profile.json / .md.

    python -m kvjax.experiments.gpu_model_bench --cases "decode:32:512:bf16 prefill:32:512" [--out DIR]
    python -m kvjax.experiments.gpu_model_bench --transformers --cases "decode:32:512 prefill:32:512"
    python -m kvjax.experiments.gpu_model_bench --tiny                    # every code path, tiny shapes, CPU

A case is KIND:BATCH:CONTEXT[:KV[:IMPL[:K]]] (KV bf16 / fp8_e4m3 ...; IMPL pallas / reference or a
leave-one-out variant of pallas: no-attention (decode attention returns zeros), no-sampling (a bare
argmax for the sampler), no-allocator (the device loop's transition without the block pool); K =
steps per call, so K 1 against 8 is the device loop left out).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.experiments import results_dir
from kvjax.markdown import markdown_table
from kvjax.math_utils import cdiv
from kvjax.utils.output_files import write_json, write_text

BLOCK = 16
COMPILED: list = []  # (event, function, seconds) of every JAX trace / lowering / compile in this process
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: COMPILED.append((name.rsplit("/", 1)[-1], kw.get("fun_name"), round(secs, 3)))
    if name.startswith("/jax/core/compile/") else None)


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # decode | prefill
    batch: int
    context: int
    kv: str = "bf16"
    impl: str = "pallas"
    k: int = 8  # steps_per_call

    @classmethod
    def parse(cls, text: str) -> "Case":
        parts = text.split(":")
        if parts[0] not in ("decode", "prefill") or not 3 <= len(parts) <= 6:
            raise SystemExit(f"gpu_model_bench: error: bad case {text!r}: KIND:BATCH:CONTEXT[:KV[:IMPL[:K]]]")
        kw = dict(kind=parts[0], batch=int(parts[1]), context=int(parts[2]))
        for name, value in zip(("kv", "impl", "k"), parts[3:]):
            kw[name] = int(value) if name == "k" else value
        return cls(**kw)

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.batch}:{self.context}:{self.kv}:{self.impl}:{self.k}"


# ----------------------------------------------------------------------------------------- kvjax
def build_model(preset_name: str, layers: int | None, impl: str = "pallas"):
    from kvjax.config.presets import preset
    from kvjax.models import build_model as build, random_params
    from kvjax.models.hub import LoadedModel
    from kvjax.models.tokenizer import Tokenizer

    config = preset(preset_name)
    if layers:
        config = config.replace(num_layers=layers)
    module = build(config, "reference")
    t0 = time.perf_counter()
    params = jax.block_until_ready(random_params(module, jax.random.key(0)))
    return LoadedModel(f"preset:{config.name}", config, module, params, Tokenizer()), time.perf_counter() - t0


def weight_bytes(model) -> tuple[int, int]:
    """(all parameter bytes, the bytes a decode step reads: all but an untied embedding table)."""
    total = sum(x.nbytes for x in jax.tree.leaves(model.params))
    embed = model.params["embed_tokens"]["embedding"].nbytes if "embed_tokens" in model.params else 0
    return total, total - (0 if model.config.tie_word_embeddings else embed)


def _no_attention():
    """A leave-one-out variant: decode attention returns zeros (its reads and math left out), registered
    as a backend beside the others (its name among configuration's, kvjax.config.attention)."""
    import kvjax.attention as attn
    from kvjax.config import attention as backends

    base = attn._IMPLS["pallas"]
    zero = lambda q, *a, **k: jnp.zeros_like(q)  # noqa: E731
    attn._IMPLS["no-attention"] = dataclasses.replace(base, decode=zero, mla_decode=lambda ql, qr, *a, **k: jnp.zeros_like(ql))
    backends.IMPLS = tuple(attn._IMPLS)
    jax.clear_caches()


def _bare_argmax(logits, rows, positions, num_logprobs=0):
    """The sampler left out: the greedy token alone (every logit is still computed: argmax reads them
    all), no log-probabilities, ranks, penalties or draws."""
    from kvjax.engine.sampling import Sampled

    b = logits.shape[0]
    return Sampled(jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros(b, jnp.float32), jnp.ones(b, jnp.int32),
                   jnp.zeros((b, num_logprobs), jnp.int32), jnp.zeros((b, num_logprobs), jnp.float32))


def _no_pool_transition(state, rows, sampled, active, allocate):
    """The allocator left out of the device loop: the transition's append and stop check without
    `allocate_step` (its cond and loops); the loop goes on only while no row needs a new block, so
    the host's next `schedule` allocates what the next call needs."""
    from kvjax.core.sched.transition import decode_transition

    state, t = decode_transition(state, rows, sampled, active, False)
    go = jnp.asarray(allocate) & (t.finish == 0).all() & (t.need == 0).all() & ~t.append_refused.any()
    return state, t.replace(allocated=go)


@contextlib.contextmanager
def leave_out(impl: str):
    """The leave-one-out variants of a case's IMPL: "no-attention" (decode attention returns zeros),
    "no-sampling" (`_bare_argmax` for the sampler), "no-allocator" (`_no_pool_transition` in the
    device loop); the others change nothing. Yields the attention backend to build the LLM with.
    Compiled programs are dropped on the way in and out, so no variant reuses another's."""
    import kvjax.engine.steps as steps

    saved = steps.sampling.sample, steps.decode_transition
    if impl == "no-attention":
        _no_attention()
    elif impl == "no-sampling":
        steps.sampling.sample = _bare_argmax
    elif impl == "no-allocator":
        steps.decode_transition = _no_pool_transition
    if impl in ("no-sampling", "no-allocator"):
        jax.clear_caches()
    try:
        yield "pallas" if impl in ("no-sampling", "no-allocator") else impl
    finally:
        if (steps.sampling.sample, steps.decode_transition) != saved:
            steps.sampling.sample, steps.decode_transition = saved
            jax.clear_caches()


def _llm(model, case: Case, max_len: int, budget: int, backend: str | None = None):
    from kvjax import LLM

    return LLM(model, max_num_seqs=case.batch, max_model_len=max_len, block_size=BLOCK, steps_per_call=case.k,
               enable_prefix_caching=False, kv_cache_dtype=case.kv, attention_backend=backend or case.impl,
               num_gpu_blocks_override=1 + case.batch * cdiv(max_len, BLOCK), max_num_batched_tokens=budget, seed=0)


def _random_like(key, x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype)
    info = jnp.iinfo(x.dtype)
    return jax.random.randint(key, x.shape, info.min, info.max, jnp.int32).astype(x.dtype)


def fill_pages(cache):
    """The cache with every page array (not the scales or counters) drawn at random."""
    from kvjax.worker.paged_cache import KVPages, LatentPages

    rand = jax.jit(_random_like)
    layers = []
    for i, layer in enumerate(cache.layers):
        key = jax.random.key(100 + i)
        if isinstance(layer, KVPages):
            k1, k2 = jax.random.split(key)
            layer = layer.replace(k=rand(k1, layer.k), v=rand(k2, layer.v))
        elif isinstance(layer, LatentPages):
            layer = layer.replace(latent=rand(key, layer.latent))
        layers.append(layer)
    return cache.replace(layers=tuple(layers))


def decode_case(model, case: Case, calls: int, peaks: dict, profile_dir: str | None = None,
                backend: str | None = None) -> dict:
    """Every request at case.context tokens (marked computed, pages random), then `calls` timed
    decode calls of the engine after one that compiles."""
    from kvjax import SamplingParams

    gen = case.k * (calls + 4) + 1
    max_len = case.context + gen
    llm = _llm(model, case, max_len, budget=8192, backend=backend)
    eng = llm.engine
    rng = np.random.default_rng(case.batch)
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    for i in range(case.batch):
        eng.add_request(f"r{i}", rng.integers(0, model.config.vocab_size, case.context - 1).tolist(), params)
    sched, started = eng.scheduler, 0
    while started < case.batch:  # the prompts' steps, marked computed without running the model
        plan = sched.schedule()
        started += int(np.sum(plan.sample))
        sched.update(plan, np.zeros(plan.num_requests, np.int32))
    eng.cache = fill_pages(eng.cache)
    jax.block_until_ready(eng.cache)
    t0, warm = time.perf_counter(), 0
    while True:  # warm up until a call compiles nothing (a row crossing a table-width bucket compiles anew)
        mark = len(COMPILED)
        eng.step()
        warm += 1
        if len(COMPILED) == mark or warm == 3:
            break
    compile_s = time.perf_counter() - t0
    per_step, trace, mark = [], None, len(COMPILED)
    if profile_dir:
        jax.profiler.start_trace(profile_dir)
    for _ in range(calls):  # per step: a call's time over the steps it ran (a loop may stop early)
        before = sum(r.num_tokens for r in sched.running)
        t0 = time.perf_counter()
        eng.step()
        took = time.perf_counter() - t0
        per_step.append(took / max(1, (sum(r.num_tokens for r in sched.running) - before) // case.batch))
    if profile_dir:
        jax.profiler.stop_trace()
        trace = profile_dir
    total, read = weight_bytes(model)
    kv_token = llm.kv_spec.bytes_per_token
    ctx = case.context + case.k * (warm + calls // 2)  # mid-run context per request
    kv_read = case.batch * ctx * kv_token
    step = statistics.median(per_step)
    roof = (read + kv_read) / (peaks["read_gb_s"] * 1e9) if peaks else float("nan")
    mem = _memory()
    del llm, eng
    return {"case": case.label, "kind": "decode", "batch": case.batch, "context": case.context, "kv": case.kv,
            "impl": case.impl, "k": case.k, "step_ms": step * 1e3, "step_samples_ms": [s * 1e3 for s in per_step],
            "decode_tok_s": case.batch / step, "weights_read_bytes": read, "kv_read_bytes": kv_read,
            "roofline_ms": roof * 1e3, "vs_roofline": step / roof, "compile_s": compile_s, "warm_calls": warm,
            "compiled_in_timed_calls": COMPILED[mark:][:20], "trace": trace, **mem}


def prefill_case(model, case: Case, peaks: dict, backend: str | None = None) -> dict:
    from kvjax import SamplingParams

    budget = min(case.batch * case.context, 65536)
    llm = _llm(model, case, case.context + 1, budget=budget, backend=backend)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.config.vocab_size, case.context).tolist() for _ in range(case.batch)]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for _ in range(2):
        llm.reset_prefix_cache()
        mark = len(COMPILED)
        t0 = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    tokens = case.batch * case.context
    c = model.config
    total, _ = weight_bytes(model)
    flops = 2 * (total / 2) * tokens + 4 * c.num_layers * c.num_heads * c.head_dim * case.batch * case.context ** 2 / 2
    roof = flops / (peaks["matmul_tflop_s"] * 1e12) if peaks else float("nan")
    mem = _memory()
    s = out.summary
    return {"case": case.label, "kind": "prefill", "batch": case.batch, "context": case.context, "kv": case.kv,
            "impl": case.impl, "ttft_ms": times[1] * 1e3, "cold_s": times[0], "prefill_tok_s": tokens / times[1],
            "engine_prefill_tok_s": None if s.prefill_tokens_per_s != s.prefill_tokens_per_s else s.prefill_tokens_per_s,
            "compiled_in_timed_run": COMPILED[mark:][:20],
            "flops": flops, "roofline_ms": roof * 1e3, "vs_roofline": times[1] / roof, **mem}


def _memory() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {"bytes_in_use": stats.get("bytes_in_use"), "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


# ----------------------------------------------------------------------------------- transformers
def transformers_cases(preset_name: str, layers: int | None, cases: list[Case], new_tokens: int) -> list[dict]:
    import torch
    import transformers

    from kvjax.config.model import RopeConfig
    from kvjax.config.presets import preset
    from kvjax.experiments.vs_transformers import hf_llama_config

    config = preset(preset_name)
    if layers:
        config = config.replace(num_layers=layers)
    # A speed baseline: Llama-3's rope scaling changes the rotary table, not the work, so both sides
    # are timed with default RoPE (hf_llama_config builds only that).
    config = config.replace(rope=RopeConfig(theta=config.rope.theta))
    hf_config = transformers.LlamaConfig(**{k: v for k, v in hf_llama_config(config).items()
                                             if k not in ("architectures", "model_type", "dtype")})
    hf_config._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        hf = transformers.LlamaForCausalLM(hf_config).eval()
    init_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    rows = []
    for case in cases:
        ids = torch.randint(0, config.vocab_size, (case.batch, case.context), device=dev)
        mask = torch.ones_like(ids)
        try:
            with torch.no_grad():
                if case.kind == "prefill":
                    times = []
                    for _ in range(2):
                        sync()
                        t0 = time.perf_counter()
                        hf(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
                        sync()
                        times.append(time.perf_counter() - t0)
                    rows.append({"case": case.label, "kind": "prefill", "batch": case.batch, "context": case.context,
                                 "ttft_ms": times[1] * 1e3, "prefill_tok_s": ids.numel() / times[1]})
                else:
                    n = new_tokens
                    run = lambda m: hf.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m,  # noqa: E731
                                                do_sample=False, pad_token_id=0, cache_implementation="static")
                    run(2)  # warm
                    sync()
                    t0 = time.perf_counter()
                    run(1)
                    sync()
                    first = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    run(n)
                    sync()
                    total = time.perf_counter() - t0
                    tpot = (total - first) / (n - 1)
                    rows.append({"case": case.label, "kind": "decode", "batch": case.batch, "context": case.context,
                                 "step_ms": tpot * 1e3, "decode_tok_s": case.batch / tpot, "ttft_ms": first * 1e3,
                                 "new_tokens": n})
        except Exception as e:  # noqa: BLE001  one case's failure (out of memory) must not hide the rest
            rows.append({"case": case.label, "kind": case.kind, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        if dev == "cuda":
            rows[-1]["peak_bytes"] = torch.cuda.max_memory_allocated()
            del ids, mask
            torch.cuda.empty_cache()
    return [{"init_s": init_s, "transformers": transformers.__version__, "torch": torch.__version__}] + rows


# ----------------------------------------------------------------------------------------- output
def markdown(r: dict) -> str:
    def f(x, fmt=",.2f"):
        return "—" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)

    lines = [f"# {r['model']} ({r['layers']} layers, random bf16 weights) on {r['device']}", "",
             f"Weights {r['weight_bytes'] / 1e9:.2f} GB (read per decode step {r['weights_read_bytes'] / 1e9:.2f} GB), "
             f"random init {r['init_s']:.1f} s. Peaks: {f(r['peaks'].get('read_gb_s'), ',.0f')} GB/s read, "
             f"{f(r['peaks'].get('matmul_tflop_s'), ',.0f')} TFLOP/s bf16.", ""]
    rows = []
    for row in r["rows"]:
        if "error" in row:
            rows.append([row["case"], "error", row["error"][:80], "", "", "", ""])
        elif row["kind"] == "decode":
            rows.append([row["case"], f(row["step_ms"]), f(row["decode_tok_s"], ",.0f"), f(row["roofline_ms"]),
                         f(row["vs_roofline"]), f(row.get("compile_s"), ".1f"),
                         f((row.get("bytes_in_use") or 0) / 2**30, ".1f")])
        else:
            rows.append([row["case"], f(row["ttft_ms"]), f(row["prefill_tok_s"], ",.0f"), f(row["roofline_ms"]),
                         f(row["vs_roofline"]), f(row.get("cold_s"), ".1f"), f((row.get("bytes_in_use") or 0) / 2**30, ".1f")])
    lines += markdown_table(["case", "step / TTFT ms", "tok/s", "roofline ms", "× roofline", "compile s", "GiB in use"],
                            rows, "lrrrrrr")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="a kvjax preset (random weights in its shapes)")
    p.add_argument("--layers", type=int, default=None, help="keep this many of its layers")
    p.add_argument("--cases", default=None, help="space-separated KIND:B:CTX[:KV[:IMPL[:K]]] "
                   "(default: decode:32:512 prefill:32:512; with --tiny, three tiny cases)")
    p.add_argument("--calls", type=int, default=6, help="timed decode calls per case")
    p.add_argument("--new-tokens", type=int, default=32, help="transformers: tokens generated per decode case")
    p.add_argument("--peaks", default=None, help="device_peaks.json (default: --out's)")
    p.add_argument("--profile", nargs="?", const="first", default=None, metavar="CASE",
                   help="trace the timed calls of one decode case (its label prefix, e.g. decode:128; default the first)")
    p.add_argument("--transformers", action="store_true", help="run the transformers baseline instead (torch, GPU)")
    p.add_argument("--time-budget", type=float, default=1e9, help="skip cases once this many seconds have passed")
    p.add_argument("--tiny", action="store_true", help="the tiny preset, tiny cases: the code paths on a CPU")
    p.add_argument("--tag", default="", help="suffix of the output files")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    start = time.perf_counter()
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.model = args.model if args.model.startswith("tiny") else "tiny"
        args.layers, args.calls = None, 1
        args.cases = args.cases or ("decode:2:24:bf16:reference:2 decode:2:24:fp8_e4m3:no-attention:2 "
                                    "decode:2:24:bf16:no-sampling:2 decode:2:24:bf16:no-allocator:2 "
                                    "prefill:2:16:bf16:reference")
    args.cases = args.cases or "decode:32:512 prefill:32:512"
    cases = [Case.parse(c) for c in args.cases.split()]
    stem = f"gpu_model_bench{args.tag}"
    if args.transformers:
        rows = transformers_cases(args.model, args.layers, cases, args.new_tokens)
        result = {"model": args.model, "layers": args.layers, "baseline": rows[0], "rows": rows[1:]}
        write_json(out / f"{stem}_transformers.json", result, "--out", indent=1)
        for row in rows[1:]:
            print(row, flush=True)
        return result
    peaks_path = pathlib.Path(args.peaks) if args.peaks else out / "device_peaks.json"
    peaks = json.loads(peaks_path.read_text()) if peaks_path.exists() else {}
    model, init_s = build_model(args.model, args.layers)
    total, read = weight_bytes(model)
    result = {"model": model.config.name, "layers": model.config.num_layers, "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "init_s": init_s, "weight_bytes": total, "weights_read_bytes": read,
              "peaks": peaks, "rows": []}
    profiled = False
    for case in cases:
        if time.perf_counter() - start > args.time_budget:
            result["rows"].append({"case": case.label, "kind": case.kind, "error": "skipped: time budget"})
            continue
        try:
            with leave_out(case.impl) as backend:
                if case.kind == "decode":
                    trace = None
                    if args.profile and not profiled and (args.profile == "first" or case.label.startswith(args.profile)):
                        trace, profiled = str(out / "trace"), True
                    row = decode_case(model, case, args.calls, peaks, trace, backend)
                    if trace:
                        from kvjax.experiments.step_profile import summarise
                        row["profile"] = summarise(trace, out, steps=args.calls * case.k)
                else:
                    row = prefill_case(model, case, peaks, backend)
        except Exception as e:  # noqa: BLE001  record and go on: one failing case must not hide the others
            row = {"case": case.label, "kind": case.kind, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        result["rows"].append(row)
        write_json(out / f"{stem}.json", result, "--out", indent=1, default=float)
        write_text(out / f"{stem}.md", markdown(result), "--out")
        print({k: v for k, v in row.items() if k not in ("step_samples_ms", "profile")}, flush=True)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
