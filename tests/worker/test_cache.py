"""The paged cache pytree and step metadata: exact bytes, slot-mapped writes, block-table reads."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.metadata import MetadataError, build_metadata, decode_metadata
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.worker.paged_cache import (CacheError, ContiguousCache, ContiguousKV, ContiguousLatent, KVPages, LatentPages,
                                      PagedCache, gather_pages, write_kv, write_step)


# --------------------------------------------------------------------------------------------
# Bytes: hand-computed, and equal to the spec's num_blocks × bytes_per_block.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, num_blocks, block_size, expected", [
    # MHA fp32: 2 layers × (K + V) × 4 slots × 4 heads × 16 dims × 4 B = 4096 per block.
    (KVSpec("mha", 2, 4, 4, 16, kv_dtype="fp32"), 10, 4, 10 * 4096),
    # GQA bf16: 3 layers × 2 × 16 slots × 2 kv heads × 8 dims × 2 B = 3072 per block.
    (KVSpec("gqa", 3, 8, 2, 8, kv_dtype="bf16"), 5, 16, 5 * 3072),
    # MLA bf16: 2 layers × 1 latent × 4 slots × (16 + 8) dims × 2 B = 384 per block.
    (KVSpec.mla(2, 4, kv_lora_rank=16, qk_rope_head_dim=8, kv_dtype="bf16"), 6, 4, 6 * 384),
    # Skip layer 1 keeps fp32 while layer 0 is fp16: (2×4×2×8×2) + (2×4×2×8×4) = 768 per block.
    (KVSpec("gqa", 2, 4, 2, 8, kv_dtype="fp16", skip_layers=(1,), model_dtype="fp32"), 3, 4, 3 * 768),
])
def test_cache_bytes_equal_spec(spec, num_blocks, block_size, expected):
    cache = PagedCache.create(spec, num_blocks, block_size)
    assert cache.kv_nbytes == expected == num_blocks * spec.bytes_per_block(block_size)
    assert cache.scale_nbytes == 0 and cache.nbytes == expected + 4 * spec.num_layers  # + i32 counters
    assert cache.num_blocks == num_blocks and cache.block_size == block_size
    for i, pages in enumerate(cache.layers):
        page_arrays = [pages.latent] if isinstance(pages, LatentPages) else [pages.k, pages.v]
        for page in page_arrays:
            assert page.dtype == jnp.dtype(spec.layer_dtype(i).storage) == spec.layer_dtype(i).dtype


def test_cache_layouts():
    gqa = PagedCache.create(KVSpec("gqa", 2, 8, 2, 16), 7, 4)
    assert isinstance(gqa.layers[0], KVPages) and gqa.layers[0].k.shape == (7, 4, 2, 16)
    mla = PagedCache.create(KVSpec.mla(3, 4, kv_lora_rank=32, qk_rope_head_dim=8), 7, 4)
    assert isinstance(mla.layers[2], LatentPages) and mla.layers[2].latent.shape == (7, 4, 40)


def test_cache_refuses_bad_sizes():
    spec = KVSpec("gqa", 2, 8, 2, 16)
    with pytest.raises(CacheError, match="num_blocks 1 leaves no usable block"):
        PagedCache.create(spec, 1, 4)
    with pytest.raises(CacheError, match="block_size must be a positive integer, got 0"):
        PagedCache.create(spec, 4, 0)
    with pytest.raises(CacheError, match="'nvfp4' needs a head dim that is a multiple of 16, got 24"):
        PagedCache.create(KVSpec("gqa", 2, 8, 2, 24, kv_dtype="nvfp4"), 4, 4)
    with pytest.raises(CacheError, match="nvfp4_ds_mla"):
        PagedCache.create(KVSpec.mla(1, 2, kv_lora_rank=32, qk_rope_head_dim=16, kv_dtype="nvfp4"), 4, 4)


# --------------------------------------------------------------------------------------------
# Writes and reads
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, donate_argnums=0)
def _write(pages, k, v, slots):
    return write_kv(pages, k, v, slots)


def test_write_scatters_to_slots_and_padding_to_null_block():
    pages = KVPages(jnp.zeros((5, 4, 2, 3)), jnp.zeros((5, 4, 2, 3)))
    table = [3, 1]
    slots = [table[p // 4] * 4 + p % 4 for p in range(5)] + [0]  # 5 tokens, then one padding token
    assert slots == [12, 13, 14, 15, 4, 0]
    k = jnp.arange(6 * 2 * 3, dtype=jnp.float32).reshape(6, 2, 3) + 1
    old = pages.k
    new = _write(pages, k, -k, jnp.asarray(slots, jnp.int32))
    assert old.is_deleted(), "the jitted write should donate the pages"
    want = np.zeros((5, 4, 2, 3), np.float32)
    want[3] = k[0:4]
    want[1, 0] = k[4]
    want[0, 0] = k[5]  # the padding token lands in the null block
    np.testing.assert_array_equal(new.k, want)
    np.testing.assert_array_equal(new.v, -want)
    gathered = gather_pages(new.k, jnp.asarray([[3, 1, 0]]))  # [1, 12, 2, 3]
    np.testing.assert_array_equal(gathered[0, :5], k[:5])


def test_write_step_takes_either_cache_from_the_step_metadata():
    """Paged layers write through the slot mapping, contiguous rows at (row, position); padding
    tokens land in the null block of a paged layer and nowhere in a contiguous one."""
    md = build_metadata([0, 2], [3, 1], [[3, 1], [4, 2]], block_size=2, max_tokens=6, max_seqs=2,
                        max_blocks_per_seq=2)
    latent = jnp.arange(6 * 6, dtype=jnp.float32).reshape(6, 6) + 1  # tokens 4, 5 are padding
    paged = write_step(LatentPages(jnp.zeros((5, 2, 6))), md, latent)
    np.testing.assert_array_equal(gather_pages(paged.latent, jnp.asarray([[3, 1]]))[0, :3], latent[:3])
    np.testing.assert_array_equal(paged.latent[2, 0], latent[3])  # sequence 1's position 2: block 2, offset 0
    rows = write_step(ContiguousLatent(jnp.zeros((2, 4, 6))), md, latent)
    np.testing.assert_array_equal(rows.latent[0, :3], latent[:3])
    np.testing.assert_array_equal(rows.latent[1, 2], latent[3])
    assert int((np.asarray(rows.latent) != 0).sum()) == 4 * 6, "padding tokens wrote into a row"
    kv = write_step(ContiguousKV(jnp.zeros((2, 4, 1, 6)), jnp.zeros((2, 4, 1, 6))), md, latent[:, None], -latent[:, None])
    np.testing.assert_array_equal(kv.v[1, 2, 0], -latent[3])
    with pytest.raises(CacheError, match="unquantized KV only; layer 0 is fp8_e4m3"):
        ContiguousCache.create(KVSpec("gqa", 1, 4, 2, 3, kv_dtype="fp8"), 2, 8)


# --------------------------------------------------------------------------------------------
# Step metadata
# --------------------------------------------------------------------------------------------
def test_build_metadata_lays_out_a_ragged_batch():
    # seq 0: 6 cached, 1 new (decode); seq 1: 0 cached, 3 new (prefill); padded to T=6, B=3.
    md = build_metadata([6, 0], [1, 3], [[4, 2], [7]], block_size=4, max_tokens=6, max_seqs=3,
                        max_blocks_per_seq=3)
    np.testing.assert_array_equal(md.positions, [6, 0, 1, 2, 0, 0])
    np.testing.assert_array_equal(md.slot_mapping, [2 * 4 + 2, 28, 29, 30, 0, 0])
    np.testing.assert_array_equal(md.seq_ids, [0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(md.valid, [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(md.block_tables, [[4, 2, 0], [7, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(md.context_lens, [7, 3, 0])
    np.testing.assert_array_equal(md.logits_indices, [0, 3, 0])
    assert not md.decode


@pytest.mark.parametrize("args, message", [
    (([0], [9], [[1, 2, 3]]), "9 scheduled tokens exceed max_tokens 8"),
    (([0], [5], [[1]]), "5 tokens need 2 blocks of 4, its block table has 1"),
    (([0], [5], [[1, 0]]), "uses the null block 0"),
    (([30], [1], [[1] * 8]), "31 tokens need 8 blocks of 4, more than max_blocks_per_seq 4"),
    (([0, 0, 0], [1, 1, 1], [[1], [2], [3]]), "3 sequences exceed max_seqs 2"),
])
def test_build_metadata_errors(args, message):
    with pytest.raises(MetadataError, match=message):
        build_metadata(*args, block_size=4, max_tokens=8, max_seqs=2, max_blocks_per_seq=4)


def test_decode_metadata_matches_host_builder():
    tables = [[3, 5, 0], [2, 0, 0], [6, 1, 4]]
    done = [5, 3, 8]
    host = build_metadata(done, [1, 1, 1], tables, block_size=4, max_tokens=4, max_seqs=4, max_blocks_per_seq=3,
                          decode=True)
    device = jax.jit(decode_metadata, static_argnums=3)(
        jnp.asarray(tables + [[0, 0, 0]], jnp.int32), jnp.asarray(done + [0], jnp.int32),
        jnp.asarray([True, True, True, False]), 4)
    assert device.decode and host.decode
    for field in ("positions", "slot_mapping", "seq_ids", "valid", "block_tables", "context_lens"):
        np.testing.assert_array_equal(getattr(device, field)[:3], getattr(host, field)[:3], err_msg=field)
    assert int(device.context_lens[3]) == 0 and int(device.slot_mapping[3]) == 0 and not device.valid[3]
    with pytest.raises(MetadataError, match="one new token per sequence"):
        build_metadata([0], [2], [[1]], block_size=4, max_tokens=2, max_seqs=2, max_blocks_per_seq=1, decode=True)
