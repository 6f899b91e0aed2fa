"""Whole-model decode with attn_impl="pallas" (interpret mode on CPU) matches "reference".

The Pallas kernels serve decode steps; prefill/ragged steps use the jnp reference in both
impls, so after the same prefill every decode step's logits must agree to f32 accumulation
error, for GQA and MLA, with bf16 and fp8 pages, and int8 pages with per-token-head scales (GQA).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.metadata import build_metadata, decode_metadata
from kvjax.models import build_model, init_params, preset
from kvjax.worker.paged_cache import PagedCache


def _decode_logits(model, params, spec, prompts, steps, block_size=4):
    batch, per_seq = len(prompts), 4
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    cache = PagedCache.create(spec, 1 + batch * per_seq, block_size)
    lens = [len(p) for p in prompts]
    md = build_metadata([0] * batch, lens, tables, block_size=block_size, max_tokens=sum(lens), max_seqs=batch,
                        max_blocks_per_seq=per_seq)
    toks = jnp.asarray(np.concatenate(prompts).astype(np.int32))
    logits, cache = model.apply({"params": params}, toks, md, cache, md.logits_indices)
    out = [logits]
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    computed = jnp.asarray(lens, jnp.int32)
    for _ in range(steps):
        dmd = decode_metadata(md.block_tables, computed, jnp.ones(batch, bool), block_size)
        logits, cache = model.apply({"params": params}, tok, dmd, cache)
        out.append(logits)
        tok, computed = jnp.argmax(logits, -1).astype(jnp.int32), computed + 1
    return np.stack([np.asarray(x) for x in out])


@pytest.mark.parametrize("name, kv_dtype", [pytest.param("tiny", "fp32", marks=pytest.mark.slow), ("tiny", "fp8_e4m3"), ("tiny", "int8_per_token_head"),
                                            pytest.param("tiny-mla", "bf16", marks=pytest.mark.slow)])
def test_pallas_decode_matches_reference(name, kv_dtype):
    cfg = preset(name)
    params = init_params(build_model(cfg), jax.random.key(4))
    spec = cfg.kv_spec(kv_dtype)
    prompts = [np.array([3, 1, 4, 1, 5]), np.array([9, 2, 6])]
    ref = _decode_logits(build_model(cfg, "reference"), params, spec, prompts, 6)
    pal = _decode_logits(build_model(cfg, "pallas"), params, spec, prompts, 6)
    np.testing.assert_allclose(pal, ref, atol=2e-4, rtol=1e-4)
