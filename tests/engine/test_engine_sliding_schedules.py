"""The sliding-window engine tests' other schedules (tests/engine/test_engine_sliding.py's models,
prompts and comparison), in their own file so that the suite's two workers share them: pools so
small that requests are preempted and recomputed, on the grouped allocator and with every layer
kept full, token budgets that split prompts over several steps, and the Pallas decode kernel
(interpret mode on CPU). Each rotates over the four families."""
from __future__ import annotations

import pytest
from test_engine_sliding import PARAMS, _rotate, check, make_case, run, tight


@pytest.fixture(scope="module", params=PARAMS)
def case(request, tmp_path_factory):
    return make_case(request.param, tmp_path_factory)


@pytest.mark.parametrize("case, k", _rotate(("qwen2-window", 1)), indirect=["case"])
def test_matches_transformers_with_preemption(case, k):
    # 23 usable blocks for 4 rows of up to 13, every layer kept as full attention
    result = run(case, num_blocks=24, steps_per_call=k, disable_hybrid_kv_cache_manager=True)
    assert result.summary.preemptions > 0
    check(case, result)


@pytest.mark.parametrize("case, k", _rotate(("mistral-window", 1), ("gemma3", 8)), indirect=["case"])
def test_matches_transformers_with_preemption_on_groups(case, k):
    """The grouped allocator preempting: the smallest pool the scheduler accepts (one request's
    most blocks, over all groups, plus the null block) for 4 rows, with 8-token chunks."""
    result = run(case, num_blocks=tight(case), steps_per_call=k, max_num_batched_tokens=8)
    assert result.summary.preemptions > 0
    check(case, result)


@pytest.mark.parametrize("case, budget", _rotate(("qwen2-window", 5)), indirect=["case"])
def test_matches_transformers_with_chunked_prefill(case, budget):
    """Prompts split over several steps, a prefix hit followed by a chunked rest, and preemption."""
    result = run(case, num_blocks=24, max_num_batched_tokens=budget, disable_hybrid_kv_cache_manager=True)
    assert result.summary.preemptions > 0 and result.summary.prefix_hit_tokens > 0
    check(case, result)
    result = run(case, max_num_batched_tokens=budget)  # the grouped allocator, chunked, with prefix hits
    assert result.summary.prefix_hit_tokens > 0
    check(case, result)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gemma3"], indirect=True)
def test_matches_transformers_with_pallas_decode(case):
    """The Pallas decode kernel (interpret mode on CPU) with each layer's window and Gemma 2's soft-cap."""
    result = run(case, attn_impl="pallas", num_blocks=tight(case), steps_per_call=8, max_num_batched_tokens=8)
    assert result.summary.preemptions > 0
    check(case, result)
