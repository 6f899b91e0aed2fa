"""experiments/kernel_bench.py's report: the targets each measured shape meets, the markdown table,
the JSON and the dispatch table (kvjax.attention.mgpu_dispatch) the rows make."""
from __future__ import annotations

import pathlib

from kvjax.attention.mgpu_dispatch import render_table_module, table_from_rows
from kvjax.markdown import markdown_table
from kvjax.utils.output_files import write_json, write_text

GiB = 2 ** 30


def summarize(rows, ceil: dict):
    """The issue's H200 targets, from the measured rows (None where a row is missing)."""
    def get(kind, fmt, batch, context, impl):
        for r in rows:
            if (r["kind"], r["format"], r["batch"], r["context"], r["impl"]) == (kind, fmt, batch, context, impl) \
                    and r.get("seconds"):
                return r
        return None

    def ratio(a, b):
        return a and b and round(b["seconds"] / a["seconds"], 2)

    checks = []
    for kind, batch, context in sorted({(r["kind"], r["batch"], r["context"]) for r in rows
                                        if r["kind"] not in ("ragged", "mla_ragged")}):
        mos = {f: get(kind, f, batch, context, "mosaic") for f in ("bf16", "fp8_e4m3", "fp8_per_token_head", "nvfp4")}
        tri = get(kind, "bf16", batch, context, "triton")
        checks.append({
            "kind": kind, "batch": batch, "context": context,
            "mosaic_bf16_pct_of_read": mos["bf16"] and round(100 * mos["bf16"]["gbps"] / ceil["read_gbps"], 1),
            "triton_bf16_pct_of_read": tri and round(100 * tri["gbps"] / ceil["read_gbps"], 1),
            "mosaic_fp8_speedup_over_bf16": ratio(mos["fp8_e4m3"], mos["bf16"]),
            "mosaic_over_triton_bf16": ratio(mos["bf16"], tri),
            "mosaic_over_triton_fp8": ratio(mos["fp8_e4m3"], get(kind, "fp8_e4m3", batch, context, "triton")),
            "mosaic_over_jax_shipped_bf16": ratio(mos["bf16"], get(kind, "bf16", batch, context, "jax_shipped")),
            "mosaic_over_triton_per_token": ratio(mos["fp8_per_token_head"],
                                                  get(kind, "fp8_per_token_head", batch, context, "triton")),
            "mosaic_over_triton_nvfp4": ratio(mos["nvfp4"], get(kind, "nvfp4", batch, context, "triton")),
            "target_shape": batch >= 32 and context >= 8192,
        })
    return checks


def prefill_checks(rows) -> list:
    """The ragged prefill target (>= 50% of the bf16 matmul rate), Mosaic GPU against Triton, per
    kind (GQA's "ragged", MLA's "mla_ragged"), page format and context."""
    out = []
    ragged = [r for r in rows if r["kind"] in ("ragged", "mla_ragged")]
    for kind, fmt, context in sorted({(r["kind"], r["format"], r["context"]) for r in ragged}):
        got = {r["impl"]: r for r in ragged if (r["kind"], r["format"], r["context"]) == (kind, fmt, context)
               and r.get("seconds")}
        mos, tri = got.get("mosaic"), got.get("triton")
        out.append({"kind": kind, "format": fmt, "context": context, "chunk": (mos or tri or {}).get("chunk"),
                    "mosaic_tflops": mos and round(mos["tflops"], 1), "triton_tflops": tri and round(tri["tflops"], 1),
                    "mosaic_pct_of_matmul": mos and round(mos["pct_of_matmul"], 1),
                    "mosaic_over_triton": mos and tri and round(tri["seconds"] / mos["seconds"], 2)})
    return out


def _row_cells(r: dict) -> list:
    """One measurement's cells; a variant that did not run shows its status as its note."""
    head = [r["model"], r["format"], r["batch"], r["context"], r["impl"]]
    if not r.get("seconds"):
        return head + ["", f"{r['kv_bytes'] / 2**20:.1f}", "", "", r["status"]]
    if r["kind"] in ("ragged", "mla_ragged"):  # TFLOP/s and % of the matmul rate in the rate columns
        return head + [f"{r['seconds'] * 1e6:.1f}", f"{r['kv_bytes'] / 2**20:.1f}", f"{r['tflops']:.1f} TFLOP/s",
                       f"{r['pct_of_matmul']:.1f} (matmul)", f"chunk {r['chunk']}"]
    return head + [f"{r['seconds'] * 1e6:.1f}", f"{r['kv_bytes'] / 2**20:.1f}", f"{r['gbps']:.1f}",
                   f"{r['pct_of_read']:.1f}", r.get("tiles", "")]


def write(out_dir: pathlib.Path, meta: dict, rows: list, checks: list) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    prefill = prefill_checks(rows)
    write_json(out_dir / "kernel_bench.json", {**meta, "rows": rows, "summary": checks, "prefill": prefill}, "--out")
    c = meta["ceilings"]
    lines = [f"# Decode kernel bandwidth ({meta['device']}, jax {meta['jax']}, "
             f"{'tiny, interpreted' if meta['tiny'] else 'compiled'})", "",
             f"read {c['read_gbps']:.0f} GB/s, copy {c['copy_gbps']:.0f} GB/s (read + write) over "
             f"{c['buffer_bytes'] / GiB:.3g} GiB; bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s at n = {c['matmul_n']}",
             "", *markdown_table(["model", "pages", "batch", "context", "impl", "µs", "KV MiB", "GB/s",
                                  "% of read", "tiles / note"], [_row_cells(r) for r in rows])]
    lines += ["", "## Targets (H200: bf16 GQA >= 85% of read at batch >= 32, context >= 8K; MLA >= 80%;"
              " fp8 >= 1.7x bf16; faster than Triton and JAX's shipped kernel)", "",
              *markdown_table(["kind", "batch", "context", "mosaic bf16 % read", "triton bf16 % read",
                               "mosaic fp8 / bf16", "mosaic / triton bf16", "mosaic / triton fp8",
                               "mosaic / shipped", "mosaic / triton per-token", "mosaic / triton nvfp4",
                               "target shape"],
                              [[c["kind"], c["batch"], c["context"], c["mosaic_bf16_pct_of_read"],
                                c["triton_bf16_pct_of_read"], c["mosaic_fp8_speedup_over_bf16"],
                                c["mosaic_over_triton_bf16"], c["mosaic_over_triton_fp8"],
                                c["mosaic_over_jax_shipped_bf16"], c["mosaic_over_triton_per_token"],
                                c["mosaic_over_triton_nvfp4"], c["target_shape"]] for c in checks])]
    lines += ["", "## Ragged prefill (a chunk at the end of its context; target >= 50% of the bf16 matmul rate)", "",
              *markdown_table(["kind", "pages", "context", "chunk", "mosaic TFLOP/s", "triton TFLOP/s",
                               "mosaic % of matmul", "mosaic / triton"],
                              [[p["kind"], p["format"], p["context"], p["chunk"], p["mosaic_tflops"], p["triton_tflops"],
                                p["mosaic_pct_of_matmul"], p["mosaic_over_triton"]] for p in prefill])]
    write_text(out_dir / "kernel_bench.md", "\n".join(lines) + "\n", "--out")
    table = table_from_rows(rows, meta["device"])
    write_text(out_dir / "mgpu_table.py", render_table_module(
        table, source=f"experiments/kernel_bench.py on {meta['device']} (jax {meta['jax']})"), "--out")
