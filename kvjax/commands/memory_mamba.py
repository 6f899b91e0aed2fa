"""`kvjax memory`'s part for an attention + Mamba hybrid (Bamba, Granite-4.0-H, Nemotron-H): the engine's block
size and groups (kvjax.config.engine's resolvers, as the engine builds its pool), the report's "mamba" section and
its lines. The arithmetic is kvjax.accounting.mamba_pool's and kvjax.accounting.hybrid's.
"""
from __future__ import annotations

from kvjax.engine.cli_args import as_flags
from kvjax.errors import KvjaxError, UsageError


def resolve_pool(config, spec, block_size: int, tp: int):
    """(the attention block size, grown beside Mamba layers until a page holds a state, and the
    kvjax.accounting.mamba_pool.MambaPool of the engine's groups), by the engine's resolvers."""
    from kvjax.accounting.mamba_pool import MambaPool
    from kvjax.config.engine import resolve_block_size, resolve_kv_cache_groups

    try:
        grown = resolve_block_size(config, spec, block_size)
        groups = resolve_kv_cache_groups(config, spec, grown, hybrid=True, kv_layout="paged", host_tier=False,
                                         tensor_parallel_size=tp)
    except KvjaxError as e:  # the engine's words for its arguments: said in flags
        raise UsageError(as_flags(str(e))) from None
    return grown, MambaPool.from_config(config, groups)


def report(sized, requested_block_size: int) -> dict:
    """The JSON "mamba" section: the state, the grown block size, each group, and the bytes kvjax and vLLM hold."""
    gp, pool = sized.groups, sized.pool
    held = pool.held_bytes(gp)
    return {"state_shapes": [list(s) for s in pool.state.shapes], "state_dtypes": list(pool.state.dtypes),
            "state_bytes": pool.state.page_bytes, "requested_block_size": requested_block_size,
            "block_size": gp.block_size, "bytes_per_block": gp.bytes_per_block, "num_blocks": gp.num_blocks,
            "groups": [{"kind": g.kind, "layers": list(g.layers), "block_bytes": g.block_bytes,
                        "blocks_per_request": n} for g, n in zip(gp.groups, gp.blocks_per_request)],
            "max_concurrency": gp.max_concurrency, "kv_cache_tokens": gp.kv_cache_tokens, "admitted": gp.admitted,
            "tensors": pool.tensors, "vllm_bytes": held["vllm"], "kvjax_bytes": held["kvjax"]}


def lines(r: dict) -> list[str]:
    """The report's lines for the Mamba section (after the budget's)."""
    m, p = r["mamba"], r["plan"]
    shapes = " + ".join(f"{'×'.join(map(str, s))} {d}" for s, d in zip(m["state_shapes"], m["state_dtypes"]))
    grown = (f"grown from {m['requested_block_size']} so that an attention page holds a state"
             if m["block_size"] != m["requested_block_size"] else "its attention page already holds a state")
    groups = ", ".join(f"{g['kind'].replace('_attention', '')} {g['layers']}" for g in m["groups"])
    return [
        f"Mamba state / layer: {m['state_bytes']:,} B ({shapes}); attention block size {m['block_size']} ({grown})",
        f"hybrid KV cache (vLLM's, as the engine runs it): {len(m['groups'])} groups ({groups}): "
        f"{p['budget_bytes']:,} // {m['bytes_per_block']:,} B per block = {m['num_blocks']:,} blocks; per request "
        f"{' + '.join(str(g['blocks_per_request']) for g in m['groups'])} blocks at {r['max_model_len']} tokens; "
        f"max concurrency {m['max_concurrency']:.2f}x",
        f"kvjax's layout: {m['tensors']} slot tensor{'s' * (m['tensors'] > 1)} of {m['num_blocks']:,} pages, each "
        f"Mamba state inside its block's page = {m['kvjax_bytes']:,} B; vLLM's num_blocks × bytes per block = "
        f"{m['vllm_bytes']:,} B ({m['kvjax_bytes'] / m['vllm_bytes']:.2f}x)",
    ]


def check_fits(sized) -> None:
    """Refuse, before allocating it, a hybrid cache that with the weights exceeds a device."""
    from kvjax.accounting import memory as mem

    cache = sized.pool.held_bytes(sized.groups)["kvjax"]
    mem.check_fits(f"the weights ({sized.weights_bytes:,} B) and the hybrid cache of {sized.num_blocks:,} blocks "
                   f"({cache:,} B)", sized.weights_bytes + cache, sized.devices)
