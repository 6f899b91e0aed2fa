"""cleanup_dist_env_and_memory (vLLM's call between two LLMs in one process): device arrays that
nothing reachable refers to, but that a reference cycle still holds, are freed; JAX's compiled
programs are kept, holding no array of a deleted LLM, and the next LLM runs them as they are."""
import contextlib
import gc
import sys
import types

import jax
import jax.monitoring
import jax.numpy as jnp
import pytest

from kvjax import LLM, SamplingParams
from kvjax.distributed import cleanup_dist_env_and_memory

# One LLM and one request shape for the tests below, so that they share compiled programs: fp8 pages
# (their scales beside them) and log-probabilities, which add arrays and programs of their own.
LLM_ARGS = dict(kv_cache_dtype="fp8", num_gpu_blocks_override=64, use_tqdm_on_load=False)
PARAMS = SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=1)


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


@pytest.mark.slow  # 30 s; the default run frees a deleted LLM in test_compiled_steps_are_kept_and_hold_no_array_of_a_deleted_llm
def test_a_deleted_llm_in_a_reference_cycle_is_freed():
    cleanup_dist_env_and_memory()
    before = _live()
    with _no_automatic_gc():
        llm = LLM("small-gqa", **LLM_ARGS)
        out = llm.generate(["def f"], PARAMS, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        llm.owner = llm  # e.g. a callback stored on the LLM that refers back to it
        held = _live()
        del llm, out
        assert _live() == held  # the cycle keeps its weights and KV pages on the device
        cleanup_dist_env_and_memory()
        after = _live()
    assert held[1] > before[1] + 1_000_000  # the model's weights and pages were there
    assert after[0] <= before[0] and after[1] <= before[1], (before, held, after)


@contextlib.contextmanager
def _traces():
    """The functions JAX traces inside the block (a jit cache miss traces before it compiles)."""
    traced = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield traced
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_compiled_steps_are_kept_and_hold_no_array_of_a_deleted_llm():
    # the engine's steps take weights, pages and pool as arguments: the programs JAX keeps cached
    # hold none of them, and the next LLM of the same model and sizes runs them as they are
    cleanup_dist_env_and_memory()
    before = _live()
    llm = LLM("small-gqa", **LLM_ARGS)
    first = llm.generate(["def f"], PARAMS, use_tqdm=False)[0].outputs[0]
    assert _live()[1] > before[1] + 1_000_000
    del llm
    cleanup_dist_env_and_memory()
    after = _live()
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)
    llm = LLM("small-gqa", **LLM_ARGS)
    with _traces() as traced:
        again = llm.generate(["def f"], PARAMS, use_tqdm=False)[0].outputs[0]
    assert traced == []  # every program the first LLM compiled ran again as it was
    assert again.token_ids == first.token_ids


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
