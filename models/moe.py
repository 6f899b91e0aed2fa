"""Mixture-of-experts MLP blocks: router → top-k → expert SwiGLU MLPs → weighted sum, dropless.

A MoE layer replaces the dense MLP of the layers in `ModelConfig.moe_layers` (the others keep
models.layers.MLP). Per token, a linear router gives one logit per routed expert, `route` turns the
logits into k expert ids and k weights as the family does (`MoEConfig`, kvjax.config.model), each of the
k experts (a SwiGLU MLP of width I) runs on the token, and the output is the weighted sum, plus the
shared experts every token passes through. It reproduces transformers 5's `MixtralSparseMoeBlock`,
`Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`, `DeepseekV2Moe`, `DeepseekV3MoE` and gpt-oss's
`GptOssMLP`, and, where they differ, vLLM 0.33's `grouped_topk`
(model_executor/layers/fused_moe/router/grouped_topk_router.py): DeepSeek-V2's `norm_topk_prob`, which
transformers ignores, and `topk_method` / `scoring_func`, which transformers' DeepSeek classes hard-code.

Dropless: every token reaches all k of its experts (no capacity factor, nothing dropped), so the
result never depends on what else is in the batch. Two expert paths compute the same [T, k, D]:

- `experts_ragged` (the default): the T·k (token, expert) assignments are sorted by expert, so each
  expert's tokens are one contiguous run, and `jax.lax.ragged_dot` multiplies every run by its own
  expert's weights — a grouped GEMM over exactly T·k rows, the work of the chosen experts only (vLLM's
  fused_moe does the same with `moe_align_block_size` and a Triton kernel). Every shape is static
  (T·k rows, group sizes a length-E bincount), so a jitted step compiles once per token count whatever
  the routing.
- `experts_dense`: every expert on every token (einsums over [T, E, ...]), then the k chosen are
  gathered: E/k times the work, no sort — the plain reference the tests compare the ragged path with.

`MoE.impl` picks one ("ragged" or "dense"); None reads the environment variable KVJAX_MOE_IMPL
(default "ragged") when the model is traced, so a change after a step compiled takes a new process.

Dtypes as transformers: the router logits in the model dtype (DeepSeek: float32 inputs and a float32
router weight, `MoEConfig.router_f32`), scores and the top-k weights in float32; the weights scale the
expert outputs in float32 (Mixtral, DeepSeek) or cast to the model dtype first (Qwen, gpt-oss:
`f32_weights`). Expert matmuls accumulate in float32 and round to the model dtype; each weighted output
is rounded to the model dtype, and the k are summed in float32 and rounded once.

Parameters of a MoE layer, `layers_{i}/mlp/...` (Hugging Face names in models.loader):

    gate/kernel                  [D, E]      router (gpt-oss: router/kernel and router/bias [E])
    gate/e_score_correction_bias f32[E]      topk_method noaux_tc: added to the scores to choose only
    experts/gate_up_proj         [E, D, 2I]  columns [0, I) the gate projection, [I, 2I) the up projection
                                             (under tensor parallelism: MoEConfig.gate_up_blocks blocks)
    experts/down_proj            [E, I, D]
    experts/gate_up_proj_bias    [E, 2I]     gpt-oss (expert_bias)
    experts/down_proj_bias       [E, D]      gpt-oss
    shared_expert/{gate,up,down}_proj/kernel   Qwen2-MoE (width shared_expert_intermediate_size),
    shared_expert_gate/kernel    [D, 1]        with its sigmoid gate
    shared_experts/{gate,up,down}_proj/kernel  DeepSeek (width n_shared_experts × moe_intermediate_size)

Axis legend beyond the project's: E routed experts, k experts per token, I an expert's width, A = T·k
(token, expert) assignments.
"""
from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.config.model import ModelConfig, MoEConfig
from kvjax.models.mlp import MLP, dense

IMPLS = ("ragged", "dense")
IMPL_ENV = "KVJAX_MOE_IMPL"


def default_impl() -> str:
    """The expert path $KVJAX_MOE_IMPL names ("ragged" when unset)."""
    impl = os.environ.get(IMPL_ENV, "ragged")
    if impl not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={impl!r} is not an expert path; choose one of {', '.join(IMPLS)}")
    return impl


