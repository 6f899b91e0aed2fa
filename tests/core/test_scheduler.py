"""The scheduler with a fake, deterministic "model" that really reads its KV cache.

FakeModel keeps one int per KV slot (P * Z slots). Each step it writes every scheduled
token id at its slot (block_table[p // Z] × Z + p % Z, worked out here from the plan), then, for each request that samples, reads the
request's whole sequence back THROUGH ITS BLOCK TABLE (what attention would read) and
returns crc32(sequence) % VOCAB. A wrong block table, a stale prefix hit, a block reused
while still in use, or a token written to the wrong slot changes the sequence read back,
hence every later token: comparing the streams of a tiny pool (many preemptions) with a
huge one (none) checks the allocator and the scheduler end to end.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from kvjax.config.scheduler import SchedulerConfig
from kvjax.core import block_pool
from kvjax.core import kv_cache_manager as manager
from kvjax.core.sched.scheduler import Scheduler

VOCAB = 50
Z = 4


class FakeModel:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv = np.full(sched.config.num_blocks * Z, -1, np.int64)

    def __call__(self, plan):
        self.kv[slot_mapping(plan)] = plan.token_ids  # every layer writes KV before attending
        out = np.zeros(plan.num_requests, np.int32)
        for i, rid in enumerate(plan.req_ids):
            pos = np.arange(plan.seq_lens[i])
            seq = self.kv[plan.block_tables[i, pos // Z] * Z + pos % Z]
            req = self.sched.requests[rid]
            assert list(seq) == req.tokens[: plan.seq_lens[i]], (
                f"{rid} reads {list(seq)} from its KV, expected {req.tokens[: plan.seq_lens[i]]}")
            out[i] = zlib.crc32(seq.astype(np.int64).tobytes()) % VOCAB
        return out


def positions(plan) -> np.ndarray:
    """i32[T]: the positions of the plan's tokens, request after request."""
    return np.concatenate([np.arange(e - n, e) for n, e in zip(plan.num_scheduled, plan.seq_lens)] or
                          [np.zeros(0, np.int64)]).astype(np.int32)


def slot_mapping(plan) -> np.ndarray:
    """i32[T]: where each of the plan's tokens is written, through its request's block table."""
    row = np.repeat(np.arange(plan.num_requests), plan.num_scheduled)
    pos = positions(plan)
    return plan.block_tables[row, pos // Z] * Z + pos % Z


def workload(n=24, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(10)]  # shared prefix: prefix-cache hits
    reqs = []
    for i in range(n):
        prompt = (system if i % 3 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))]
        reqs.append((f"q{i}", prompt, rng.randint(2, 20), rng.randint(0, 3)))
    return reqs


def run(cfg: SchedulerConfig, reqs, check_every_step=True, arrive_every=2):
    sched = Scheduler(cfg)
    model = FakeModel(sched)
    pending, step = list(reqs), 0
    while pending or sched.has_unfinished():
        if step % arrive_every == 0 and pending:  # requests keep arriving while others run
            rid, prompt, n, prio = pending.pop(0)
            sched.add_request(rid, prompt, n, priority=prio)
        plan = sched.schedule()
        sched.update(plan, model(plan))
        step += 1
        assert step < 5000, "no progress"
        if check_every_step:
            manager.check_invariants(sched.state)
            s = sched.state
            for i, rid in enumerate(plan.req_ids):  # the plan's lengths are what the pool computed
                r = sched.requests[rid]
                if r.status == "running":
                    assert int(s.reqs.num_computed[r.slot]) == plan.seq_lens[i]
            for r in sched.running:  # the pool holds the host's tokens
                assert int(s.reqs.num_tokens[r.slot]) == r.num_tokens
    assert all(r.status == "finished" for r in sched.requests.values())
    s = sched.state
    assert int(s.pool.num_free) == cfg.num_blocks - 1 and not bool(s.pool.ref_cnt.any()), "leaked blocks"
    assert not bool(s.reqs.active.any()), "leaked request slots"
    return {rid: r.output for rid, r in sched.requests.items()}, sched


def config(num_blocks, **kw):
    base = dict(block_size=Z, max_num_seqs=6, max_num_batched_tokens=48, max_model_len=48)
    return SchedulerConfig(num_blocks=num_blocks, **{**base, **kw})


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_tiny_pool_preempts_but_streams_match_a_huge_pool(policy):
    reqs = workload()
    big, s_big = run(config(400, policy=policy), reqs)
    small, s_small = run(config(16, policy=policy), reqs)
    assert s_big.num_preemptions == 0
    assert s_small.num_preemptions > 0
    assert small == big
    assert all(len(big[rid]) == n for rid, _, n, _ in reqs)


def test_streams_match_without_prefix_caching():
    reqs = workload(12, seed=1)
    with_cache, _ = run(config(400), reqs, check_every_step=False)
    small, sched = run(config(14, prefix_caching=False), reqs, check_every_step=False)
    assert sched.num_preemptions > 0 and small == with_cache


