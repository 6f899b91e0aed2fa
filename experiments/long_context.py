"""Long-context prefill attention in bounded memory: compiled temporaries and time, old vs tiled vs kernel.

(a) Temporaries. One attention layer's ragged prefill (one sequence, a chunk of C new tokens that
    ends at the context length S, pages of 16) in Llama-3-8B's shape (32 query heads, 8 kv heads,
    head dim 128) and Llama-3-70B's (64, 8, 128), at S = 8K, 32K and 128K with chunks of 512,
    2,048 and 8,192 tokens, for each KV page format (bf16, fp8_e4m3 with per-head scales,
    int8_per_token_head, nvfp4): XLA's `memory_analysis().temp_size_in_bytes` of the compiled
    program for the old reference (kvjax.attention.reference.paged_attention_reference) and the
    tiled form (kvjax.attention.tiled.paged_attention_tiled, default tiles), and for the Pallas
    kernel (kvjax.attention.pallas_ragged.ragged_paged_attention): on a GPU the compiled kernel's
    program; on CPU, where the kernel only runs interpreted, the program around it with the
    pallas_call replaced by an opaque host callback of the same inputs and outputs — what XLA
    plans in device memory for the kernel's step (its q tiles, block tables, partial outputs,
    the scattered result), the kernel's own working set being per program in SRAM and
    registers. Programs are lowered on ShapeDtypeStructs, so nothing is allocated: a 128K
    context's pages never exist here. The issue's acceptance: Llama-3-8B, an 8,192-token chunk
    over 32K, under 1 GiB tiled and with the kernel.
(b) CPU time. The old reference and the tiled form side by side in one run, at shapes both can
    run on this machine (SmolLM2-135M's 9/3/64 heads up to 4K tokens, Llama-3-8B's 32/8/128 up to
    2K, prompts, chunks over a cached prefix, batches of short prompts, a mixed prefill + decode
    step): the best of the repeats after a warm-up, compile excluded, and which form
    kvjax.attention's dispatcher picks there (`tiled.use_tiled` on this backend).
(c) Tiles. The tiled form's time at a few (q_tile, kv_tokens) sizes on two of (b)'s shapes: where
    `PrefillTiles`' defaults come from.
(e) SmolLM2-135M end to end on this CPU (kvjax.LLM, its real weights): prefill and decode tokens/s
    with the ragged dispatch as shipped (tiled above `tiled.REFERENCE_SCORES_BYTES`) against the old
    reference on every ragged step (the bound raised past any step), side by side in one process,
    alternating, the best of the rounds: the issue's "not slower than today".
(d) GPU only (`--gpu`, a run of its own on a lent GPU, about a minute): the kernel, the tiled form and the old
    reference (where its scores fit) timed on Llama-3-8B's shape, bf16 and fp8 pages, a 2,048-token
    chunk at the end of 8K, 32K and 128K contexts: milliseconds, achieved TFLOP/s (4·C·N·H
    multiply-adds per visible position) and GB/s of K/V pages read, with a time budget.

Writes long_context.json and long_context.md to --out (default $OUT, else experiments/results);
--engine long_context_engine.*, --gpu long_context_gpu.*.

    python experiments/long_context.py            # all three (a few minutes on 2 cores)
    python experiments/long_context.py --quick    # a small subset, for a smoke test
    python experiments/long_context.py --gpu      # on a GPU: (a) for Llama-3-8B and (d)
    python experiments/long_context.py --engine   # (e) only
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import platform
import time
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvjax.attention import pallas_ragged, tiled  # noqa: E402
from kvjax.attention.metadata import BatchMetadata, build_metadata  # noqa: E402
from kvjax.attention.reference import paged_attention_reference  # noqa: E402
from kvjax.attention.tiled import PrefillTiles, paged_attention_tiled  # noqa: E402
from kvjax.experiments import results_dir  # noqa: E402
from kvjax.markdown import markdown_table  # noqa: E402
from kvjax.quant import nvfp4  # noqa: E402
from kvjax.utils.output_files import write_json, write_text  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
Z = 16  # tokens per page


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    heads: int  # N
    kv_heads: int  # K
    head_dim: int  # H


LLAMA_8B, LLAMA_70B = Shape("Llama-3-8B", 32, 8, 128), Shape("Llama-3-70B", 64, 8, 128)
SMOLLM2 = Shape("SmolLM2-135M", 9, 3, 64)
FORMATS = ("bf16", "fp8_e4m3", "int8_per_token_head", "nvfp4")
CONTEXTS = (8192, 32768, 131072)
CHUNKS = (512, 2048, 8192)
GPU_TOLERANCE = 2 ** -4  # --gpu: |kernel - tiled| on bf16 outputs of size ~1 (a few bf16 ulps at 1-2)
IMPLS = {"old": paged_attention_reference, "tiled": paged_attention_tiled,
         "kernel": functools.partial(pallas_ragged.ragged_paged_attention, interpret=False)}


# --------------------------------------------------------------------------------------------
# (a) compiled temporaries, from shapes only
# --------------------------------------------------------------------------------------------
def page_structs(shape: Shape, fmt: str, num_pages: int):
    """(page struct, scale struct or None) of one of K / V in format fmt: what a cache layer holds."""
    s = jax.ShapeDtypeStruct
    dims = (num_pages, Z, shape.kv_heads)
    if fmt == "bf16":
        return s(dims + (shape.head_dim,), jnp.bfloat16), None
    if fmt == "fp8_e4m3":
        return s(dims + (shape.head_dim,), jnp.float8_e4m3fn), s((shape.kv_heads,), jnp.float32)
    if fmt == "int8_per_token_head":
        return s(dims + (shape.head_dim,), jnp.int8), s(dims, jnp.float32)
    return s(dims + (nvfp4.packed_width(shape.head_dim),), jnp.uint8), s((shape.kv_heads,), jnp.float32)


def metadata_struct(chunk: int, context: int) -> BatchMetadata:
    """One sequence's step, `chunk` new tokens ending at `context`, as ShapeDtypeStructs."""
    s, i32 = jax.ShapeDtypeStruct, jnp.int32
    blocks = context // Z
    return BatchMetadata(positions=s((chunk,), i32), slot_mapping=s((chunk,), i32), seq_ids=s((chunk,), i32),
                         valid=s((chunk,), jnp.bool_), block_tables=s((1, blocks), i32), context_lens=s((1,), i32),
                         logits_indices=s((1,), i32), query_start=s((1,), i32), max_query_len=chunk)


