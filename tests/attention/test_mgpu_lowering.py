"""The Mosaic GPU kernels lower for CUDA (sm_90), checked on a machine without a GPU.

`Traced.lower(lowering_platforms=("cuda",))` runs the whole Pallas → Mosaic GPU lowering in
Python — TMA descriptors, SMEM tiling and swizzles, barriers, wgmma operand rules, register
layouts — and puts the kernel into a `mosaic_gpu_v2` custom call; what remains for the GPU is
ptxas and the launch. So a tile shape or dtype the hardware path refuses fails here, as the
swizzle of P·V's operands did for 32-lane heads (found on the H200, now a case below). Both of
Mosaic GPU's lowering semantics are lowered: JAX 0.10's default (Lane) and 0.11's (Warpgroup),
whichever this JAX is (kvjax.attention.mgpu_interpret, KVJAX_MGPU_SEMANTICS).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kvjax.attention.mgpu_decode import paged_decode
from kvjax.attention.tiles import MosaicDecodeTiles

S = jax.ShapeDtypeStruct
PAGES = {"bf16": jnp.bfloat16, "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
SEMANTICS = ["lane", "warpgroup"]


def use_semantics(monkeypatch, semantics: str) -> None:
    """Lower with these semantics. They are read while a kernel is traced, and the kernels' jitted
    functions keep their traces: without clearing them, the second semantics would reuse the first's."""
    monkeypatch.setenv("KVJAX_MGPU_SEMANTICS", semantics)
    jax.clear_caches()


def mosaic_kernels(fn, *args) -> list[str]:
    """The Mosaic GPU custom calls of fn lowered for CUDA."""
    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in module.splitlines() if "@mosaic_gpu" in line]


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("kv, head_dim, block_size, ppb, splits, stages, window, softcap", [
    ("bf16", 128, 16, 8, 1, 2, None, None),
    ("e4m3", 128, 16, 8, 4, 2, 33, 30.0),
    ("e5m2", 64, 64, 1, 2, 3, None, None),
    ("bf16", 32, 8, 8, 2, 2, 9, 50.0),  # 32 lanes: P's swizzle follows V's (64 bytes)
    ("bf16", 256, 16, 4, 2, 2, None, None),  # the output staged in two column halves
])
def test_gqa_decode_lowers_for_cuda(monkeypatch, semantics, kv, head_dim, block_size, ppb, splits, stages, window,
                                    softcap):
    use_semantics(monkeypatch, semantics)
    batch, kv_heads, group, pages, max_blocks = 3, 2, 4, 40, 12
    page = S((pages, block_size, kv_heads, head_dim), PAGES[kv])

    def fn(q, k, v, tables, lens):
        return paged_decode(q, k, v, tables, lens, scale=head_dim ** -0.5, window=window, softcap=softcap,
                            k_scale=None if kv == "bf16" else 0.01, v_scale=None if kv == "bf16" else 0.02,
                            tiles=MosaicDecodeTiles(ppb, splits, stages), interpret=False)

    calls = mosaic_kernels(fn, S((batch, kv_heads * group, head_dim), jnp.bfloat16), page, page,
                           S((batch, max_blocks), jnp.int32), S((batch,), jnp.int32))
    assert len(calls) == 1


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("kv, heads, block_size, splits", [("bf16", 128, 64, 1), ("e4m3", 16, 16, 4),
                                                          ("e5m2", 70, 32, 2)])
