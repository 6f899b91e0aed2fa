"""cleanup_dist_env_and_memory (vLLM's call between two LLMs in one process): device arrays that
nothing reachable refers to, but that a reference cycle or a JAX cache still holds, are freed."""
import contextlib
import gc
import sys
import types

import jax
import jax.numpy as jnp

from kvjax import LLM, SamplingParams
from kvjax.distributed import cleanup_dist_env_and_memory


def _live() -> tuple[int, int]:
    arrays = jax.live_arrays()
    return len(arrays), sum(a.nbytes for a in arrays)


@contextlib.contextmanager
def _no_automatic_gc():
    """Only the collections the test makes run, so that what a cycle holds stays until cleanup."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def test_a_deleted_llm_in_a_reference_cycle_is_freed():
    cleanup_dist_env_and_memory()
    before = _live()
    with _no_automatic_gc():
        llm = LLM("small-gqa", num_gpu_blocks_override=64, use_tqdm_on_load=False)
        out = llm.generate(["def f"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        llm.owner = llm  # e.g. a callback stored on the LLM that refers back to it
        held = _live()
        del llm, out
        assert _live() == held  # the cycle keeps its weights and KV pages on the device
        cleanup_dist_env_and_memory()
        after = _live()
    assert held[1] > before[1] + 1_000_000  # the model's weights and pages were there
    assert after[0] <= before[0] and after[1] <= before[1], (before, held, after)


class _Static:
    """A static jit argument (hashable) that carries an array: JAX's cache keeps it alive."""

    def __init__(self, array):
        self.array = array

    def __hash__(self):
        return 0

    def __eq__(self, other):
        return isinstance(other, _Static)


def test_arrays_held_only_by_jax_caches_are_freed():
    cleanup_dist_env_and_memory()
    before = _live()
    add = jax.jit(lambda static, x: x + static.array, static_argnums=0)
    static = _Static(jnp.ones(250_000))  # 1 MB
    add(static, 1.0).block_until_ready()
    del static
    gc.collect()
    assert _live()[1] >= before[1] + 1_000_000  # the compiled program's cache entry holds it
    cleanup_dist_env_and_memory()
    assert _live()[1] <= before[1]


def test_objects_frozen_by_gc_freeze_are_freed():
    cleanup_dist_env_and_memory()
    before = _live()
    with _no_automatic_gc():
        cycle = {"pages": jnp.ones(250_000)}
        cycle["self"] = cycle
        gc.freeze()  # what some servers do after start-up; gc.collect alone would skip these
        del cycle
        gc.collect()
        assert _live()[1] >= before[1] + 1_000_000
        cleanup_dist_env_and_memory()
    assert gc.get_freeze_count() == 0
    assert _live()[1] <= before[1]


def test_shutdown_ray_shuts_down_an_imported_ray_only(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    cleanup_dist_env_and_memory(shutdown_ray=True)  # no Ray imported: nothing to shut down, no import
    assert "ray" not in sys.modules
    calls = []
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(shutdown=lambda: calls.append(1)))
    cleanup_dist_env_and_memory()
    assert calls == []
    cleanup_dist_env_and_memory(shutdown_ray=True)
    assert calls == [1]
