"""Decode-attention kernel benchmark: Mosaic GPU, Triton, JAX's shipped kernel and XLA, against measured ceilings.

Decode reads the whole KV history once per step (SPEC "Why decode is bound by KV memory"), so
the figure of merit of a decode kernel is bytes of KV read per second, as a fraction of what
the device can stream at all. For each shape this measures, with compile time excluded
(warm-up, then the median of timed calls, each ended by block_until_ready):

* mosaic      kvjax's Mosaic GPU kernels (kvjax.attention.mgpu_decode / mgpu_mla, default tiles);
* triton      kvjax's Triton kernels (kvjax.attention.pallas_decode / pallas_mla, default tiles);
* jax_shipped JAX's own `jax.experimental.pallas.ops.gpu.paged_attention` (GQA only: pages
              transposed to its [K, P, Z, H] layout and q prescaled, outside the timed region;
              its fp8 path needs per-token scale pages, of ones here, which it also reads);
* xla_ref     the plain jnp reference beside them (gather by block table, f32 softmax) under jit.

achieved GB/s = KV bytes of the valid tokens / time (q, tables and outputs are not counted),
each time the median of repeated runs of 10 calls back to back. The ceilings are measured in the
same run by kvjax.experiments.device_peaks, timed the same way (synchronizing every call
under-reads an H200 by a fifth): read GB/s (a jitted sum over 4 GiB of bf16: every byte read
once, nothing written), copy GB/s (read + write of a jitted elementwise op) and the bf16 matmul
TFLOP/s (8192³) the ragged prefill target is stated against. "% of read" is the decode
kernels' column. The ragged prefill rows time a 2,048-token chunk at the end of an 8K and a 32K
context through kvjax.attention.mgpu_ragged and pallas_ragged (TFLOP/s of the causal products,
% of the matmul rate); at 8K also MLA's (mgpu_ragged_mla against pallas_ragged's MLA kind) and
GQA's on per-token fp8 and nvfp4 pages (`jobs_in_order` says which rows come first).

Shapes (GPU): Llama-3-8B-like GQA (32 q heads, 8 kv heads, head dim 128) and DeepSeek-like MLA
(16 heads, 512 + 64), batch 1, 8, 32, 128 × context 8K, 32K (--contexts adds others), bf16 and
fp8 (e4m3 with per-head / per-channel scales), the issue's target shapes first, so that a
--time-budget cuts the least useful; shapes whose KV doesn't fit are skipped, and so is the XLA
reference where its f32 gather wouldn't. On CPU (or --tiny) it runs tiny shapes through the
interpreters (Triton's interpret mode, Mosaic GPU's CPU interpreter), only so that it can't rot:
CPU numbers say nothing about a GPU.

Writes kernel_bench.json and kernel_bench.md to --out (default $OUT, else experiments/results),
rewriting both after every row so a run cut short still leaves its results, and mgpu_table.py:
the measured Mosaic-vs-Triton winner per shape, for kvjax.attention.mgpu_dispatch (copy it to
kvjax/attention/mgpu_table.py to make attention_backend="pallas" use it).
Run: python -m kvjax.experiments.kernel_bench [--tiny] [--time-budget SECONDS]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from kvjax.attention import (mgpu_decode, mgpu_mla, mgpu_ragged, mgpu_ragged_mla, pallas_decode, pallas_mla,
                             pallas_ragged)
from kvjax.attention.metadata import build_metadata
from kvjax.attention.reference import mla_paged_decode_reference, paged_decode_reference
from kvjax.experiments import results_dir
from kvjax.experiments.kernel_bench_report import summarize, write
from kvjax.math_utils import cdiv

FP8 = jnp.float8_e4m3fn
IMPLS = ("mosaic", "triton", "jax_shipped", "xla_ref")
# Page formats: name → (page dtype, kv_dtype as a cache's pages carry it). MLA latents take the first two;
# the scaled GQA formats run at the target shapes only (batch >= 32 at 8K), within the run's budget.
FORMATS = {"bf16": (jnp.bfloat16, None), "fp8_e4m3": (FP8, "fp8_e4m3"),
           "fp8_per_token_head": (FP8, "fp8_per_token_head"), "nvfp4": (jnp.uint8, "nvfp4")}
SCALED = ("fp8_per_token_head", "nvfp4")


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    kind: str  # "gqa" | "mla"
    heads: int  # query heads N
    kv_heads: int  # K (1 for MLA)
    head_dim: int  # H (GQA) or kv_lora_rank (MLA)
    rope_dim: int = 0  # rope, qk_rope_head_dim (MLA)

    def kv_bytes(self, batch: int, context: int, fmt: str = "bf16") -> int:
        """Bytes of the pages (and per-token scales) a decode step reads for batch × context tokens:
        nvfp4 holds H/2 bytes of values and H/16 of block scales a head, per-token pages a 4-byte scale."""
        if self.kind == "mla":
            return batch * context * (self.head_dim + self.rope_dim) * jnp.dtype(FORMATS[fmt][0]).itemsize
        h = self.head_dim
        per_head = {"bf16": 2 * h, "fp8_e4m3": h, "fp8_per_token_head": h + 4, "nvfp4": h // 2 + h // 16}[fmt]
        return batch * context * 2 * self.kv_heads * per_head

    @property
    def group(self) -> int:
        """The head layout the dispatch table keys on: GQA's group, MLA's heads."""
        return self.heads // self.kv_heads if self.kind == "gqa" else self.heads


GPU_MODELS = (Model("llama-3-8b-like", "gqa", 32, 8, 128), Model("deepseek-like", "mla", 16, 1, 512, 64))
TINY_MODELS = (Model("tiny-gqa", "gqa", 16, 8, 64), Model("tiny-mla", "mla", 16, 1, 128, 64))


def time_call(fn, args, warmup: int, repeats: int, iters: int = 10) -> float:
    """Seconds per call of fn(*args), compile and warm-up excluded: the median over `repeats` timings
    of `iters` calls back to back (dispatch is asynchronous; only the last is waited on), as
    kvjax.experiments.device_peaks times the ceilings, so kernels and ceilings are timed alike."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def ceilings(tiny: bool) -> dict:
    """The device's read and copy bandwidth and bf16 matmul rate, measured by
    kvjax.experiments.device_peaks (the project's one method: random bf16 data several times the L2,
    calls back to back) on 4 GiB and 8192³ (tiny: 16 MiB and 256³)."""
    from kvjax.experiments.device_peaks import measure

    r = measure(1 / 64, 256, 2, 1) if tiny else measure(4.0, 8192, 20, 3)
    return {"read_gbps": r["read_gb_s"], "copy_gbps": r["copy_gb_s"], "matmul_tflops": r["matmul_tflop_s"],
            "buffer_bytes": r["array_bytes"], "matmul_n": r["matmul_n"]}


