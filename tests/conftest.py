"""Test-wide settings: CPU JAX, offline Hugging Face, float32 matmuls at full precision."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # tests/test_tp.py: 8 CPU devices

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

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
