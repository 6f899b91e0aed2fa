"""Test-wide settings: CPU JAX, offline Hugging Face, float32 matmuls at full precision."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # tests/test_tp.py: 8 CPU devices

from hypothesis import settings  # noqa: E402

# The suite's hypothesis runs are repeatable (the same examples on every machine), so a CI run
# fails only on a change. To look for new failing inputs: pytest --hypothesis-profile=explore.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")
