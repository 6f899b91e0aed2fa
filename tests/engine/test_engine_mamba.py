"""The engine's greedy tokens equal transformers' greedy `generate` on attention + Mamba2 hybrids.

Tiny random Bamba, Granite-4.0-H (with experts and without) and Nemotron-H checkpoints (tests/mamba_fixtures.py), saved with
save_pretrained and loaded by kvjax's loader, fp32, served as vLLM serves them: the attention block size grown
until an attention page holds a Mamba state (4 → 48 here), one KV cache group for the attention layer and one per
Mamba layer, each request holding one state block in each Mamba group (mamba_cache_mode "none", so no prefix
caching). One engine, a pool of two requests' first blocks and a token budget of 8 (every prompt's prefill split across steps, the
state carried through its block): first three short prompts that fit together (roomy: nothing preempted), then
four long ones that outgrow the pool (preempted, their state recomputed from the prompt when readmitted). A 6-layer
Bamba with groups of two layers (two slot tensors, every state inside a page as vLLM keeps it) is sized by
gpu_memory_utilization and matches transformers too.
Comparisons stop before the first near-tie (a top-2 margin below MARGIN in transformers), as in
tests/engine/test_engine_sliding.py.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
import transformers as tf
from engine_fixtures import engine_config
from hf_fixtures import hf_greedy, random_model, save_hf_model
from mamba_fixtures import BASE, MAMBA, hybrid_config

import kvjax
from kvjax.engine.arg_utils import EngineArgs
from kvjax.engine.core import Engine
from kvjax.engine.sampling import SamplingParams
from kvjax.errors import KvjaxError
from kvjax.models import build_model
from kvjax.models.loader import load_checkpoint

MARGIN = 1e-4
SHORT, LONG = (5, 13, 9), (30, 37, 27, 33)  # prompt lengths: with 16 / 24 new tokens, 21 ≤ 48 < 54 tokens
NEW_SHORT, NEW_LONG = 16, 24


def _prompts(lengths, seed):
    rng = np.random.RandomState(seed)
    return [[int(t) for t in rng.randint(0, 128, size=n)] for n in lengths]


@pytest.fixture(scope="module", params=[pytest.param("bamba")] + [
    pytest.param(n, marks=pytest.mark.slow) for n in ("granite", "granite-dense", "nemotron_h")])
def case(request, tmp_path_factory):
    hf = random_model(*hybrid_config(request.param), seed=0)
    config, params = load_checkpoint(save_hf_model(hf, str(tmp_path_factory.mktemp(request.param))), dtype="float32")
    short, long = _prompts(SHORT, 1), _prompts(LONG, 2)
    want = ([hf_greedy(hf, p, NEW_SHORT, MARGIN) for p in short], [hf_greedy(hf, p, NEW_LONG, MARGIN) for p in long])
    return config, params, (short, long), want


def _check(result, want):
    for i, (res, (tokens, n)) in enumerate(zip(result.results, want)):
        assert res.finish_reason == "length", res.finish_reason
        assert n >= len(tokens) // 2, f"prompt {i}: a near-tie after {n} tokens leaves too little to compare"
        assert res.output[:n] == tokens[:n], f"prompt {i}"


def test_matches_transformers_roomy_then_preempting_with_chunked_prefill(case):
    config, params, (short, long), (want_short, want_long) = case
    kw = dict(block_size=4, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=8, steps_per_call=4)
    groups = engine_config(config, **kw).cache_config.groups
    # room for two requests' first blocks (one per group) and no more: a long request outgrowing its first
    # attention block preempts the other
    cfg = engine_config(config, num_blocks=1 + 2 * len(groups.windows), **kw)
    assert cfg.block_size == 48 and groups.windows.count("mamba") == len(config.mamba_layers)  # vLLM's grown block
    assert not cfg.scheduler_config.prefix_caching
    engine = Engine(build_model(config, "reference"), params, cfg)
    roomy = engine.generate(short, SamplingParams(max_tokens=NEW_SHORT, temperature=0.0))
    assert roomy.summary.preemptions == 0
    _check(roomy, want_short)
    tight = engine.generate(long, SamplingParams(max_tokens=NEW_LONG, temperature=0.0))
    assert tight.summary.preemptions > 0  # recomputed from the prompt: a fresh state at position 0
    _check(tight, want_long)


def test_prefix_caching_is_refused_beside_mamba_layers():
    """vLLM's mamba_cache_mode "none" caches no prefix: off by default, refused when asked for."""
    from kvjax.config.hf import from_hf_config

    config = from_hf_config(hybrid_config("bamba")[0].to_dict())
    assert not EngineArgs(model="bamba", num_gpu_blocks_override=9).create_engine_config(config).cache_config \
        .enable_prefix_caching
    with pytest.raises(KvjaxError, match="mamba_cache_mode"):
        EngineArgs(model="bamba", num_gpu_blocks_override=9, enable_prefix_caching=True).create_engine_config(config)


def test_sized_by_gpu_memory_utilization_with_two_slot_tensors(tmp_path):
    """A 6-layer Bamba (attention layers 1 and 4): vLLM's groups of 2 layers (Mamba [0, 3], Mamba [2, 5], full
    [1, 4]) share 2 slot tensors, each Mamba state inside its block's page, so a pool sized by
    gpu_memory_utilization holds exactly the blocks its budget bought; greedy tokens still equal transformers'."""
    hf = random_model(tf.BambaConfig(**BASE, **MAMBA, num_hidden_layers=6, attn_layer_indices=[1, 4]),
                      tf.BambaForCausalLM, seed=0)
    total, util = 4 << 20, 0.9
    llm = kvjax.LLM(save_hf_model(hf, str(tmp_path / "bamba6")), dtype="float32", max_model_len=64, max_num_seqs=2,
                    max_num_batched_tokens=16, gpu_memory_utilization=util, total_memory_bytes=total)
    groups = llm.vllm_config.cache_config.groups
    assert groups.windows == ("mamba", "mamba", None) and groups.layer_slots == (0, 0, 0, 1, 1, 1)
    # a page: 48 tokens (grown from 16) × K and V × 2 kv heads × head dim 16 × 4 B = 12,288 B ≥ a 10,496 B state
    n, page = llm.num_blocks, 48 * 2 * 2 * 16 * 4
    cache = llm.llm_engine.engine.cache
    assert len(cache.layers) == 2 and cache.kv_nbytes == 2 * n * page  # vLLM's: 2 tensors of n pages, nothing more
    weights = 4 * sum(x.size for x in jax.tree_util.tree_leaves(llm.model.params))
    assert 2 <= n and weights + 2 * n * page <= util * total  # the budget bought the blocks the cache holds
    prompts = _prompts((9, 21), 1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        kvjax.SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    for p, out in zip(prompts, outs):
        tokens, n_ok = hf_greedy(hf, p, 12, MARGIN)
        assert n_ok >= 6 and list(out.outputs[0].token_ids)[:n_ok] == tokens[:n_ok]
