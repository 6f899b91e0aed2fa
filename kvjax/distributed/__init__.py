"""`cleanup_dist_env_and_memory`, vLLM's call between two LLMs in one process (vLLM 0.33
`vllm/distributed/parallel_state.py`), so that a vLLM script's

    del llm
    cleanup_dist_env_and_memory()
    llm = LLM(...)

runs here and the second LLM finds the first one's device memory free.

vLLM tears down its process groups (model parallel, then the distributed environment), optionally
shuts Ray down, collects garbage and empties the accelerator's caching allocator. kvjax has no
process groups: tensor parallelism is one process driving a JAX mesh, whose devices need no
teardown. What is left for it is the Python side: device buffers that nothing reachable refers to
any more, but that are still held by a reference cycle (which only the garbage collector breaks)
or by one of JAX's caches (compiled programs and traced functions, kept with the static arguments
and constants they were built from).
"""
from __future__ import annotations

import gc
import sys

import jax

__all__ = ["cleanup_dist_env_and_memory"]


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Free the device memory of objects the program no longer refers to (a deleted `kvjax.LLM`:
    its weights, KV pages, block pool and compiled steps).

    What it does, in order:
    1. `gc.unfreeze()`: objects moved to the permanent generation by `gc.freeze()` become
       collectable again (vLLM does the same first).
    2. `gc.collect()`: unreachable reference cycles are freed, with the device arrays they hold
       (an LLM stored on an object it refers to, a callback that closes over the LLM).
    3. `jax.clear_caches()`: JAX's caches of compiled programs and traced functions are emptied,
       and with them the arrays kept alive only by a cached program's static arguments or
       constants; every later call compiles again (the persistent compilation cache on disk, if
       one is set, is kept).
    4. `gc.collect()` again, for what the cleared caches were the last to hold.
    5. shutdown_ray=True: if the process has imported Ray, `ray.shutdown()` (as vLLM); kvjax itself
       never starts Ray, so without Ray imported there is nothing to shut down.

    What it does not do: free an array or an LLM that is still referenced (a variable, a list, the
    `_` of an interactive session, the traceback of the last exception); return memory that XLA's
    allocator already holds to the device (JAX has no counterpart of torch's `empty_cache`: freed
    buffers are reused by the next arrays of this process, and `XLA_PYTHON_CLIENT_ALLOCATOR=platform`
    hands each one back as it is freed); clear kvjax's host-side `functools` caches, which hold
    sizes and jitted wrappers but no device memory; tear down process groups or environment
    variable caches (kvjax has none)."""
    gc.unfreeze()
    gc.collect()
    jax.clear_caches()
    gc.collect()
    if shutdown_ray and "ray" in sys.modules:
        sys.modules["ray"].shutdown()
