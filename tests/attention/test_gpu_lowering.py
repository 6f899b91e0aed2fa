"""The Pallas kernels lower for CUDA, checked on a machine without a GPU.

JAX can lower a jitted function for another platform than the one it runs on
(`Traced.lower(lowering_platforms=("cuda",))`). For a Pallas kernel that runs the whole Pallas
→ Triton lowering (the kernel becomes Triton IR inside an `__gpu$xla.gpu.triton` custom call),
which is where an operation, a block shape or a dtype Triton doesn't take is refused. The
interpret-mode tests (test_pallas_decode.py) check what the kernels compute; this checks that
the same code is accepted by the GPU backend, over the shapes of the issue's sweep. What it
can't see: Triton's own compilation to PTX and the launch, which happen in XLA on a GPU
(experiments/gpu_check.sh).
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from kvjax.attention.metadata import BatchMetadata, build_metadata, decode_metadata
from kvjax.attention.pallas_decode import paged_decode
from kvjax.attention.pallas_mla import mla_paged_decode
from kvjax.attention.pallas_ragged import mla_ragged_paged_attention, ragged_paged_attention
from kvjax.attention.tiles import default_mla_tiles, default_tiles
from kvjax.models import build_model, init_params, preset
from kvjax.worker.paged_cache import PagedCache

S = jax.ShapeDtypeStruct
FP8 = {"bf16": jnp.bfloat16, "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2, "nvfp4": jnp.uint8, "int8": jnp.int8,
       "fp8-token": jnp.float8_e4m3fn}
DECODE_FORMATS = {"nvfp4": "nvfp4", "int8": "int8_per_token_head", "fp8-token": "fp8_per_token_head"}  # else None


def lower_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_kernels(module: str) -> list[str]:
    """Names of the Triton kernels a lowered module launches."""
    calls = [line for line in module.splitlines() if "__gpu$xla.gpu.triton" in line]
    return [re.search(r'name = "([^"]+)"', line).group(1) for line in calls]


@pytest.mark.parametrize("kv", ["bf16", "e4m3", "e5m2", "nvfp4", "int8", "fp8-token"])
@pytest.mark.parametrize("group,head_dim,block_size,splits", [
    (1, 64, 16, 1), (2, 128, 4, 4), (4, 128, 64, 1), (7, 64, 16, 4), (16, 128, 16, 1), (4, 128, 64, 4)])
def test_gqa_kernel_lowers_for_cuda(kv, group, head_dim, block_size, splits):
    batch, kv_heads, blocks, max_blocks = 3, 2, 40, 8
    tiles = dataclasses.replace(default_tiles(batch=batch, num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                                              block_size=block_size, max_blocks=max_blocks), num_splits=splits)
    width = head_dim // 2 + head_dim // 16 if kv == "nvfp4" else head_dim  # nvfp4: values, then block scales
    page = S((blocks, block_size, kv_heads, width), FP8[kv])
    per_token = kv in ("int8", "fp8-token")  # a scale per token and kv head
    scale = None if kv == "bf16" else S((blocks, block_size, kv_heads) if per_token else (kv_heads,), jnp.float32)

    def fn(q, k, v, tables, lens, k_scale, v_scale):
        return paged_decode(q, k, v, tables, lens, scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale,
                            tiles=tiles, interpret=False, kv_dtype=DECODE_FORMATS.get(kv))

    module = lower_for_cuda(fn, S((batch, kv_heads * group, head_dim), jnp.bfloat16), page, page,
                            S((batch, max_blocks), jnp.int32), S((batch,), jnp.int32), scale, scale)
    assert triton_kernels(module) == [f"kvjax_paged_decode_h{tiles.block_h}_p{tiles.pages_per_block}_s{splits}"]


@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
@pytest.mark.parametrize("window,softcap,splits", [(1, None, 1), (17, 30.0, 4), (200, 50.0, 2), (None, 20.0, 3)])
def test_windowed_gqa_kernel_lowers_for_cuda(kv, window, softcap, splits):
    """Sliding windows (a start page read from the context length), tanh soft-capping and sinks
    (merged outside the kernel) are accepted by the Triton lowering too."""
    batch, kv_heads, group, head_dim, block_size, blocks, max_blocks = 3, 2, 4, 128, 16, 40, 12
    tiles = dataclasses.replace(default_tiles(batch=batch, num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                                              block_size=block_size, max_blocks=max_blocks), num_splits=splits)
    page = S((blocks, block_size, kv_heads, head_dim), FP8[kv])
    scale = None if kv == "bf16" else S((kv_heads,), jnp.float32)

    def fn(q, k, v, tables, lens, k_scale, v_scale, sinks):
        return paged_decode(q, k, v, tables, lens, scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale,
                            window=window, sinks=sinks, softcap=softcap, tiles=tiles, interpret=False)

    module = lower_for_cuda(fn, S((batch, kv_heads * group, head_dim), jnp.bfloat16), page, page,
                            S((batch, max_blocks), jnp.int32), S((batch,), jnp.int32), scale, scale,
                            S((kv_heads * group,), jnp.float32))
    variant = ("" if window is None else f"_w{window}") + ("" if softcap is None else "_cap")
    assert triton_kernels(module) == [f"kvjax_paged_decode_h{tiles.block_h}_p{tiles.pages_per_block}_s{splits}"
                                      f"{variant}"]


@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
@pytest.mark.parametrize("block_size,splits", [(16, 1), (64, 4)])
def test_mla_kernel_lowers_for_cuda(kv, block_size, splits):
    batch, heads, rank, rope, blocks, max_blocks = 2, 16, 512, 64, 24, 8
    tiles = dataclasses.replace(default_mla_tiles(batch=batch, num_heads=heads, kv_lora_rank=rank,
                                                  block_size=block_size, max_blocks=max_blocks), num_splits=splits)
    scale = None if kv == "bf16" else S((rank + rope,), jnp.float32)

    def fn(q_latent, q_rope, latent, tables, lens, latent_scale):
        return mla_paged_decode(q_latent, q_rope, latent, tables, lens, scale=0.07, latent_scale=latent_scale,
                                tiles=tiles, interpret=False)

    module = lower_for_cuda(fn, S((batch, heads, rank), jnp.bfloat16), S((batch, heads, rope), jnp.bfloat16),
                            S((blocks, block_size, rank + rope), FP8[kv]), S((batch, max_blocks), jnp.int32),
                            S((batch,), jnp.int32), scale)
    assert triton_kernels(module) == [f"kvjax_mla_paged_decode_h{tiles.block_h}_p{tiles.pages_per_block}_s{splits}"]


@pytest.mark.parametrize("name", ["tiny", "tiny-mla"])
def test_default_model_decode_step_lowers_for_cuda(name, monkeypatch):
    """A whole decode step of a model built without naming an attn_impl, as on a GPU backend
    (where the default is "pallas" and the kernels run compiled): the decode attention of every
    layer is the Triton kernel (one kernel definition: the layers share its shapes)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    config = preset(name).replace(dtype="bfloat16")
    model = build_model(config)
    params = init_params(model, jax.random.key(0))
    batch, block_size, max_blocks = 2, 16, 4
    cache = PagedCache.create(config.kv_spec("fp8_e4m3"), 1 + batch * max_blocks, block_size)

    def step(params, tokens, tables, computed, cache):
        md = decode_metadata(tables, computed, jnp.ones(tokens.shape, bool), block_size)
        return model.apply({"params": params}, tokens, md, cache)

    module = lower_for_cuda(step, params, S((batch,), jnp.int32), S((batch, max_blocks), jnp.int32),
                            S((batch,), jnp.int32), cache)
    kernel = "kvjax_mla_paged_decode" if config.is_mla else "kvjax_paged_decode"
    assert [k.split("_h")[0] for k in triton_kernels(module)] == [kernel]