def test_mla_decode_lowers_for_cuda(monkeypatch, semantics, kv, heads, block_size, splits):
    """DeepSeek's 512 + 64 latent: three warpgroups, two latent stages, fp8 widened in SMEM — what
    fits a block's 227 KiB (Mosaic GPU refuses a kernel over it when lowering)."""
    from kvjax.attention.mgpu_mla import mla_paged_decode

    use_semantics(monkeypatch, semantics)
    batch, rank, rope, pages, max_blocks = 2, 512, 64, 40, 12

    def fn(q_latent, q_rope, latent, tables, lens):
        return mla_paged_decode(q_latent, q_rope, latent, tables, lens, scale=0.07,
                                latent_scale=None if kv == "bf16" else 0.01,
                                tiles=MosaicDecodeTiles(64 // block_size, splits, 2), interpret=False)

    calls = mosaic_kernels(fn, S((batch, heads, rank), jnp.bfloat16), S((batch, heads, rope), jnp.bfloat16),
                           S((pages, block_size, rank + rope), PAGES[kv]), S((batch, max_blocks), jnp.int32),
                           S((batch,), jnp.int32))
    assert len(calls) == 1


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("kv, group, head_dim, block_size, ppb, window, softcap", [
    ("bf16", 4, 128, 16, 4, None, None), ("e4m3", 8, 128, 64, 1, 4096, 30.0), ("bf16", 1, 64, 8, 16, 9, None),
    ("e5m2", 7, 64, 16, 8, None, 50.0)])
def test_ragged_prefill_lowers_for_cuda(monkeypatch, semantics, kv, group, head_dim, block_size, ppb, window, softcap):
    """The ragged kernel's two warpgroups (TMA producer, wgmma consumer) at each page format it reads."""
    from kvjax.attention.mgpu_ragged import ragged_paged_attention
    from kvjax.attention.tiles import MosaicRaggedTiles
    from test_gpu_lowering import ragged_metadata

    use_semantics(monkeypatch, semantics)
    tokens, seqs, kv_heads, pages, max_blocks = 256, 4, 2, 40, 32
    page = S((pages, block_size, kv_heads, head_dim), PAGES[kv])
    scale = None if kv == "bf16" else S((kv_heads,), jnp.float32)
    fmt = {"bf16": None, "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}[kv]

    def fn(q, k, v, md, k_scale, v_scale, sinks):
        return ragged_paged_attention(q, k, v, md, scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale,
                                      window=window, sinks=sinks, softcap=softcap, kv_dtype=fmt,
                                      tiles=MosaicRaggedTiles(ppb), interpret=False)

    calls = mosaic_kernels(fn, S((tokens, kv_heads * group, head_dim), jnp.bfloat16), page, page,
                           ragged_metadata(tokens, seqs, max_blocks, 128), scale, scale,
                           S((kv_heads * group,), jnp.float32))
    assert len(calls) == 1


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("head_dim, kv_heads, block_size, ppb, splits, stages, window, softcap", [
    (128, 2, 16, 4, 2, 2, 33, 30.0), (64, 4, 8, 16, 1, 3, None, None), (128, 8, 64, 1, 4, 2, None, None)])
def test_nvfp4_decode_lowers_for_cuda(monkeypatch, semantics, head_dim, kv_heads, block_size, ppb, splits, stages,
                                      window, softcap):
    """nvfp4 pages (kvjax.attention.mgpu_nvfp4): two boxes per page and head from the [P, Z, K·W] view, the
    nibbles decoded through padded SMEM, the block scales broadcast by a wgmma. The kernel pins Lane
    semantics, so it lowers the same under either setting."""
    use_semantics(monkeypatch, semantics)
    batch, group, pages, max_blocks = 3, 4, 40, 12
    page = S((pages, block_size, kv_heads, head_dim // 2 + head_dim // 16), jnp.uint8)

    def fn(q, k, v, tables, lens):
        return paged_decode(q, k, v, tables, lens, scale=head_dim ** -0.5, k_scale=0.5, v_scale=2.0, window=window,
                            softcap=softcap, kv_dtype="nvfp4", tiles=MosaicDecodeTiles(ppb, splits, stages),
                            interpret=False)

    calls = mosaic_kernels(fn, S((batch, kv_heads * group, head_dim), jnp.bfloat16), page, page,
                           S((batch, max_blocks), jnp.int32), S((batch,), jnp.int32))
    assert len(calls) == 1


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("fmt, head_dim, kv_heads, block_size, ppb, splits, stages, window, softcap", [
    ("int8_per_token_head", 128, 8, 16, 8, 1, 2, None, None), ("fp8_per_token_head", 64, 8, 64, 1, 4, 3, 33, 30.0),
    ("int8_per_token_head", 128, 16, 16, 4, 2, 2, None, 50.0)])
def test_per_token_decode_lowers_for_cuda(monkeypatch, semantics, fmt, head_dim, kv_heads, block_size, ppb, splits,
                                          stages, window, softcap):
    """Per-token-head pages: [Z, K] scale boxes beside each page, each slot scaled row by row while widening."""
    use_semantics(monkeypatch, semantics)
    batch, group, pages, max_blocks = 3, 2, 40, 12
    dtype = jnp.int8 if fmt.startswith("int8") else jnp.float8_e4m3fn
    page, scales = S((pages, block_size, kv_heads, head_dim), dtype), S((pages, block_size, kv_heads), jnp.float32)

    def fn(q, k, v, tables, lens, k_scale, v_scale):
        return paged_decode(q, k, v, tables, lens, scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale,
                            window=window, softcap=softcap, kv_dtype=fmt, tiles=MosaicDecodeTiles(ppb, splits, stages),
                            interpret=False)

    calls = mosaic_kernels(fn, S((batch, kv_heads * group, head_dim), jnp.bfloat16), page, page,
                           S((batch, max_blocks), jnp.int32), S((batch,), jnp.int32), scales, scales)
    assert len(calls) == 1


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("fmt, group, head_dim, kv_heads, block_size, ppb, stages, window, softcap", [
    ("int8_per_token_head", 4, 128, 8, 16, 4, 2, None, None), ("fp8_per_token_head", 1, 64, 16, 64, 1, 3, 4096, 30.0),
    ("nvfp4", 4, 128, 2, 16, 4, 2, None, 50.0), ("nvfp4", 7, 64, 4, 8, 16, 2, 9, None)])
def test_quantized_ragged_prefill_lowers_for_cuda(monkeypatch, semantics, fmt, group, head_dim, kv_heads, block_size,
                                                  ppb, stages, window, softcap):
    """The ragged kernel on per-token-head pages ([Z, K] scale boxes beside each page, each slot scaled
    row by row while widening) and nvfp4 pages (kvjax.attention.mgpu_ragged_nvfp4: two boxes per page
    and head, unpacked by the consumer warpgroup; it pins Lane semantics)."""
    from kvjax.attention.mgpu_ragged import ragged_paged_attention
    from kvjax.attention.tiles import MosaicRaggedTiles
    from test_gpu_lowering import ragged_metadata

    use_semantics(monkeypatch, semantics)
    tokens, seqs, pages, max_blocks = 256, 4, 40, 32
    if fmt == "nvfp4":
        page = S((pages, block_size, kv_heads, head_dim // 2 + head_dim // 16), jnp.uint8)
        scale = S((kv_heads,), jnp.float32)
    else:
        page = S((pages, block_size, kv_heads, head_dim), jnp.int8 if fmt.startswith("int8") else jnp.float8_e4m3fn)
        scale = S((pages, block_size, kv_heads), jnp.float32)

    def fn(q, k, v, md, k_scale, v_scale, sinks):
        return ragged_paged_attention(q, k, v, md, scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale,
                                      window=window, sinks=sinks, softcap=softcap, kv_dtype=fmt,
                                      tiles=MosaicRaggedTiles(ppb, stages), interpret=False)

    calls = mosaic_kernels(fn, S((tokens, kv_heads * group, head_dim), jnp.bfloat16), page, page,
                           ragged_metadata(tokens, seqs, max_blocks, 128), scale, scale,
                           S((kv_heads * group,), jnp.float32))
    assert len(calls) == 1
