"""What vLLM's hybrid KV cache buys, measured three ways (markdown + JSON + PNG).

(a) Capacity. Gemma-3-27B and gpt-oss-120b on one H200 (141 GiB × 0.92 minus the weights, as
    experiments/vllm_hybrid_reference.py and `kvjax plan --device-memory-gib 141` budget them) at
    8K, 32K and 128K: max concurrency and KV cache tokens from the arithmetic
    (kvjax.accounting.hybrid.plan_groups, which vllm_hybrid_reference checks against vLLM's
    functions), hybrid beside the all-full fallback, and from the allocator itself: kvjax's grouped
    KVCacheManager on a pool of the planned blocks admits requests of max_model_len tokens one
    after another, each prefilled in chunks of the tokens in flight (2 batches of 8192), until one
    is refused. The count admitted must equal the arithmetic's.
(b) Decode step time against context length on a small sliding-window model on CPU: one decode
    step (the model over the paged cache, reference attention) at contexts W, 2W, 4W, 8W with a
    window W and with full attention, timed side by side in one run. With the window the step at
    8W should be within 1.3x of the step at W; full attention grows with the context.
(c) Prefix-cache hits for a shared long system prompt, with and without a window: the engine on
    a tiny Gemma-3-shaped model (5 sliding : 1 full), the same KV bytes either way, requests that
    share a system prompt several windows long arriving in waves; hit tokens per run.

    python experiments/hybrid_bench.py            # all three; --quick: (b) and (c) smaller
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvjax.accounting import budget as bud  # noqa: E402
from kvjax.accounting import hybrid  # noqa: E402
from kvjax.config.presets import preset  # noqa: E402
from kvjax.core import kv_cache_manager as manager  # noqa: E402
from kvjax.core.kv_cache_groups import all_full  # noqa: E402
from kvjax.utils.output_files import save_figure, write_json, write_text  # noqa: E402
from kvjax.utils.plotting import pyplot  # noqa: E402
from kvjax.utils.strict_json import dumps  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
H200_GIB, BLOCK, BATCHED, BATCHES = "141", 16, 8192, 2
WEIGHTS_GIB = {"gpt-oss-120b": "60.8"}  # its MXFP4 checkpoint (arXiv:2508.10925, Table 1)
CONTEXTS = (8192, 32768, 131072)


# ----------------------------------------------------------------------------- (a) capacity
def budget_for(name: str, config, max_len: int) -> int:
    weights = bud.gib(WEIGHTS_GIB[name]) if name in WEIGHTS_GIB else bud.weight_bytes(config.num_params, "bf16")
    return bud.plan(config.kv_spec(), context=max_len, block_size=BLOCK, total_bytes=bud.gib(H200_GIB),
                    weights_bytes=weights).budget_bytes


def admit(gp: hybrid.GroupPlan, max_len: int, chunk: int) -> tuple[int, list[int]]:
    """The allocator's count: requests of max_len tokens on a pool of gp.num_blocks, prefilled in
    chunks, until one is refused. -> (admitted, blocks each group's table holds for the first)."""
    windows = tuple(g.window for g in gp.groups)
    m = -(-max_len // BLOCK)
    cap = gp.admitted + 2
    state = manager.init(gp.num_blocks, BLOCK, cap, m, prefix_caching=False, windows=windows)
    tokens = jnp.arange(m * BLOCK, dtype=jnp.int32) % 1000
    admitted, held = 0, None
    for r in range(cap):
        state, ok = manager.add_request(state, r, tokens, max_len)
        assert bool(ok)
        done = 0
        while done < max_len and bool(ok):
            n = min(chunk, max_len - done)
            state, ok = manager.allocate_slots(state, r, n)
            done += n
        if not bool(ok):
            break
        admitted += 1
        if held is None:
            t = state.reqs
            held = [int(t.num_held[r, g]) - int(t.num_skipped[r, g]) for g in range(len(windows))]
    return admitted, held


def capacity() -> list[dict]:
    rows = []
    for name in ("gemma-3-27b", "gpt-oss-120b"):
        config = preset(name)
        for max_len in CONTEXTS:
            budget = budget_for(name, config, max_len)
            kw = dict(block_size=BLOCK, max_model_len=max_len, max_num_batched_tokens=BATCHED,
                      max_concurrent_batches=BATCHES)
            for kind, windows in (("hybrid", config.layer_windows), ("all full", all_full(config.layer_windows))):
                gp = hybrid.plan_groups(config.kv_spec(), windows, budget, **kw)
                t0 = time.time()
                got, held = admit(gp, max_len, BATCHES * BATCHED)
                rows.append({"model": config.title, "max_model_len": max_len, "kv": kind, "groups": len(gp.groups),
                             "bytes_per_block": gp.bytes_per_block, "num_blocks": gp.num_blocks,
                             "blocks_per_request": sum(gp.blocks_per_request), "held_by_one": sum(held),
                             "max_concurrency": round(gp.max_concurrency, 2), "kv_cache_tokens": gp.kv_cache_tokens,
                             "admitted_arithmetic": gp.admitted, "admitted_allocator": got,
                             "agree": got == gp.admitted, "seconds": round(time.time() - t0, 1)})
                print(dumps(rows[-1]), flush=True)
    return rows


# ----------------------------------------------------------------------------- (b) decode step time
def step_times(window: int, contexts: list[int], batch: int, reps: int) -> dict:
    """Seconds per decode step at each context, with the window and with full attention, timed in
    alternation (the same model, cache and tables)."""
    from kvjax.attention.metadata import decode_metadata
    from kvjax.config.model import ModelConfig
    from kvjax.models import build_model, init_params
    from kvjax.worker.model_runner import forward
    from kvjax.worker.paged_cache import PagedCache

    z, layers = 16, 4
    base = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=layers, num_heads=4,
                num_kv_heads=4, head_dim=64, max_position_embeddings=16 * max(contexts), dtype="float32")
    models = {"window": ModelConfig("mistral", sliding_window=window, sliding_layers=tuple(range(layers)), **base),
              "full": ModelConfig("mistral", **base)}
    m = max(contexts) // z + 1
    every = jnp.asarray(1 + np.arange(batch * m).reshape(batch, m), jnp.int32)
    out = {k: [] for k in models}
    built = {}
    for kind, config in models.items():
        model = build_model(config, "reference")
        params = init_params(model, jax.random.key(0))
        cache = PagedCache.create(config.kv_spec(), batch * m + 1, z)
        step = jax.jit(lambda p, t, md, c, model=model: forward(model, p, t, md, c)[0])
        built[kind] = (step, params, cache)
    for ctx in contexts:  # each context with its own table width, as the engine buckets it to the longest row
        tables = every[:, :ctx // z + 1]
        md = decode_metadata(tables, jnp.full(batch, ctx - 1, jnp.int32), jnp.ones(batch, bool), z)
        tokens = jnp.zeros(batch, jnp.int32)
        for kind in models:  # compile, then warm
            step, params, cache = built[kind]
            jax.block_until_ready(step(params, tokens, md, cache))
        best = {k: float("inf") for k in models}
        for _ in range(reps):  # alternating, the best of each
            for kind in models:
                step, params, cache = built[kind]
                t0 = time.perf_counter()
                jax.block_until_ready(step(params, tokens, md, cache))
                best[kind] = min(best[kind], time.perf_counter() - t0)
        for kind in models:
            out[kind].append(best[kind])
        print(dumps({"context": ctx, **{k: round(v * 1e3, 3) for k, v in best.items()}}), flush=True)
    return out


# ----------------------------------------------------------------------------- (c) prefix hits
def prefix_hits(quick: bool) -> dict:
    """The engine on a tiny Gemma-3-shaped model: a system prompt of 6 windows shared by every
    request, the same KV bytes for the hybrid pool and the all-full one (72 blocks of every layer:
    the all-full pool holds two requests and little of the cache beside them)."""
    from kvjax.config.hf import from_hf_config
    from kvjax.engine.arg_utils import EngineArgs
    from kvjax.engine.core import Engine
    from kvjax.engine.sampling import SamplingParams
    from kvjax.models import build_model, init_params

    window, z = 16, 4
    hf = {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 512, "sliding_window": window, "sliding_window_pattern": 6,
          "query_pre_attn_scalar": 16, "torch_dtype": "float32"}
    config = from_hf_config(hf)
    model = build_model(config, "reference")
    params = init_params(model, jax.random.key(0))
    rng = np.random.RandomState(0)
    system = [int(t) for t in rng.randint(0, 128, 6 * window)]
    n = 8 if quick else 16
    prompts = [system + [int(t) for t in rng.randint(0, 128, 5)] for _ in range(n)]
    kv_bytes = 72 * config.kv_spec().bytes_per_block(z)  # 72 all-full blocks' worth: two requests and a bit
    out = {}
    for kind, on in (("hybrid", True), ("all full", False)):
        engine_config = EngineArgs(model="gemma3-tiny", block_size=z, kv_cache_memory_bytes=kv_bytes, max_num_seqs=4,
                                   max_model_len=160, disable_hybrid_kv_cache_manager=not on,
                                   attention_backend="reference").create_engine_config(config)
        groups, num_blocks = engine_config.cache_config.groups.windows, engine_config.num_blocks
        engine = Engine(model, params, engine_config)
        run = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
        s = run.summary
        out[kind] = {"num_blocks": num_blocks, "groups": len(groups), "prefix_hit_tokens": s.prefix_hit_tokens,
                     "prefix_queried_tokens": s.prefix_queried_tokens, "preemptions": s.preemptions,
                     "outputs": [r.output for r in run.results]}
        print(dumps({k: v for k, v in {"kv": kind, **out[kind]}.items() if k != "outputs"}), flush=True)
    out["same_tokens"] = out["hybrid"].pop("outputs") == out["all full"].pop("outputs")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions in (b), fewer requests in (c)")
    ap.add_argument("--skip-capacity", action="store_true", help="leave out (a), the slowest part")
    args = ap.parse_args(argv)
    t0 = time.time()
    cap = [] if args.skip_capacity else capacity()
    window = 256
    contexts = [window, 2 * window, 4 * window, 8 * window]
    times = step_times(window, contexts, batch=8, reps=5 if args.quick else 20)
    ratio = {k: v[-1] / v[0] for k, v in times.items()}
    hits = prefix_hits(args.quick)
    result = {"capacity": cap, "decode": {"window": window, "contexts": contexts,
                                          "step_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()},
                                          "ratio_8w_over_w": {k: round(v, 3) for k, v in ratio.items()},
                                          "within_1_3x": ratio["window"] <= 1.3},
              "prefix_hits": hits, "machine": f"{os.cpu_count()} CPU cores, {jax.default_backend()}",
              "seconds": round(time.time() - t0, 1), "command": "python experiments/hybrid_bench.py"
              + (" --quick" if args.quick else "") + (" --skip-capacity" if args.skip_capacity else "")}
    OUT.mkdir(exist_ok=True)
    write_json(OUT / "hybrid_bench.json", result, "--out")
    _markdown(result)
    _plot(result)
    print(dumps(result["decode"]))
    return 0 if all(r["agree"] for r in cap) else 1


def _markdown(r: dict) -> None:
    from kvjax.markdown import markdown_table

    def table(headers, rows):
        return "\n".join(markdown_table(headers, rows))

    lines = ["# Hybrid KV cache: capacity, decode time, prefix hits", "", f"`{r['command']}` ({r['machine']}, "
             f"{r['seconds']} s)", ""]
    if r["capacity"]:
        lines += ["## (a) One H200, block size 16, 2 × 8192 tokens in flight", "",
                  table(["model", "max_model_len", "KV", "groups", "bytes / block", "blocks", "blocks / request",
                         "max concurrency", "KV cache tokens", "admitted (arithmetic)", "admitted (allocator)"],
                        [[x["model"], f"{x['max_model_len']:,}", x["kv"], x["groups"], f"{x['bytes_per_block']:,}",
                          f"{x['num_blocks']:,}", x["blocks_per_request"], f"{x['max_concurrency']:.2f}x",
                          f"{x['kv_cache_tokens']:,}", x["admitted_arithmetic"], x["admitted_allocator"]]
                         for x in r["capacity"]]), ""]
    d = r["decode"]
    lines += [f"## (b) Decode step time, window {d['window']} vs full attention (ms, best of the repetitions)", "",
              table(["context"] + list(d["step_ms"]), [[f"{c:,}"] + [f"{d['step_ms'][k][i]:.3f}" for k in d["step_ms"]]
                                                       for i, c in enumerate(d["contexts"])]), "",
              f"8W / W: window {d['ratio_8w_over_w']['window']:.3f}x, full {d['ratio_8w_over_w']['full']:.3f}x "
              f"(target: window within 1.3x: {'yes' if d['within_1_3x'] else 'NO'})", ""]
    h = r["prefix_hits"]
    lines += ["## (c) Prefix-cache hits, a shared system prompt of 6 windows, the same KV bytes", "",
              table(["KV", "groups", "blocks", "hit tokens", "queried tokens", "preemptions"],
                    [[k, h[k]["groups"], h[k]["num_blocks"], h[k]["prefix_hit_tokens"], h[k]["prefix_queried_tokens"],
                      h[k]["preemptions"]] for k in ("hybrid", "all full")]), "",
              f"greedy tokens the same both ways: {'yes' if h['same_tokens'] else 'NO'}", ""]
    write_text(OUT / "hybrid_bench.md", "\n".join(lines), "--out")


def _plot(r: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    d = r["decode"]
    for kind, ms in d["step_ms"].items():
        axes[0].plot(d["contexts"], ms, marker="o", label=kind)
    axes[0].set(xlabel="context (tokens)", ylabel="decode step (ms)", title=f"(b) window {d['window']} vs full",
                xscale="log")
    axes[0].legend()
    rows = [x for x in r["capacity"] if x["model"] == "Gemma-3-27B"] or r["capacity"]
    for kind in ("hybrid", "all full"):
        pts = [(x["max_model_len"], x["max_concurrency"]) for x in rows if x["kv"] == kind]
        if pts:
            axes[1].plot(*zip(*pts), marker="o", label=kind)
    axes[1].set(xlabel="max_model_len", ylabel="max concurrency", xscale="log",
                title=f"(a) {rows[0]['model'] if rows else ''} on one H200")
    axes[1].legend()
    fig.tight_layout()
    save_figure(fig, OUT / "hybrid_bench.png", "--out", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