def temp_bytes(impl: str, shape: Shape, fmt: str, chunk: int, context: int) -> tuple[int, int]:
    """(compiled temporary bytes, argument bytes) of one layer's prefill under `impl`."""
    page, scale = page_structs(shape, fmt, context // Z + 1)
    q = jax.ShapeDtypeStruct((chunk, shape.heads, shape.head_dim), jnp.bfloat16)
    fn = IMPLS[impl]

    def step(q, k, v, ks, vs, md):
        return fn(q, k, v, md, scale=shape.head_dim ** -0.5, k_scale=ks, v_scale=vs,
                  kv_dtype=None if fmt == "bf16" else fmt)

    stub = impl == "kernel" and jax.default_backend() != "gpu"
    with mock.patch.object(pallas_ragged.pl, "pallas_call", stubbed_pallas_call) if stub else contextlib.nullcontext():
        memory = jax.jit(step).lower(q, page, page, scale, scale, metadata_struct(chunk, context)).compile() \
            .memory_analysis()
    return memory.temp_size_in_bytes, memory.argument_size_in_bytes


def stubbed_pallas_call(kernel, *, out_shape, **_):
    """A pallas_call that XLA sees as an opaque op (a host callback) of the kernel's per-step inputs
    (meta, tables, logit scales, q tiles; the pages it reads in place are left out) and its outputs:
    what remains of the program is what XLA plans around the kernel."""
    shapes = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape)

    def call(meta, tables, logit_scale, *rest):
        return list(jax.pure_callback(lambda *a: tuple(np.zeros(s.shape, s.dtype) for s in shapes), shapes, meta,
                                      tables, logit_scale, rest[0]))
    return call


