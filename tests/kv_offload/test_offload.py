"""The host offload tier wired into the scheduler and engine (kvjax.kv_offload.host_pages, kvjax.kv_offload.manager).

* Host pages: a block copied out and back in is the same bytes in every per-block array
  (bf16, fp8 with static scales, int8 with per-token scale pages, MLA latents), in
  pinned_host memory and in NumPy; one page holds exactly the block's bytes, worked by hand.
* Scheduler: a prompt whose prefix is half on the device and half in the host tier loads
  exactly the missing half, into the fresh blocks after the device hits (worked on paper).
* Engine: greedy tokens are identical with the tier on and off, with preemption, prefix
  caching and 1 or 4 decode steps per call; with a tier large enough for the whole multi-turn
  workload only the unshared remainder is prefilled (counted by hand).
* Bad sizes and policies are refused with the value named.

The model and engine shapes are tests/engine/test_engine.py's (compiled steps are shared).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import Z, assert_pool_empty, engine, greedy, outputs, tiny  # noqa: F401

from kvjax.config.scheduler import SchedulerConfig
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.core.sched.scheduler import Scheduler
from kvjax.errors import KvjaxError
from kvjax.experiments.offload_bench import chat_workload
from kvjax.kv_offload import host_pages as offload
from kvjax.kv_offload import manager as host_cache
from kvjax.worker.paged_cache import PagedCache


# ----------------------------------------------------------------------------------- host pages
def _random_cache(spec: KVSpec, num_blocks: int, seed: int) -> PagedCache:
    """A cache whose per-block arrays hold random values of their dtypes (scales untouched)."""
    cache = PagedCache.create(spec, num_blocks, Z)  # fp8: vLLM's default scales, 1.0
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))

    def fill(x):
        if x.ndim < 2:
            return x
        return jax.random.uniform(next(keys), x.shape, jnp.float32, -2, 2).astype(x.dtype)

    return jax.tree_util.tree_map(fill, cache)


SPECS = {  # (spec, bytes per block by hand: layers × (K and V) × Z × kv heads × head dim × itemsize)
    "bf16": (KVSpec("gqa", 3, 8, 2, 16, kv_dtype="bf16"), 3 * 2 * Z * 2 * 16 * 2),
    "fp8": (KVSpec("gqa", 2, 8, 2, 16, kv_dtype="fp8_e4m3"), 2 * 2 * Z * 2 * 16 * 1),
    "int8": (KVSpec("gqa", 2, 8, 2, 16, kv_dtype="int8_per_token_head"),
             2 * 2 * Z * 2 * (16 * 1 + 4)),  # + an f32 scale per token and kv head
    "mla": (KVSpec.mla(2, 4, kv_lora_rank=32, qk_rope_head_dim=8, kv_dtype="bf16"), 2 * Z * (32 + 8) * 2),
}


@pytest.mark.parametrize("kind", ["pinned_host", "numpy"])
@pytest.mark.parametrize("name", list(SPECS))
def test_a_block_copied_out_and_back_is_the_same_bytes(name, kind):
    spec, nbytes = SPECS[name]
    src = _random_cache(spec, 9, seed=1)
    before = jax.device_get(src)
    pages = offload.HostPages(4, src, memory_kind=kind)
    assert pages.memory_kind == kind and pages.bytes_per_block == nbytes == spec.bytes_per_block(Z)
    pages.store(src, [3, 5, 8], [2, 0, 3])
    assert pages.bytes_stored == 3 * nbytes
    fresh = jax.device_get(PagedCache.create(spec, 9, Z))
    dst = pages.load(PagedCache.create(spec, 9, Z), [0, 2, 3], [1, 6, 7])
    assert pages.bytes_loaded == 3 * nbytes
    after = jax.device_get(dst)
    moved = {1: 5, 6: 3, 7: 8}  # destination block -> source block
    leaves = zip(*(jax.tree_util.tree_leaves(c) for c in (after, before, fresh)))
    for got, want, untouched in ((np.asarray(x) for x in t) for t in leaves):
        if got.ndim < 2:  # static scales and counters stay as the fresh cache has them
            np.testing.assert_array_equal(got, untouched)
            continue
        for b in range(1, 9):  # block 0 takes padding writes
            expect = want[moved[b]] if b in moved else untouched[b]
            np.testing.assert_array_equal(got[b].view(np.uint8), expect.view(np.uint8), err_msg=f"block {b}")


def test_host_pages_refuse_a_missing_page_and_an_unknown_memory_kind():
    spec, _ = SPECS["bf16"]
    cache = PagedCache.create(spec, 4, Z)
    with pytest.raises(offload.OffloadError, match="memory kind must be"):
        offload.HostPages(2, cache, memory_kind="disk")
    with pytest.raises(offload.OffloadError, match="slot 1 holds no page"):
        offload.HostPages(2, cache).load(cache, [1], [2])


def test_host_blocks_is_whole_bytes_over_block_bytes():
    assert offload.host_blocks(1, 1000) == 2**30 // 1000
    assert offload.host_blocks("0.5", 4096) == 2**29 // 4096
    assert offload.host_blocks(0, 4096) == 0
    for bad, says in [(-1, "'-1'"), ("abc", "'abc'"), (float("nan"), "nan"), ("inf", "'inf'"),
                      (1e-9, "smaller than one block of 4,096 bytes")]:
        with pytest.raises(KvjaxError, match=says):
            offload.host_blocks(bad, 4096)
    with pytest.raises(offload.OffloadError, match="'lfu'"):
        offload.check_policy("lfu")


# ----------------------------------------------------------------------------------- scheduler
def _run_alone(sched: Scheduler, rid: str, prompt: list[int]):
    """Add a 1-token request and run it to the end without a model; -> its first plan."""
    sched.add_request(rid, prompt, 1)
    first = plan = sched.schedule()
    while True:
        sched.update(plan, np.zeros(plan.num_requests, np.int32))
        if not sched.has_unfinished():
            return first
        plan = sched.schedule()


def test_a_prefix_half_on_device_half_on_host_loads_exactly_the_missing_half():
    # 6 usable blocks of 4 tokens, a host tier of 16 blocks.
    sched = Scheduler(SchedulerConfig(num_blocks=7, block_size=4, max_num_seqs=2, max_model_len=24,
                                      num_host_blocks=16))
    a = list(range(100, 117))  # 17 tokens: 4 full blocks + 1
    plan = _run_alone(sched, "a", a)
    a_blocks = plan.block_tables[0, :4].tolist()
    assert a_blocks == [1, 2, 3, 4] and len(plan.loads) == 0
    # After the step its 4 full blocks went to host slots 0..3, in order.
    held = {h: s for h, s, _ in host_cache.entries(sched.host)["lru"]}
    assert sorted(held.values()) == [0, 1, 2, 3]
    # A ended: its blocks sit in the free queue, the partial block 5 at the head, the cached ones
    # at the tail, last block first (vLLM frees in reverse so a prefix is evicted from its end):
    # queue = 5, 6, 4, 3, 2, 1. B's 16 tokens take 4 blocks from the head: 5, 6, then A's 4 and 3.
    plan = _run_alone(sched, "b", list(range(200, 216)))
    assert plan.block_tables[0, :4].tolist() == [5, 6, 4, 3]
    # A again: blocks 1 and 2 still hold its first two blocks (2 device hits); its blocks 3 and 4
    # were evicted, and are loaded from host slots 2 and 3 into two fresh blocks. Only the 17th
    # token is computed.
    sched.add_request("a2", a, 1)
    plan = sched.schedule()
    table = plan.block_tables[0].tolist()
    assert table[:2] == [1, 2]
    assert plan.loads.tolist() == [[2, table[2]], [3, table[3]]]
    assert plan.num_scheduled.tolist() == [1] and plan.seq_lens.tolist() == [17]
    assert plan.token_ids.tolist() == [116]
    assert sched.host_hit_tokens == 8
    # Loads pin their slots until the engine says they are copied.
    assert sorted(r for _, _, r in host_cache.entries(sched.host)["lru"]) == [0] * 6 + [1, 1]
    sched.loads_done(plan)
    assert all(r == 0 for _, _, r in host_cache.entries(sched.host)["lru"])
    host_cache.check_invariants(sched.host)


def test_admission_touches_every_block_hash_and_device_hits_are_offered_again():
    """vLLM's connector at admission touches all of a request's full-block hashes, resident or
    not (an ARC ghost hit moves p), and offers the tier a request's blocks from block 0, device
    hits included, unless it loaded host hits. Worked by hand: 6 usable blocks of 4 tokens, a
    tier of 2 slots; a (9 tokens: a1, a2) runs, then b (b1, b2) evicts a1, a2 from the tier
    but not from the device (the queue after a is 3, 4, 5, 6, 2, 1: b takes 3, 4, 5)."""
    a, b = list(range(100, 109)), list(range(200, 209))
    for policy in ("lru", "arc"):
        sched = Scheduler(SchedulerConfig(num_blocks=7, block_size=4, max_num_seqs=1, max_model_len=16,
                                          num_host_blocks=2, host_policy=policy))
        _run_alone(sched, "a", a)
        a_hashes = [h for h, _, _ in host_cache.entries(sched.host)["t1" if policy == "arc" else "lru"]]
        _run_alone(sched, "b", b)
        sched.take_stores()
        e = host_cache.entries(sched.host)
        assert not set(a_hashes) & {h for h, _, _ in e["t1" if policy == "arc" else "lru"]}
        sched.add_request("a2", a, 1)
        plan = sched.schedule()
        assert plan.block_tables[0, :2].tolist() == [1, 2] and len(plan.loads) == 0  # 2 device hits
        if policy == "arc":
            # a1, a2 are in B1 (|B1| = 2, |B2| = 0): each ghost hit raises p by max(1, 0 // 2) = 1.
            assert int(sched.host.target) == 2
            continue
        sched.update(plan, np.zeros(1, np.int32))
        # LRU: after the step, a1 and a2 (the device hits, blocks 1 and 2) go back to the tier,
        # evicting b's two blocks.
        assert sorted(blk for blk, _ in sched.take_stores()) == [1, 2]
        assert sorted(h for h, _, _ in host_cache.entries(sched.host)["lru"]) == sorted(a_hashes)


def test_scheduler_config_refuses_a_tier_without_prefix_caching():
    with pytest.raises(KvjaxError, match="num_host_blocks=4"):
        SchedulerConfig(num_blocks=7, block_size=4, num_host_blocks=4, prefix_caching=False, max_model_len=8)
    with pytest.raises(KvjaxError, match="num_host_blocks=-1"):
        SchedulerConfig(num_blocks=7, block_size=4, num_host_blocks=-1, max_model_len=8)


# ----------------------------------------------------------------------------------- engine
def unshared(prompts, n_conv):
    """Prefill tokens when every earlier turn's full blocks are found: each conversation's first
    prompt whole, then each later prompt less its predecessor's full blocks (at most
    (len - 1) // Z of them, so the last token is computed)."""
    total = 0
    for i, p in enumerate(prompts):
        if i < n_conv:
            total += len(p)
        else:
            total += len(p) - Z * min(len(prompts[i - n_conv]) // Z, (len(p) - 1) // Z)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_tokens_are_identical_with_the_tier_on_and_off(tiny, k):
    # 4 conversations × 3 turns of 9, 16 and 23 tokens, interleaved (experiments/offload_bench.py).
    ps = chat_workload(4, 3, first=9, new=7, vocab=128)
    runs = {}
    tiers = [(0, "lru"), (64, "lru"), (64, "arc"), (3, "lru")] if k == 1 else [(0, "lru"), (64, "lru")]
    for host, policy in tiers:
        eng = engine(tiny, num_blocks=14, max_num_seqs=2, steps_per_call=k, kv_offload_blocks=host,
                     kv_offload_policy=policy)
        runs[host, policy] = run = eng.generate(ps, greedy(3))
        assert_pool_empty(eng)
        if host:
            host_cache.check_invariants(eng.scheduler.host)
    off = runs[0, "lru"]
    assert off.summary.preemptions > 0, "the workload should preempt"
    assert off.summary.host_blocks == 0 and off.summary.host_memory_kind is None
    for key, run in runs.items():
        assert outputs(run) == outputs(off), key
    big = runs[64, "lru"].summary
    # 12 prompts of 9 / 16 / 23 tokens: 4 × (9 + 8 + 7) = 96 tokens prefilled, 72 loaded (18 blocks).
    assert unshared(ps, 4) == 96
    assert big.prefill_tokens == 96 < off.summary.prefill_tokens
    assert big.host_hit_tokens == 72 and big.host_bytes_loaded == 18 * eng.host_pages.bytes_per_block
    assert big.host_memory_kind == "pinned_host" and big.host_blocks == 64
    # Every block computed in full was stored once. Per conversation: turn 1 computes 9 + 2 tokens (2
    # full blocks), turn 2 16 + 2 (2 more), turn 3 23 + 2 (2 more, the last holding a generated token).
    assert big.host_blocks_in_use == 4 * 6 and big.host_bytes_stored == 24 * eng.host_pages.bytes_per_block
    if k == 1:
        assert runs[64, "arc"].summary.prefill_tokens == 96
        assert runs[3, "lru"].summary.host_blocks_in_use == 3


def test_engine_refuses_bad_tier_settings(tiny):
    for kw, says in [(dict(kv_offloading_size=-1), r"kv_offloading_size must be in \[0, 1048576\] GiB, got -1"),
                     (dict(kv_offloading_size="2"), "kv_offloading_size must be a finite number"),
                     (dict(kv_offloading_size=1e-9), "smaller than one block"),
                     (dict(kv_offloading_size=1, kv_transfer_config={"kv_connector_extra_config": {
                         "eviction_policy": "mru"}}), "'mru'"),
                     (dict(kv_offloading_size=1, enable_prefix_caching=False), "needs prefix caching")]:
        with pytest.raises(KvjaxError, match=says):
            engine(tiny, **kw)