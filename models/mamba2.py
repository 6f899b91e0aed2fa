"""The Mamba2 mixer (state space duality, SSD: Dao & Gu, arXiv:2405.21060) over its state in the shared page tensors.

Reproduces transformers' `BambaMixer` / `GraniteMoeHybridMambaLayer` / `NemotronHMamba2Mixer` torch path (the
one that runs without the mamba_ssm and causal_conv1d kernels) and vLLM's `MambaMixer2`:

    in_proj(x) → gate z [inner], xBC [conv_dim], dt [heads]
    xBC ← silu(causal depthwise conv of width conv_kernel over the sequence's xBC, its last inputs the conv state)
    x, B, C ← split(xBC): x [heads, head_dim], B and C [n_groups, state] (head h reads group h // (heads / n_groups))
    dt ← clamp(softplus(dt + dt_bias), time_step_limit);  A = −exp(A_log)
    h_t = exp(dt_t·A) h_{t−1} + dt_t · x_t ⊗ B_t;  y_t = C_t · h_t + D · x_t           (the SSM, per head)
    y ← gated RMSNorm: rmsnorm(y · silu(z)) per group of inner / n_groups channels, × weight
    out_proj(y)

Prefill runs the chunked SSD scan (`ssd_scan`: quadratic attention-like form inside each chunk of chunk_size
tokens, the recurrence between chunks), a port of transformers' `mamba2_chunk_scan`, from the sequence's saved
state; a decode step runs the one-step recurrence (`ssd_step`, transformers' `mamba2_selective_state_update`).
Both are plain jnp: a ragged step's sequences are laid into a [B, Q] grid (as kvjax.attention.reference lays
queries), the grid's padding given dt = 0 so that it neither decays nor feeds the state, and the state each
sequence ends with is written back to its state block (kvjax.worker.mamba_state).

Mamba's own sizes are spelled out in shape comments (conv_dim, heads, head_dim, state, n_groups, chunk); B, Q and
T are the package legend's.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention.metadata import BatchMetadata
from kvjax.config.model import ModelConfig
from kvjax.models.mlp import dense
from kvjax.worker.mamba_state import read_state, state_rows, write_state
from kvjax.worker.paged_cache import KVPages, LatentPages


def segsum(x: jax.Array) -> jax.Array:
    """[..., L] → [..., L, L]: out[i, j] = x[j+1] + … + x[i] for i ≥ j, −inf above the diagonal
    (transformers' `segment_sum`: masked cumulative sums, stabler than differences of one cumsum)."""
    n = x.shape[-1]
    below = jnp.tril(jnp.ones((n, n), bool), -1)
    summed = jnp.cumsum(jnp.where(below, x[..., :, None], 0.0), axis=-2)
    return jnp.where(jnp.tril(jnp.ones((n, n), bool)), summed, -jnp.inf)


def ssd_scan(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array, init: jax.Array,
             chunk: int) -> tuple[jax.Array, jax.Array]:
    """The chunked SSD scan of B sequences of L tokens (L a multiple of chunk), all in f32, without the D skip.

    x f32[B, L, heads, head_dim]; dt f32[B, L, heads] (discretized, 0 on padding); a f32[heads] (A, negative);
    b, c f32[B, L, heads, state] (each head's group); init f32[B, heads, head_dim, state] → (y f32[B, L, heads,
    head_dim], final state f32[B, heads, head_dim, state])."""
    nb, length, h, p = x.shape
    nc = length // chunk

    def chunks(t):
        return t.reshape(nb, nc, chunk, *t.shape[2:])

    xd = chunks(x * dt[..., None])  # [B, nc, chunk, heads, head_dim]
    ad = jnp.moveaxis(chunks(dt * a), -1, 1)  # [B, heads, nc, chunk]
    b, c = chunks(b), chunks(c)  # [B, nc, chunk, heads, state]
    a_cum = jnp.cumsum(ad, axis=-1)  # [B, heads, nc, chunk]
    # 1. within each chunk: an attention-like, causally decayed C·B score per pair of positions
    decay = jnp.exp(segsum(ad))  # [B, heads, nc, l, s]
    scores = jnp.einsum("bclhn,bcshn->bhcls", c, b) * decay
    y_diag = jnp.einsum("bhcls,bcshp->bclhp", scores, xd)
    # 2. each chunk's own contribution to the state at its end
    to_end = jnp.exp(a_cum[..., -1:] - a_cum)  # [B, heads, nc, chunk]
    states = jnp.einsum("bclhn,bhcl,bclhp->bchpn", b, to_end, xd)  # [B, nc, heads, head_dim, state]
    # 3. the recurrence between chunks: each chunk's start state, and the final one
    states = jnp.concatenate([init[:, None], states], axis=1)  # [B, nc + 1, ...]
    across = jnp.exp(segsum(jnp.pad(a_cum[..., -1], ((0, 0), (0, 0), (1, 0)))))  # [B, heads, nc + 1, nc + 1]
    states = jnp.einsum("bhzc,bchpn->bzhpn", across, states)
    starts, final = states[:, :-1], states[:, -1]
    # 4. each position's read of its chunk's start state
    y_off = jnp.einsum("bclhn,bchpn,bhcl->bclhp", c, starts, jnp.exp(a_cum))
    return (y_diag + y_off).reshape(nb, length, h, p), final


def ssd_step(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
             state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence per sequence, f32, without the D skip: x [B, heads, head_dim], dt [B, heads],
    b, c [B, heads, state], state [B, heads, head_dim, state] → (y [B, heads, head_dim], new state)."""
    decay = jnp.exp(dt * a)[..., None, None]  # [B, heads, 1, 1]
    state = state * decay + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    return jnp.einsum("bhpn,bhn->bhp", state, c), state


def causal_conv(xbc: jax.Array, conv_state: jax.Array, weight: jax.Array, bias: jax.Array | None,
                counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution of each sequence's new inputs after its saved ones.

    xbc [B, Q, conv_dim] (zero past each sequence's counts i32[B] tokens); conv_state [B, kernel − 1, conv_dim];
    weight [conv_dim, 1, kernel] (torch's Conv1d layout) → (f32[B, Q, conv_dim] before the activation, the new
    conv state: the last kernel − 1 inputs up to each sequence's last token)."""
    kernel, q = weight.shape[-1], xbc.shape[1]
    full = jnp.concatenate([conv_state.astype(jnp.float32), xbc.astype(jnp.float32)], axis=1)  # [B, kernel-1+Q, conv]
    w = weight[:, 0, :].astype(jnp.float32)  # [conv_dim, kernel]
    out = sum(full[:, k:k + q] * w[:, k] for k in range(kernel))  # the kernel's taps, not the tokens
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    keep = counts[:, None] + jnp.arange(kernel - 1)[None, :]  # i32[B, kernel - 1]
    return out, jnp.take_along_axis(full, keep[:, :, None], axis=1)


def gated_rms_norm(y: jax.Array, gate: jax.Array, weight: jax.Array, groups: int, eps: float) -> jax.Array:
    """rmsnorm(y · silu(gate)) over each of `groups` equal slices of the last axis, in f32, × weight
    (transformers' `*RMSNormGated` with norm_before_gate False). y, gate [..., inner] → [..., inner] f32."""
    h = y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    g = h.reshape(*h.shape[:-1], groups, -1)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * g.reshape(h.shape)


def to_grid(values: jax.Array, md: BatchMetadata, counts: jax.Array, q: int) -> jax.Array:
    """Flat [T, ...] → [B, Q, ...]: sequence b's tokens from md.query_start[b], zero past its counts[b]."""
    idx = md.query_start[:, None] + jnp.arange(q)[None, :]  # i32[B, Q]
    grid = values[jnp.clip(idx, 0, values.shape[0] - 1)]
    mask = jnp.arange(q)[None, :] < counts[:, None]
    return jnp.where(mask.reshape(mask.shape + (1,) * (grid.ndim - 2)), grid, 0)


def from_grid(grid: jax.Array, md: BatchMetadata) -> jax.Array:
    """[B, Q, ...] → flat [T, ...]: token t is its sequence's row at t − query_start (padding tokens: zero)."""
    q = jnp.clip(jnp.arange(md.num_tokens) - md.query_start[md.seq_ids], 0, grid.shape[1] - 1)
    flat = grid[md.seq_ids, q]
    return jnp.where(md.valid.reshape((-1,) + (1,) * (flat.ndim - 1)), flat, 0)


class Mamba2Mixer(nn.Module):
    """(x [T, D], the step's metadata as this layer's group sees it, its slot's page tensor, the state at the start
    of its state block's page) → (out [T, D], pages)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, md: BatchMetadata, pages: KVPages | LatentPages):
        if not isinstance(pages, (KVPages, LatentPages)):
            raise TypeError(f"a Mamba2 mixer needs its slot's paged tensor, got {type(pages).__name__}")
        c, m = self.config, self.config.mamba
        inner, heads, hd, n, g = m.intermediate_size, m.num_heads, m.head_dim, m.state_size, m.n_groups
        dtype = jnp.dtype(c.dtype)
        proj = dense(c, inner + m.conv_dim + heads, m.proj_bias, "in_proj")(x)  # [T, inner + conv_dim + heads]
        z, xbc, dt = jnp.split(proj, [inner, inner + m.conv_dim], axis=-1)
        conv_w = self.param("conv1d", nn.initializers.lecun_normal(), (m.conv_dim, 1, m.conv_kernel), dtype)
        conv_b = self.param("conv1d_bias", nn.initializers.zeros, (m.conv_dim,), dtype) if m.conv_bias else None
        dt_bias = self.param("dt_bias", nn.initializers.ones, (heads,), dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (heads,), dtype)
        skip = self.param("D", nn.initializers.ones, (heads,), dtype)
        norm_w = self.param("norm", nn.initializers.ones, (inner,), dtype)

        block, counts, fresh = state_rows(md)
        spec = m.state_spec(c.dtype)  # the state's shapes and dtypes, as the cache's pages were sized for
        conv_state, ssm_state = read_state(pages, spec, block, fresh)
        q = 1 if md.decode else md.max_query_len
        grid = (lambda v: v[:, None]) if md.decode else (lambda v: to_grid(v, md, counts, q))  # decode: token b is row b
        xbc_g, dt_g = grid(xbc), grid(dt).astype(jnp.float32)  # [B, Q, conv_dim], [B, Q, heads]
        conv_out, conv_state = causal_conv(xbc_g, conv_state, conv_w, conv_b, counts)
        xbc_g = jax.nn.silu(conv_out).astype(dtype)  # the conv's output in the model dtype, as transformers
        xs, bs, cs = jnp.split(xbc_g.astype(jnp.float32), [inner, inner + g * n], axis=-1)
        nb = xs.shape[0]
        xs = xs.reshape(nb, q, heads, hd)
        bs = jnp.repeat(bs.reshape(nb, q, g, n), heads // g, axis=2)  # [B, Q, heads, state]: head h reads group h // (heads/g)
        cs = jnp.repeat(cs.reshape(nb, q, g, n), heads // g, axis=2)
        lo, hi = m.time_step_limit
        dt_g = jnp.clip(jax.nn.softplus(dt_g + dt_bias.astype(jnp.float32)), lo, hi)
        dt_g = jnp.where(jnp.arange(q)[None, :, None] < counts[:, None, None], dt_g, 0.0)  # padding: state untouched
        a = -jnp.exp(a_log.astype(jnp.float32))
        if md.decode:
            y, ssm_state = ssd_step(xs[:, 0], dt_g[:, 0], a, bs[:, 0], cs[:, 0], ssm_state)
            y = y[:, None]
        else:
            chunk = min(m.chunk_size, q)
            pad = -q % chunk
            padded = [jnp.pad(t, ((0, 0), (0, pad)) + ((0, 0),) * (t.ndim - 2)) for t in (xs, dt_g, bs, cs)]
            y, ssm_state = ssd_scan(*padded[:2], a, *padded[2:], ssm_state, chunk)
            y = y[:, :q]
        y = (y + skip.astype(jnp.float32)[:, None] * xs).reshape(nb, q, inner)  # the D skip
        pages = write_state(pages, spec, block, conv_state, ssm_state)
        y = y[:, 0] if md.decode else from_grid(y, md)  # [T, inner]
        y = gated_rms_norm(y, z, norm_w, g, c.rms_norm_eps)
        return dense(c, c.hidden_size, m.proj_bias, "out_proj")(y.astype(dtype)), pages