# --------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------
def route(logits: jax.Array, moe: MoEConfig, correction_bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] → (weights f32[T, k], expert ids i32[T, k]), as `moe` says.

    correction_bias f32[E] (topk_method noaux_tc) is added to the scores that choose the experts
    and to nothing else: the weights are the unbiased scores of the chosen (DeepSeek-V3's aux-loss-free
    load balancing, arXiv 2412.19437 §2.1.2). The chosen scores are renormalised, then scaled, as
    vLLM's grouped_topk does for both DeepSeeks (DeepSeek-V2's own code scales only the weights it does
    not renormalise; no released V2 config renormalises, and transformers' V2 never does)."""
    k = moe.top_k
    if moe.scoring_func == "topk_softmax":  # gpt-oss: top-k of the logits, softmax over those k only
        top, ids = jax.lax.top_k(logits, k)  # [T, k] in the logits' dtype
        return jax.nn.softmax(top.astype(jnp.float32), axis=-1), ids
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if moe.scoring_func == "softmax" else jax.nn.sigmoid(logits)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if moe.grouped:
        choice = _limit_to_groups(choice, moe)
    _, ids = jax.lax.top_k(choice, k)  # [T, k]
    weights = jnp.take_along_axis(scores, ids, axis=-1)  # f32[T, k]
    if moe.norm_topk_prob:
        # transformers' DeepSeek-V3 adds 1e-20 to the sum (sigmoid scores need not sum to anything)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + (1e-20 if moe.scoring_func == "sigmoid" else 0.0))
    return weights * moe.routed_scaling_factor, ids