def test_preemption_by_hand():
    """Z=4, 6 usable blocks, 2 seqs. Worked out on paper:
    step 1: admit A (8 tokens) -> [1,2], B -> [3,4]; all four cached. Free [5,6]. C waits.
    step 2: A's 9th token -> block 5, B's -> block 6. Free [].
    steps 3-5: positions 9..11 fit; step 5 fills and caches blocks 5 (A) and 6 (B).
    step 6: A's 13th token needs a block, none free: preempt running[-1] = B (release
      6, 4, 3, all hashed -> tail: queue [6,4,3]); A retries and pops 6, evicting B's
      third block. A has its 6th output: finished, releases 6 (unhashed, head), 5, 2, 1
      (tail): queue [6,4,3,5,2,1]. B is at the FRONT of waiting, ahead of C.
    step 7: B re-admitted with 13 tokens: its own blocks 3, 4 still hold its hashes ->
      2 hits (8 tokens); its third block was evicted -> 2 new from the head: 6, 5.
      C (4 tokens, no hit possible) then gets block 2."""
    cfg = SchedulerConfig(num_blocks=7, block_size=Z, max_num_seqs=2, max_num_batched_tokens=64,
                          max_model_len=24)
    sched = Scheduler(cfg)
    model = FakeModel(sched)
    sched.add_request("A", list(range(1, 9)), 6)
    sched.add_request("B", list(range(11, 19)), 8)
    sched.add_request("C", [40, 41, 42, 43], 2)
    plans = []
    for _ in range(7):
        plans.append(sched.schedule())
        sched.update(plans[-1], model(plans[-1]))
        if len(plans) == 6:
            assert [r.req_id for r in sched.waiting] == ["B", "C"]
            assert block_pool.free_queue(sched.state.pool) == [6, 4, 3, 5, 2, 1]
    p1, p2, p6, p7 = plans[0], plans[1], plans[5], plans[6]
    assert p1.req_ids == ("A", "B") and list(p1.num_scheduled) == [8, 8]
    assert [list(t[:2]) for t in p1.block_tables] == [[1, 2], [3, 4]]
    assert list(p2.block_tables[:, 2]) == [5, 6]
    assert p6.req_ids == ("A",) and p6.preempted == ("B",)
    assert list(p6.block_tables[0, :4]) == [1, 2, 5, 6]
    assert sched.requests["A"].status == "finished" and sched.num_preemptions == 1
    assert p7.req_ids == ("B", "C")
    assert list(p7.num_scheduled) == [5, 4]  # B: 13 tokens - 8 hit
    assert list(positions(p7)[:5]) == [8, 9, 10, 11, 12]
    assert list(p7.block_tables[0, :4]) == [3, 4, 6, 5]
    assert list(p7.block_tables[1, :1]) == [2]
    assert list(slot_mapping(p7)[:5]) == [6 * Z + 0, 6 * Z + 1, 6 * Z + 2, 6 * Z + 3, 5 * Z + 0]
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, model(plan))
    assert int(sched.state.pool.num_free) == 6


def test_chunked_prefill_under_a_small_token_budget():
    reqs = [(f"c{i}", list(range(i, i + 30)), 5, 0) for i in range(4)]
    big, _ = run(config(400, max_num_batched_tokens=64), reqs, check_every_step=False)
    small, sched = run(config(400, max_num_batched_tokens=7), reqs, check_every_step=False)
    assert small == big


def test_config_and_request_validation():
    with pytest.raises(ValueError, match="needs 12 blocks but the pool has only 9 usable"):
        SchedulerConfig(num_blocks=10, block_size=Z, max_model_len=48)
    with pytest.raises(ValueError, match="policy must be"):
        SchedulerConfig(num_blocks=40, block_size=Z, policy="lifo")
    sched = Scheduler(config(40))
    with pytest.raises(ValueError, match="> max_model_len=48"):
        sched.add_request("x", [1] * 40, 9)
    sched.add_request("x", [1], 1)
    with pytest.raises(ValueError, match="already used"):
        sched.add_request("x", [1], 1)


def _admission_order(sched: Scheduler, model) -> list[str]:
    order = []
    while sched.has_unfinished():
        plan = sched.schedule()
        order += [r for r in plan.req_ids if r not in order]
        sched.update(plan, model(plan))
    return order


def test_priority_policy_admits_the_most_important_waiting_request_first():
    """One row at a time: with policy "priority" the waiting request with the lowest (priority,
    arrival) goes next (vLLM's priority queue); FCFS would run them in arrival order."""
    sched = Scheduler(config(40, max_num_seqs=1, policy="priority"))
    for rid, prio in (("late", 2), ("urgent", 0), ("mid", 1), ("urgent2", 0)):
        sched.add_request(rid, [1, 2, 3], 2, priority=prio)
    assert _admission_order(sched, FakeModel(sched)) == ["urgent", "urgent2", "mid", "late"]


def test_priority_policy_preempts_the_least_important_running_request():
    """Z=4, 4 usable blocks, 2 rows. A (priority 5) is admitted first, B (priority 0) next, so
    running = [A, B]. When the pool runs dry, FCFS would preempt running[-1] = B; the priority
    policy preempts the request with the largest (priority, arrival): A."""
    for policy, victim in (("priority", "A"), ("fcfs", "B")):
        sched = Scheduler(SchedulerConfig(num_blocks=5, block_size=Z, max_num_seqs=2, max_num_batched_tokens=64,
                                          max_model_len=16, policy=policy))
        model = FakeModel(sched)
        sched.add_request("A", [1, 2, 3, 4], 12, priority=5)
        plan = sched.schedule()
        sched.update(plan, model(plan))
        sched.add_request("B", [5, 6, 7, 8], 12, priority=0)
        preempted = []
        while sched.has_unfinished() and not preempted:
            plan = sched.schedule()
            preempted = list(plan.preempted)
            sched.update(plan, model(plan))
        assert preempted == [victim], policy


def test_token_range_is_the_slice_of_prompt_and_output():
    from kvjax.core.sched.request import Request

    rng = random.Random(0)
    for _ in range(500):
        req = Request("r", [rng.randrange(9) for _ in range(rng.randrange(6))], 5,
                      output=[rng.randrange(9) for _ in range(rng.randrange(6))])
        start = rng.randrange(req.num_tokens + 2)
        end = rng.randrange(start, req.num_tokens + 3)
        assert req.token_range(start, end) == (req.prompt + req.output)[start:end]
