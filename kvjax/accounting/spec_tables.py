"""SPEC Tables 1 and 2, recomputed from the presets and the formulas (no stored results).

Table 1: KV bytes per token for four reference models, bf16 and fp8, at 128K context, and the
ratio against the same model with one KV head per query head. Table 2: how many 8K/32K
requests fit in the KV budget of a GPU after weights, for six deployment scenarios. The rows
are plain dicts; `kvjax tables` (kvjax.commands.tables) renders them.
"""
from __future__ import annotations

from typing import Any

from kvjax.accounting import budget as bud
from kvjax.config.presets import preset


def table1() -> list[dict[str, Any]]:
    rows = []
    for name in ("llama-2-7b", "llama-3-8b", "llama-3-70b", "deepseek-v3"):
        config = preset(name)
        bf16, fp8 = config.kv_spec("bf16"), config.kv_spec("fp8")
        rows.append(dict(model=config.title, kind=bf16.kind.upper(), layers=bf16.num_layers,
                         kv_heads=bf16.num_kv_heads, head_dim=bf16.head_dim,
                         bf16_bytes_per_token=bf16.bytes_per_token, fp8_bytes_per_token=fp8.bytes_per_token,
                         bf16_bytes_128k=bf16.bytes_per_request(131072), mha_ratio=bf16.mha_ratio))
    return rows


def scenario_plan(sc: dict[str, Any]) -> bud.Plan:
    """Run one Table 2 scenario or simulator group through `budget.plan`."""
    spec = preset(sc["preset"]).kv_spec(sc.get("kv_dtype", "bf16"))
    return bud.plan(spec, context=sc["context"], total_bytes=bud.gib(sc["gpu_gib"]),
                    util=sc.get("util", "0.92"), weights_bytes=bud.gib(sc["weights_gib"]),
                    tp=sc.get("tp", 1), pooled=sc.get("pooled", False))


def table2() -> list[dict[str, Any]]:
    rows = []
    for sc in bud.TABLE2:
        pl = scenario_plan(sc)
        rows.append(dict(scenario=sc["scenario"], gpu_gib=pl.total_bytes / bud.GiB, util=float(pl.util),
                         weights_gib=pl.weights_bytes / bud.GiB, budget_gib=pl.budget_bytes / bud.GiB,
                         context=pl.context, kv_bytes_per_request=pl.kv_bytes_per_request,
                         budget_per_request=pl.concurrency_exact, concurrency=pl.concurrency,
                         concurrency_blocks=pl.concurrency_blocks, pooled=pl.pooled))
    return rows
