"""Device measurement helpers: live-array bytes and XLA memory analysis on CPU, and measured
bytes against the analytic ones (KV pages, weights); kvjax.accounting.sizing's profile → budget → blocks
called as a library function, against the budget formula worked out here."""
import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.accounting import memory
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.worker.paged_cache import CacheError, PagedCache


@pytest.fixture(autouse=True)
def _no_collection_while_measuring():
    """The tests count live bytes before and after an allocation: a garbage collection in
    between would free arrays that an earlier test left in reference cycles and shift the
    count, so collect first and hold the collector off during the test."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_live_bytes_track_allocations_exactly():
    dev = jax.devices()[0]
    before = memory.live_bytes(dev)
    x = jnp.zeros((1000, 256), jnp.float32)
    y = jnp.ones((10,), jnp.bfloat16)
    assert memory.live_bytes(dev) - before == 1000 * 256 * 4 + 10 * 2
    assert memory.tree_bytes({"a": x, "b": [y]}) == 1000 * 256 * 4 + 20
    assert memory.tree_bytes_on((x, y), dev) == 1000 * 256 * 4 + 20
    del x, y
    assert memory.live_bytes(dev) == before


def test_compiled_memory_sees_donation():
    x = jnp.zeros((512, 128), jnp.float32)
    plain = memory.compiled_memory(jax.jit(lambda a: a * 2), x)
    donated = memory.compiled_memory(jax.jit(lambda a: a * 2, donate_argnums=0), x)
    assert plain.argument == donated.argument == 512 * 128 * 4
    assert plain.alias == 0 and plain.peak_extra >= 512 * 128 * 4
    assert donated.alias == 512 * 128 * 4 and donated.peak_extra == donated.temp


def test_cpu_has_no_allocator_stats():
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        assert memory.peak_bytes(dev) is None and memory.bytes_limit(dev) is None
        assert memory.bytes_in_use(dev) == memory.live_bytes(dev)


# --------------------------------------------------------------------------------------------
# Measured against analytic: KV pages, weights, and the reconciliation helpers
# --------------------------------------------------------------------------------------------
SPECS = {"mha": KVSpec("mha", 2, 4, 4, 16), "gqa": KVSpec("gqa", 3, 8, 2, 32),
         "mla": KVSpec.mla(2, 4, kv_lora_rank=32, qk_rope_head_dim=16)}


@pytest.mark.parametrize("kind", ["mha", "gqa", "mla"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "fp8_e5m2", "int8_per_token_head", "nvfp4"])
def test_measured_kv_page_bytes_equal_analytic(kind, kv_dtype):
    spec = SPECS[kind].replace(kv_dtype=kv_dtype)
    if kv_dtype == "nvfp4" and kind == "mla":  # vLLM's MLA fp4 layout is nvfp4_ds_mla, not this one
        with pytest.raises(CacheError, match="nvfp4"):
            PagedCache.create(spec, 7, 16)
        return
    dev = jax.devices()[0]
    num_blocks, block_size = 7, 16
    before = memory.live_bytes(dev)
    cache = PagedCache.create(spec, num_blocks, block_size)
    measured = memory.live_bytes(dev) - before
    pages = num_blocks * spec.bytes_per_block(block_size)  # int8's per-token scale pages included
    static = memory.cache_static_bytes(spec)  # fp8 scales and the counters, outside the formula
    slot_arrays = [a for a in jax.tree_util.tree_leaves(cache) if a.ndim >= 2]
    assert sum(a.nbytes for a in slot_arrays) == pages == cache.kv_nbytes
    assert sum(a.nbytes for a in jax.tree_util.tree_leaves(cache) if a.ndim < 2) == static
    assert measured == pages + static
    if kv_dtype.startswith("fp8") or kv_dtype == "nvfp4":  # f32 per kv head for K and V, or per latent channel
        per_layer = 4 * (48 if kind == "mla" else 2 * spec.num_kv_heads)
        assert static == spec.num_layers * (per_layer + 4)
    if kv_dtype == "nvfp4":  # hand count: H/2 bytes of E2M1 pairs and H/16 e4m3 scales per head, K and V
        h, k = spec.head_dim, spec.num_kv_heads
        assert pages == spec.num_layers * num_blocks * block_size * 2 * k * (h // 2 + h // 16)


@pytest.mark.parametrize("dtype, width", [("float32", 4), ("bfloat16", 2)])
def test_measured_weight_bytes_equal_params_times_dtype(dtype, width):
    from kvjax.models import build_model, init_params, preset

    config = preset("tiny").replace(dtype=dtype)
    d, i, v, n, k, h, layers = (config.hidden_size, config.intermediate_size, config.vocab_size, config.num_heads,
                                config.num_kv_heads, config.head_dim, config.num_layers)
    # embed + per layer (q, k, v, o, gate/up/down, 2 norms) + final norm + lm_head
    params = v * d + layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * i + 2 * d) + d + d * v
    model = build_model(config)
    dev = jax.devices()[0]
    before = memory.live_bytes(dev)
    weights = init_params(model, jax.random.key(0))
    assert memory.live_bytes(dev) - before == params * width == memory.tree_bytes(weights)
    assert sum(x.size for x in jax.tree_util.tree_leaves(weights)) == params


def test_live_bytes_count_a_shared_buffer_once():
    """Reading a sharded array's shards leaves per-shard Arrays alive over the same buffers."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    dev = jax.devices()[0]
    before = memory.live_bytes(dev)
    x = jax.device_put(jnp.zeros((64, 8), jnp.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert [s.data.nbytes for s in x.addressable_shards] == [2048]
    assert memory.live_bytes(dev) - before == 2048


def test_rows_and_explanations():
    row = memory.Row("kv pages", 1000, 1024, "x")
    assert (row.diff, row.ratio) == (24, 1.024) and row.to_json()["diff"] == 24
    assert memory.Row("a", 0, 0).ratio == 1.0 and memory.Row("a", 5, None).ratio is None
    assert memory.rounded_bytes([1, 256, 257]) == 256 + 256 + 512
    assert memory.explain_arrays(100, 100, [100], "cpu") == "exact"
    assert memory.explain_arrays(300, 512, [100, 200], "gpu").startswith("allocator rounding")
    assert "more than the arrays" in memory.explain_arrays(300, 4096, [100, 200], "gpu")
    assert "less than the arrays" in memory.explain_arrays(300, 200, [100, 200], "gpu")
    assert math.isclose(memory.Row("w", 3, 4).ratio, 4 / 3)


# --------------------------------------------------------------------------------------------
# kvjax.accounting.sizing: profile → budget → blocks as a library call (what `kvjax decode --util` and
# LLM(gpu_memory_utilization=...) use)
# --------------------------------------------------------------------------------------------
SIZE = dict(block_size=16, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128)


@pytest.fixture(scope="module")
def tiny():
    from kvjax.models import build_model, init_params, preset

    config = preset("tiny")
    model = build_model(config)
    return model, init_params(model, jax.random.key(0)), config.kv_spec()


@pytest.mark.parametrize("util", [None, "0.5"])
def test_profile_and_size_follows_the_budget_formula(tiny, util):
    from fractions import Fraction

    from kvjax.accounting import sizing
    from kvjax.accounting.reconcile import reconcile

    model, params, spec = tiny
    total = 4 * 1024**2
    r = sizing.profile_and_size(model, params, spec, util=util, total_bytes=total, **SIZE)
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))  # CPU: resident bytes, exactly
    assert r.weights_bytes == weights and r.weights_per_device == (weights,) and r.weights_analytic == weights
    assert r.activations_bytes > r.profile.inputs > 0 and r.profile.measured == (r.profile.analytic,)
    requested = math.ceil(total * Fraction(util or "0.92"))
    want = (requested - r.weights_bytes - r.activations_bytes) // spec.bytes_per_block(16)
    assert r.num_blocks == r.plan.num_blocks == want >= 2
    assert (r.plan.requested_bytes, r.plan.weights_bytes, r.plan.activations_bytes) == (
        requested, weights, r.activations_bytes)
    assert r.non_kv_bytes == weights + r.activations_bytes and r.total_bytes == total and not r.total_from_device
    # Allocating what was planned (kvjax.accounting.reconcile): every row measures exactly its analytic bytes on CPU.
    check = reconcile(r)
    assert [row.name for row in check.rows] == ["weights", "kv pages", "scales + counters", "block tables",
                                               "activation peak", "total resident"]
    assert all(row.measured == row.analytic for row in check.rows), check.rows
    assert check.rows[1].analytic == want * spec.bytes_per_block(16) and check.devices_agree


