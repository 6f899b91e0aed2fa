"""kvjax: a JAX reference implementation of vLLM V1's paged KV cache.

The Python API mirrors vLLM's offline one (see kvjax.engine.llm, kvjax.engine.outputs):

    import kvjax
    llm = kvjax.LLM("small-gqa", kv_cache_dtype="fp8")
    outs = llm.generate(["def fib(n):"], kvjax.SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9))
    print(outs[0].outputs[0].text, outs[0].outputs[0].finish_reason)

The names below load on first use, so that `import kvjax.core.kv_cache_interface` or the `kvjax plan` command
do not pay for importing JAX.

Installed, kvjax is the only top-level package: the repository's `models/` and `experiments/`
folders become `kvjax.models` and `kvjax.experiments` (pyproject.toml's package-dir). In a
checkout those folders sit beside `kvjax/`, not inside it; `_CheckoutFolders` maps the same two
names there, so pytest or `python -m` run from the repository root (where `./kvjax` comes first
on sys.path, before any install) import all of kvjax from that one tree.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"  # pyproject.toml's; `kvjax --version` reads the installed metadata first

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.dirname(_HERE)
_FOLDERS = ("models", "experiments")  # kvjax.<name> is the checkout's top-level <name>/


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds kvjax.models and kvjax.experiments in the checkout's top-level folders."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != __name__ or name not in _FOLDERS:
            return None
        folder = os.path.join(_CHECKOUT, name)
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def _in_checkout() -> bool:
    return (not os.path.isdir(os.path.join(_HERE, _FOLDERS[0]))
            and all(os.path.isfile(os.path.join(_CHECKOUT, f, "__init__.py")) for f in _FOLDERS))


if _in_checkout() and not any(isinstance(f, _CheckoutFolders) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFolders())

_EXPORTS = {
    "LLM": "kvjax.engine.llm", "LLMError": "kvjax.engine.arg_utils",
    "RequestOutput": "kvjax.engine.outputs", "CompletionOutput": "kvjax.engine.outputs",
    "Logprob": "kvjax.engine.outputs", "RequestMetrics": "kvjax.engine.outputs",
    "SamplingParams": "kvjax.engine.sampling", "SamplingParamsError": "kvjax.engine.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvjax' has no attribute {name!r}")
