"""Reference paged attention against plain dense NumPy attention on contiguous K/V.

Pages are filled through permuted block tables with block size 4 and context lengths that do
not fill their last block; every slot no sequence owns (block 0 included) holds NaN, so any
read outside a sequence's own positions shows up as a NaN or a mismatch.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import get_impl, mla_paged_attention, paged_attention
from kvjax.config.attention import default_impl
from kvjax.config.engine import EngineError
from kvjax.attention.metadata import build_metadata
from kvjax.attention.reference import (mla_paged_attention_reference, mla_paged_decode_reference,
                                       paged_attention_reference, paged_decode_reference)
from kvjax.models import build_model, preset
from kvjax.worker.paged_cache import KVPages, LatentPages

Z, P, M = 4, 20, 4  # block size, blocks, max blocks per sequence
DONE = [4, 0, 0, 3]  # tokens cached before the step
NEW = [3, 1, 12, 1]  # tokens this step: a chunk, a 1-token prompt, a prompt, a decode
CTX = [d + n for d, n in zip(DONE, NEW)]  # 7, 1, 12, 4
SCALE = 0.3


def _tables():
    free = list(np.random.RandomState(0).permutation(np.arange(1, P)))
    return [[int(free.pop()) for _ in range(-(-n // Z))] for n in CTX]


def _paged(per_seq, tables, dtype=np.float32):
    """Contiguous per-sequence vectors [ctx, ...] → pages [P, Z, ...] (NaN where unowned)."""
    pages = np.full((P, Z) + per_seq[0].shape[1:], np.nan, np.float32)
    for vectors, table in zip(per_seq, tables):
        for pos, vec in enumerate(vectors):
            pages[table[pos // Z], pos % Z] = vec
    return jnp.asarray(pages, dtype)


def _dense(q, keys, values, scale):
    """q [N, Hk]; keys [S, K, Hk]; values [S, K, Hv] → [N, Hv], in float64."""
    group = q.shape[0] // keys.shape[1]
    out = []
    for n in range(q.shape[0]):
        s = keys[:, n // group].astype(np.float64) @ q[n].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out.append(p @ values[:, n // group].astype(np.float64) / p.sum())
    return np.stack(out)


def _inputs(kv_heads, head_dim=8, heads=4, seed=0):
    rng = np.random.RandomState(seed)
    keys = [rng.randn(n, kv_heads, head_dim).astype(np.float32) for n in CTX]
    values = [rng.randn(n, kv_heads, head_dim).astype(np.float32) for n in CTX]
    q = rng.randn(sum(NEW), heads, head_dim).astype(np.float32)
    return q, keys, values


def _metadata(tables, decode=False):
    if decode:
        return build_metadata([c - 1 for c in CTX], [1] * 4, tables, block_size=Z, max_tokens=5,
                              max_seqs=5, max_blocks_per_seq=M, decode=True)
    return build_metadata(DONE, NEW, tables, block_size=Z, max_tokens=24, max_seqs=5, max_blocks_per_seq=M)


def _ragged_expected(q, keys, values):
    """Token t of sequence b at position p sees positions 0..p of b."""
    out, t = [], 0
    for b, (done, new) in enumerate(zip(DONE, NEW)):
        for p in range(done, done + new):
            out.append(_dense(q[t], keys[b][:p + 1], values[b][:p + 1], SCALE))
            t += 1
    return np.stack(out)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA (group 2), MQA
def test_ragged_matches_dense(kv_heads):
    q, keys, values = _inputs(kv_heads)
    tables = _tables()
    md = _metadata(tables)
    q_padded = jnp.asarray(np.pad(q, ((0, 24 - len(q)), (0, 0), (0, 0))))
    got = np.asarray(paged_attention_reference(q_padded, _paged(keys, tables), _paged(values, tables), md,
                                               scale=SCALE))
    np.testing.assert_allclose(got[:len(q)], _ragged_expected(q, keys, values), atol=1e-5)
    assert not got[len(q):].any(), "padding tokens attend to nothing"


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_decode_matches_dense(kv_heads):
    _, keys, values = _inputs(kv_heads)
    q = np.random.RandomState(1).randn(5, 4, 8).astype(np.float32)
    tables = _tables()
    table_array = jnp.asarray([t + [0] * (M - len(t)) for t in tables] + [[0] * M], jnp.int32)
    lens = jnp.asarray(CTX + [0], jnp.int32)  # row 4 is padding
    got = np.asarray(paged_decode_reference(jnp.asarray(q), _paged(keys, tables), _paged(values, tables),
                                            table_array, lens, scale=SCALE))
    want = np.stack([_dense(q[b], keys[b], values[b], SCALE) for b in range(4)])
    np.testing.assert_allclose(got[:4], want, atol=1e-5)
    assert not got[4].any()
    # The dispatcher picks the same function for a decode step.
    md = _metadata(tables, decode=True)
    via = paged_attention(jnp.asarray(q), KVPages(_paged(keys, tables), _paged(values, tables)), md, scale=SCALE)
    np.testing.assert_allclose(np.asarray(via)[:4], want, atol=1e-5)


def test_bf16_pages_and_queries():
    q, keys, values = _inputs(2)
    tables = _tables()
    md = _metadata(tables)
    rounded = [[np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in arrays] for arrays in (keys, values)]
    want = _ragged_expected(q, *rounded)
    q_padded = jnp.asarray(np.pad(q, ((0, 24 - len(q)), (0, 0), (0, 0))))
    k_pages, v_pages = _paged(keys, tables, jnp.bfloat16), _paged(values, tables, jnp.bfloat16)
    got = paged_attention_reference(q_padded, k_pages, v_pages, md, scale=SCALE)  # f32 query, bf16 pages
    np.testing.assert_allclose(np.asarray(got)[:len(q)], want, atol=1e-5)
    got = paged_attention_reference(q_padded.astype(jnp.bfloat16), k_pages, v_pages, md, scale=SCALE)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32)[:len(q)], want, atol=3e-2, rtol=3e-2)


def _mla_inputs(rank=8, rope=4, heads=4):
    rng = np.random.RandomState(2)
    latents = [rng.randn(n, rank + rope).astype(np.float32) for n in CTX]
    q_latent = rng.randn(sum(NEW), heads, rank).astype(np.float32)
    q_rope = rng.randn(sum(NEW), heads, rope).astype(np.float32)
    return q_latent, q_rope, latents


def _mla_dense(q_latent, q_rope, latent, scale):
    """Absorbed MLA written out: score = q_latent·c_kv + q_rope·k_pe; output = Σ p c_kv."""
    rank = q_latent.shape[-1]
    c_kv, k_pe = latent[:, :rank].astype(np.float64), latent[:, rank:].astype(np.float64)
    s = (q_latent @ c_kv.T + q_rope @ k_pe.T) * scale  # [N, S]
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ c_kv


def test_mla_ragged_and_decode_match_dense():
    q_latent, q_rope, latents = _mla_inputs()
    tables = _tables()
    pages = _paged(latents, tables)
    md = _metadata(tables)
    pad = ((0, 24 - len(q_latent)), (0, 0), (0, 0))
    got = np.asarray(mla_paged_attention_reference(jnp.asarray(np.pad(q_latent, pad)),
                                                   jnp.asarray(np.pad(q_rope, pad)), pages, md, scale=SCALE))
    want, t = [], 0
    for b, (done, new) in enumerate(zip(DONE, NEW)):
        for p in range(done, done + new):
            want.append(_mla_dense(q_latent[t], q_rope[t], latents[b][:p + 1], SCALE))
            t += 1
    np.testing.assert_allclose(got[:t], np.stack(want), atol=1e-5)
    assert not got[t:].any()

    qd_latent, qd_rope = q_latent[:4], q_rope[:4]  # one query per sequence
    table_array = jnp.asarray([t + [0] * (M - len(t)) for t in tables], jnp.int32)
    got = np.asarray(mla_paged_decode_reference(jnp.asarray(qd_latent), jnp.asarray(qd_rope), pages, table_array,
                                                jnp.asarray(CTX, jnp.int32), scale=SCALE))
    want = np.stack([_mla_dense(qd_latent[b], qd_rope[b], latents[b], SCALE) for b in range(4)])
    np.testing.assert_allclose(got, want, atol=1e-5)
    md = _metadata(tables, decode=True)
    via = mla_paged_attention(jnp.asarray(np.pad(qd_latent, ((0, 1), (0, 0), (0, 0)))),
                              jnp.asarray(np.pad(qd_rope, ((0, 1), (0, 0), (0, 0)))), LatentPages(pages), md,
                              scale=SCALE)
    np.testing.assert_allclose(np.asarray(via)[:4], want, atol=1e-5)


def test_shape_errors_name_the_shape():
    pages = jnp.zeros((4, 2, 2, 8))
    with pytest.raises(ValueError, match=r"q must be \[B, N, H\], got shape \(4, 8\)"):
        paged_decode_reference(jnp.zeros((4, 8)), pages, pages, jnp.zeros((4, 1), jnp.int32),
                               jnp.zeros(4, jnp.int32), scale=1.0)
    with pytest.raises(ValueError, match="2 kv heads do not divide 3 query heads"):
        paged_decode_reference(jnp.zeros((4, 3, 8)), pages, pages, jnp.zeros((4, 1), jnp.int32),
                               jnp.zeros(4, jnp.int32), scale=1.0)
    with pytest.raises(ValueError, match="kv_lora_rank 6 \\+ rope dim 4 must equal the latent page width 12"):
        mla_paged_decode_reference(jnp.zeros((1, 2, 6)), jnp.zeros((1, 2, 4)), jnp.zeros((4, 2, 12)),
                                   jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32), scale=1.0)


def test_unknown_attn_impl_is_named():
    with pytest.raises(ValueError, match="unknown attn_impl 'flash'; available: pallas, reference"):
        get_impl("flash")
    with pytest.raises(ValueError, match="unknown attn_impl 'bogus'"):
        build_model(preset("tiny"), attn_impl="bogus")


def test_default_impl_is_pallas_on_gpu_only(monkeypatch):
    import jax

    assert default_impl() == "reference" and build_model(preset("tiny")).attn_impl == "reference"  # CPU here
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert default_impl() == "pallas"
    from kvjax.config.engine import resolve_attention_backend  # an engine's: the pages' and the mesh's rules too

    config = preset("tiny")
    assert resolve_attention_backend(None, config.kv_spec("fp8_e4m3"), 1) == "pallas"
    assert resolve_attention_backend(None, config.kv_spec("int8_per_token_head"), 1) == "pallas"  # GQA kernels read them
    mla = preset("tiny-mla").kv_spec("int8_per_token_head")
    assert resolve_attention_backend(None, mla, 1) == "reference"  # the MLA kernels read static scales only
    with pytest.raises(EngineError, match="MLA kernels read static scales only"):
        resolve_attention_backend("pallas", mla, 1)
    assert resolve_attention_backend(None, config.kv_spec("fp8_e4m3"), 2) == "reference"  # not partitioned over a mesh
    assert build_model(preset("tiny")).attn_impl == "pallas"
    assert build_model(preset("tiny"), attn_impl="reference").attn_impl == "reference"