def test_profile_and_size_errors(tiny):
    from kvjax.accounting import sizing

    model, params, spec = tiny
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(sizing.NoMemoryLimitError, match="cpu device reports no memory limit: pass total_bytes"):
            sizing.profile_and_size(model, params, spec, **SIZE)
        assert issubclass(sizing.NoMemoryLimitError, ValueError)
    with pytest.raises(sizing.NoUsableBlockError, match="no usable block") as e:
        sizing.profile_and_size(model, params, spec, total_bytes=100_000, **SIZE)
    assert e.value.plan.num_blocks < 2
    with pytest.raises(ValueError, match="util must be in \\(0, 1\\], got 1.5"):  # budget.BudgetError
        sizing.profile_and_size(model, params, spec, util="1.5", total_bytes=10**7, **SIZE)
    with pytest.raises(sizing.SizingError, match="max_num_batched_tokens must be a positive integer, got 0"):
        sizing.profile_and_size(model, params, spec, total_bytes=10**7, **{**SIZE, "max_num_batched_tokens": 0})
    step = sizing.compile_profile(model, params, spec, block_size=16, max_num_batched_tokens=32)
    with pytest.raises(sizing.SizingError, match="compiled for block_size 16, max_num_batched_tokens 32"):
        sizing.profile_and_size(model, params, spec, total_bytes=10**7, step=step, **SIZE)
