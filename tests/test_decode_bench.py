"""The decode benchmark's contiguous baseline is the same model, and the benchmark runs.

`experiments/decode_bench.py` times kvjax's paged model against a hand-written decoder over a
contiguous cache; its ratio only means something if both compute the same thing. Here the
hand-written decoder's logits are compared with the paged Flax model's, step by step, on a
random model with every feature the baseline claims (GQA with group 2, RoPE, untied head).
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import decode_bench
from kvjax.attention.metadata import build_metadata, decode_metadata
from kvjax.cache import PagedCache
from models import build_model, init_params, preset


def test_dense_step_matches_the_paged_model():
    config = preset("tiny")
    model = build_model(config, "reference")
    params = init_params(model, jax.random.key(0))
    b, prompt, steps, z = 3, 5, 4, 4
    per_seq = -(-(prompt + steps) // z)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (b, prompt + steps)).astype(np.int32)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))[::-1] for i in range(b)]  # not in order
    md = build_metadata([0] * b, [prompt] * b, tables, block_size=z, max_tokens=b * prompt, max_seqs=b,
                        max_blocks_per_seq=per_seq)
    cache = PagedCache.create(config.kv_spec(), 1 + b * per_seq, z)
    _, cache = model.apply({"params": params}, jnp.asarray(tokens[:, :prompt].reshape(-1)), md, cache)
    shape = (b, per_seq * z, config.num_kv_heads, config.head_dim)
    dense = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(config.num_layers)]
    copied = dense
    for t in range(prompt):  # the baseline's prefill: one position at a time
        pos = jnp.full(b, t, jnp.int32)
        _, dense = decode_bench.dense_step(config, params, jnp.asarray(tokens[:, t]), pos, dense)
        _, copied = decode_bench.dense_step(config, params, jnp.asarray(tokens[:, t]), pos, copied, copy_k=True)
    for t in range(prompt, prompt + steps):
        step_md = decode_metadata(md.block_tables, jnp.full(b, t, jnp.int32), jnp.ones(b, bool), z)
        paged_logits, cache = model.apply({"params": params}, jnp.asarray(tokens[:, t]), step_md, cache)
        pos = jnp.full(b, t, jnp.int32)
        dense_logits, dense = decode_bench.dense_step(config, params, jnp.asarray(tokens[:, t]), pos, dense)
        copied_logits, copied = decode_bench.dense_step(config, params, jnp.asarray(tokens[:, t]), pos, copied,
                                                        copy_k=True)
        np.testing.assert_allclose(dense_logits, paged_logits, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(copied_logits, dense_logits, atol=1e-6, rtol=1e-6)


def test_dense_step_refuses_what_it_does_not_implement():
    for config in (preset("tiny").replace(qk_norm=True), preset("tiny-mla")):
        with pytest.raises(ValueError, match="Llama-style GQA without q/k norms only"):
            decode_bench.dense_step(config, {}, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), [])


def test_tiny_run_writes_its_tables(tmp_path):
    result = decode_bench.main(["--tiny", "--repeats", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "decode_bench.json").read_text())
    pd = saved["paged_vs_dense"]
    assert pd["token_agreement"] == 1.0 and pd["engine_agreement"] == 1.0
    assert {c["s_max"] for c in saved["context_sweep"]} == {32, 64}
    assert saved["loop_vs_host"]["same_tokens"] and saved["prefix_caching"]["same_tokens"]
    assert saved["prefix_caching"]["on"]["prefill_tokens"] < saved["prefix_caching"]["off"]["prefill_tokens"]
    md = (tmp_path / "decode_bench.md").read_text()
    assert f"{pd['ratio']:.2f}×" in md and result["targets"].keys() == saved["targets"].keys()
