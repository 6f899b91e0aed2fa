"""The scheduler's first-block record (kvjax.core.sched.first_blocks): it skips a prefix search
only where the search would find nothing, so every decision is the same as searching every time."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kvjax.config.scheduler import SchedulerConfig
from kvjax.core import kv_cache_manager as manager
from kvjax.core.sched import first_blocks
from kvjax.core.sched.request import Request
from kvjax.core.sched.scheduler import Scheduler

Z = 4


def test_a_first_block_may_hit_once_an_earlier_request_had_it():
    fb = first_blocks.FirstBlocks(Z)
    a = Request("a", [1, 2, 3, 4, 5], 3)
    assert not fb.may_hit(a)  # nobody had [1, 2, 3, 4]
    fb.add(a)
    assert fb.may_hit(Request("b", [1, 2, 3, 4, 9, 9], 3))
    assert not fb.may_hit(Request("c", [1, 2, 3, 5, 9, 9], 3))  # another first block
    assert not fb.may_hit(Request("d", [1, 2, 3, 4, 9, 9], 3, salt="x"))  # another salt
    assert not fb.may_hit(Request("e", [1, 2, 3, 4], 3))  # 4 tokens: the last is computed, no block to hit


def test_a_short_prompt_is_recorded_when_its_output_fills_the_first_block():
    fb = first_blocks.FirstBlocks(Z)
    a, short = Request("a", [1, 2], 5), Request("s", [7], 2)
    fb.add(a), fb.add(short)
    assert fb.pending == {a, short}
    a.output += [3, 4]
    short.status = "finished"  # finished with 1 + 0 tokens: its first block was never full
    fb.grown()
    assert fb.pending == set()
    assert fb.may_hit(Request("b", [1, 2, 3, 4, 5], 3))
    assert not fb.may_hit(Request("c", [7, 0, 0, 0, 5], 3))


class _AlwaysSearch(first_blocks.FirstBlocks):
    def may_hit(self, req):
        return req.num_tokens > self.block_size


def _run(cfg, reqs, always_search: bool):
    """The workload through a Scheduler, tokens sampled by a fixed rule; → (plans, final pool)."""
    sched = Scheduler(cfg)
    if always_search:
        sched.first_blocks = _AlwaysSearch(Z)
    plans, pending, step = [], list(reqs), 0
    while pending or sched.has_unfinished():
        if step % 2 == 0 and pending:
            sched.add_request(*pending.pop(0))
        plan = sched.schedule()
        plans.append((plan.req_ids, plan.num_scheduled.tolist(), (plan.seq_lens - plan.num_scheduled).tolist(),
                      plan.block_tables.tolist()))
        sched.update(plan, [(len(rid) + step) % 3 for rid in plan.req_ids])  # few ids: outputs share blocks
        step += 1
    return plans, manager.canonical(sched.state)


@pytest.mark.parametrize("num_blocks", [12, 64])  # preempting, and not
def test_decisions_equal_searching_every_time(num_blocks):
    rng = np.random.default_rng(0)
    shared = [5, 6, 7, 8, 9, 1]
    reqs = []
    for i in range(30):  # shared prefixes, prompts shorter than a block, outputs that fill first blocks
        prompt = (shared[:rng.integers(1, 7)] if i % 2 else []) + rng.integers(0, 3, rng.integers(1, 9)).tolist()
        reqs.append((f"r{i}", prompt, int(rng.integers(2, 9))))
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=Z, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=40)
    fast, slow = _run(cfg, reqs, False), _run(cfg, reqs, True)
    assert fast[0] == slow[0]
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(fast[1]), jax.tree.leaves(slow[1])))
    assert any(start > 0 for _, _, starts, _ in fast[0] for start in starts[:1])  # hits happened


def test_a_short_prompts_output_block_is_hit_by_a_later_request():
    """By hand: "a" has a 2-token prompt and samples 10, 11, 12, ...; its first block [1, 2, 10, 11]
    is full and computed after its third step. "b" = that block + 2 tokens then hits it: 4 tokens
    computed before its first step."""
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=Z, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=32))
    sched.add_request("a", [1, 2], 6)
    for k in range(4):  # a's prompt, then its 10, 11, 12 computed (block 0 full and cached)
        plan = sched.schedule()
        sched.update(plan, [10 + k])
    assert sched.output("a") == [10, 11, 12, 13]
    sched.add_request("b", [1, 2, 10, 11, 3, 3], 2)
    plan = sched.schedule()
    i = plan.req_ids.index("b")
    assert int(plan.seq_lens[i] - plan.num_scheduled[i]) == Z
    assert plan.block_tables[i, 0] == plan.block_tables[plan.req_ids.index("a"), 0]
