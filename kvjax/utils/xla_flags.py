"""XLA flags for kvjax's decode loop on a GPU, set in XLA_FLAGS at import when KVJAX_XLA_FLAGS=1.

Opt-in until a GPU run has measured them against XLA's defaults (experiments/gpu_check.sh's
`model_cb` step sets KVJAX_XLA_FLAGS=1 beside the `model` step, which runs without them). XLA
reads XLA_FLAGS once, when the first computation starts a backend, so `import kvjax` (whose
package __init__ calls `apply`) sets them before that; importing kvjax after a GPU computation has
run leaves the backend as it started. A flag that XLA_FLAGS already names is left as the user set
it. The flags only touch XLA's GPU compiler: a CPU run parses them and is unchanged.

`--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL` (XLA's defaults plus two command types).
The engine's decode call is one `lax.while_loop` of up to steps_per_call model steps (kvjax.engine.steps)
whose body holds the block pool's allocation loops (`block_pool.take`, the table's column loop). By
default XLA's GPU runtime runs a while loop or a conditional from the host: each iteration copies
its predicate to the host, waits for it, then launches the body's kernels one by one (about 520
for a Llama-3-8B step). On an H200 (run 1 of experiments/results/gpu) a B 32 step then took
10.4 ms for 6.7 ms of kernels, with about five such copies a step; two of them (the sampler's
draw and the transition's allocation, both `lax.cond`s then) are gone from the code since, the
rest are these loops. With WHILE and CONDITIONAL recorded into command buffers (CUDA graphs with
conditional nodes) the loops run on the device without the host between iterations (the
prediction: the B 32 step from 10.4 ms towards 7.5; unmeasured: the GPU time of 2026-12-04 ran
out first).
"""
from __future__ import annotations

import os

DEFAULT_FLAGS = ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",)


def with_defaults(xla_flags: str, enabled: str | None = None) -> str:
    """XLA_FLAGS's value `xla_flags` with each of DEFAULT_FLAGS whose name it lacks appended when
    `enabled` (KVJAX_XLA_FLAGS's value) is "1"; else unchanged."""
    if (enabled or "").strip() != "1":
        return xla_flags
    names = {f.split("=", 1)[0].lstrip("-") for f in xla_flags.split()}
    extra = [f for f in DEFAULT_FLAGS if f.split("=", 1)[0].lstrip("-") not in names]
    return " ".join([xla_flags.strip(), *extra]).strip()


def apply() -> None:
    """Set XLA_FLAGS to `with_defaults` of its value (see the module docstring)."""
    value = with_defaults(os.environ.get("XLA_FLAGS", ""), os.environ.get("KVJAX_XLA_FLAGS"))
    if value:
        os.environ["XLA_FLAGS"] = value
