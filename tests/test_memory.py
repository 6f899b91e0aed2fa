"""Device measurement helpers: live-array bytes and XLA memory analysis on CPU."""
import jax
import jax.numpy as jnp

from kvjax import memory


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