def pages_as_bits_bytes(shape: Shape, fmt: str, context: int) -> int:
    """The CPU backend's one copy of the K and V pages as integers (tiled.as_bits): bf16 and fp8 only."""
    if fmt not in ("bf16", "fp8_e4m3"):
        return 0
    return 2 * (context // Z + 1) * Z * shape.kv_heads * shape.head_dim * (2 if fmt == "bf16" else 1)


def temporaries(shapes, formats, contexts, chunks, log) -> list[dict]:
    rows = []
    for shape in shapes:
        for fmt in formats:
            for context in contexts:
                for chunk in chunks:
                    row = dict(model=shape.name, format=fmt, context=context, chunk=chunk,
                               old_scores_bytes=chunk * shape.heads * context * 4,
                               pages_as_bits_bytes=pages_as_bits_bytes(shape, fmt, context))
                    for impl in IMPLS:
                        t0 = time.perf_counter()
                        row[f"{impl}_temp_bytes"], row["argument_bytes"] = temp_bytes(impl, shape, fmt, chunk, context)
                        row[f"{impl}_compile_s"] = round(time.perf_counter() - t0, 2)
                    row["ratio"] = round(row["old_temp_bytes"] / row["tiled_temp_bytes"], 1)
                    rows.append(row)
                    log(f"{shape.name} {fmt} S={context} C={chunk}: old {row['old_temp_bytes'] / GiB:.2f} GiB, "
                        f"tiled {row['tiled_temp_bytes'] / GiB:.3f} GiB, kernel {row['kernel_temp_bytes'] / GiB:.3f} GiB")
    return rows


# --------------------------------------------------------------------------------------------
# (b), (c) CPU time on real arrays
# --------------------------------------------------------------------------------------------
def make_step(shape: Shape, seqs, seed=0):
    """q bf16[T, N, H], bf16 K/V pages through permuted tables, and the step's metadata:
    seqs = [(cached, new)] per sequence."""
    rng = np.random.default_rng(seed)
    blocks = [-(-(d + n) // Z) for d, n in seqs]
    num_pages = 1 + sum(blocks)
    free = list(rng.permutation(np.arange(1, num_pages)))
    tables = [[int(free.pop()) for _ in range(b)] for b in blocks]
    tokens = sum(n for _, n in seqs)
    md = build_metadata([d for d, _ in seqs], [n for _, n in seqs], tables, block_size=Z, max_tokens=tokens,
                        max_seqs=len(seqs), max_blocks_per_seq=max(blocks), max_query_len=max(n for _, n in seqs))
    page = (num_pages, Z, shape.kv_heads, shape.head_dim)
    k, v = (jnp.asarray(rng.standard_normal(page), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((tokens, shape.heads, shape.head_dim)), jnp.bfloat16)
    return q, k, v, md


def best_seconds(fns: dict, args, repeats: int) -> dict:
    """name → the best seconds of fns[name](*args) over `repeats` calls, compile and a warm-up call
    excluded. The functions take turns, so a load that comes and goes (this machine is shared)
    falls on all of them alike."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def jitted(impl, shape: Shape, tiles: PrefillTiles | None = None, **kw):
    kw = kw if tiles is None else dict(kw, tiles=tiles)
    return jax.jit(lambda q, k, v, md: IMPLS[impl](q, k, v, md, scale=shape.head_dim ** -0.5, **kw))


SPEED_CASES = (  # (shape, label, [(cached, new)] per sequence)
    (SMOLLM2, "prompt 512", [(0, 512)]),
    (SMOLLM2, "prompt 1,024", [(0, 1024)]),
    (SMOLLM2, "prompt 2,048", [(0, 2048)]),
    (SMOLLM2, "prompt 4,096", [(0, 4096)]),
    (SMOLLM2, "chunk 1,024 over 4,096", [(3072, 1024)]),
    (SMOLLM2, "8 prompts × 128", [(0, 128)] * 8),
    (SMOLLM2, "8 prompts × 512", [(0, 512)] * 8),
    (SMOLLM2, "16 × 64 + 16 decodes at 512", [(0, 64)] * 16 + [(511, 1)] * 16),
    (LLAMA_8B, "prompt 512", [(0, 512)]),
    (LLAMA_8B, "prompt 2,048", [(0, 2048)]),
    (LLAMA_8B, "chunk 512 over 2,048", [(1536, 512)]),
    (LLAMA_8B, "4 prompts × 256", [(0, 256)] * 4),
)
QUICK_SPEED = (SPEED_CASES[0], SPEED_CASES[5], SPEED_CASES[8])


def speed(cases, repeats: int, log) -> list[dict]:
    rows = []
    for shape, label, seqs in cases:
        q, k, v, md = make_step(shape, seqs)
        row = dict(model=shape.name, step=label, tokens=sum(n for _, n in seqs), sequences=len(seqs),
                   old_scores_bytes=tiled.reference_scores_bytes(md, shape.heads, Z),
                   default=("tiled" if tiled.use_tiled(md, shape.heads, Z) else "old"))
        fns = {impl: jitted(impl, shape) for impl in ("old", "tiled")}  # the kernel runs interpreted on CPU
        np.testing.assert_allclose(*(np.asarray(fn(q, k, v, md), np.float32) for fn in fns.values()),
                                   rtol=2 ** -7, atol=2 ** -7)  # one bf16 ulp: the same attention
        best = best_seconds(fns, (q, k, v, md), repeats)
        row["old_ms"], row["tiled_ms"] = (round(best[impl] * 1e3, 2) for impl in fns)
        row["old_over_tiled"] = round(row["old_ms"] / row["tiled_ms"], 2)
        rows.append(row)
        log(f"{shape.name} {label}: old {row['old_ms']} ms, tiled {row['tiled_ms']} ms")
    return rows


TILE_SIZES = ((64, 128), (128, 128), (128, 256), (256, 256), (256, 512), (512, 512))


def tile_sweep(cases, sizes, repeats: int, log) -> list[dict]:
    rows = []
    for shape, label, seqs in cases:
        q, k, v, md = make_step(shape, seqs)
        fns = {size: jitted("tiled", shape, PrefillTiles(*size)) for size in sizes}
        for (q_tile, kv_tokens), seconds in best_seconds(fns, (q, k, v, md), repeats).items():
            rows.append(dict(model=shape.name, step=label, q_tile=q_tile, kv_tokens=kv_tokens,
                             ms=round(seconds * 1e3, 2)))
            log(f"{shape.name} {label} tiles {q_tile}/{kv_tokens}: {rows[-1]['ms']} ms")
    return rows


def gpu_step(shape: Shape, fmt: str, chunk: int, context: int, seed=0):
    """One sequence's last `chunk` tokens at `context`, random on the device: (q, k, v, md, kw)."""
    blocks = context // Z
    perm = np.random.default_rng(seed).permutation(np.arange(1, blocks + 1))
    md = build_metadata([context - chunk], [chunk], [perm.tolist()], block_size=Z, max_tokens=chunk, max_seqs=1,
                        max_blocks_per_seq=blocks, max_query_len=chunk)
    keys = jax.random.split(jax.random.key(seed), 3)
    page = (blocks + 1, Z, shape.kv_heads, shape.head_dim)
    k, v = (jax.random.normal(key, page, jnp.bfloat16) for key in keys[:2])
    kw = {}
    if fmt == "fp8_e4m3":
        k, v = k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)
        kw = dict(k_scale=jnp.full(shape.kv_heads, 0.5, jnp.float32), v_scale=jnp.full(shape.kv_heads, 0.5, jnp.float32),
                  kv_dtype=fmt)
    q = jax.random.normal(keys[2], (chunk, shape.heads, shape.head_dim), jnp.bfloat16)
    return q, k, v, md, kw


def gpu_speed(formats, contexts, chunk: int, repeats: int, budget_s: float, log) -> list[dict]:
    """(d): kernel, tiled and old (its f32 scores under 16 GiB) on the GPU, with a time budget."""
    rows, t0 = [], time.perf_counter()
    shape = LLAMA_8B
    for fmt in formats:
        for context in contexts:
            if time.perf_counter() - t0 > budget_s:
                log(f"time budget of {budget_s} s spent: {fmt} S={context} skipped")
                continue
            q, k, v, md, kw = gpu_step(shape, fmt, chunk, context)
            impls = ["kernel", "tiled"] + (["old"] if chunk * shape.heads * context * 4 <= 16 * GiB else [])
            fns = {impl: jitted(impl, shape, **kw) for impl in impls}
            best = best_seconds(fns, (q, k, v, md), repeats)
            out = {impl: np.asarray(fn(q, k, v, md), np.float32) for impl, fn in fns.items() if impl != "old"}
            flops = 4 * chunk * shape.heads * shape.head_dim * (context - (chunk - 1) / 2)  # QK and PV, causal
            kv_bytes = 2 * context * shape.kv_heads * shape.head_dim * jnp.dtype(k.dtype).itemsize
            # the compiled kernel against the tiled form: bf16 outputs of values of size ~1
            row = dict(model=shape.name, format=fmt, context=context, chunk=chunk,
                       kernel_vs_tiled_max_abs=float(np.max(np.abs(out["kernel"] - out["tiled"]))))
            for impl, seconds in best.items():
                row[f"{impl}_ms"] = round(seconds * 1e3, 3)
                row[f"{impl}_tflops"] = round(flops / seconds / 1e12, 1)
                row[f"{impl}_kv_gbps"] = round(kv_bytes / seconds / 1e9, 1)
            rows.append(row)
            log(f"{fmt} S={context} C={chunk}: " + ", ".join(f"{i} {row[f'{i}_ms']} ms" for i in impls)
                + f"; |kernel - tiled| <= {row['kernel_vs_tiled_max_abs']:.2e}")
    return rows


def engine_speed(rounds: int, log, model: str = "smollm2-135m") -> list[dict]:
    """(e): prefill / decode tokens/s of the engine, ragged dispatch as shipped vs the old reference."""
    from kvjax import LLM, SamplingParams

    llm = LLM(model, max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=4, enable_prefix_caching=False,
              use_tqdm_on_load=False)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 10_000, 1024).tolist()} for _ in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    shipped = tiled.REFERENCE_SCORES_BYTES["cpu"]
    rows = {name: dict(model=model, dispatch=name, prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0)
            for name in ("shipped", "old")}
    tokens = {}
    try:
        for r in range(rounds):
            for name, bound in (("shipped", shipped), ("old", 1 << 62)):
                tiled.REFERENCE_SCORES_BYTES["cpu"] = bound
                jax.clear_caches()  # the engine's steps were traced under the other bound
                llm.generate(prompts, params, use_tqdm=False)  # compiles
                out = llm.generate(prompts, params, use_tqdm=False)
                s = out.summary
                row = rows[name]
                row["prefill_tokens_per_s"] = max(row["prefill_tokens_per_s"], round(s.prefill_tokens_per_s, 1))
                row["decode_tokens_per_s"] = max(row["decode_tokens_per_s"], round(s.decode_tokens_per_s, 1))
                tokens[name] = [o.outputs[0].token_ids for o in out]
                log(f"{model} round {r + 1} {name}: prefill {s.prefill_tokens_per_s:.0f} tok/s, "
                    f"decode {s.decode_tokens_per_s:.0f} tok/s")
    finally:
        tiled.REFERENCE_SCORES_BYTES["cpu"] = shipped
        jax.clear_caches()
    same = tokens["shipped"] == tokens["old"]
    for row in rows.values():
        row["same_tokens"] = same
    return list(rows.values())


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def acceptance(rows: list[dict]) -> dict | None:
    """Llama-3-8B, bf16, an 8,192-token chunk over 32K: the tiled form and the kernel under 1 GiB."""
    for r in rows:
        if (r["model"], r["format"], r["context"], r["chunk"]) == (LLAMA_8B.name, "bf16", 32768, 8192):
            return dict(old_gib=round(r["old_temp_bytes"] / GiB, 2), tiled_gib=round(r["tiled_temp_bytes"] / GiB, 3),
                        kernel_gib=round(r["kernel_temp_bytes"] / GiB, 3),
                        under_1_gib=max(r["tiled_temp_bytes"], r["kernel_temp_bytes"]) < GiB)
    return None


def render(result: dict) -> str:
    def gib(b):
        return f"{b / GiB:,.2f}" if b >= GiB / 10 else f"{b / GiB:.3f}"

    lines = ["# Long-context prefill attention: old reference vs tiled vs the Pallas kernel", "",
             f"`{result['command']}` ({result['machine']}, {result['seconds']} s)", ""]
    acc = result["acceptance"]
    if acc:
        lines += [f"Acceptance (issue 40): Llama-3-8B, bf16 pages, an 8,192-token chunk over 32K needs "
                  f"**{acc['tiled_gib']} GiB** of temporaries tiled and **{acc['kernel_gib']} GiB** with the kernel "
                  f"(old reference: {acc['old_gib']} GiB): "
                  f"{'met' if acc['under_1_gib'] else 'missed'} (< 1 GiB).", ""]
    kernel_note = ("the compiled kernel's program" if result["backend"] == "gpu" else
                   "the program around the kernel, the pallas_call stubbed by an opaque host callback of its inputs "
                   "and outputs (it runs only interpreted on CPU): what XLA plans in device memory for the step; the "
                   "kernel's own working set is per program, in SRAM and registers")
    if result["temporaries"]:
        lines += [f"## (a) Compiled temporaries of one layer's prefill (XLA memory_analysis, {result['backend']})", "",
                  "One sequence, a chunk of C new tokens ending at context S, pages of 16, bf16 queries. "
                  "\"old scores\" is B·Q·N·S f32 (the reference's score array alone). \"pages as bits\" is the part of "
                  "the tiled form's temporaries that is the CPU backend's one copy of the K/V page arrays as integers "
                  "(tiled.as_bits; bf16 and fp8 pages only); the rest is the tiles and O(C) rows. \"kernel\": "
                  f"{kernel_note}. Arguments (the pages, the queries) are not temporaries.", "",
                  *markdown_table(["model", "format", "S", "C", "old scores GiB", "old GiB", "tiled GiB",
                                   "of which pages as bits GiB", "kernel GiB", "old / tiled"],
                                  [[r["model"], r["format"], f"{r['context']:,}", f"{r['chunk']:,}",
                                    gib(r["old_scores_bytes"]), gib(r["old_temp_bytes"]), gib(r["tiled_temp_bytes"]),
                                    gib(r["pages_as_bits_bytes"]), gib(r["kernel_temp_bytes"]), f"{r['ratio']:,}×"]
                                   for r in result["temporaries"]], "lllrrrrrrr"), ""]
    if result.get("gpu_speed"):
        impls = [i for i in ("kernel", "tiled", "old") if any(f"{i}_ms" in r for r in result["gpu_speed"])]
        lines += ["## (d) GPU time of one layer's prefill attention (Llama-3-8B shape, compile excluded, best of "
                  f"{result['repeats']})", "", "TFLOP/s counts 4·C·N·H per visible position (QK and PV, causal); "
                  "GB/s is the K/V pages' bytes over the time. \"—\": the old reference's f32 scores would exceed "
                  "16 GiB.", "",
                  *markdown_table(["format", "S", "C"] + [f"{i} ms" for i in impls] + [f"{i} TFLOP/s" for i in impls]
                                  + ["kernel KV GB/s", "max abs kernel − tiled"],
                                  [[r["format"], f"{r['context']:,}", f"{r['chunk']:,}"]
                                   + [f"{r[f'{i}_ms']:,}" if f"{i}_ms" in r else "—" for i in impls]
                                   + [str(r[f"{i}_tflops"]) if f"{i}_ms" in r else "—" for i in impls]
                                   + [str(r["kernel_kv_gbps"]), f"{r['kernel_vs_tiled_max_abs']:.1e}"]
                                   for r in result["gpu_speed"]],
                                  "lrr" + "r" * (2 * len(impls) + 2)), ""]
    if result.get("engine"):
        e = {r["dispatch"]: r for r in result["engine"]}
        lines += ["## (e) SmolLM2-135M end to end on this CPU: ragged dispatch as shipped vs the old reference", "",
                  "kvjax.LLM on the real weights, 4 prompts of 1,024 tokens and 32 greedy tokens each, "
                  "max_num_batched_tokens 2,048; the engine's timed steps (compile excluded), the best of "
                  f"{result['engine_rounds']} alternating rounds. Same greedy tokens: "
                  f"{'yes' if result['engine'][0]['same_tokens'] else 'NO'}.", "",
                  *markdown_table(["dispatch", "prefill tok/s", "decode tok/s"],
                                  [[r["dispatch"], f"{r['prefill_tokens_per_s']:,}", f"{r['decode_tokens_per_s']:,}"]
                                   for r in result["engine"]]
                                  + [["shipped / old", f"{e['shipped']['prefill_tokens_per_s'] / e['old']['prefill_tokens_per_s']:.2f}×",
                                      f"{e['shipped']['decode_tokens_per_s'] / e['old']['decode_tokens_per_s']:.2f}×"]],
                                  "lrr"), ""]
    if not result["speed"]:
        return "\n".join(lines)
    lines += ["## (b) CPU time, old reference vs tiled (bf16 pages and queries, compile excluded, best of "
              f"{result['repeats']} calls each, taking turns)", "",
              "\"default\" is what kvjax.attention runs for that step on this backend (tiled above "
              f"{tiled.REFERENCE_SCORES_BYTES['cpu'] // MiB} MiB of old scores on CPU, "
              f"{tiled.REFERENCE_SCORES_BYTES['default'] // MiB} MiB elsewhere).", "",
              *markdown_table(["model", "step", "tokens", "old scores MiB", "old ms", "tiled ms", "old / tiled",
                               "default"],
                              [[r["model"], r["step"], f"{r['tokens']:,}", f"{r['old_scores_bytes'] / MiB:,.1f}",
                                f"{r['old_ms']:,}", f"{r['tiled_ms']:,}", f"{r['old_over_tiled']}×", r["default"]]
                               for r in result["speed"]], "llrrrrrl"), ""]
    if result["tiles"]:
        lines += ["## (c) Tiled time by tile size (ms)", "",
                  *markdown_table(["model", "step", "q_tile", "kv_tokens", "ms"],
                                  [[r["model"], r["step"], r["q_tile"], r["kv_tokens"], f"{r['ms']:,}"]
                                   for r in result["tiles"]], "llrrr"), ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="output dir (default $OUT, else ./experiments/results)")
    parser.add_argument("--quick", action="store_true", help="a small subset of every part (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per CPU measurement (default 5)")
    parser.add_argument("--gpu", action="store_true", help="on a GPU: (a) for Llama-3-8B and the kernel's time (d)")
    parser.add_argument("--engine", action="store_true", help="(e) only: SmolLM2-135M end to end, shipped vs old")
    parser.add_argument("--rounds", type=int, default=3, help="(e): alternating rounds (default 3)")
    parser.add_argument("--time-budget", type=float, default=60.0, help="seconds for (d) (default 60)")
    args = parser.parse_args(argv)
    if args.gpu and "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
        # XLA's GEMM autotuner allocates scratch for the program it compiles: for the old reference at
        # 128K it asked for 128 GiB and failed (RESOURCE_EXHAUSTED in redzone_allocator on an H200).
        # Read when the GPU backend starts, which no device call has done yet.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    repeats = args.repeats or (1 if args.quick else 5)
    t0 = time.perf_counter()

    def log(message):
        print(f"[{time.perf_counter() - t0:6.1f} s] {message}", flush=True)

    gpu_rows, engine_rows = [], []
    if args.engine:
        temps, speeds, tiles = [], [], []
        engine_rows = engine_speed(args.rounds, log)
    elif args.gpu:
        temps = temporaries([LLAMA_8B], ["bf16", "fp8_e4m3"], CONTEXTS, [8192], log)
        gpu_rows = gpu_speed(["bf16", "fp8_e4m3"], CONTEXTS, 2048, repeats, args.time_budget, log)
        speeds, tiles = [], []
    elif args.quick:
        temps = temporaries([LLAMA_8B], ["bf16", "nvfp4"], [8192], [512], log)
        speeds = speed(QUICK_SPEED, repeats, log)
        tiles = tile_sweep([QUICK_SPEED[0]], TILE_SIZES[:2], repeats, log)
    else:
        temps = temporaries([LLAMA_8B, LLAMA_70B], FORMATS, CONTEXTS, CHUNKS, log)
        speeds = speed(SPEED_CASES, repeats, log)
        tiles = tile_sweep([SPEED_CASES[2], SPEED_CASES[9]], TILE_SIZES, repeats, log)
        engine_rows = engine_speed(args.rounds, log)
    result = dict(command="python experiments/long_context.py" + (" --quick" if args.quick else "")
                  + (" --gpu" if args.gpu else "") + (" --engine" if args.engine else ""),
                  backend=jax.default_backend(), engine=engine_rows, engine_rounds=args.rounds,
                  machine=f"{os.cpu_count()} CPU cores, {platform.machine()}, jax {jax.__version__} "
                          f"{jax.default_backend()}",
                  default_tiles=dataclasses.asdict(PrefillTiles()), repeats=repeats,
                  reference_scores_bytes=dict(tiled.REFERENCE_SCORES_BYTES), acceptance=acceptance(temps),
                  temporaries=temps, speed=speeds, tiles=tiles, gpu_speed=gpu_rows, seconds=round(time.perf_counter() - t0, 1))
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "long_context_engine" if args.engine else "long_context_gpu" if args.gpu else "long_context"
    write_json(out / f"{stem}.json", result, "--out")
    write_text(out / f"{stem}.md", render(result) + "\n", "--out")
    log(f"wrote {out / f'{stem}.md'}")
    bad = [r for r in gpu_rows if r["kernel_vs_tiled_max_abs"] > GPU_TOLERANCE]
    if bad:
        raise SystemExit(f"the compiled kernel and the tiled form differ by more than {GPU_TOLERANCE}: {bad}")
    return result


if __name__ == "__main__":
    main()
