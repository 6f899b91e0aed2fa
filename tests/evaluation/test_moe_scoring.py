"""Teacher-forced scoring and the accuracy lab on mixture-of-experts models (issue 39): the tiny
Qwen3-MoE-shaped and gpt-oss-shaped presets. JAX cannot vmap jax.lax.ragged_dot (the MoE experts'
grouped product), so kvjax.evaluation.scoring maps their rows one after another; the rows' logits
must still be each row's own prefill, computed here one row at a time through model_runner.forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.evaluation import accuracy
from kvjax.evaluation.scoring import prefill_layout, sequence_logits
from kvjax.models import build_model, init_params, preset
from kvjax.worker.model_runner import forward
from kvjax.worker.paged_cache import PagedCache


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-gpt-oss"])
def test_scored_rows_are_each_rows_own_prefill(name):
    config = preset(name)
    model = build_model(config, "reference")
    params = init_params(model, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (3, 24)), jnp.int32)
    got = sequence_logits(model, params, tokens, config.kv_spec(), block_size=8)  # [3, 24, V]
    md, blocks = prefill_layout(24, 8)
    one = jax.jit(lambda row: forward(model, params, row, md, PagedCache.create(config.kv_spec(), blocks, 8))[0])
    want = np.stack([np.asarray(one(row)) for row in tokens])
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(want[0], want[1], atol=1e-3)  # the rows differ: a broadcast row would fail


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-moe", "tiny-gpt-oss"])
def test_the_accuracy_lab_runs_on_moe_models(name, tmp_path):
    """`kvjax accuracy`'s evaluate on random-weight MoE models with the fp8, int8 and nvfp4 variants:
    the bf16 baseline is at distance 0 from itself, every variant's bytes per token are its format's
    (fewer than bf16's), and every KL is finite and non-negative."""
    rng = np.random.default_rng(0)
    for f in ("data.txt", "calib.txt"):
        (tmp_path / f).write_bytes(bytes(rng.integers(32, 127, 2048).astype(np.uint8)))
    variants = ("fp8_e4m3 dynamic", "int8_per_token_head", "nvfp4")
    out = accuracy.evaluate(f"preset:{name}", str(tmp_path / "data.txt"), str(tmp_path / "calib.txt"), seq_len=32,
                            max_windows=2, prompts=1, prompt_len=8, decode_tokens=4, skip_counts=(), only=variants)
    rows = {r["variant"]: r for r in out["results"]}
    assert set(rows) == {"bf16", *variants}, set(rows)
    assert rows["bf16"]["kl_vs_bf16"] == 0.0
    for v in variants:
        assert 0.0 <= rows[v]["kl_vs_bf16"] < float("inf"), v
        assert rows[v]["bytes_per_token"] < rows["bf16"]["bytes_per_token"], v
