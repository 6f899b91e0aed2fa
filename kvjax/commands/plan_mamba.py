"""`kvjax plan`'s section for a model with Mamba layers (Granite-4.0-H, Nemotron-H, Bamba, Falcon-H1, Jamba):
vLLM's pool of attention and Mamba groups on the plan's budget (kvjax.accounting.hybrid.plan_model), rendered.
vLLM has no fallback that caches such a model in one group, so the section has one column. No JAX.
"""
from __future__ import annotations

from kvjax.accounting import budget as bud
from kvjax.accounting import hybrid
from kvjax.core.kv_cache_groups import HybridError
from kvjax.core.kv_cache_interface import SpecError
from kvjax.errors import UsageError


def mamba_plan(pl: bud.Plan, config, max_num_batched_tokens: int) -> hybrid.GroupPlan | None:
    """vLLM's KV cache groups of `config` (a ModelConfig with Mamba layers) on one rank of the plan `pl`
    (the attention block size grown to hold a Mamba state), None when the weights leave no budget."""
    if pl.budget_bytes is None or pl.budget_bytes <= 0:
        return None
    try:
        return hybrid.plan_model(config, pl.budget_bytes, kv_dtype=pl.spec.kv_dtype, block_size=pl.block_size,
                                 max_model_len=pl.context, max_num_batched_tokens=max_num_batched_tokens,
                                 tp=1 if pl.pooled else pl.tp)
    except (HybridError, SpecError) as e:
        raise UsageError(str(e)) from None


def format_mamba(gp: hybrid.GroupPlan, group_names: str) -> str:
    """The Mamba state, the block size it grew, and the pool's rows; group_names: the groups, as plan names them."""
    state = gp.state
    page = gp.bytes_per_block // max(len(g.layers) for g in gp.groups)
    shapes = " + ".join(f"{'×'.join(map(str, s))} {d}" for s, d in zip(state.shapes, state.dtypes))
    grown = (f"grown from {gp.requested_block_size} so that a page ({page:,} B) holds a state"
             if gp.block_size != gp.requested_block_size else "its page already holds a state")
    padding = page - state.page_bytes
    rows = [("Mamba state / layer", f"{state.page_bytes:,} B", f"conv + SSM state, one rank: {shapes}"),
            ("attention block size", f"{gp.block_size:,} tokens", grown),
            ("Mamba page padding", f"{padding:,} B",
             f"{100 * padding / state.page_bytes:.2f}% of a state (vLLM's mamba_page_size_padded)"),
            ("KV cache groups", group_names, ""),
            ("bytes / block", f"{gp.bytes_per_block:,} B", "the largest group's pages"),
            ("blocks", f"{gp.num_blocks:,}", "block 0 is null"),
            ("blocks / request", f"{sum(gp.blocks_per_request):,}",
             "cdiv(max_model_len, block) per attention group, 1 per Mamba group"),
            ("KV cache size", f"{gp.kv_cache_tokens:,} tokens", ""),
            ("max concurrency", f"{gp.max_concurrency:,.2f}x", "vLLM's, at max_model_len"),
            ("block-pool concurrency", f"{gp.admitted:,}", "usable blocks // blocks per request")]
    w = [max(len(r[i]) for r in rows) for i in range(2)]
    return "vLLM's hybrid KV cache (attention + Mamba groups)\n" + "\n".join(
        f"{a:<{w[0]}}  {b:<{w[1]}}  {c}".rstrip() for a, b, c in rows)
