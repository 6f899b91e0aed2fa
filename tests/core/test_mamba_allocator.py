"""Mamba groups in the jittable allocator (kvjax.core.kv_cache_manager with a `MAMBA` window), as vLLM 0.33's
MambaManager in mamba_cache_mode "none": one state block per request from its first allocation to its end,
prefix caching off. Checked against a trace worked out by hand, against kvjax.testing.hybrid_oracle (vLLM's
steps in plain Python, with a Mamba group's own block size, max_model_len) on random op sequences, and the
batched decode step against one request at a time. experiments/vllm_replay_reference.py --mamba runs the same
ops through vLLM's own KVCacheManager (experiments/results/vllm_replay_reference_mamba.md: every state equal)."""
import random

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, settings

from kvjax.core import kv_cache_manager as manager
from kvjax.core.kv_cache_groups import MAMBA
from kvjax.core.replay import ReplayError, iter_trace
from kvjax.errors import KvjaxError
from kvjax.utils.strict_json import dumps
from test_hybrid_allocator import HybridMachine


def _run(ops):
    return [out for out, _ in iter_trace(dumps(op) for op in ops)]


def test_hand_worked_mamba_trace():
    # groups: Mamba, full attention (Z = 4), Mamba; 11 usable blocks
    init = {"op": "init", "num_blocks": 12, "block_size": 4, "prefix_caching": False,
            "groups": [{"type": "mamba"}, {"type": "full_attention"}, {"type": "mamba"}]}
    out = _run([init, {"op": "add", "req": "a", "tokens": [1, 2, 3, 4, 5, 6]},
                {"op": "append", "req": "a", "tokens": [7, 8, 9]},
                {"op": "add", "req": "b", "tokens": list(range(1, 18))},
                {"op": "free", "req": "a"},
                {"op": "add", "req": "c", "tokens": [1, 2, 3]}])
    # a's 6 tokens: one state block in each Mamba group, cdiv(6, 4) = 2 attention blocks, taken group by group
    assert out[1]["new_blocks"] == [[1], [2, 3], [4]] and out[1]["num_free"] == 7
    # 9 tokens: a third attention block; the states stay
    assert out[2]["new_blocks"] == [[], [5], []] and out[2]["blocks"] == [[1], [2, 3, 5], [4]]
    # b needs 1 + cdiv(17, 4) + 1 = 7 blocks, 6 are free: refused, nothing taken
    assert not out[3]["ok"] and out[3]["num_free"] == 6
    # free: group by group, each group's blocks last first, every one to the queue's head (none cached)
    assert out[4]["free_queue"] == [4, 5, 3, 2, 1, 6, 7, 8, 9, 10, 11]
    assert out[5]["new_blocks"] == [[4], [5], [3]]


def test_prefix_caching_with_a_mamba_group_is_refused():
    with pytest.raises(KvjaxError, match="mamba_cache_mode='align', which kvjax does not implement"):
        manager.init(8, 4, 2, prefix_caching=True, windows=(MAMBA, None))
    with pytest.raises(ReplayError, match="mamba_cache_mode='align'"):
        _run([{"op": "init", "num_blocks": 8, "block_size": 4, "groups": [{"type": "mamba"}, {"type": "full_attention"}]}])
    with pytest.raises(ReplayError, match=r"or \{\"type\": \"mamba\"\}"):
        _run([{"op": "init", "num_blocks": 8, "block_size": 4, "prefix_caching": False,
               "groups": [{"type": "mamba", "sliding_window": 4}]}])
    with pytest.raises(KvjaxError, match="attention-free"):
        manager.init(8, 4, 2, prefix_caching=False, windows=(MAMBA,))


def _same(a, b):
    return all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_allocate_step_with_mamba_groups_equals_one_at_a_time():
    """Requests decode until the pool runs out: the batched step must leave exactly the state of
    allocate_slots one request at a time, take no block in a Mamba group after the first, and refuse at
    the same place."""
    z, rng = 2, random.Random(3)
    s = manager.init(24, z, 6, 24, prefix_caching=False, windows=(MAMBA, None, MAMBA))
    for r, toks in enumerate([[1, 2, 3, 4, 5], [7] * 3, [4, 4, 4, 4, 4, 4, 4]]):
        t = jnp.zeros(48, jnp.int32).at[:len(toks)].set(jnp.asarray(toks))
        s, ok = manager.add_request(s, r, t, len(toks))
        s, ok2 = manager.allocate_slots(s, r, len(toks))
        assert bool(ok) and bool(ok2)
    assert [int(x) for x in s.reqs.num_held[:3, 0]] == [1, 1, 1]
    order = jnp.array([2, 0, 1, -1, -1, -1], jnp.int32)
    seq, refused = s, False
    for step in range(40):
        tok = jnp.asarray([rng.randrange(9) for _ in range(6)], jnp.int32)
        s, _ = manager.append_token_step(s, tok, jnp.arange(6) < 3)
        _, fits = manager.step_fits(s, order, jnp.ones(6, jnp.int32))
        s, ok = manager.allocate_step(s, order, jnp.ones(6, jnp.int32))
        oks = []
        for r in (2, 0, 1):
            seq, _ = manager.append_tokens(seq, r, tok[r:r + 1], 1)
            if oks and not oks[-1]:
                oks.append(False)
                continue
            seq, ok1 = manager.allocate_slots(seq, r, 1)
            oks.append(bool(ok1))
        assert [bool(ok[i]) for i in range(3)] == oks and bool(fits) == all(oks), f"step {step}"
        assert _same(s, seq), f"step {step}"
        manager.check_invariants(s)
        assert (s.reqs.num_held[:3, 0] == 1).all() and (s.reqs.num_held[:3, 2] == 1).all(), "one state block each"
        if not all(oks):
            refused = True
            break
    assert refused, "the attention group should run the pool out"


class MambaMachine(HybridMachine):
    prefix_caching, windows = False, (MAMBA, None, MAMBA)


class AttentionFirstMambaMachine(HybridMachine):
    prefix_caching, windows = False, (None, MAMBA, 3)


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestMambaMachine = MambaMachine.TestCase
TestMambaMachine.settings = settings(max_examples=8, stateful_step_count=25, **_SETTINGS)


@pytest.mark.slow
class TestAttentionFirstMambaMachine(AttentionFirstMambaMachine.TestCase):
    """A Mamba group between a full and a sliding one (attention first, as Falcon-H1 orders its layers)."""
    settings = settings(max_examples=10, stateful_step_count=25, **_SETTINGS)
