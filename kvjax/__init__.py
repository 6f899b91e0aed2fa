"""kvjax: a JAX reference implementation of vLLM V1's paged KV cache.

The Python API mirrors vLLM's offline one (see kvjax.llm):

    import kvjax
    llm = kvjax.LLM("small-gqa", kv_dtype="fp8")
    outs = llm.generate(["def fib(n):"], kvjax.SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9))
    print(outs[0].text, outs[0].finish_reason)

The names below load on first use, so that `import kvjax.spec` or the `kvjax plan` command
do not pay for importing JAX.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "kvjax.llm", "LLMError": "kvjax.llm", "RequestOutput": "kvjax.llm", "CompletionOutput": "kvjax.llm",
    "SamplingParams": "kvjax.sampling", "SamplingParamsError": "kvjax.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvjax' has no attribute {name!r}")
