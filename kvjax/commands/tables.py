"""`kvjax tables`: SPEC Tables 1 and 2 recomputed from the formulas (kvjax.accounting.spec_tables).

Table 1: KV bytes per token of four reference models, bf16 and fp8; Table 2: how many requests
fit in a GPU's KV budget after weights (budget = ceil(GPU × util) − weights; floor everywhere),
for six deployment scenarios. It prints both as markdown (`table1_markdown`, `table2_markdown`,
which `kvjax report` renders them with too), or with --json one object holding the two tables'
rows. Nothing here imports JAX, so the command starts at once.
"""
from __future__ import annotations

from typing import Any

from kvjax.accounting import budget as bud
from kvjax.markdown import markdown_table
from kvjax.utils.strict_json import dumps


def _num(x: float, digits: int = 6) -> str:
    return f"{x:,.{digits}g}" if x != int(x) else f"{int(x):,}"


def table1_markdown(rows: list[dict[str, Any]]) -> str:
    headers = ["model", "kind", "L", "Hkv", "D", "bf16/token", "fp8/token", "128K bf16", "vs same-shape MHA"]
    cells = [[r["model"], r["kind"], r["layers"], r["kv_heads"], r["head_dim"],
              bud.human_bytes(r["bf16_bytes_per_token"]), bud.human_bytes(r["fp8_bytes_per_token"]),
              bud.human_bytes(r["bf16_bytes_128k"]), f"{r['mha_ratio']:.3g}×"] for r in rows]
    return "\n".join(markdown_table(headers, cells, align="llrrrrrrr"))


def table2_markdown(rows: list[dict[str, Any]]) -> str:
    headers = ["scenario", "GPU GiB", "util", "weights GiB", "budget GiB", "context", "KV/request", "budget/request",
               "concurrency", "block-pool concurrency"]
    cells = [[r["scenario"], _num(r["gpu_gib"]), f"{r['util']:g}", _num(r["weights_gib"]), f"{r['budget_gib']:,.6g}",
              f"{r['context'] // 1024}K", bud.human_bytes(r["kv_bytes_per_request"]), f"{r['budget_per_request']:.4g}",
              f"{r['concurrency']}" + (" (pooled arithmetic only)" if r["pooled"] else ""), r["concurrency_blocks"]]
             for r in rows]
    return "\n".join(markdown_table(headers, cells, align="lrrrrrrrrr"))


def add_parser(sub) -> None:
    p = sub.add_parser("tables", help="recompute SPEC Tables 1 and 2 from the formulas")
    p.add_argument("--json", action="store_true", help="print one JSON object: the two tables' rows")


def run(args) -> int:
    from kvjax.accounting import spec_tables as tables

    t1, t2 = tables.table1(), tables.table2()
    if args.json:
        print(dumps({"table1": t1, "table2": t2}, indent=2))
    else:
        print("Table 1 — KV bytes per token (GiB = 1024³)\n")
        print(table1_markdown(t1))
        print("\nTable 2 — concurrency (budget = ceil(GPU × util) − weights; floor everywhere)\n")
        print(table2_markdown(t2))
    return 0