def ragged_metadata(tokens: int, seqs: int, max_blocks: int, max_query_len: int) -> BatchMetadata:
    i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
    return BatchMetadata(i32(tokens), i32(tokens), i32(tokens), S((tokens,), jnp.bool_), i32(seqs, max_blocks),
                         i32(seqs), i32(seqs), i32(seqs), max_query_len=max_query_len)


RAGGED_FORMATS = {"bf16": (jnp.bfloat16, None), "e4m3": (jnp.float8_e4m3fn, "fp8_e4m3"),
                  "e5m2": (jnp.float8_e5m2, "fp8_e5m2"), "int8": (jnp.int8, "int8_per_token_head"),
                  "fp8-token": (jnp.float8_e4m3fn, "fp8_per_token_head"), "nvfp4": (jnp.uint8, "nvfp4")}


RAGGED_SHAPES = [(1, 64, 16, None, None), (4, 128, 16, 4096, 30.0), (7, 64, 64, None, 50.0), (8, 128, 1, 128, None)]


@pytest.mark.parametrize("kv, shape", [  # the default run: each format once, the shapes in turn
    pytest.param(kv, shape, marks=() if i % len(RAGGED_SHAPES) == j else pytest.mark.slow)
    for i, kv in enumerate(RAGGED_FORMATS) for j, shape in enumerate(RAGGED_SHAPES)])
