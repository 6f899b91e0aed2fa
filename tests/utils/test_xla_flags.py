"""kvjax.utils.xla_flags: with KVJAX_XLA_FLAGS=1, kvjax's XLA GPU flags join the user's XLA_FLAGS
without overriding a flag the user named; without it, XLA_FLAGS is left alone."""
import os
import subprocess
import sys

from kvjax.utils.xla_flags import DEFAULT_FLAGS, with_defaults

FLAG = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"


def test_flags_added_to_empty_and_to_other_flags():
    assert DEFAULT_FLAGS == (FLAG,)
    assert with_defaults("", "1") == FLAG
    assert with_defaults("--xla_gpu_autotune_level=0", " 1 ") == f"--xla_gpu_autotune_level=0 {FLAG}"


def test_a_flag_the_user_named_is_kept_as_given():
    mine = "--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/x"
    assert with_defaults(mine, "1") == mine
    assert with_defaults("xla_gpu_enable_command_buffer=FUSION", "1") == "xla_gpu_enable_command_buffer=FUSION"


def test_off_unless_asked():
    assert with_defaults("", None) == ""
    assert with_defaults("", "0") == ""
    assert with_defaults("--xla_gpu_autotune_level=0", "yes") == "--xla_gpu_autotune_level=0"


def test_import_kvjax_sets_them_before_jax_starts_a_backend():
    code = ("import os, kvjax, jax.numpy as jnp; assert float(jnp.ones(2).sum()) == 2.0; "
            "print(os.environ['XLA_FLAGS'])")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KVJAX_XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "JAX_PLATFORMS": "cpu", "KVJAX_XLA_FLAGS": "1"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == FLAG  # and XLA on the CPU parsed it: the computation ran
    off = subprocess.run([sys.executable, "-c", "import os, kvjax; print(os.environ.get('XLA_FLAGS'))"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert off.strip() == "None"
