"""models.random_params: the fast random weights the GPU experiments use have init_params' tree, and
Flax's own initializers (through init_params) as the reference for their values: norm weights,
biases and sinks equal, every matrix with the same spread (a standard deviation within 12%, a mean near 0)."""
import jax
import numpy as np
import pytest

from kvjax.config.presets import preset
from kvjax.models import build_model, init_params, random_params


@pytest.mark.parametrize("name", ["tiny", "tiny-mla", "tiny-moe", "tiny-moe-mla", "tiny-gpt-oss"])
def test_random_params_match_flax_init(name):
    model = build_model(preset(name), "reference")
    flax_params = init_params(model, jax.random.key(0))
    fast = random_params(model, jax.random.key(1))
    assert jax.tree.structure(fast) == jax.tree.structure(flax_params)
    for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(flax_params), jax.tree.leaves(fast)):
        where = jax.tree_util.keystr(path)
        assert got.shape == ref.shape and got.dtype == ref.dtype, where
        ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
        if path[-1].key not in ("kernel", "embedding", "gate_up_proj", "down_proj"):  # norms, biases, sinks
            np.testing.assert_array_equal(got, ref, err_msg=where)
            continue
        assert abs(got.std() / ref.std() - 1) < 0.12, (where, got.std(), ref.std())
        assert abs(got.mean()) < 0.1 * ref.std(), (where, got.mean())
        assert not np.array_equal(got, ref), where  # drawn anew, not copied from init


def test_random_params_differ_by_key_and_layer():
    model = build_model(preset("tiny"), "reference")
    a, b = random_params(model, jax.random.key(0)), random_params(model, jax.random.key(1))
    k0, k1 = (np.asarray(a[f"layers_{i}"]["self_attn"]["q_proj"]["kernel"]) for i in (0, 1))
    assert not np.array_equal(k0, k1)  # the same shape in two layers: two draws
    assert not np.array_equal(k0, np.asarray(b["layers_0"]["self_attn"]["q_proj"]["kernel"]))
    again = random_params(model, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(again["lm_head"]["kernel"]), np.asarray(a["lm_head"]["kernel"]))


def test_random_params_refuse_what_cannot_fit(monkeypatch):
    from kvjax.accounting import memory as mem

    monkeypatch.setattr(mem, "host_ram_bytes", lambda: 1024)  # a CPU device's ceiling is the host's RAM
    model = build_model(preset("tiny"), "reference")
    with pytest.raises(mem.WontFitError, match="weights of a llama model"):
        random_params(model, jax.random.key(0))
