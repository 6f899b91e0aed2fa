"""Device measurement helpers: live-array bytes and XLA memory analysis on CPU, and measured
bytes against the analytic ones (KV pages, weights)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import memory
from kvjax.cache import PagedCache
from kvjax.spec import KVSpec


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
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "fp8_e5m2", "int8_per_token_head"])
def test_measured_kv_page_bytes_equal_analytic(kind, kv_dtype):
    spec = SPECS[kind].replace(kv_dtype=kv_dtype)
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
    if kv_dtype.startswith("fp8"):  # hand count: f32 per kv head for K and V, or per latent channel
        per_layer = 4 * (48 if kind == "mla" else 2 * spec.num_kv_heads)
        assert static == spec.num_layers * (per_layer + 4)


@pytest.mark.parametrize("dtype, width", [("float32", 4), ("bfloat16", 2)])
def test_measured_weight_bytes_equal_params_times_dtype(dtype, width):
    from models import build_model, init_params, preset

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
