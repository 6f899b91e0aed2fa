"""Decode context parallelism for MLA (kvjax.attention.dcp, kvjax.worker.dcp_pages) on a CPU mesh, against the
plain paged MLA reference on the same tokens written to unsplit pages, elementwise (f32, 1e-5):

a ragged prefill of sequences of 1, 6 and 11 tokens (none a multiple of D; the 1-token one leaves every rank but
rank 0 without a key, so its partial log-sum-exp is −inf) in randomly permuted blocks, then a decode step, at
D = 2 (TP 2 and TP 4) and D = 4 (TP 4). Unwritten slots hold NaN, which must never reach an output. A wrong
log-sum-exp merge (e.g. the partial outputs averaged) fails here: the ranks' partials are normalized over
different keys.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import build_metadata, decode_metadata, mla_paged_attention
from kvjax.attention.reference import mla_paged_attention_reference, mla_paged_decode_reference
from kvjax.worker import sharding as shd
from kvjax.worker.paged_cache import LatentPages, write_latent

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (jax_num_cpu_devices in tests/conftest.py)")

ZV, NUM_BLOCKS, RANK, ROPE, HEADS = 4, 12, 16, 8, 4  # scheduler block of ZV tokens, kv_lora_rank, rope, query heads
LENS = [1, 6, 11]
SCALE = 0.3


def _pages(mesh=None):
    latent = jnp.full((NUM_BLOCKS, ZV, RANK + ROPE), jnp.nan, jnp.float32)  # [P, Zv, C]
    if mesh is None:
        return LatentPages(latent=latent)
    return LatentPages(latent=jax.device_put(latent, NamedSharding(mesh, P(None, shd.DCP_AXIS))), dcp_mesh=mesh)


@pytest.mark.parametrize("tp,dcp", [(2, 2), (4, 2), (4, 4)])
def test_split_attention_is_the_whole_sequences_attention(tp, dcp):
    mesh = shd.make_mesh(tp, dcp=dcp)
    rng = np.random.default_rng(tp * 10 + dcp)
    blocks = rng.permutation(np.arange(1, NUM_BLOCKS))  # block 0 is the null block
    tables = np.zeros((len(LENS), 4), np.int32)
    tables[:, :3] = blocks[:9].reshape(len(LENS), 3)
    md = build_metadata([0] * len(LENS), LENS, tables, block_size=ZV, max_tokens=sum(LENS), max_seqs=len(LENS),
                        max_blocks_per_seq=tables.shape[1])
    heads = NamedSharding(mesh, P(None, shd.tp_axes(mesh), None))
    whole = NamedSharding(mesh, P())

    @jax.jit
    def split_step(split, latent, q_latent, q_rope, md):  # the engine's path: write, then attend over the split
        split = write_latent(split, latent, md.slot_mapping)
        return split, mla_paged_attention(q_latent, q_rope, split, md, scale=SCALE)

    def step(pages, split, latent, q_latent, q_rope, md, reference):
        pages = write_latent(pages, latent, md.slot_mapping)
        split, got = split_step(split, latent, jax.device_put(q_latent, heads), jax.device_put(q_rope, heads),
                                jax.device_put(md, whole))
        return pages, split, np.asarray(jax.jit(reference)(pages)), np.asarray(got)

    t = sum(LENS)
    q_latent, q_rope = rng.standard_normal((t, HEADS, RANK), np.float32), rng.standard_normal((t, HEADS, ROPE), np.float32)
    latent = jnp.asarray(rng.standard_normal((t, RANK + ROPE), np.float32))
    pages, split, want, got = step(_pages(), _pages(mesh), latent, q_latent, q_rope, md, lambda pages: (
        mla_paged_attention_reference(q_latent, q_rope, pages.latent, md, scale=SCALE)))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    dmd = decode_metadata(jnp.asarray(tables), jnp.asarray(LENS, jnp.int32), jnp.ones(len(LENS), bool), ZV)
    b = len(LENS)
    q_latent, q_rope = rng.standard_normal((b, HEADS, RANK), np.float32), rng.standard_normal((b, HEADS, ROPE), np.float32)
    latent = jnp.asarray(rng.standard_normal((b, RANK + ROPE), np.float32))
    _, _, want, got = step(pages, split, latent, q_latent, q_rope, dmd, lambda pages: mla_paged_decode_reference(
        q_latent, q_rope, pages.latent, dmd.block_tables, dmd.context_lens, scale=SCALE))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
