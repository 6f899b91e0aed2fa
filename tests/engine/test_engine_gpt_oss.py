"""The engine's greedy tokens on gpt-oss equal transformers' greedy `generate`.

tests/moe_fixtures.py's tiny random-init gpt-oss (float32; 4 layers, 0 and 2 sliding with a window of 5,
per-head sinks, 8 experts top-2, YaRN RoPE), saved with save_pretrained and loaded with kvjax's loader.
Half of the prompts share an 8-token prefix (two blocks of 4, longer than the window); every request
runs to 20 to 39 tokens, 4 windows and more. Against transformers' greedy generate (eager attention, its
sliding-window DynamicCache, no EOS), the engine runs them:

- with a roomy pool on the grouped allocator (vLLM's hybrid KV cache: the sliding layers' group frees
  the blocks its window left) and prefix caching: the shared prefix hits;
- (slow) with a pool so small that requests are preempted and recomputed;
- with fp8 KV pages (kv_cache_dtype "fp8", e4m3 at vLLM's default scale 1.0): the pages hold 1 byte a
  value, (2 · K · H) bytes a token a layer, and the tokens equal transformers' with every key and value
  its attention reads rounded to e4m3 as kvjax stores them (transformers' eager attention wrapped);
- (slow) with the Pallas decode kernel (interpret mode on CPU), sinks and window in the kernel.

Near-ties are handled as in tests/engine/test_engine_moe.py: each prompt's comparison stops before the
first step whose top-2 logit margin in the reference is below MARGIN; at least 90% of the tokens are compared.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from engine_fixtures import engine_config
from hf_fixtures import hf_greedy, save_hf_model
from moe_fixtures import GPT_OSS_WINDOW, make_gpt_oss_model
from transformers.models.gpt_oss import modeling_gpt_oss

from kvjax.engine.core import Engine
from kvjax.engine.sampling import SamplingParams
from kvjax.models import build_model
from kvjax.models.loader import load_checkpoint

Z = 4
MAX_NEW = 16
MARGIN = 1e-4
SHARED = 8
LENGTHS = (4, 3, 9, 12, 7, 15)  # each prompt's own tokens; odd prompts start with the shared prefix
FP8_MAX = 448.0  # float8_e4m3fn


def _prompts(seed):
    rng = np.random.RandomState(seed)
    shared = [int(t) for t in rng.randint(0, 128, size=SHARED)]
    return [(shared if i % 2 else []) + [int(t) for t in rng.randint(0, 128, size=n)] for i, n in enumerate(LENGTHS)]


PROMPTS = _prompts(0)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    hf = make_gpt_oss_model()
    folder = save_hf_model(hf, str(tmp_path_factory.getbasetemp() / "engine-gpt-oss"))
    config, params = load_checkpoint(folder, dtype="float32")
    assert SHARED > GPT_OSS_WINDOW and all(len(p) + MAX_NEW >= 4 * GPT_OSS_WINDOW for p in PROMPTS)
    return hf, config, params, _reference(hf)


def _reference(hf):
    want = [hf_greedy(hf, p, MAX_NEW, MARGIN) for p in PROMPTS]
    assert sum(n for _, n in want) >= 0.9 * MAX_NEW * len(PROMPTS), "too many near-ties to compare"
    return want


def run(case, attn_impl="reference", num_blocks=96, generate=True, **kw):
    """(the engine, its greedy generation of PROMPTS, or None when not generate)."""
    _, config, params, _ = case
    cfg = engine_config(config, **{"num_blocks": num_blocks, "block_size": Z, "max_num_seqs": 4, "max_model_len": 48,
                                   "enable_prefix_caching": True, "steps_per_call": 8, "attention_backend": attn_impl,
                                   **kw})
    eng = Engine(build_model(config, attn_impl), params, cfg)
    return eng, eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0)) if generate else None


def check(want, result):
    for i, (res, (tokens, n)) in enumerate(zip(result.results, want)):
        assert res.finish_reason in ("stop", "length"), res.finish_reason
        assert res.output[:n] == tokens[:n], f"prompt {i} ({len(PROMPTS[i])} tokens)"


@pytest.mark.slow  # the default run compares gpt-oss with transformers once: test_fp8_kv_pages_and_tokens
def test_matches_transformers_with_prefix_hits(case):
    _, result = run(case)
    check(case[3], result)
    assert result.summary.prefix_hit_tokens >= SHARED  # the shared prefix, longer than the window, hits


@pytest.mark.slow
def test_matches_transformers_with_preemption(case):
    """The smallest pool the scheduler accepts with 8-token chunks (one request's most blocks over both KV
    cache groups, plus the null block): four rows cannot all fit, so requests are preempted and recomputed."""
    probe, _ = run(case, max_num_batched_tokens=8, generate=False)
    _, result = run(case, num_blocks=probe.scheduler_config.blocks_per_request + 1, max_num_batched_tokens=8)
    assert result.summary.preemptions > 0
    check(case[3], result)


def _fp8_eager_attention(attention):
    """transformers' eager attention over keys and values rounded to float8_e4m3fn (saturated at ±448), as
    kvjax's fp8 pages store them at scale 1.0 and read them back."""
    def fp8(x):
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)

    def wrapped(module, query, key, value, *args, **kwargs):
        wrapped.calls += 1
        return attention(module, query, fp8(key), fp8(value), *args, **kwargs)
    wrapped.calls = 0
    return wrapped


def test_fp8_kv_pages_and_tokens(case, monkeypatch):
    hf, config, _, _ = case
    eng, result = run(case, kv_cache_dtype="fp8")
    k, h, layers = config.num_kv_heads, config.head_dim, config.num_layers
    assert eng.cache.layers[0].k.dtype == jnp.float8_e4m3fn
    assert config.kv_spec("fp8").bytes_per_token == layers * 2 * k * h  # one byte a value
    for pages in eng.cache.layers:  # [P, Z, K, H] at 1 byte, one f32 scale per kv head for K and for V
        assert pages.k.nbytes == pages.v.nbytes == pages.k.shape[0] * Z * k * h
        assert pages.k_scale.shape == (k,) and float(pages.k_scale.max()) == 1.0
    assert int(sum(int(p.nonfinite) for p in eng.cache.layers)) == 0
    attention = _fp8_eager_attention(modeling_gpt_oss.eager_attention_forward)
    monkeypatch.setattr(modeling_gpt_oss, "eager_attention_forward", attention)
    want = _reference(hf)
    assert attention.calls > 0, "transformers did not run the fp8 attention"
    check(want, result)
    assert [t for t, _ in want] != [t for t, _ in case[3]], "fp8 rounding changed no token: a weak check"


@pytest.mark.slow
def test_matches_transformers_with_pallas_decode(case):
    _, result = run(case, attn_impl="pallas")
    check(case[3], result)
