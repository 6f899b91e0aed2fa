"""The attention backends by name (vLLM's `attention_backend` values) and the platform's default.

The engine's configuration checks and chooses a backend by name (kvjax.config.engine.
resolve_attention_backend) without importing the kernels: the implementations behind the names are
kvjax.attention's (`get_impl`), registered under exactly these. No JAX at import.
"""
from __future__ import annotations

IMPLS = ("reference", "pallas")  # the names: vLLM's attention_backend, kvjax's backends


def default_impl() -> str:
    """The platform's implementation: "pallas" on a GPU backend, where its kernels compile;
    "reference" elsewhere (on CPU Pallas runs only interpreted, slowly). An engine's backend is
    resolved from it once, with the KV format's and the mesh's rules
    (kvjax.config.engine.resolve_attention_backend)."""
    import jax

    return "pallas" if jax.default_backend() == "gpu" else "reference"
