"""`kvjax tables`: SPEC Tables 1 and 2 recomputed from the formulas (kvjax.accounting.spec_tables).

Table 1: KV bytes per token of four reference models, bf16 and fp8; Table 2: how many requests
fit in a GPU's KV budget after weights (budget = ceil(GPU × util) − weights; floor everywhere),
for six deployment scenarios. It prints both as markdown, or with --json one object holding the
two tables' rows. Nothing here imports JAX, so the command starts at once.
"""
from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("tables", help="recompute SPEC Tables 1 and 2 from the formulas")
    p.add_argument("--json", action="store_true", help="print one JSON object: the two tables' rows")


def run(args) -> int:
    from kvjax.accounting import spec_tables as tables

    t1, t2 = tables.table1(), tables.table2()
    if args.json:
        print(json.dumps({"table1": t1, "table2": t2}, indent=2))
    else:
        print("Table 1 — KV bytes per token (GiB = 1024³)\n")
        print(tables.table1_markdown(t1))
        print("\nTable 2 — concurrency (budget = ceil(GPU × util) − weights; floor everywhere)\n")
        print(tables.table2_markdown(t2))
    return 0
