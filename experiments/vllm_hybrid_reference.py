"""kvjax.accounting.hybrid beside vLLM 0.33's own functions, on the layer patterns of the tests and the presets with
sliding-window layers.

    pip download vllm==0.33.0 --no-deps && unzip the wheel into SRC
    pip install --target DEPS cbor2 pyzmq aiohttp openai openai-harmony pybase64 cachetools msgspec \
        cloudpickle py-cpuinfo xgrammar fastapi partial-json-parser llguidance   # vLLM's pure-Python imports
    python -m kvjax.experiments.vllm_hybrid_reference --vllm-src SRC --deps DEPS

vLLM is read from its unzipped wheel, as kvjax reads vLLM's rules everywhere (it is not a kvjax
dependency and is not installed). torch comes from the test extra (vLLM's specs carry a torch
dtype). vLLM's side: `kv_cache_planning`'s grouping (`_get_kv_cache_groups_uniform_spec`,
`_uniform_type`, `_uniform_page_size` after `unify_kv_cache_spec_page_size`),
`_get_kv_cache_bytes_per_block` for a layer-outer layout, num_blocks = budget // bytes per block,
and `kv_cache_utils.get_max_concurrency_for_kv_cache_config`. Prints one line per pattern and exits
1 if any figure differs; nothing here runs in the suite.

The presets (Gemma-3-27B, Gemma-3-270M, Gemma-2-9B, gpt-oss-20b and -120b, Mistral-7B-v0.1) are each checked
at 8K, 32K and 128K max_model_len (capped at their max_position_embeddings), their KV spec and layer windows as
the preset gives them, on the budget `kvjax plan --preset NAME --device-memory-gib 141 --block-size 16` gives
an H200 (ceil(141 GiB × 0.92) − the weights: the preset's parameters in bf16; gpt-oss's MXFP4 checkpoints,
--weights-gib 12.8 / 60.8), with `kvjax plan`'s hybrid defaults: 8192 batched tokens, 2 batches in flight.
Besides the groups, bytes per block, blocks and concurrency, the page of one layer is compared.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import types

from kvjax.accounting import budget as bud
from kvjax.accounting.hybrid import plan_groups
from kvjax.config.presets import preset
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.experiments import require

GIB = 2**30
# (name, windows, kv heads, head dim, budget bytes, max_model_len, max_num_batched_tokens, batches in flight)
CASES = [
    ("5:1 (Gemma-3-27B's shape)", [None if (i + 1) % 6 == 0 else 1024 for i in range(62)], 16, 128, 60 * GIB, 8192,
     2048, 1),
    ("all full, 62 layers", [None] * 62, 16, 128, 60 * GIB, 8192, 2048, 1),
    ("all one window (Mistral-7B-v0.1's)", [4096] * 32, 8, 128, 10 * GIB, 32768, 8192, 1),
    ("the same, 2 batches in flight", [4096] * 32, 8, 128, 10 * GIB, 32768, 8192, 2),
    ("the same, max_model_len 1000", [4096] * 32, 8, 128, 10 * GIB, 1000, 8192, 1),
    ("12 sliding + 13 full", [128] * 12 + [None] * 13, 8, 64, GIB, 4096, 2048, 1),
    ("alternating 12:12 (gpt-oss-20b's)", [128 if i % 2 == 0 else None for i in range(24)], 8, 64, GIB, 4096, 2048, 1),
    ("4 full then 2 sliding (Qwen2's max_window_layers)", [None] * 4 + [512] * 2, 2, 64, GIB, 4096, 2048, 1),
]

PRESETS = ("gemma-3-27b", "gemma-3-270m", "gemma-2-9b", "gpt-oss-20b", "gpt-oss-120b", "mistral-7b-v0.1")
CONTEXTS = (8192, 32768, 131072)
H200_GIB = "141"  # SPEC group B's card (kvjax.accounting.budget.GROUPS)
BLOCK, BATCHED, BATCHES = 16, 8192, 2  # vLLM's CUDA block size; kvjax plan's hybrid defaults
# The MXFP4 checkpoints' sizes (arXiv:2508.10925, Table 1): gpt-oss-120b's parameters in bf16 would not
# fit the card.
WEIGHTS_GIB = {"gpt-oss-20b": "12.8", "gpt-oss-120b": "60.8"}


def preset_cases():
    """(name, config, budget bytes, max_model_len) for each preset and context."""
    for name in PRESETS:
        config = preset(name)
        weights = (bud.gib(WEIGHTS_GIB[name]) if name in WEIGHTS_GIB else
                   bud.weight_bytes(config.num_params, "bf16"))
        for max_len in sorted({min(c, config.max_position_embeddings) for c in CONTEXTS}):
            pl = bud.plan(config.kv_spec(), context=max_len, block_size=BLOCK, total_bytes=bud.gib(H200_GIB),
                          weights_bytes=weights)
            yield f"{name} at {max_len:,}", config, pl.budget_bytes, max_len


def _vllm():
    """vLLM's modules from the folders on sys.path (main puts --vllm-src and --deps there)."""
    names = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils", "vllm.v1.kv_cache_interface")
    return tuple(importlib.import_module(name) for name in names)


