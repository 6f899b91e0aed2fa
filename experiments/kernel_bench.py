"""Decode-attention kernel benchmark: achieved KV bandwidth against the device's copy bandwidth.

Decode reads the whole KV history once per step (SPEC "Why decode is bound by KV memory"), so
the figure of merit of a decode kernel is bytes of KV read per second, as a fraction of what
the device can stream at all. For each shape this measures, with compile time excluded
(warm-up, then the median of timed calls, each ended by block_until_ready):

* pallas      kvjax.attention's Pallas kernels (default tiles);
* xla_ref     the plain jnp reference beside them (gather by block table, f32 softmax) under jit;
* jax_shipped JAX's own `jax.experimental.pallas.ops.gpu.paged_attention` (GQA only: pages
              transposed to its [K, P, Z, H] layout and q prescaled, outside the timed region;
              its fp8 path needs per-token scale pages, of ones here, which it also reads).

achieved GB/s = KV bytes of the valid tokens / time (q, tables and outputs are not counted);
copy GB/s = bytes read + written by a jitted elementwise op on a large buffer, measured in the
same run; the ratio of the two is the "% of copy" column.

Shapes (GPU): Llama-3-8B-like GQA (32 q heads, 8 kv heads, head dim 128) and DeepSeek-like MLA
(16 heads, 512 + 64), batch 1, 8, 32, 128 × context 1K, 8K, 32K, bf16 and fp8 (e4m3 with
per-head / per-channel scales); shapes whose KV doesn't fit are skipped, and so is the XLA
reference where its f32 gather wouldn't. The issue's targets are checked in the summary. On
CPU (or --tiny) it runs tiny shapes in interpret mode, only so that it can't rot: CPU numbers
say nothing about a GPU.

Writes kernel_bench.json and kernel_bench.md to --out (default $OUT, else experiments/results),
rewriting both after every row so a run cut short by a time limit still leaves its results.
Run: python -m kvjax.experiments.kernel_bench [--tiny] [--time-budget SECONDS]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from kvjax.attention.pallas_decode import paged_decode, paged_decode_reference
from kvjax.attention.pallas_mla import mla_paged_decode, mla_paged_decode_reference
from kvjax.attention.tiles import default_mla_tiles, default_tiles
from kvjax.errors import write_json, write_text
from kvjax.experiments import results_dir
from kvjax.markdown import markdown_table
from kvjax.math_utils import cdiv

GiB = 1024**3
FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    kind: str  # "gqa" | "mla"
    heads: int  # query heads N
    kv_heads: int  # K (1 for MLA)
    head_dim: int  # H (GQA) or kv_lora_rank (MLA)
    rope_dim: int = 0  # rope, qk_rope_head_dim (MLA)

    def kv_bytes(self, batch: int, context: int, itemsize: int) -> int:
        per_token = 2 * self.kv_heads * self.head_dim if self.kind == "gqa" else self.head_dim + self.rope_dim
        return batch * context * per_token * itemsize


GPU_MODELS = (Model("llama-3-8b-like", "gqa", 32, 8, 128), Model("deepseek-like", "mla", 16, 1, 512, 64))
TINY_MODELS = (Model("tiny-gqa", "gqa", 8, 2, 64), Model("tiny-mla", "mla", 16, 1, 64, 16))


def time_call(fn, args, warmup: int, repeats: int) -> float:
    """Median seconds of fn(*args), compile and warm-up excluded."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, warmup: int, repeats: int) -> float:
    """Bytes/s of a jitted elementwise op (one read + one write of every byte) on a bf16 buffer."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 2)  # not `a + 0`: XLA may simplify that to no copy at all
    seconds = time_call(f, (x,), warmup, repeats)
    del x
    return 2 * nbytes / seconds


def fill_pages(shape, dtype, key):
    """Pages of `shape` in `dtype`: a random tile per block slot, varied per page, computed on device."""
    tile = jax.random.normal(key, shape[1:], jnp.float32)  # [Z, ...]: small
    per_page = 1.0 + 0.01 * (jnp.arange(shape[0], dtype=jnp.float32) % 13)
    make = jax.jit(lambda t, p: (t[None] * p.reshape((-1,) + (1,) * (len(shape) - 1))).astype(dtype))
    return make(tile, per_page)


def build_case(model: Model, batch: int, context: int, block_size: int, dtype, seed: int):
    """Inputs of one decode step: every sequence holds `context` tokens in scattered pages."""
    key = jax.random.key(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    blocks = cdiv(context, block_size)
    num_pages = batch * blocks + 1  # + the null block 0
    tables = (jax.random.permutation(k1, num_pages - 1) + 1)[: batch * blocks].reshape(batch, blocks)
    tables = tables.astype(jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    fp8 = jnp.dtype(dtype) == jnp.dtype(FP8)
    if model.kind == "gqa":
        shape = (num_pages, block_size, model.kv_heads, model.head_dim)
        pages = (fill_pages(shape, dtype, k2), fill_pages(shape, dtype, k3))
        scales = (jnp.full((model.kv_heads,), 0.01, jnp.float32),) * 2 if fp8 else (None, None)
        q = (jax.random.normal(k4, (batch, model.heads, model.head_dim), jnp.float32),)
    else:
        shape = (num_pages, block_size, model.head_dim + model.rope_dim)
        pages = (fill_pages(shape, dtype, k2),)
        scales = (jnp.full((shape[-1],), 0.01, jnp.float32),) if fp8 else (None,)
        ql, qr = jax.random.split(k4)
        q = (jax.random.normal(ql, (batch, model.heads, model.head_dim), jnp.float32),
             jax.random.normal(qr, (batch, model.heads, model.rope_dim), jnp.float32))
    q = tuple(x.astype(jnp.bfloat16) for x in q)
    return q, pages, tables, lens, scales


def impl_fns(model: Model, case, block_size: int, interpret: bool):
    """name → (jitted fn, args) for every implementation that applies to this model."""
    q, pages, tables, lens, scales = case
    batch, blocks = tables.shape
    if model.kind == "gqa":
        scale = model.head_dim ** -0.5
        tiles = default_tiles(batch=batch, num_kv_heads=model.kv_heads, group=model.heads // model.kv_heads,
                              head_dim=model.head_dim, block_size=block_size, max_blocks=blocks)
        ks, vs = scales
        kv_dtype = "fp8_e4m3" if ks is not None else None  # the pages' format, as a cache's pages carry it
        fns = {
            "pallas": (jax.jit(lambda q, k, v, t, l: paged_decode(
                q, k, v, t, l, scale=scale, k_scale=ks, v_scale=vs, tiles=tiles, interpret=interpret)),
                (*q, *pages, tables, lens)),
            "xla_ref": (jax.jit(lambda q, k, v, t, l: paged_decode_reference(
                q, k, v, t, l, scale=scale, k_scale=ks, v_scale=vs, kv_dtype=kv_dtype)), (*q, *pages, tables, lens)),
        }
        return fns, tiles
    scale = (model.head_dim // 4 + model.rope_dim) ** -0.5  # DeepSeek: (qk_nope + qk_rope) ** -0.5
    tiles = default_mla_tiles(batch=batch, num_heads=model.heads, kv_lora_rank=model.head_dim,
                              block_size=block_size, max_blocks=blocks)
    (ls,) = scales
    fns = {
        "pallas": (jax.jit(lambda ql, qr, c, t, l: mla_paged_decode(
            ql, qr, c, t, l, scale=scale, latent_scale=ls, tiles=tiles, interpret=interpret)),
            (*q, *pages, tables, lens)),
        "xla_ref": (jax.jit(lambda ql, qr, c, t, l: mla_paged_decode_reference(
            ql, qr, c, t, l, scale=scale, latent_scale=ls, kv_dtype=None if ls is None else "fp8_e4m3")),
            (*q, *pages, tables, lens)),
    }
    return fns, tiles


def shipped_fn(model: Model, case, block_size: int, interpret: bool):
    """JAX's shipped GQA kernel on its own layout; the layout change happens here, untimed."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    q, (k_pages, v_pages), tables, lens, _ = case
    blocks = tables.shape[1]
    k_t = jnp.transpose(k_pages, (2, 0, 1, 3))  # [P, Z, K, H] → [K, P, Z, H]
    v_t = jnp.transpose(v_pages, (2, 0, 1, 3))
    qs = (q[0].astype(jnp.float32) * model.head_dim ** -0.5).astype(q[0].dtype)  # it applies no softmax scale
    k_splits = math.gcd(16, blocks)  # its default, reduced to divide the table width
    ppcb = max(1, min(128 // block_size, blocks // k_splits))
    kwargs = dict(block_h=16, pages_per_compute_block=ppcb, k_splits=k_splits, interpret=interpret)
    extra = ()
    if jnp.dtype(k_pages.dtype) == jnp.dtype(FP8):  # its fp8 path needs scale pages [K, P, Z]
        ones = jnp.ones(k_t.shape[:3], jnp.float32)
        extra = (ones, ones)
    fn = jax.jit(lambda q, k, v, t, l, *s: paged_attention(q, k, v, t, l, *s, **kwargs))
    return fn, (qs, k_t, v_t, tables, lens, *extra)


def free_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def plan(models, batches, contexts, dtypes):
    """All shapes, the issue's target shapes first so that a time budget cuts the least useful."""
    rows = [(m, d, b, c) for m in models for d in dtypes for b in batches for c in contexts]
    return sorted(rows, key=lambda r: (not (r[2] >= 32 and r[3] >= 8192), r[0].kind != "gqa"))


def summarize(rows, copy_gbps):
    """The issue's H200 targets, from the measured rows (None where a row is missing)."""
    def get(model_kind, dtype, batch, context, impl):
        for r in rows:
            if (r["kind"], r["dtype"], r["batch"], r["context"], r["impl"]) == (model_kind, dtype, batch, context,
                                                                                   impl) and r.get("seconds"):
                return r
        return None

    checks = []
    keys = sorted({(r["kind"], r["batch"], r["context"]) for r in rows})
    for kind, batch, context in keys:
        bf16, fp8 = get(kind, "bfloat16", batch, context, "pallas"), get(kind, "float8_e4m3fn", batch, context,
                                                                         "pallas")
        shipped = get(kind, "bfloat16", batch, context, "jax_shipped")
        checks.append({
            "kind": kind, "batch": batch, "context": context,
            "bf16_pct_of_copy": bf16 and round(100 * bf16["gbps"] / copy_gbps, 1),
            "fp8_speedup_over_bf16": bf16 and fp8 and round(bf16["seconds"] / fp8["seconds"], 2),
            "bf16_speedup_over_jax_shipped": bf16 and shipped and round(shipped["seconds"] / bf16["seconds"], 2),
            "target_shape": kind == "gqa" and batch >= 32 and context >= 8192,
        })
    return checks


def _row_cells(r: dict) -> list:
    """One measurement's cells; a variant that did not run shows its status as its note."""
    head = [r["model"], r["dtype"], r["batch"], r["context"], r["impl"]]
    if not r.get("seconds"):
        return head + ["", f"{r['kv_bytes'] / 2**20:.1f}", "", "", r["status"]]
    return head + [f"{r['seconds'] * 1e6:.1f}", f"{r['kv_bytes'] / 2**20:.1f}", f"{r['gbps']:.1f}",
                   f"{r['pct_of_copy']:.1f}", r.get("tiles", "")]


def write(out_dir: pathlib.Path, meta: dict, rows: list, checks: list) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "kernel_bench.json", {**meta, "rows": rows, "summary": checks}, "--out")
    lines = [f"# Decode kernel bandwidth ({meta['device']}, {'tiny interpret mode' if meta['tiny'] else 'compiled'})",
             "", f"copy bandwidth: {meta['copy_gbps']:.1f} GB/s (read + write of {meta['copy_bytes'] / GiB:.3g} GiB)",
             "", *markdown_table(["model", "kv dtype", "batch", "context", "impl", "µs", "KV MiB", "GB/s",
                                  "% of copy", "tiles / note"], [_row_cells(r) for r in rows])]
    lines += ["", "## Targets (H200: >= 80% of copy for bf16 GQA at batch >= 32, context >= 8K;"
              " fp8 >= 1.7x bf16; faster than JAX's shipped kernel)", "",
              *markdown_table(["kind", "batch", "context", "bf16 % of copy", "fp8 / bf16 speedup", "vs jax_shipped",
                               "target shape"],
                              [[c["kind"], c["batch"], c["context"], c["bf16_pct_of_copy"], c["fp8_speedup_over_bf16"],
                                c["bf16_speedup_over_jax_shipped"], c["target_shape"]] for c in checks])]
    write_text(out_dir / "kernel_bench.md", "\n".join(lines) + "\n", "--out")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes in interpret mode (default on CPU)")
    parser.add_argument("--out", default=None, help="output dir (default $OUT, else ./experiments/results)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per page (GPU 64, tiny 16)")
    parser.add_argument("--batches", type=int, nargs="*", default=None)
    parser.add_argument("--contexts", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; remaining rows are skipped")
    parser.add_argument("--impls", nargs="*", default=["pallas", "xla_ref", "jax_shipped"])
    args = parser.parse_args(argv)

    tiny = args.tiny or jax.default_backend() == "cpu"
    interpret = jax.default_backend() == "cpu"
    models = TINY_MODELS if tiny else GPU_MODELS
    batches = args.batches or ([2] if tiny else [1, 8, 32, 128])
    contexts = args.contexts or ([64, 256] if tiny else [1024, 8192, 32768])
    block_size = args.block_size or (16 if tiny else 64)
    repeats = args.repeats or (3 if tiny else 20)
    warmup = 1 if tiny else 3
    budget = args.time_budget or (40.0 if tiny else 1e9)
    out_dir = results_dir(args.out)
    start = time.perf_counter()

    copy_bytes = (16 * 2**20) if tiny else GiB
    copy_gbps = copy_bandwidth(copy_bytes, warmup, repeats) / 1e9
    meta = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "jax": jax.__version__,
            "python": platform.python_version(), "tiny": tiny, "interpret": interpret, "block_size": block_size,
            "copy_bytes": copy_bytes, "copy_gbps": copy_gbps, "repeats": repeats}
    rows: list = []
    for i, (model, dtype, batch, context) in enumerate(plan(models, batches, contexts, [jnp.bfloat16, FP8])):
        itemsize = jnp.dtype(dtype).itemsize
        kv = model.kv_bytes(batch, context, itemsize)
        base = {"model": model.name, "kind": model.kind, "dtype": jnp.dtype(dtype).name, "batch": batch,
                "context": context, "kv_bytes": kv}
        impls = [name for name in args.impls if model.kind == "gqa" or name != "jax_shipped"]
        free = free_bytes()
        if time.perf_counter() - start > budget:
            rows += [{**base, "impl": name, "status": "skipped: time budget"} for name in impls]
            continue
        if free is not None and kv > 0.45 * free:
            rows += [{**base, "impl": name, "status": "skipped: KV does not fit"} for name in impls]
            continue
        case = build_case(model, batch, context, block_size, dtype, seed=i)
        fns, tiles = impl_fns(model, case, block_size, interpret)
        for name in impls:
            row = {**base, "impl": name}
            gathered_f32 = kv * 4 // itemsize
            if name == "xla_ref" and free is not None and 3 * gathered_f32 > 0.5 * free:
                row["status"] = "skipped: the reference's f32 gather does not fit"
            elif time.perf_counter() - start > budget:
                row["status"] = "skipped: time budget"
            else:
                try:
                    fn, fn_args = shipped_fn(model, case, block_size, interpret) if name == "jax_shipped" \
                        else fns[name]
                    seconds = time_call(fn, fn_args, warmup, repeats)
                    gbps = kv / seconds / 1e9
                    row.update(seconds=seconds, gbps=gbps, pct_of_copy=100 * gbps / copy_gbps, status="ok")
                    if name == "pallas":
                        row["tiles"] = (f"ppb={tiles.pages_per_block} splits={tiles.num_splits} "
                                        f"block_h={tiles.block_h} warps={tiles.num_warps}")
                    del fn, fn_args
                except Exception as e:  # recorded in the row, never hidden: a kernel that fails is a result
                    row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            write(out_dir, meta, rows, summarize(rows, copy_gbps))
        del case, fns
    meta["wall_seconds"] = round(time.perf_counter() - start, 1)
    checks = summarize(rows, copy_gbps)
    write(out_dir, meta, rows, checks)
    print((out_dir / "kernel_bench.md").read_text())
    return {**meta, "rows": rows, "summary": checks}


if __name__ == "__main__":
    main()
