"""The engine's greedy tokens equal transformers' greedy `generate` on models with sliding-window layers.

Tiny random-init checkpoints of tests/hf_fixtures.py's SLIDING_CASES, one per family (Mistral,
Qwen2 with use_sliding_window, Gemma 2, Gemma 3; windows of 4 to 7 tokens), saved with
save_pretrained and loaded with kvjax's loader, fp32. Half of the prompts share a 16-token prefix
(four blocks of 4, longer than every window), and each request runs to 30 to 52 tokens, over 4
windows. The engine runs them on the grouped allocator (vLLM's hybrid KV cache) with prefix
caching (the shared prefix hits) and 8 decode steps per call, and, rotating over the families,
with 1 step per call, pools so small that requests are preempted and recomputed (grouped and
with every layer kept full), token budgets that split prompts over several steps, and the
Pallas decode kernel.

Near-ties are handled as there: the comparison of a prompt stops before the first step whose
top-2 margin in transformers is below MARGIN, and at least 90% of the tokens must be compared.
"""
from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import engine_config
from hf_fixtures import hf_greedy, make_hf_model, save_hf_model

from kvjax.engine.core import Engine
from kvjax.engine.sampling import SamplingParams
from kvjax.models import build_model
from kvjax.models.loader import load_checkpoint

Z = 4
MAX_NEW = 24
MARGIN = 1e-4
SHARED = 16  # the shared prefix: 4 blocks, over twice the widest window
LENGTHS = (6, 3, 9, 12, 11, 4)  # each prompt's own tokens; odd prompts start with the shared prefix
FAST = ("gemma2",)  # the case the not-slow suite runs (its default schedule only): window, soft-caps, prefix hits
# The four families (Qwen3 and Gemma 3's soft-capped variant: tests/models/test_sliding_models.py's logits). Each
# runs the default schedule; the other schedules rotate over them (the dense models' test_engine_hf.py runs every
# schedule on every case), which keeps the suite within CI's time.
FAMILIES = ("mistral-window", "qwen2-window", "gemma2", "gemma3")


def _prompts():
    rng = np.random.RandomState(1)
    shared = [int(t) for t in rng.randint(0, 128, size=SHARED)]
    return [(shared if i % 2 else []) + [int(t) for t in rng.randint(0, 128, size=n)] for i, n in enumerate(LENGTHS)]


PROMPTS = _prompts()


PARAMS = [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in FAMILIES]


@pytest.fixture(scope="module", params=PARAMS)
def case(request, tmp_path_factory):
    return make_case(request.param, tmp_path_factory)


def make_case(name, tmp_path_factory):
    """(config, params, transformers' greedy tokens per prompt) of one case."""
    hf = make_hf_model(name)
    folder = save_hf_model(hf, str(tmp_path_factory.getbasetemp() / "engine-sliding" / name))
    config, params = load_checkpoint(folder, dtype="float32")
    windows = [w for w in config.layer_windows if w]
    assert windows and all(len(p) + MAX_NEW >= 4 * max(windows) for p in PROMPTS), "sequences must outrun the window"
    assert SHARED > max(windows)
    want = [hf_greedy(hf, p, MAX_NEW, MARGIN) for p in PROMPTS]
    assert sum(n for _, n in want) >= 0.9 * MAX_NEW * len(PROMPTS), "too many near-ties to compare"
    return config, params, want


def run(case, attn_impl="reference", **kw):
    """The engine over PROMPTS; by default a pool of 64 blocks of every layer's pages: on the grouped
    allocator, whose block is one group's pages, the same bytes in more blocks."""
    config, params, _ = case
    if "num_blocks" not in kw:
        from kvjax.core.kv_cache_groups import kv_cache_groups

        per_block = config.num_layers if kw.get("disable_hybrid_kv_cache_manager") else \
            max(len(g.layers) for g in kv_cache_groups(config.kv_spec(), config.layer_windows, Z))
        kw["num_blocks"] = 64 * config.num_layers // per_block
    cfg = engine_config(config, **{"block_size": Z, "max_num_seqs": 4, "max_model_len": 56,
                                   "attention_backend": attn_impl, **kw})
    return Engine(build_model(config, attn_impl), params, cfg).generate(
        PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))


def check(case, result):
    _, _, want = case
    for i, (res, (tokens, n)) in enumerate(zip(result.results, want)):
        assert res.finish_reason in ("stop", "length"), res.finish_reason
        assert res.output[:n] == tokens[:n], f"prompt {i} ({len(PROMPTS[i])} tokens)"


@pytest.mark.parametrize("prefix_caching, k", [(True, 8)])
def test_matches_transformers(case, prefix_caching, k):
    result = run(case, enable_prefix_caching=prefix_caching, steps_per_call=k)
    check(case, result)
    hits = result.summary.prefix_hit_tokens
    assert hits >= SHARED if prefix_caching else hits == 0  # the shared prefix, longer than the window, hits


def _rotate(*cases_and_args):
    return [pytest.param(c, a, marks=pytest.mark.slow) for c, a in cases_and_args]


@pytest.mark.parametrize("case, k", [("gemma2", 8)] + _rotate(("mistral-window", 1)), indirect=["case"])
def test_grouped_allocator_frees_what_the_window_left(case, k):
    """On the grouped allocator (one block table per KV cache group, vLLM's hybrid KV cache
    manager, the default) the windows' blocks are freed as they move: the same tokens as with
    every layer kept as full attention, and fewer layer pages held at the peak. A block of the
    grouped pool holds one page per layer of a group (vLLM's bytes per block), a block of the
    all-full pool one per layer of the model."""
    from kvjax.core.kv_cache_groups import kv_cache_groups

    config, _, want = case
    groups = kv_cache_groups(config.kv_spec(), config.layer_windows, Z)
    assert any(g.window is not None for g in groups)
    grouped, full = run(case, steps_per_call=k), run(case, steps_per_call=k, disable_hybrid_kv_cache_manager=True)
    check(case, grouped)
    assert [r.output for r in grouped.results] == [r.output for r in full.results]
    per_block = max(len(g.layers) for g in groups)
    assert grouped.summary.peak_blocks_used * per_block < full.summary.peak_blocks_used * config.num_layers


def tight(case) -> int:
    """The smallest grouped pool the scheduler accepts with 8-token chunks: one request's most
    blocks over all groups, plus the null block."""
    config, params, _ = case
    probe = Engine(build_model(config), params, engine_config(
        config, num_blocks=64, block_size=Z, max_num_seqs=4, max_model_len=56, max_num_batched_tokens=8))
    return probe.scheduler_config.blocks_per_request + 1
