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

Axes. Every shape comment and docstring in kvjax/, models/ and experiments/ (`i32[B, M]`,
`[P, Z, K, H]`) uses this one legend, each letter for one thing only:

    B  batch rows of a step (its requests; a scoring batch's windows)
    T  tokens: a step's flat, padded token axis (a chunk's, or the token ids handed to one call)
    Q  new tokens per sequence in a step (max_query_len)
    S  positions of a sequence (cached, or of a scoring window)
    N  query heads              K  kv heads              G  query heads per kv head (N / K)
    H  head dim (Hk, Hv where the keys' and the values' differ)
    C  MLA latent channels (kv_lora_rank + qk_rope_head_dim)
    D  hidden size              V  vocabulary            L  layers
    P  pages (blocks) of the pool, the null block 0 included
    Z  tokens per page (block size)
    M  blocks per request (block-table width)
    R  request slots of the pool
    E  host slots of the offload tier (also the cells of each ARC ghost list)
    A  entries handed to one block-pool or host-index call (blocks, hashes or slots)
    X  stop ids per row         J  log-probabilities per token          W  scoring windows

Lengths that are not axes of the model or the cache are spelled out: steps (the decode steps of
one device call: `[steps, B]`), loads (host → device copies), splits (split-K), the Pallas
tiles (block_h, block_k, pages_per_split), MLA's widths (kv_lora_rank, rope, nope, v) and a
hash's two u32 lanes (2). A module's own note says what a letter is for its calls where that
adds something (which M, which T); in prose, K and V alone are the key and value tensors.
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

# XLA GPU flags for the decode loop, with KVJAX_XLA_FLAGS=1 (kvjax.utils.xla_flags says which and
# why): set at import, since XLA reads XLA_FLAGS once, when the first computation starts its backend.
from kvjax.utils import xla_flags as _xla_flags  # noqa: E402

_xla_flags.apply()

_EXPORTS = {name: module for module, names in (  # name → the module that defines it
    ("kvjax.engine.llm", ("LLM",)), ("kvjax.engine.llm_engine", ("LLMEngine",)),
    ("kvjax.engine.async_llm", ("AsyncLLM",)), ("kvjax.engine.arg_utils", ("EngineArgs", "AsyncEngineArgs", "LLMError")),
    ("kvjax.engine.outputs", ("RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics")),
    ("kvjax.engine.sampling_params", ("SamplingParams", "SamplingParamsError", "RequestOutputKind")),
    ("kvjax.engine.beam_search", ("BeamSearchParams",)),
) for name in names}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvjax' has no attribute {name!r}")