def vllm_figures(windows, kv_heads, head, budget, max_len, batched, batches, with_page=False):
    torch = require("torch", "test", "vllm_hybrid_reference")
    kp, utils, interface = _vllm()
    FullAttentionSpec, KVCacheConfig, SlidingWindowSpec = (interface.FullAttentionSpec, interface.KVCacheConfig,
                                                           interface.SlidingWindowSpec)

    specs = {}
    for i, w in enumerate(windows):
        kw = dict(block_size=16, num_kv_heads=kv_heads, head_size=head, dtype=torch.bfloat16)
        specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(**kw) if w is None else \
            SlidingWindowSpec(**kw, sliding_window=w)
    if kp.is_kv_cache_spec_uniform(specs):
        groups = kp._get_kv_cache_groups_uniform_spec(specs)
    elif uniform := kp.UniformTypeKVCacheSpecs.from_specs(specs):
        groups = kp._get_kv_cache_groups_uniform_type(uniform)
    else:
        groups = kp._get_kv_cache_groups_uniform_page_size(kp.unify_kv_cache_spec_page_size(specs))
    per_block = kp._get_kv_cache_bytes_per_block(groups, types.SimpleNamespace(is_block_outermost=False))
    config = KVCacheConfig(num_blocks=budget // per_block, kv_cache_tensors=[], kv_cache_groups=groups)
    vllm_config = types.SimpleNamespace(max_in_flight_tokens=batches * batched,
                                        model_config=types.SimpleNamespace(max_model_len=max_len),
                                        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
    layers = [tuple(int(n.split(".")[2]) for n in g.layer_names) for g in groups]
    out = layers, per_block, budget // per_block, utils.get_max_concurrency_for_kv_cache_config(vllm_config, config)
    return out + (specs["model.layers.0.self_attn.attn"].page_size_bytes,) if with_page else out


def _line(same, name, mine, theirs):
    page = f"page {mine[4]:,} B, " if len(mine) > 4 else ""
    return (f"{'same' if same else 'DIFFERENT':9} {name}: {len(mine[0])} groups, {page}{mine[1]:,} B per block, "
            f"{mine[2]:,} blocks, concurrency {mine[3]:.4f}" + ("" if same else f"; vLLM: {theirs[1:]}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vllm_hybrid_reference", description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-src", required=True, help="vLLM 0.33's unzipped wheel (the folder holding vllm/)")
    ap.add_argument("--deps", help="a folder of vLLM's pure-Python imports (pip install --target)")
    args = ap.parse_args(argv)
    if not os.path.isdir(os.path.join(args.vllm_src, "vllm")):
        ap.error(f"--vllm-src {args.vllm_src!r} holds no vllm/ folder")
    sys.path[:0] = [args.vllm_src] + ([args.deps] if args.deps else [])
    try:
        _vllm()
    except ImportError as e:
        ap.error(f"vLLM's source does not import: {e} (install its pure-Python imports into --deps)")
    differ = 0
    for name, windows, kv_heads, head, budget, max_len, batched, batches in CASES:
        ours = plan_groups(KVSpec("gqa", len(windows), kv_heads, kv_heads, head, kv_dtype="bf16"), windows, budget,
                           block_size=16, max_model_len=max_len, max_num_batched_tokens=batched,
                           max_concurrent_batches=batches)
        mine = ([g.layers for g in ours.groups], ours.bytes_per_block, ours.num_blocks, ours.max_concurrency)
        theirs = vllm_figures(windows, kv_heads, head, budget, max_len, batched, batches)
        same = mine == theirs
        differ += not same
        print(_line(same, name, mine, theirs))
    for name, config, budget, max_len in preset_cases():
        spec, windows = config.kv_spec(), config.layer_windows
        ours = plan_groups(spec, windows, budget, block_size=BLOCK, max_model_len=max_len,
                           max_num_batched_tokens=BATCHED, max_concurrent_batches=BATCHES)
        mine = ([g.layers for g in ours.groups], ours.bytes_per_block, ours.num_blocks, ours.max_concurrency,
                spec.page_bytes(0, BLOCK))
        theirs = vllm_figures(windows, spec.num_kv_heads, spec.head_dim, budget, max_len, BATCHED, BATCHES,
                              with_page=True)
        same = mine == theirs
        differ += not same
        print(_line(same, name, mine, theirs))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