def test_ragged_kernel_lowers_for_cuda(kv, shape):
    """The ragged prefill kernel on every page format it dequantizes, group sizes that need padding,
    pages of 1 to 64 positions, windows, soft-capping and sinks (merged outside the kernel)."""
    group, head_dim, block_size, window, softcap = shape
    tokens, seqs, kv_heads, blocks, max_blocks = 256, 4, 2, 40, 32
    dtype, fmt = RAGGED_FORMATS[kv]
    width = head_dim // 2 + head_dim // 16 if kv == "nvfp4" else head_dim
    page = S((blocks, block_size, kv_heads, width), dtype)
    scale = None if fmt is None else S((blocks, block_size, kv_heads) if "per_token" in fmt else (kv_heads,),
                                       jnp.float32)

    def fn(q, k, v, md, k_scale, v_scale, sinks):
        return ragged_paged_attention(q, k, v, md, scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale,
                                      window=window, sinks=sinks, softcap=softcap, kv_dtype=fmt, interpret=False)

    module = lower_for_cuda(fn, S((tokens, kv_heads * group, head_dim), jnp.bfloat16), page, page,
                            ragged_metadata(tokens, seqs, max_blocks, 128), scale, scale,
                            S((kv_heads * group,), jnp.float32))
    (kernel,) = triton_kernels(module)
    assert kernel.startswith(f"kvjax_ragged_paged_attention_{'nvfp4' if kv == 'nvfp4' else 'gqa'}_q")


@pytest.mark.parametrize("fmt", [None, pytest.param("fp8_e4m3", marks=pytest.mark.slow), "int8_per_token_head"])
def test_mla_ragged_kernel_lowers_for_cuda(fmt):
    tokens, seqs, heads, rank, rope, block_size, blocks, max_blocks = 128, 3, 16, 512, 64, 16, 24, 8
    dtype = {None: jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn, "int8_per_token_head": jnp.int8}[fmt]
    scale = None if fmt is None else S((blocks, block_size) if "per_token" in fmt else (rank + rope,), jnp.float32)

    def fn(q_latent, q_rope, latent, md, latent_scale):
        return mla_ragged_paged_attention(q_latent, q_rope, latent, md, scale=0.07, latent_scale=latent_scale,
                                          kv_dtype=fmt, interpret=False)

    module = lower_for_cuda(fn, S((tokens, heads, rank), jnp.bfloat16), S((tokens, heads, rope), jnp.bfloat16),
                            S((blocks, block_size, rank + rope), dtype), ragged_metadata(tokens, seqs, max_blocks, 64),
                            scale)
    (kernel,) = triton_kernels(module)
    assert kernel.startswith("kvjax_ragged_paged_attention_mla_q")


@pytest.mark.parametrize("name", ["tiny", pytest.param("tiny-mla", marks=pytest.mark.slow)])
def test_default_model_prefill_step_lowers_for_cuda(name, monkeypatch):
    """A whole prefill step (two prompts) of a model built without naming an attn_impl, as on a GPU
    backend: every layer's attention is the ragged Triton kernel, nothing of the jnp forms."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    config = preset(name).replace(dtype="bfloat16")
    model = build_model(config)
    params = init_params(model, jax.random.key(0))
    block_size = 16
    cache = PagedCache.create(config.kv_spec("fp8_e4m3"), 9, block_size)
    md = build_metadata([0, 0], [40, 23], [[1, 2, 3], [4, 5]], block_size=block_size, max_tokens=64, max_seqs=2,
                        max_blocks_per_seq=4)

    def step(params, tokens, md, cache):
        return model.apply({"params": params}, tokens, md, cache)

    module = lower_for_cuda(step, params, S((64,), jnp.int32), md, cache)
    kind = "mla" if config.is_mla else "gqa"
    assert {k.split("_q")[0] for k in triton_kernels(module)} == {f"kvjax_ragged_paged_attention_{kind}"}
