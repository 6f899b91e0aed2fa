"""Decode context parallelism for MLA: each rank attends over its share of the latent cache, and the partial
outputs are merged with their log-sum-exps (vLLM's `--decode-context-parallel-size`,
`vllm/v1/attention/ops/dcp.py: cp_lse_ag_out_rs`, `vllm/model_executor/layers/attention/mla_attention.py`).

MLA's one latent per token is replicated on every tensor-parallel rank (SPEC: TP does not shrink per-device MLA
KV). DCP splits it by token over D ranks of the TP group instead (kvjax.worker.dcp_pages: token p on rank p % D),
so each rank holds 1/D of every sequence and the pool holds D times the tokens. A step's attention then runs, in
`jax.shard_map` over the mesh's ("tp", "dcp") axes, as vLLM's does:

1. each rank's query heads (split over all TP ranks) are all-gathered over its DCP group: q [T, N·D/TP, C];
2. each rank attends those heads over the tokens it holds, a paged sequence of its own (positions p ≡ r mod D at
   local position p // D; a query at position p sees local positions ≤ floor((p − r) / D), a decode query all
   ceil((L − r) / D) of them), giving per-rank outputs o_r [T, H, C] normalized over its own tokens and their
   log-sum-exps lse_r [T, H] (−inf where a rank holds none of a query's keys);
3. the D partials are all-gathered and combined as split-K decode combines its splits (kvjax.attention.
   pallas_decode.merge_splits: out = Σ_r exp(lse_r − m) o_r / Σ_r exp(lse_r − m)), exact softmax attention over
   the whole sequence; each rank keeps its own heads' rows.
vLLM reduce-scatters the corrected outputs over heads instead of all-gathering them; the sum is the same, the
bytes moved differ (D× here), and kvjax's collectives are XLA's either way.

Step 2 is plain jnp in f32 (the reference form: gather by block table, mask by position), for prefill, mixed and
decode steps alike. `check_dcp` holds vLLM's rules and kvjax's limits: MLA only (vLLM also splits GQA/MQA caches
when TP exceeds the KV heads), D divides TP (kvjax.config.parallel), not for nvfp4's packed pages.

Axes: the kvjax package docstring's legend; H here is the heads a DCP group holds.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kvjax.attention.metadata import BatchMetadata
from kvjax.attention.reference import HIGHEST, _query_blocks, _to_tokens, gather_dequant
from kvjax.quant.kv_formats import kv_format
from kvjax.worker.dcp_pages import DCP_AXIS, local_lengths, local_positions
from kvjax.worker.sharding import tp_axes


def check_dcp(kv_spec, tensor_parallel_size: int, dcp: int, block_size: int, error: type) -> None:
    """Refuse, by name, a decode context parallel size this model's KV cache cannot take (module docstring)."""
    if kv_spec.kind != "mla":
        raise error(f"decode_context_parallel_size={dcp}: kvjax splits MLA's latent cache only, and this model's "
                    f"KV cache is {kv_spec.kind} (vLLM also splits GQA/MQA caches when tensor_parallel_size exceeds "
                    "the KV heads); set --decode-context-parallel-size 1")
    if tensor_parallel_size % dcp:
        raise error(f"tp_size={tensor_parallel_size} must be divisible by dcp_size={dcp}.")
    if kv_format(kv_spec.kv_dtype).scale == "per_block":
        raise error(f"decode_context_parallel_size={dcp} with kv_cache_dtype {kv_spec.kv_dtype}: packed pages are "
                    "not split by token")
    if block_size < 1:
        raise error(f"block_size={block_size} must be at least 1 (vLLM: at least cp_kv_cache_interleave_size)")


def partial_attention(q: jax.Array, latent: jax.Array, md: BatchMetadata, scale: float, rank_lens=None
                      ) -> tuple[jax.Array, jax.Array]:
    """One rank's MLA attention over the keys it holds. q: [T, H, C] (latent query ‖ rope query); latent: f32[B, S, C]
    gathered keys (values: the first kv_lora_rank lanes, `rank_lens` = q's latent width), md with local positions
    and lengths → (out f32[T, H, kv_lora_rank] normalized over these keys, lse f32[T, H], −inf where none)."""
    token, mask = _query_blocks(md, latent.shape[1])  # [B, Q], bool[B, Q, S]
    values = jnp.where(jnp.any(mask, axis=1)[..., None], latent[..., :rank_lens], 0.0)  # NaN in unread slots stays out
    scores = jnp.einsum("bqhc,bsc->bqhs", q[token], latent, precision=HIGHEST) * scale  # f32[B, Q, H, S]
    scores = jnp.where(mask[:, :, None, :], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)  # masked: exp(−inf) = 0
    total = jnp.sum(weights, axis=-1)  # [B, Q, H]
    out = jnp.einsum("bqhs,bsc->bqhc", weights, values, precision=HIGHEST) / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, peak[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return _to_tokens(out, md), jnp.where(md.valid[:, None], _to_tokens(lse, md), -jnp.inf)


def mla_dcp_attention(q_latent: jax.Array, q_rope: jax.Array, pages, md: BatchMetadata, *, scale: float) -> jax.Array:
    """q_latent: [T, N, kv_lora_rank]; q_rope: [T, N, rope]; pages: LatentPages [P, Zv, C] split by token over
    pages.dcp_mesh → f32[T, N, kv_lora_rank], the whole sequences' attention (module docstring)."""
    from kvjax.attention.pallas_decode import merge_splits

    mesh, rank_width = pages.dcp_mesh, q_latent.shape[-1]
    dcp, heads = mesh.shape[DCP_AXIS], P(None, tp_axes(mesh), None)
    names = [n for n in ("latent", "scale") if getattr(pages, n) is not None]
    specs = tuple(P(None, DCP_AXIS) if getattr(pages, n).ndim >= 2 else P() for n in names)

    def attend(ql, qr, arrays, md):  # on one rank: ql [T, N/TP, R], pages [P, Z, C]
        kv = dict(zip(names, arrays))
        r = jax.lax.axis_index(DCP_AXIS)
        q = jnp.concatenate([ql, qr], axis=-1).astype(jnp.float32)
        q = jax.lax.all_gather(q, DCP_AXIS, axis=1, tiled=True)  # [T, H, C]: the DCP group's heads
        latent = gather_dequant(kv["latent"], kv.get("scale"), md.block_tables, pages.kv_dtype)  # f32[B, S, C]
        local = md.replace(positions=local_positions(md.positions, dcp, r),
                           context_lens=local_lengths(md.context_lens, dcp, r))
        out, lse = partial_attention(q, latent, local, scale, rank_width)
        outs = jax.lax.all_gather(out, DCP_AXIS)  # [D, T, H, R]
        lses = jax.lax.all_gather(lse, DCP_AXIS)  # [D, T, H]
        merged = merge_splits(outs, lses, axis=0)  # [T, H, R]
        own = ql.shape[1]
        return jax.lax.dynamic_slice_in_dim(merged, r * own, own, axis=1)  # this rank's heads

    return jax.shard_map(attend, mesh=mesh, in_specs=(heads, heads, specs, P()), out_specs=heads, check_vma=False)(
        q_latent, q_rope, tuple(getattr(pages, n) for n in names), md)


__all__ = ["check_dcp", "mla_dcp_attention", "partial_attention"]