def _limit_to_groups(choice: jax.Array, moe: MoEConfig) -> jax.Array:
    """choice [T, E] with every expert outside the token's topk_group best groups set to -inf.

    A group's rank: its best score (group_limited_greedy, DeepSeek-V2) or the sum of its two best
    (noaux_tc, DeepSeek-V3). DeepSeek uses this to bound how many devices a token's experts live on.
    transformers' V2 masks with 0 where vLLM and its V3 use -inf: the same choice, since MoEConfig
    requires the kept groups to hold at least top_k experts."""
    tokens, experts = choice.shape
    groups = choice.reshape(tokens, moe.n_group, experts // moe.n_group)  # [T, G, E/G]
    if moe.topk_method == "noaux_tc":
        group_scores = jax.lax.top_k(groups, 2)[0].sum(axis=-1)  # [T, G]
    else:
        group_scores = groups.max(axis=-1)  # [T, G]
    _, best = jax.lax.top_k(group_scores, moe.topk_group)  # [T, topk_group]
    keep = jax.nn.one_hot(best, moe.n_group, dtype=jnp.bool_).any(axis=1)  # [T, G]
    keep = jnp.repeat(keep, experts // moe.n_group, axis=1)  # [T, E]
    return jnp.where(keep, choice, -jnp.inf)


# --------------------------------------------------------------------------------------------
# Experts
# --------------------------------------------------------------------------------------------
def activate(h: jax.Array, moe: MoEConfig) -> jax.Array:
    """[..., 2I] gate and up projections → [..., I]: silu(gate) · up, or gpt-oss's clamped SwiGLU
    (gate ≤ limit, |up| ≤ limit, then (up + 1) · gate · σ(alpha · gate)).

    The 2I columns are `moe.gate_up_blocks` blocks [gate_b | up_b] (1: transformers' all-gate-then-up),
    and block b's I / blocks outputs are columns b·I/blocks onward of the result. Under tensor
    parallelism each rank holds one block, so its gate and up meet on the rank, with no communication."""
    blocks = h.reshape(*h.shape[:-1], moe.gate_up_blocks, 2, -1)  # [..., b, 2, I/b]
    gate, up = blocks[..., 0, :], blocks[..., 1, :]  # [..., b, I/b] each
    if moe.activation == "swiglu":
        out = nn.silu(gate) * up
    else:
        gate = jnp.minimum(gate, moe.swiglu_limit)
        up = jnp.clip(up, -moe.swiglu_limit, moe.swiglu_limit)
        out = (up + 1) * (gate * jax.nn.sigmoid(gate * moe.swiglu_alpha))
    return out.reshape(*h.shape[:-1], -1)  # [..., I]


def experts_ragged(x: jax.Array, ids: jax.Array, w: dict, moe: MoEConfig) -> jax.Array:
    """x [T, D], ids i32[T, k] → [T, k, D]: each token through each of its k experts, as one grouped
    matmul per projection over the T·k assignments sorted by expert. `w`: Experts' parameters."""
    tokens, k = ids.shape
    dtype = x.dtype
    flat = ids.reshape(tokens * k)  # i32[A]: assignment a = t·k + j is token t's j-th expert
    order = jnp.argsort(flat, stable=True)  # i32[A]: the assignments sorted by expert
    expert = flat[order]  # i32[A], non-decreasing
    sizes = jnp.bincount(flat, length=moe.num_experts).astype(jnp.int32)  # i32[E], sums to A
    rows = x[order // k]  # [A, D]: each sorted assignment's token
    # f32 weights: full f32 products. XLA's GPU grouped matmul otherwise rounds f32 operands as
    # TF32 does (1.5e-3 from transformers on an H200, where the dense path's dots match to 1e-5).
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    h = jax.lax.ragged_dot(rows, w["gate_up_proj"], sizes, precision=precision,
                           preferred_element_type=jnp.float32).astype(dtype)
    if moe.expert_bias:
        h = h + w["gate_up_proj_bias"][expert]  # [A, 2I]
    out = jax.lax.ragged_dot(activate(h, moe), w["down_proj"], sizes, precision=precision,
                             preferred_element_type=jnp.float32).astype(dtype)  # [A, D]
    if moe.expert_bias:
        out = out + w["down_proj_bias"][expert]
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # back to t·k + j order
    return out.reshape(tokens, k, -1)


def experts_dense(x: jax.Array, ids: jax.Array, w: dict, moe: MoEConfig) -> jax.Array:
    """The reference of experts_ragged: every expert on every token, then the k chosen gathered.
    Its products run in float32 (XLA:CPU has no bf16 × bf16 → f32 batched dot) and round to the
    model dtype where the ragged path's do."""
    dtype, f32 = x.dtype, jnp.float32
    h = jnp.einsum("td,edf->tef", x.astype(f32), w["gate_up_proj"].astype(f32)).astype(dtype)  # [T, E, 2I]
    if moe.expert_bias:
        h = h + w["gate_up_proj_bias"]
    out = jnp.einsum("tei,eid->ted", activate(h, moe).astype(f32), w["down_proj"].astype(f32))
    out = out.astype(dtype)  # [T, E, D]
    if moe.expert_bias:
        out = out + w["down_proj_bias"]
    return jnp.take_along_axis(out, ids[:, :, None], axis=1)  # [T, k, D]


def combine(outs: jax.Array, weights: jax.Array, moe: MoEConfig) -> jax.Array:
    """Σ_j weights[t, j] · outs[t, j]: outs [T, k, D], weights f32[T, k] → [T, D] in outs' dtype.

    Each product is rounded to the model dtype (transformers adds them into a model-dtype buffer),
    in float32 when `f32_weights`, else with the weights cast to the model dtype first."""
    dtype = outs.dtype
    w = weights if moe.f32_weights else weights.astype(dtype)
    terms = (outs.astype(w.dtype) * w[:, :, None]).astype(dtype)  # [T, k, D]
    return terms.astype(jnp.float32).sum(axis=1).astype(dtype)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------
class Router(nn.Module):
    """x [T, D] → (weights f32[T, k], expert ids i32[T, k])."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        c, moe = self.config, self.config.moe
        dtype = jnp.float32 if moe.router_f32 else jnp.dtype(c.dtype)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (c.hidden_size, moe.num_experts), dtype)
        logits = jnp.dot(x.astype(dtype), kernel)  # [T, E]
        if moe.router_bias:
            logits = logits + self.param("bias", nn.initializers.zeros, (moe.num_experts,), dtype)
        bias = None
        if moe.topk_method == "noaux_tc":  # a float32 buffer in transformers, learned outside the loss
            bias = self.param("e_score_correction_bias", nn.initializers.zeros, (moe.num_experts,), jnp.float32)
        return route(logits, moe, bias)


class Experts(nn.Module):
    """The routed experts, stacked: (x [T, D], ids i32[T, k]) → [T, k, D] by `impl`'s path."""

    config: ModelConfig
    impl: str = "ragged"

    @nn.compact
    def __call__(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        c, moe = self.config, self.config.moe
        e, d, i = moe.num_experts, c.hidden_size, moe.intermediate_size
        dtype = jnp.dtype(c.dtype)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                batch_axis=(0,))
        w = {"gate_up_proj": self.param("gate_up_proj", init, (e, d, 2 * i), dtype),
             "down_proj": self.param("down_proj", init, (e, i, d), dtype)}
        if moe.expert_bias:
            w["gate_up_proj_bias"] = self.param("gate_up_proj_bias", nn.initializers.zeros, (e, 2 * i), dtype)
            w["down_proj_bias"] = self.param("down_proj_bias", nn.initializers.zeros, (e, d), dtype)
        if self.impl not in IMPLS:
            raise ValueError(f"unknown MoE expert path {self.impl!r}; choose one of {', '.join(IMPLS)}")
        return (experts_ragged if self.impl == "ragged" else experts_dense)(x, ids, w, moe)


class MoE(nn.Module):
    """One layer's MoE block: x [T, D] → [T, D] (routed experts' weighted sum + shared experts)."""

    config: ModelConfig
    impl: str | None = None  # "ragged" or "dense"; None: default_impl() ($KVJAX_MOE_IMPL)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c, moe = self.config, self.config.moe
        weights, ids = Router(c, name="router" if c.model_type == "gpt_oss" else "gate")(x)
        y = combine(Experts(c, self.impl or default_impl(), name="experts")(x, ids), weights, moe)  # [T, D]
        if moe.shared_intermediate_size:
            shared_name = "shared_expert" if c.model_type == "qwen2_moe" else "shared_experts"
            shared = MLP(c, moe.shared_intermediate_size, name=shared_name)(x)
            if moe.shared_expert_gate:  # Qwen2-MoE: how much of the shared expert each token takes
                shared = nn.sigmoid(dense(c, 1, False, "shared_expert_gate")(x)) * shared
            y = y + shared
        return y
