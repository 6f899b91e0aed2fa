"""Engine arguments are resolved once (vLLM's `EngineArgs.create_engine_config()` → `VllmConfig`):
each derived value — "auto" for the KV dtype, the attention backend, the KV cache groups, the
model length, the step budget, the pool size — is computed by one function of
kvjax.config.engine, called once while an LLM is built, and the layers below read the result.

Two independent checks: the source (ast: which modules call the derivations at all) and a run
(each resolver counted while a real LLM is built and generates)."""
from __future__ import annotations

import ast
import os

import pytest

import kvjax.engine.arg_utils as arg_utils
from kvjax.config import engine as config_engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESOLVERS = ("resolve_kv_spec", "resolve_attention_backend", "resolve_block_size", "resolve_kv_cache_groups",
             "resolve_max_model_len", "resolve_step_budget", "resolve_num_blocks")
# What the resolvers derive from, below them: nothing in the engine's layers may call these again.
DERIVATIONS = set(RESOLVERS) | {"resolve_kv_dtype", "kv_cache_groups", "pool_limits", "default_impl", "kv_spec",
                                "with_num_blocks", "create_engine_config", "step_budget", "model_len"}
ENGINE_LAYERS = ("kvjax/core", "kvjax/worker", "kvjax/kv_offload", "kvjax/engine/core.py", "kvjax/engine/steps.py",
                 "kvjax/engine/output_processor.py", "kvjax/engine/llm.py", "kvjax/engine/async_llm.py")


def _calls(path: str) -> set[str]:
    """The names of the functions and methods a file calls."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return out


def _files(where: str) -> list[str]:
    path = os.path.join(ROOT, where)
    if path.endswith(".py"):
        return [path]
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]


def test_the_engine_layers_derive_nothing_from_the_arguments():
    # the scheduler, pool, cache, host tier, engine core, device steps, output side and the API read the
    # resolved config; the one place that creates it is LLMEngine (kvjax/engine/llm_engine.py)
    for where in ENGINE_LAYERS:
        for path in _files(where):
            assert not _calls(path) & DERIVATIONS, (os.path.relpath(path, ROOT), _calls(path) & DERIVATIONS)


def test_each_resolver_is_defined_once_and_called_from_create_engine_config_only():
    defined, callers = {}, {}
    for path in _files("kvjax") + _files("models"):
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in RESOLVERS:
                defined.setdefault(node.name, []).append(os.path.relpath(path, ROOT))
            if isinstance(node, ast.FunctionDef):
                for call in ast.walk(node):
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in RESOLVERS:
                        callers.setdefault(call.func.id, set()).add(f"{os.path.relpath(path, ROOT)}:{node.name}")
    assert defined == {name: ["kvjax/config/engine.py"] for name in RESOLVERS}
    # kvjax memory sizes a cache without an engine (no pool, scheduler or backend to resolve): it takes the KV format
    # and a given max_model_len's rule from the same resolvers rather than deriving them a second way; for an attention
    # + Mamba hybrid also the grown block size and the groups (kvjax/commands/memory_mamba.py)
    memory = {"resolve_kv_spec", "resolve_max_model_len"}
    mamba = {"resolve_block_size", "resolve_kv_cache_groups"}
    assert callers == {name: {"kvjax/engine/arg_utils.py:create_engine_config"}
                       | ({"kvjax/commands/memory.py:__init__"} if name in memory else set())
                       | ({"kvjax/commands/memory_mamba.py:resolve_pool"} if name in mamba else set())
                       for name in RESOLVERS}


def test_auto_means_the_models_dtype_in_one_function():
    # "auto" is no KV format: only resolve_kv_dtype reads it (vLLM: kv_cache_dtype="auto" is the model's dtype)
    from kvjax.config.engine import resolve_kv_dtype
    from kvjax.quant.kv_formats import SpecError, kv_format

    assert resolve_kv_dtype("auto", "float32") == "fp32" and resolve_kv_dtype("AUTO", "bfloat16") == "bf16"
    assert resolve_kv_dtype("fp8", "float32") == "fp8_e4m3"
    with pytest.raises(SpecError):
        kv_format("auto")
    texts = []
    for path in _files("kvjax") + _files("models"):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "auto"
                                                     for c in [node.left, *node.comparators]):
                texts.append((os.path.relpath(path, ROOT), ast.unparse(node)))
    kv = [t for t in texts if "kv" in t[1].lower()]
    # besides the resolver, two commands look at the flag as the user typed it, deriving no dtype: plan prints
    # the kv dtype as asked (vLLM prints its --kv-cache-dtype so), decode refuses skip layers with auto (no-ops)
    assert kv == [("kvjax/config/engine.py", "str(kv_cache_dtype).lower() == 'auto'"),
                  ("kvjax/commands/plan.py", "kv_dtype == 'auto'"),
                  ("kvjax/commands/decode.py", "args.kv_cache_dtype == 'auto'")], kv


def test_building_an_llm_resolves_each_value_once(monkeypatch):
    import kvjax

    counts = {}
    for name in RESOLVERS:
        original = getattr(arg_utils, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(arg_utils, name, counted)
        monkeypatch.setattr(config_engine, name, counted)  # a second caller would be counted here too
    llm = kvjax.LLM("small-gqa", kv_cache_dtype="fp8", block_size=16, num_gpu_blocks_override=24, max_num_seqs=2,
                    use_tqdm_on_load=False)
    assert counts == {name: 1 for name in RESOLVERS}
    llm.generate(["def f(x):"], kvjax.SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert counts == {name: 1 for name in RESOLVERS}, "a request re-derived an engine argument"
    config = llm.vllm_config  # what they resolved, read by the engine and its scheduler
    assert config.cache_config.kv_spec.kv_dtype == "fp8_e4m3" and config.attention_backend == "reference"
    assert config.max_model_len == 2048 and config.max_num_batched_tokens == 2048
    assert llm.engine.scheduler.config is config.scheduler_config and config.scheduler_config.num_blocks == 24
