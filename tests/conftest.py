"""Test-wide settings: CPU JAX, offline Hugging Face, float32 matmuls at full precision, and one
persistent compilation cache for the run.

Most of the suite's time is XLA compiling. The same programs come back in many files (the
same tiny configs, the same engine steps), in both xdist workers and in the `kvjax` processes
that tests start, and each file ends by clearing JAX's in-memory caches (below). So the run
keeps JAX's persistent compilation cache in a fresh temporary folder that every process of
the run shares (through JAX_COMPILATION_CACHE_DIR, which the workers and subprocesses inherit)
and that is removed at the end: a clean run still starts empty. A folder given in
JAX_COMPILATION_CACHE_DIR beforehand (.ci/run shares one with its report run) is used as it is.
"""
import os
import shutil
import tempfile
from importlib.metadata import version as _version

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Mosaic GPU's CPU interpreter runs a kernel's warpgroups as threads whose host callbacks block
# (barrier waits) on XLA:CPU's client thread pool, one thread per core unless PJRT_NPROC says
# otherwise; with the kernel's own callback waiting for its warpgroups, two cores' pool deadlocks
# when two callbacks block at once (a stall with every thread waiting, seen 2 in ~20 interpreted
# nvfp4 ragged calls under load; none in 18 with 8 threads). kvjax.attention.mgpu_interpret says more.
os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))
_OWN_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # set here, before JAX reads it; xdist workers inherit it
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvjax-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the many small programs add up too
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite's programs are tiny and most of its time is compiling them: XLA's lowest backend
# optimization level compiles about a tenth faster on the whole suite (measured side by side), and
# what the tests compare (tokens, KL, allocator state) is the same. The `kvjax` processes that tests
# start inherit it; the main job (.ci/run's report run, a user's) keeps XLA's default.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# XLA:CPU's older elemental emitters compile the suite's small fused loops in about 60% of the time its
# MLIR fusion emitters take (test_vllm_api's programs: 14 s against 25 s of backend compilation, the
# tests' results the same). Only where the flag was measured: XLA refuses a flag it does not know.
if _version("jaxlib").startswith("0.10.") and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# tests/worker/test_tp.py needs 8 CPU devices. Asked for through JAX's config rather than XLA_FLAGS, which
# JAX hashes into every persistent-cache key: the `kvjax` processes that tests start (they inherit the
# XLA_FLAGS above, not this config) then compile programs with the same keys as the test processes.
jax.config.update("jax_num_cpu_devices", 8)

# The suite's hypothesis runs are repeatable (the same examples on every machine), so a CI run
# fails only on a change. To look for new failing inputs: pytest --hypothesis-profile=explore.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_file():
    """Each XLA:CPU executable holds a few memory mappings until JAX's caches let go of it, and
    one worker runs many files: past about 20,000 programs it crosses Linux's vm.max_map_count
    (65,530), and the next compile crashes the process. Clearing the caches after each file keeps
    a worker near 5,000 mappings."""
    yield
    jax.clear_caches()
    gc.collect()


def pytest_unconfigure(config):
    """The process that made the run's compilation cache removes it (xdist workers inherit its
    folder, so they made none)."""
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The files of longest single tests start first: with `-n 2 --dist loadfile` a worker takes one file at a time in
# collection order, so a long file collected last runs alone at the end while the other worker idles.
LONG_FILES = ("tests/distributed/test_multiprocess.py", "tests/experiments/test_gpu_check.py",
              "tests/engine/test_vllm_api.py", "tests/engine/test_trace_replay.py", "tests/simulator/test_decode_run.py",
              "tests/commands/test_default_flags.py", "tests/core/test_hybrid_allocator.py",
              "tests/entrypoints/test_server_fields.py", "tests/engine/test_engine_moe.py")


def pytest_collection_modifyitems(session, config, items):
    first = {path: i for i, path in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest keep their order