def fill_pages(shape, dtype, key):
    """Pages of `shape` in `dtype`: a random tile per block slot, varied per page, computed on device."""
    tile = jax.random.normal(key, shape[1:], jnp.float32)  # [Z, ...]: small
    per_page = 1.0 + 0.01 * (jnp.arange(shape[0], dtype=jnp.float32) % 13)
    make = jax.jit(lambda t, p: (t[None] * p.reshape((-1,) + (1,) * (len(shape) - 1))).astype(dtype))
    return make(tile, per_page)


def make_pages(model: Model, num_pages: int, block_size: int, fmt: str, keys) -> tuple:
    """(pages, scales) of `fmt`: GQA's K and V pages and their scales (None, per head, per token
    [P, Z, K]); MLA's latent pages and per-channel scale. nvfp4: random bytes below 0x78, so that
    every block scale is a finite e4m3."""
    dtype, _ = FORMATS[fmt]
    fp8 = fmt == "fp8_e4m3"
    if model.kind == "mla":
        shape = (num_pages, block_size, model.head_dim + model.rope_dim)
        return (fill_pages(shape, dtype, keys[0]),), (jnp.full((shape[-1],), 0.01, jnp.float32),) if fp8 else (None,)
    shape = (num_pages, block_size, model.kv_heads, model.head_dim)
    scales = (jnp.full((model.kv_heads,), 0.01, jnp.float32),) * 2 if fp8 else (None, None)
    if fmt == "nvfp4":
        shape = shape[:3] + (model.head_dim // 2 + model.head_dim // 16,)
        pages = tuple(jax.random.randint(k, shape, 0, 0x78, jnp.int32).astype(jnp.uint8) for k in keys)
        return pages, (jnp.ones((model.kv_heads,), jnp.float32),) * 2
    if fmt == "fp8_per_token_head":
        scales = (jnp.full(shape[:3], 0.01, jnp.float32),) * 2
    return tuple(fill_pages(shape, dtype, k) for k in keys), scales


def queries(model: Model, rows: int, key) -> tuple:
    """bf16 queries of `rows` tokens: GQA's q [rows, N, H]; MLA's q_latent and q_rope."""
    if model.kind == "gqa":
        return (jax.random.normal(key, (rows, model.heads, model.head_dim), jnp.float32).astype(jnp.bfloat16),)
    ql, qr = jax.random.split(key)
    return (jax.random.normal(ql, (rows, model.heads, model.head_dim), jnp.float32).astype(jnp.bfloat16),
            jax.random.normal(qr, (rows, model.heads, model.rope_dim), jnp.float32).astype(jnp.bfloat16))


def build_case(model: Model, batch: int, context: int, block_size: int, fmt: str, seed: int):
    """Inputs of one decode step: every sequence holds `context` tokens in scattered pages of `fmt`."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    blocks = cdiv(context, block_size)
    num_pages = batch * blocks + 1  # + the null block 0
    tables = (jax.random.permutation(k1, num_pages - 1) + 1)[: batch * blocks].reshape(batch, blocks)
    lens = jnp.full((batch,), context, jnp.int32)
    pages, scales = make_pages(model, num_pages, block_size, fmt, (k2, k3))
    return queries(model, batch, k4), pages, tables.astype(jnp.int32), lens, scales, FORMATS[fmt][1]


def impl_fn(name: str, model: Model, case, block_size: int, interpret: bool):
    """(jitted fn, args) of implementation `name` on this case, or None where it doesn't apply."""
    q, pages, tables, lens, scales, kv_dtype = case
    if model.kind == "gqa":
        scale, (ks, vs) = model.head_dim ** -0.5, scales
        if name == "jax_shipped":
            return shipped_fn(model, case, block_size, interpret)
        fn = {"mosaic": mgpu_decode.paged_decode, "triton": pallas_decode.paged_decode}.get(name)
        if fn is not None:
            return jax.jit(lambda q, k, v, t, l: fn(q, k, v, t, l, scale=scale, k_scale=ks, v_scale=vs,
                                                    kv_dtype=kv_dtype, interpret=interpret)), (*q, *pages, tables, lens)
        return jax.jit(lambda q, k, v, t, l: paged_decode_reference(
            q, k, v, t, l, scale=scale, k_scale=ks, v_scale=vs, kv_dtype=kv_dtype)), (*q, *pages, tables, lens)
    scale = (model.head_dim // 4 + model.rope_dim) ** -0.5  # DeepSeek: (qk_nope + qk_rope) ** -0.5
    (ls,) = scales
    if name == "jax_shipped":
        return None
    fn = {"mosaic": mgpu_mla.mla_paged_decode, "triton": pallas_mla.mla_paged_decode}.get(name)
    if fn is not None:
        return jax.jit(lambda ql, qr, c, t, l: fn(ql, qr, c, t, l, scale=scale, latent_scale=ls,
                                                  interpret=interpret)), (*q, *pages, tables, lens)
    return jax.jit(lambda ql, qr, c, t, l: mla_paged_decode_reference(
        ql, qr, c, t, l, scale=scale, latent_scale=ls, kv_dtype=None if ls is None else "fp8_e4m3")), \
        (*q, *pages, tables, lens)


def shipped_fn(model: Model, case, block_size: int, interpret: bool):
    """JAX's shipped GQA kernel on its own layout; the layout change happens here, untimed."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    q, (k_pages, v_pages), tables, lens, (k_scale, v_scale), kv_dtype = case
    if kv_dtype == "nvfp4":
        return None  # it reads no packed fp4 pages
    blocks = tables.shape[1]
    k_t = jnp.transpose(k_pages, (2, 0, 1, 3))  # [P, Z, K, H] → [K, P, Z, H]
    v_t = jnp.transpose(v_pages, (2, 0, 1, 3))
    qs = (q[0].astype(jnp.float32) * model.head_dim ** -0.5).astype(q[0].dtype)  # it applies no softmax scale
    k_splits = math.gcd(16, blocks)  # its default, reduced to divide the table width
    ppcb = max(1, min(128 // block_size, blocks // k_splits))
    kwargs = dict(block_h=16, pages_per_compute_block=ppcb, k_splits=k_splits, interpret=interpret)
    extra = ()
    if kv_dtype == "fp8_per_token_head":  # its fp8 path: scale pages [K, P, Z]
        extra = (jnp.transpose(k_scale, (2, 0, 1)), jnp.transpose(v_scale, (2, 0, 1)))
    elif jnp.dtype(k_pages.dtype) == jnp.dtype(FP8):  # static scales: pages of ones, which it also reads
        ones = jnp.ones(k_t.shape[:3], jnp.float32)
        extra = (ones, ones)
    fn = jax.jit(lambda q, k, v, t, l, *s: paged_attention(q, k, v, t, l, *s, **kwargs))
    return fn, (qs, k_t, v_t, tables, lens, *extra)


def prefill_case(model: Model, chunk: int, context: int, block_size: int, fmt: str, seed: int):
    """One ragged step: a chunk of `chunk` new tokens at the end of a `context`-token sequence (the
    long-context prefill's chunks), its pages scattered; → (queries, pages, metadata, scales, kv_dtype)."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    blocks = cdiv(context, block_size)
    table = [int(p) + 1 for p in jax.random.permutation(k1, blocks)]
    md = build_metadata([context - chunk], [chunk], [table], block_size=block_size, max_tokens=chunk, max_seqs=1,
                        max_blocks_per_seq=blocks, max_query_len=chunk)
    pages, scales = make_pages(model, blocks + 1, block_size, fmt, (k2, k3))
    return queries(model, chunk, k4), pages, md, scales, FORMATS[fmt][1]


def prefill_flops(model: Model, chunk: int, context: int) -> int:
    """Causal attention FLOPs of the chunk per (token, visible position) pair: GQA 4 × N × H (QKᵀ and
    PV); MLA 2 × N × C for QKᵀ over the whole latent and 2 × N × kv_lora_rank for PV."""
    visible = sum(context - chunk + i + 1 for i in range(chunk))
    if model.kind == "mla":
        return 2 * model.heads * (2 * model.head_dim + model.rope_dim) * visible
    return 4 * model.heads * model.head_dim * visible


def prefill_fn(name: str, model: Model, case, interpret: bool):
    q, pages, md, scales, kv_dtype = case
    if model.kind == "mla":
        fn = {"mosaic": mgpu_ragged_mla.mla_ragged_paged_attention,
              "triton": pallas_ragged.mla_ragged_paged_attention}[name]
        scale = (model.head_dim // 4 + model.rope_dim) ** -0.5
        return jax.jit(lambda ql, qr, c, md: fn(ql, qr, c, md, scale=scale, latent_scale=scales[0], kv_dtype=kv_dtype,
                                                interpret=interpret)), (*q, *pages, md)
    fn = {"mosaic": mgpu_ragged.ragged_paged_attention, "triton": pallas_ragged.ragged_paged_attention}[name]
    ks, vs = scales
    return jax.jit(lambda q, k, v, md: fn(q, k, v, md, scale=model.head_dim ** -0.5, k_scale=ks, v_scale=vs,
                                          kv_dtype=kv_dtype, interpret=interpret)), (*q, *pages, md)


def free_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def _rank(shape, contexts) -> int:
    """0: the issue's target shapes (batch >= 32 at the first context >= 8K); 1: batch <= 8 at the
    longest context; 2: the rest."""
    _, _, batch, context = shape
    if batch >= 32 and context == min((c for c in contexts if c >= 8192), default=max(contexts)):
        return 0
    return 1 if batch <= 8 and context == max(contexts) else 2


def plan(models, batches, contexts, formats, scaled_rank: int = 0):
    """All decode shapes by `_rank`, GQA before MLA, bf16 and fp8 of a shape together; the SCALED
    formats (GQA only) at shapes of rank <= scaled_rank (the target shapes), after MLA's."""
    rows = [(m, f, b, c) for m in models for f in formats for b in batches for c in contexts
            if f not in SCALED or (m.kind == "gqa" and _rank((m, f, b, c), contexts) <= scaled_rank)]
    return sorted(rows, key=lambda r: (_rank(r, contexts), r[1] in SCALED, r[0].kind != "gqa", r[2] != 32))


def _tiles_note(name: str, model: Model, case, block_size: int) -> str:
    """The default tiles a kvjax kernel picked for this case (for the table's last column)."""
    q, pages, tables, _, _, _ = case
    batch, blocks = tables.shape
    if name == "triton":
        from kvjax.attention.tiles import default_mla_tiles, default_tiles
        t = default_tiles(batch=batch, num_kv_heads=model.kv_heads, group=model.group, head_dim=model.head_dim,
                          block_size=block_size, max_blocks=blocks) if model.kind == "gqa" else \
            default_mla_tiles(batch=batch, num_heads=model.heads, kv_lora_rank=model.head_dim,
                              block_size=block_size, max_blocks=blocks)
        return f"ppb={t.pages_per_block} splits={t.num_splits} block_h={t.block_h} warps={t.num_warps}"
    if name == "mosaic":
        from kvjax.attention.tiles import default_mosaic_tiles
        per_token = (2 * model.head_dim if model.kind == "gqa" else model.head_dim + model.rope_dim) * \
            jnp.dtype(pages[0].dtype).itemsize
        t = default_mosaic_tiles(batch=batch, row_blocks=model.kv_heads if model.kind == "gqa" else
                                 cdiv(model.heads, 64), block_size=block_size, max_blocks=blocks,
                                 bytes_per_token=per_token)
        return f"ppb={t.pages_per_block} splits={t.num_splits} stages<={t.stages}"
    return ""


def _run(row: dict, make, interpret: bool, warmup: int, repeats: int) -> dict:
    """Time make() → (fn, args) into row (seconds, status); a failure is recorded, never hidden."""
    try:
        fn, fn_args = make()
        row.update(seconds=time_call(fn, fn_args, warmup, repeats, iters=1 if interpret else 10), status="ok")
    except Exception as e:  # a kernel that fails is a result
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if interpret:
            from kvjax.attention.mgpu_interpret import reset_interpreter
            reset_interpreter()  # an exception leaves Mosaic GPU's interpreter dirty
    return row


def decode_rows(model, fmt, batch, context, *, impls, block_size, interpret, warmup, repeats, ceil, over_budget,
                seed):
    """The rows of one decode shape (page format `fmt`, a FORMATS name), one per implementation."""
    dtype, kv_dtype = FORMATS[fmt]
    kv = model.kv_bytes(batch, context, fmt)
    base = {"model": model.name, "kind": model.kind, "format": fmt, "dtype": jnp.dtype(dtype).name,
            "kv_dtype": kv_dtype, "q_dtype": "bfloat16", "head_dim": model.head_dim, "group": model.group,
            "batch": batch, "context": context, "kv_bytes": kv}
    impls = [name for name in impls if name != "jax_shipped" or (model.kind == "gqa" and fmt != "nvfp4")]
    free = free_bytes()
    if over_budget():
        return [{**base, "impl": name, "status": "skipped: time budget"} for name in impls]
    if free is not None and kv > 0.45 * free:
        return [{**base, "impl": name, "status": "skipped: KV does not fit"} for name in impls]
    case = build_case(model, batch, context, block_size, fmt, seed=seed)
    f32_gather = 6 * model.kv_bytes(batch, context, "bf16")  # the reference's gather: three f32 copies of K and V
    rows = []
    for name in impls:
        row = {**base, "impl": name}
        if name == "xla_ref" and free is not None and f32_gather > 0.5 * free:
            row["status"] = "skipped: the reference's f32 gather does not fit"
        elif over_budget():
            row["status"] = "skipped: time budget"
        elif _run(row, lambda: impl_fn(name, model, case, block_size, interpret), interpret, warmup,
                  repeats).get("seconds"):
            gbps = kv / row["seconds"] / 1e9
            row.update(gbps=gbps, pct_of_read=100 * gbps / ceil["read_gbps"],
                       tiles=_tiles_note(name, model, case, block_size))
        rows.append(row)
    return rows


def prefill_rows(model, fmt, chunk, context, *, block_size, interpret, warmup, repeats, ceil, over_budget, seed):
    """The rows of one ragged prefill chunk (kind "ragged", MLA's "mla_ragged"), Mosaic GPU and Triton: TFLOP/s."""
    flops = prefill_flops(model, chunk, context)
    base = {"model": model.name, "kind": "ragged" if model.kind == "gqa" else "mla_ragged", "format": fmt,
            "dtype": jnp.dtype(FORMATS[fmt][0]).name, "kv_dtype": FORMATS[fmt][1], "q_dtype": "bfloat16",
            "head_dim": model.head_dim, "group": model.group, "batch": 1, "context": context, "chunk": chunk,
            "kv_bytes": model.kv_bytes(1, context, fmt), "flops": flops}
    if over_budget():
        return [{**base, "impl": name, "status": "skipped: time budget"} for name in ("mosaic", "triton")]
    case = prefill_case(model, chunk, context, block_size, fmt, seed)
    rows = []
    for name in ("mosaic", "triton"):
        row = {**base, "impl": name}
        if over_budget():
            row["status"] = "skipped: time budget"
        elif _run(row, lambda: prefill_fn(name, model, case, interpret), interpret, warmup, repeats).get("seconds"):
            tflops = flops / row["seconds"] / 1e12
            row.update(tflops=tflops, pct_of_matmul=100 * tflops / ceil["matmul_tflops"])
        rows.append(row)
    return rows


def jobs_in_order(models, shapes, contexts, *, tiny: bool, prefill: bool) -> list:
    """What runs, most wanted first (a time budget cuts the tail): GQA's decode targets (bf16, fp8),
    its ragged prefill chunk at 8K and 32K; MLA's decode targets and ragged chunk at 8K; the scaled
    formats' decode targets and ragged chunks at 8K; then every other decode shape. Tiny: every
    decode shape, then the chunks."""
    gqa, mla = models
    chunk = 16 if tiny else 2048
    at_8k = contexts[:1] if tiny else [8192]
    chunks = (lambda m, fmt, ctxs: [("prefill", (m, fmt, chunk, c)) for c in ctxs]) if prefill else \
        (lambda m, fmt, ctxs: [])
    decode = lambda keep: [("decode", r) for r in shapes if keep(r)]  # noqa: E731
    if tiny:
        return (decode(lambda r: True) + chunks(gqa, "bf16", at_8k) + chunks(mla, "bf16", at_8k)
                + chunks(gqa, "fp8_per_token_head", at_8k) + chunks(gqa, "nvfp4", at_8k))
    top = lambda r: _rank(r, contexts) == 0  # noqa: E731
    return (decode(lambda r: top(r) and r[0].kind == "gqa" and r[1] not in SCALED)
            + chunks(gqa, "bf16", [c for c in (8192, 32768) if c in contexts] or contexts[:1])
            + decode(lambda r: top(r) and r[0].kind == "mla") + chunks(mla, "bf16", at_8k)
            + decode(lambda r: top(r) and r[1] in SCALED)
            + chunks(gqa, "fp8_per_token_head", at_8k) + chunks(gqa, "nvfp4", at_8k)
            + decode(lambda r: not top(r)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, interpreted (default on CPU)")
    parser.add_argument("--out", default=None, help="output dir (default $OUT, else ./experiments/results)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per page (GPU 64, tiny 16)")
    parser.add_argument("--batches", type=int, nargs="*", default=None)
    parser.add_argument("--contexts", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; remaining rows are skipped")
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--no-prefill", action="store_true", help="skip the ragged prefill chunks")
    args = parser.parse_args(argv)

    os.environ.setdefault("PJRT_NPROC", "8")  # before JAX starts: the CPU interpreter's threads (mgpu_interpret)
    tiny = args.tiny or jax.default_backend() == "cpu"
    interpret = jax.default_backend() == "cpu"  # compiled (Mosaic GPU and Triton) on a GPU
    models = TINY_MODELS if tiny else GPU_MODELS
    batches = args.batches or ([2] if tiny else [1, 8, 32, 128])
    contexts = args.contexts or ([128] if tiny else [8192, 32768])
    block_size = args.block_size or (16 if tiny else 64)
    repeats = args.repeats or (1 if tiny else 3)
    warmup = 1 if tiny else 3
    budget = args.time_budget or (120.0 if tiny else 1e9)
    out_dir = results_dir(args.out)
    start = time.perf_counter()

    def over_budget() -> bool:
        return time.perf_counter() - start > budget

    ceil = ceilings(tiny)
    meta = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "jax": jax.__version__,
            "python": platform.python_version(), "tiny": tiny, "interpret": interpret, "block_size": block_size,
            "ceilings": ceil, "repeats": repeats}
    shapes = plan(models, batches, contexts, list(FORMATS), scaled_rank=1 if tiny else 0)
    if tiny:  # the interpreters: each kernel once per page format; MLA's three warpgroups interpret slowly
        shapes = [r for r in shapes if not (r[0].kind == "mla" and r[1] != "bf16")]
    common = dict(block_size=block_size, interpret=interpret, warmup=warmup, repeats=repeats, ceil=ceil,
                  over_budget=over_budget)
    jobs = jobs_in_order(models, shapes, contexts, tiny=tiny, prefill=not args.no_prefill)
    rows: list = []
    for i, (job, shape) in enumerate(jobs):
        if job == "decode":
            model, fmt, batch, context = shape
            rows += decode_rows(model, fmt, batch, context, impls=args.impls, seed=i, **common)
        else:
            rows += prefill_rows(*shape, seed=i, **common)
        write(out_dir, meta, rows, summarize(rows, ceil))
    meta["wall_seconds"] = round(time.perf_counter() - start, 1)
    checks = summarize(rows, ceil)
    write(out_dir, meta, rows, checks)
    print((out_dir / "kernel_bench.md").read_text())
    return {**meta, "rows": rows, "summary": checks}


if __name__ == "__main__":
    main()
