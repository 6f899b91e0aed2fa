"""`cleanup_dist_env_and_memory`, vLLM's call between two LLMs in one process (vLLM 0.33
`vllm/distributed/parallel_state.py`), so that a vLLM script's

    del llm
    cleanup_dist_env_and_memory()
    llm = LLM(...)

runs here and the second LLM finds the first one's device memory free.

vLLM tears down its process groups (model parallel, then the distributed environment), optionally
shuts Ray down, collects garbage and empties the accelerator's caching allocator. kvjax has no
process groups: tensor parallelism is one JAX mesh, whose devices need no teardown, and a job over
several processes (`runtime`: JAX's distributed runtime; `channel`: rank 0's messages over its
collectives) leaves the runtime once, when the process ends (runtime.finish), not between two LLMs.
What is left for it is the Python side: device buffers that nothing reachable refers to
any more but that a reference cycle still holds, which only the garbage collector breaks.

JAX's caches of compiled programs are kept, as vLLM keeps torch's compiled graphs: kvjax's jitted
steps take the weights, KV pages and block pool as arguments, and the model they are compiled for is
a static argument that holds its configuration only, so the caches hold none of an LLM's arrays; a
second LLM of the same model and sizes runs the first one's programs without tracing or compiling
them again (tests/test_distributed.py checks both).
"""
from __future__ import annotations

import gc
import sys

__all__ = ["cleanup_dist_env_and_memory"]


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Free the device memory of objects the program no longer refers to (a deleted `kvjax.LLM`:
    its weights, KV pages and block pool).

    What it does, in order:
    1. `gc.unfreeze()`: objects moved to the permanent generation by `gc.freeze()` become
       collectable again (vLLM does the same first).
    2. `gc.collect()`: unreachable reference cycles are freed, with the device arrays they hold
       (an LLM stored on an object it refers to, a callback that closes over the LLM).
    3. shutdown_ray=True: if the process has imported Ray, `ray.shutdown()` (as vLLM); kvjax itself
       never starts Ray, so without Ray imported there is nothing to shut down.

    What it does not do: free an array or an LLM that is still referenced (a variable, a list, the
    `_` of an interactive session, the traceback of the last exception); clear JAX's caches of
    compiled programs (module docstring: they hold no array of an LLM, and the next LLM reuses
    them; arrays that a program of the user's own holds as a static argument or a constant are
    freed by `jax.clear_caches()`); return memory that XLA's allocator already holds to the device
    (JAX has no counterpart of torch's `empty_cache`: freed buffers are reused by the next arrays
    of this process, and `XLA_PYTHON_CLIENT_ALLOCATOR=platform` hands each one back as it is
    freed); clear kvjax's host-side `functools` caches, which hold sizes and jitted wrappers but no
    device memory; tear down process groups or environment variable caches (kvjax has none)."""
    gc.unfreeze()
    gc.collect()
    if shutdown_ray and "ray" in sys.modules:
        sys.modules["ray"].shutdown()
