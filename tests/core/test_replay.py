"""`kvjax replay`: the issue-3 acceptance trace through the command, plus scenarios worked
out on paper from the rules in kvjax/core/block_pool.py's docstring. Every expected value below was
written by hand (the derivation is in the comments), never produced by the code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvjax.core.kv_cache_utils import request_block_hashes_np
from kvjax.core.replay import ReplayError, iter_trace
from kvjax.testing.pool_oracle import OraclePool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
C = [0] * 16 + [1] * 16 + [2] * 16


def init(num_blocks, block_size, prefix_caching=True, **host):
    return {"op": "init", "num_blocks": num_blocks, "block_size": block_size,
            "prefix_caching": prefix_caching, **host}


def add(req, tokens, salt=None):
    op = {"op": "add", "req": req, "tokens": tokens}
    if salt is not None:
        op["salt"] = salt
    return op


def append(req, tokens):
    return {"op": "append", "req": req, "tokens": tokens}


def free(req):
    return {"op": "free", "req": req}


RESET = {"op": "reset_prefix_cache"}


def run_lib(ops):
    return [out for out, _ in iter_trace(json.dumps(o) for o in ops)]


def run_oracle(ops):
    outs, o = [], None
    for op in ops:
        kind = op["op"]
        if kind == "init":
            o = OraclePool(op["num_blocks"], op["block_size"], op.get("prefix_caching", True))
            outs.append(o.view("init", None, True))
        elif kind == "add":
            outs.append(o.add(op["req"], op["tokens"], op.get("salt")))
        elif kind == "append":
            outs.append(o.append(op["req"], op["tokens"]))
        elif kind == "free":
            outs.append(o.free(op["req"]))
        else:
            outs.append(o.reset_prefix_cache())
    return outs


def run_cli(ops, tmp_path, *args):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in ops))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "kvjax.commands.replay", str(path), *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def check(outs, expected):
    """expected: one dict of hand-computed fields per op (missing fields not checked)."""
    assert len(outs) == len(expected)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        for k, v in exp.items():
            assert out[k] == v, f"op {i} ({out['op']} {out['req']}): {k} = {out[k]}, expected {v}"


ACCEPTANCE = [init(11, 16), add("r0", C + [3] * 7), add("r1", C + [3] * 5), free("r0"), free("r1"),
              add("r2", C + [3] * 6), free("r2"), add("r3", [99] * 160)]
ACCEPTANCE_EXPECTED = [
    {"ok": True, "free_queue": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "num_free": 10, "usage": 0.0},
    # 55 tokens -> 4 blocks popped from the head; 3 full blocks cached.
    {"ok": True, "hit_blocks": [], "new_blocks": [1, 2, 3, 4], "blocks": [1, 2, 3, 4],
     "cached": [1, 2, 3], "num_free": 6, "free_queue": [5, 6, 7, 8, 9, 10]},
    # 53 tokens: hit cap 52 tokens = 3 blocks, all cached; cdiv(53,16)=4 - 3 = 1 new.
    {"ok": True, "hit_blocks": [1, 2, 3], "hit_tokens": 48, "new_blocks": [5],
     "blocks": [1, 2, 3, 5], "num_free": 5,
     "ref_cnt": {"1": 2, "2": 2, "3": 2, "4": 1, "5": 1}, "usage": 0.5},
    # release 4,3,2,1: only 4 reaches 0, unhashed -> head.
    {"ok": True, "free_queue": [4, 6, 7, 8, 9, 10], "ref_cnt": {"1": 1, "2": 1, "3": 1, "5": 1}},
    # release 5,3,2,1: 5 unhashed -> head; 3,2,1 hashed -> tail in that order.
    {"ok": True, "free_queue": [5, 4, 6, 7, 8, 9, 10, 3, 2, 1], "num_free": 10, "ref_cnt": {}},
    # hits 1,2,3 (ref 0: touching takes them out of the queue), 1 new from the head = 5.
    {"ok": True, "hit_blocks": [1, 2, 3], "new_blocks": [5], "blocks": [1, 2, 3, 5],
     "num_free": 6, "free_queue": [4, 6, 7, 8, 9, 10]},
    {"ok": True, "free_queue": [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]},
    # 160 tokens = 10 blocks, the whole queue in order; 3,2,1 are evicted as they are popped.
    {"ok": True, "hit_blocks": [], "blocks": [5, 4, 6, 7, 8, 9, 10, 3, 2, 1], "num_free": 0,
     "free_queue": [], "usage": 1.0, "cached": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]},
]


def test_acceptance_through_the_command(tmp_path):
    res = run_cli(ACCEPTANCE, tmp_path)
    assert res.returncode == 0, res.stderr
    outs = [json.loads(line) for line in res.stdout.splitlines()]
    check(outs, ACCEPTANCE_EXPECTED)
    assert list(outs[1]) == ["op", "req", "ok", "hit_blocks", "hit_tokens", "new_blocks", "blocks",
                             "free_queue", "num_free", "ref_cnt", "cached", "usage"]


def test_show_draws_the_pool(tmp_path):
    res = run_cli(ACCEPTANCE[:3], tmp_path, "--show")
    assert res.returncode == 0, res.stderr
    text = res.stdout
    # after r1: blocks 1-3 shared (ref 2), r1's logical block 3 lives in physical block 5
    assert "ref   |  2  2  2  1  1  .  .  .  .  ." in text
    assert "r1    |  0  1  2  .  3  .  .  .  .  ." in text
    assert "free queue (head -> tail): 6 7 8 9 10" in text


# Z=4, 8 usable blocks. LRU eviction order, and a failed add that changes nothing.
EVICTION = [init(9, 4), add("a", [1] * 4 + [2] * 4 + [3] * 4 + [4]), free("a"), add("b", [9] * 9),
            add("c", [8] * 12 + [7]), add("d", [1] * 4 + [2] * 4 + [5]), free("b"),
            add("d", [1] * 4 + [2] * 4 + [5])]
EVICTION_EXPECTED = [
    {"free_queue": [1, 2, 3, 4, 5, 6, 7, 8]},
    {"blocks": [1, 2, 3, 4], "cached": [1, 2, 3]},
    # release 4 (no hash) -> head; 3, 2, 1 -> tail: a's tail is evicted before its prefix.
    {"free_queue": [4, 5, 6, 7, 8, 3, 2, 1]},
    # 3 blocks from the head; two full blocks of 9s cached.
    {"blocks": [4, 5, 6], "cached": [1, 2, 3, 4, 5], "free_queue": [7, 8, 3, 2, 1]},
    # 4 blocks: 7, 8, then 3 and 2 are evicted; c's 3 full blocks cached on 7, 8, 3.
    {"blocks": [7, 8, 3, 2], "cached": [1, 3, 4, 5, 7, 8], "free_queue": [1], "num_free": 1},
    # d hits block 1 (a's first block) but a's second block was evicted: hits [1];
    # needs 3 - 1 = 2 new + 1 for the ref-0 hit = 3 > 1 free -> fails, nothing touched.
    {"ok": False, "blocks": [], "new_blocks": [], "free_queue": [1], "num_free": 1,
     "cached": [1, 3, 4, 5, 7, 8], "ref_cnt": {"2": 1, "3": 1, "4": 1, "5": 1, "6": 1, "7": 1, "8": 1}},
    # release 6 (no hash) -> head, 5 and 4 -> tail.
    {"free_queue": [6, 1, 5, 4], "num_free": 4},
    # now 3 <= 4: touch 1, pop 6 and 5 (5 loses b's hash); d's block 1 cached on 6.
    {"ok": True, "hit_blocks": [1], "hit_tokens": 4, "new_blocks": [6, 5], "blocks": [1, 6, 5],
     "free_queue": [4], "cached": [1, 3, 4, 6, 7, 8]},
]

# Z=4, 5 usable blocks. Decode-style appends fill and cache blocks; sharing; a failed append.
DECODE = [init(6, 4), add("a", [5, 6, 7]), append("a", [8]), append("a", [9]),
          append("a", [10, 11, 12]), append("a", [13, 14, 15, 16, 17]),
          add("b", [5, 6, 7, 8, 9, 10, 11, 12, 0]), append("a", [18]), append("a", [19, 20, 21])]
DECODE_EXPECTED = [
    {},
    {"blocks": [1], "cached": []},  # 3 tokens: no full block yet
    {"new_blocks": [], "blocks": [1], "cached": [1]},  # 4th token fills block 1 -> cached
    {"new_blocks": [2], "blocks": [1, 2], "cached": [1]},
    {"new_blocks": [], "cached": [1, 2]},  # tokens 5..8 fill block 2
    {"new_blocks": [3, 4], "blocks": [1, 2, 3, 4], "cached": [1, 2, 3], "free_queue": [5]},
    # b shares a's first two blocks (hit cap 8 tokens = 2 blocks); 1 new block; pool full.
    {"ok": True, "hit_blocks": [1, 2], "hit_tokens": 8, "new_blocks": [5], "num_free": 0,
     "ref_cnt": {"1": 2, "2": 2, "3": 1, "4": 1, "5": 1}},
    {"ok": True, "new_blocks": [], "blocks": [1, 2, 3, 4]},  # 14 tokens still fit in 4 blocks
    # 17 tokens need a 5th block, none free: fails; block 4 (now full) is NOT cached.
    {"ok": False, "blocks": [1, 2, 3, 4], "cached": [1, 2, 3], "num_free": 0},
]

# Prefix caching off: no hashes, no hits, every freed block goes to the head in release order.
NO_CACHE = [init(6, 4, False), add("a", [1, 2, 3, 4, 5]), add("b", [1, 2, 3, 4, 6]), free("a"),
            free("b"), add("c", [1, 2, 3, 4, 5])]
NO_CACHE_EXPECTED = [
    {}, {"blocks": [1, 2], "cached": []},
    {"hit_blocks": [], "blocks": [3, 4], "cached": [], "free_queue": [5]},
    {"free_queue": [2, 1, 5]},
    {"free_queue": [4, 3, 2, 1, 5]},
    {"hit_blocks": [], "blocks": [4, 3], "free_queue": [2, 1, 5], "cached": []},
]

# Cache salt on the first block: only same-salt requests share.
T9 = [1, 2, 3, 4, 5, 6, 7, 8, 9]
SALT = [init(9, 4), add("a", T9, "alice"), add("b", T9), free("b"), add("c", T9, "alice"),
        add("d", T9, "bob")]
SALT_EXPECTED = [
    {}, {"blocks": [1, 2, 3], "cached": [1, 2]},
    {"hit_blocks": [], "blocks": [4, 5, 6], "cached": [1, 2, 4, 5]},  # unsalted: no hit
    {"free_queue": [6, 7, 8, 5, 4]},
    {"hit_blocks": [1, 2], "new_blocks": [6], "ref_cnt": {"1": 2, "2": 2, "3": 1, "6": 1},
     "free_queue": [7, 8, 5, 4]},
    # another salt: no hit; pops 7, 8, 5 (5 loses b's hash); blocks 7, 8 cached.
    {"hit_blocks": [], "blocks": [7, 8, 5], "cached": [1, 2, 4, 7, 8], "free_queue": [4]},
]

# reset_prefix_cache refuses while blocks are held; after it, nothing hits.
RESET_TRACE = [init(6, 4), add("a", T9), RESET, free("a"), RESET, add("b", T9)]
RESET_EXPECTED = [
    {}, {"blocks": [1, 2, 3], "cached": [1, 2]},
    {"op": "reset_prefix_cache", "req": None, "ok": False, "cached": [1, 2], "num_free": 2},
    {"free_queue": [3, 4, 5, 2, 1]},
    {"ok": True, "cached": [], "free_queue": [3, 4, 5, 2, 1]},  # queue order is kept
    {"hit_blocks": [], "blocks": [3, 4, 5], "cached": [3, 4], "free_queue": [2, 1]},
]

# Identical hashes are kept on several blocks; a lookup returns the one cached first.
DUP = [init(9, 4), add("a", [1] * 4), add("b", [1] * 4), add("c", [1] * 4 + [7]), free("a"),
       free("c"), add("d", [1] * 4 + [9])]
DUP_EXPECTED = [
    {}, {"blocks": [1], "cached": [1]},
    # 4 tokens: hit cap 3 tokens = 0 blocks, so b recomputes into block 2: duplicate hash.
    {"hit_blocks": [], "blocks": [2], "cached": [1, 2]},
    {"hit_blocks": [1], "new_blocks": [3], "ref_cnt": {"1": 2, "2": 1, "3": 1}},  # 1 is older
    {"ref_cnt": {"1": 1, "2": 1, "3": 1}, "free_queue": [4, 5, 6, 7, 8]},
    {"free_queue": [3, 4, 5, 6, 7, 8, 1]},
    # block 1 (ref 0, in the queue) still wins over block 2 (held): costs a free slot.
    {"hit_blocks": [1], "new_blocks": [3], "blocks": [1, 3], "ref_cnt": {"1": 1, "2": 1, "3": 1},
     "free_queue": [4, 5, 6, 7, 8]},
]

# The hit cap: a prompt that is entirely cached still recomputes its last block.
CAP = [init(11, 16), add("r0", C + [3] * 7), add("x", C)]
CAP_EXPECTED = [
    {}, {"blocks": [1, 2, 3, 4]},
    {"hit_blocks": [1, 2], "hit_tokens": 32, "new_blocks": [5], "cached": [1, 2, 3, 5]},
]

SCENARIOS = {"eviction": (EVICTION, EVICTION_EXPECTED), "decode": (DECODE, DECODE_EXPECTED),
             "no_cache": (NO_CACHE, NO_CACHE_EXPECTED), "salt": (SALT, SALT_EXPECTED),
             "reset": (RESET_TRACE, RESET_EXPECTED), "duplicate": (DUP, DUP_EXPECTED),
             "cap": (CAP, CAP_EXPECTED), "acceptance": (ACCEPTANCE, ACCEPTANCE_EXPECTED)}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    ops, expected = SCENARIOS[name]
    outs = run_lib(ops)
    check(outs, expected)
    assert outs == run_oracle(ops), "library and oracle disagree"


def test_failed_op_leaves_state_unchanged():
    outs = run_lib(EVICTION)
    keep = ("blocks", "free_queue", "num_free", "ref_cnt", "cached", "usage")
    assert {k: outs[5][k] for k in keep if k != "blocks"} == {k: outs[4][k] for k in keep if k != "blocks"}


def _error(lines):
    last = replay = None
    with pytest.raises(ReplayError) as e:
        for out, replay in iter_trace(lines):
            last = replay.view("check", None, True)
    return str(e.value), last, replay


@pytest.mark.parametrize("lines, message", [
    (['{"op":"init","num_blocks":6,"block_size":4}', '{"op":"add","req":"a","tokens":[1,2'],
     "line 2: not valid JSON"),
    (['{"op":"init","num_blocks":6,"block_size":4}', '', '{"op":"free","req":"zz"}'],
     "line 3: unknown request 'zz'"),
    (['{"op":"init","num_blocks":6,"block_size":4}', '{"op":"add","req":"a","tokens":[1]}',
      '{"op":"free","req":"a"}', '{"op":"free","req":"a"}'], "line 4: double free"),
    (['{"op":"init","num_blocks":6,"block_size":4}', '{"op":"add","req":"a","tokens":[1, 2.5]}'],
     "line 2: token 1 is 2.5"),
    (['{"op":"init","num_blocks":6,"block_size":4}', '{"op":"add","req":"a","tokens":[1, "x"]}'],
     "line 2: token 1 is \"x\""),
    (['{"op":"init","num_blocks":6,"block_size":4}', '{"op":"add","req":"a","tokens":[true]}'],
     "line 2: token 0 is true"),
    (['{"op":"add","req":"a","tokens":[1]}'], "line 1: op 'add' before any init"),
    (['{"op":"init","num_blocks":6,"block_size":4}', '{"op":"evict"}'], "line 2: unknown op \"evict\""),
    (['{"op":"init","num_blocks":6,"block_size":4}', '{"op":"add","req":"a","tokns":[1]}'],
     "line 2: unknown key(s) ['tokns']"),
    (['{"op":"init","num_blocks":1,"block_size":4}'], "line 1: num_blocks must be an int >= 2"),
    (['{"op":"init","num_blocks":6,"block_size":4}', '{"op":"add","req":"a","tokens":[1]}',
      '{"op":"add","req":"a","tokens":[2]}'], "line 3: request 'a' already exists"),
])
def test_bad_input_names_the_line(lines, message):
    err, before, replay = _error(lines)
    assert err.startswith(message), err
    if before is not None:  # the state is exactly as after the last good line
        assert replay.view("check", None, True) == before


def test_bad_input_through_the_command(tmp_path):
    ops = [init(6, 4), add("a", [1, 2, 3]), free("a"), free("a")]
    res = run_cli(ops, tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"kvjax replay: error: {tmp_path / 'trace.jsonl'}: line 4: double free or use after free of request 'a' "
        "(freed on line 3)"]
    assert "Traceback" not in res.stderr
    assert len(res.stdout.splitlines()) == 3  # the good lines were printed


def test_a_freed_name_can_be_added_again():
    outs = run_lib([init(6, 4), add("a", [1]), free("a"), add("a", [2]), free("a")])
    assert [o["ok"] for o in outs] == [True] * 5


def test_more_requests_than_initial_slots():
    """Replay starts with 8 request slots and doubles them when a 9th request arrives."""
    ops = [init(11, 16)] + [add(f"r{i}", [i]) for i in range(10)] + [free(f"r{i}") for i in range(10)]
    outs = run_lib(ops)
    assert all(o["ok"] for o in outs)
    assert outs[10]["num_free"] == 0 and outs[10]["blocks"] == [10] and outs[-1]["num_free"] == 10
    assert outs == run_oracle(ops)


def test_append_longer_than_the_pool_fails_like_the_oracle():
    """Found by the reader fuzz: an append past the pool's token capacity is a failed op."""
    ops = [init(2, 1), add("a", [0]), append("a", [0, 0]), free("a")]
    outs = run_lib(ops)
    assert [o["ok"] for o in outs] == [True, True, False, True]
    assert outs == run_oracle(ops)


# ------------------------------------------------------------------ the host offload tier
# The rules are kvjax/core/replay.py's docstring (the scheduler's): device hits, then the host run
# after them; host hits take fresh blocks; then this op's newly full blocks are offered to
# store. host_cache: store takes the lowest free slots in order and evicts LRU first, never a
# masked resident hash; a touch walks last to first, so the first hash ends most recent.
A = [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5]  # 17 tokens, Z=4: 5 blocks, full a1..a4
B = [9] * 9  # 3 blocks, full b1, b2

# 5 usable device blocks, 6 host slots, LRU.
HOST_LRU = [init(6, 4, host_blocks=6), add("a", A), free("a"), add("b", B), free("b"), add("c", A),
            append("c", [5, 5, 5]), add("d", B), free("c"), add("d", B), free("d"), RESET, add("f", A)]
HOST_LRU_EXPECTED = [
    {"host": {"lru": []}, "host_in_use": 0, "host_hit_blocks": 0, "loaded": [], "stored": []},
    # blocks 1..5; a1..a4 (blocks 1..4) stored in slots 0..3, then touched last to first: a1 most recent.
    {"blocks": [1, 2, 3, 4, 5], "cached": [1, 2, 3, 4], "host_hit_blocks": 0, "loaded": [],
     "stored": [[1, 0], [2, 1], [3, 2], [4, 3]], "host": {"lru": [3, 2, 1, 0]}, "host_in_use": 4},
    # 5 (no hash) -> head; 4, 3, 2, 1 -> tail. The host tier is untouched.
    {"free_queue": [5, 4, 3, 2, 1], "stored": [], "host": {"lru": [3, 2, 1, 0]}},
    # b pops 5, 4 (evicts a4), 3 (evicts a3): the device keeps a1, a2 only. b1 (block 5) -> slot 4,
    # b2 (block 4) -> slot 5, the two free slots: no host eviction. Touch b2, then b1 (MRU).
    {"blocks": [5, 4, 3], "cached": [1, 2, 4, 5], "free_queue": [2, 1], "stored": [[5, 4], [4, 5]],
     "host": {"lru": [3, 2, 1, 0, 5, 4]}, "host_in_use": 6},
    {"free_queue": [3, 2, 1, 4, 5]},  # 3 (no hash) -> head; 4, 5 -> tail
    # A again: first all of A's full-block hashes are touched, a4 to a1, all resident: lru becomes
    # b2, b1, a4, a3, a2, a1 = [5, 4, 3, 2, 1, 0]. Device hits a1, a2 (blocks 1, 2); the host holds
    # exactly the evicted a3 (slot 2) and a4 (slot 3): cap (17 - 1) // 4 = 4 = 2 + 2. 3 new blocks
    # from the head after touching 1, 2: 3, 4, 5; a3 -> block 3, a4 -> block 4. A load is not a
    # touch. Nothing is full past the hits: nothing offered (the next offer starts at block 4).
    {"ok": True, "hit_blocks": [1, 2], "hit_tokens": 8, "new_blocks": [3, 4, 5], "blocks": [1, 2, 3, 4, 5],
     "cached": [1, 2, 3, 4], "free_queue": [], "host_hit_blocks": 2, "loaded": [[2, 3], [3, 4]],
     "stored": [], "host": {"lru": [5, 4, 3, 2, 1, 0]}, "host_in_use": 6},
    # 20 tokens fill block 5 (a5): stored; the tier is full, so LRU slot 5 (b2) is evicted for it.
    # Something was stored, so c's earlier blocks a4 .. a1 (slots 3 .. 0) are touched after it.
    {"new_blocks": [], "cached": [1, 2, 3, 4, 5], "host_hit_blocks": 0, "stored": [[5, 5]],
     "host": {"lru": [4, 5, 3, 2, 1, 0]}},
    # 3 blocks > 0 free: fails, and a failed op leaves the tier as it was (no touch either).
    {"ok": False, "blocks": [], "free_queue": [], "host_hit_blocks": 0, "loaded": [], "stored": [],
     "host": {"lru": [4, 5, 3, 2, 1, 0]}, "host_in_use": 6},
    {"free_queue": [5, 4, 3, 2, 1]},  # all five hashed -> tail, last block first
    # touch b1 (slot 4; b2 is gone): [5, 3, 2, 1, 0, 4]. No device hit (b's blocks lost their
    # hashes when c took them); the host run is b1 only: pops 5, 4, 3; b1 -> block 5. b2 (block
    # 4) is offered from block 1 on: LRU slot 5 (a5) is evicted for it; then b1 is touched.
    {"ok": True, "hit_blocks": [], "new_blocks": [5, 4, 3], "cached": [1, 2, 4, 5], "free_queue": [2, 1],
     "host_hit_blocks": 1, "loaded": [[4, 5]], "stored": [[4, 5]], "host": {"lru": [3, 2, 1, 0, 5, 4]}},
    {"free_queue": [3, 2, 1, 4, 5]},
    # the device prefix cache is emptied; the host tier keeps all six.
    {"ok": True, "cached": [], "host": {"lru": [3, 2, 1, 0, 5, 4]}, "host_in_use": 6},
    # touch a4 .. a1 (slots 3 .. 0): [5, 4, 3, 2, 1, 0]. No device hit; the host run is a1 .. a4,
    # the cap: loaded into the first four of the new blocks 3, 2, 1, 4, 5. Nothing offered.
    {"ok": True, "hit_blocks": [], "new_blocks": [3, 2, 1, 4, 5], "cached": [1, 2, 3, 4], "num_free": 0,
     "host_hit_blocks": 4, "loaded": [[0, 3], [1, 2], [2, 1], [3, 4]], "stored": [],
     "host": {"lru": [5, 4, 3, 2, 1, 0]}, "host_in_use": 6},
]


def test_host_tier_lru():
    check(run_lib(HOST_LRU), HOST_LRU_EXPECTED)


@pytest.mark.slow  # the default run replays the host tier with LRU (test_host_tier_lru) and ARC through the command
def test_host_tier_arc_touch_promotes_and_a_ghost_hit_moves_p():
    # 3 usable device blocks, 3 host slots, ARC.
    ops = [init(4, 4, host_blocks=3, host_policy="arc"), add("a", [7] * 9), free("a"), add("b", [5] * 5),
           free("b"), add("c", [7] * 9), free("c"), add("d", [6] * 5), free("d"), add("e", [5] * 5)]
    b1, d1 = ("%08x%08x" % tuple(request_block_hashes_np(t, 4)[0]) for t in ([5] * 5, [6] * 5))

    def arc(t1, t2, ghosts=(), p=0):
        return {"t1": t1, "t2": t2, "b1": list(ghosts), "b2": [], "p": p}

    check(run_lib(ops), [
        {"host": arc([], [])},
        # a1, a2 (blocks 1, 2) -> slots 0, 1, into T1; touched a2 then a1: they stay in T1 (just stored).
        {"blocks": [1, 2, 3], "stored": [[1, 0], [2, 1]], "host": arc([1, 0], [])},
        {"free_queue": [3, 2, 1]},
        # b pops 3, 2 (evicts a2 on the device); b1 (block 3) -> slot 2.
        {"blocks": [3, 2], "cached": [1, 3], "stored": [[3, 2]], "host": arc([1, 0, 2], []), "host_in_use": 3},
        {"free_queue": [2, 1, 3]},
        # A's hashes are touched first, a2 then a1: a second use, T1 -> T2 (a1 most recent). Then
        # device hit a1 (block 1), host hit a2 (slot 1) -> block 2.
        {"hit_blocks": [1], "new_blocks": [2, 3], "host_hit_blocks": 1, "loaded": [[1, 2]], "stored": [],
         "cached": [1, 2], "host": arc([2], [1, 0])},
        {"free_queue": [3, 2, 1]},
        # d1 (block 3) needs a slot: |T1| = 1 >= p = 0, so T1's LRU end, slot 2 (b1), goes to B1.
        {"blocks": [3, 2], "stored": [[3, 2]], "host": arc([2], [1, 0], [b1]), "host_in_use": 3},
        {"free_queue": [2, 1, 3]},
        # B again: touching b1 is a B1 ghost hit, p = 0 + max(1, |B2| // |B1|) = 1. No device hit
        # (block 3 now holds d1), no host hit: pops 2, 1. Storing b1 (block 2): |T1| = 1 >= p = 1,
        # so T1's LRU end, slot 2 (d1), goes to B1, and b1 leaves B1 as it is stored.
        {"hit_blocks": [], "blocks": [2, 1], "cached": [2, 3], "host_hit_blocks": 0, "stored": [[2, 2]],
         "host": arc([2], [1, 0], [d1], p=1)},
    ])


def test_host_tier_through_the_command(tmp_path):
    res = run_cli([init(4, 4, host_blocks=2), add("a", [7] * 9)], tmp_path, "--show")
    assert res.returncode == 0, res.stderr
    out = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert list(out[1])[-5:] == ["host_hit_blocks", "loaded", "stored", "host", "host_in_use"]
    # a1, a2 stored in slots 0, 1; a1 touched last, so the LRU end is slot 1.
    assert "host tier (2 slots, lru, LRU end first) lru: 1 0" in res.stdout


def test_no_host_tier_adds_no_fields():
    outs = run_lib([init(4, 4, host_blocks=0, host_policy="arc"), add("a", [7] * 9)])
    assert not {"host", "host_in_use", "stored", "loaded", "host_hit_blocks"} & set(outs[1])


@pytest.mark.parametrize("extra, message", [
    ({"host_blocks": -1}, "host_blocks must be an int >= 0, got -1"),
    ({"host_blocks": 1.5}, "host_blocks must be an int >= 0, got 1.5"),
    ({"host_blocks": True}, "host_blocks must be an int >= 0, got true"),
    ({"host_blocks": 4097}, "host_blocks must be at most 4,096, got 4,097"),
    ({"host_blocks": 2, "host_policy": "fifo"}, 'host_policy must be one of "lru", "arc", got "fifo"'),
    ({"host_blocks": 2, "host_policy": None}, 'host_policy must be one of "lru", "arc", got null'),
    ({"host_blocks": 2, "prefix_caching": False}, "host_blocks=2 needs prefix_caching true"),
    ({"host_size": 2}, "unknown key(s) ['host_size']"),
])
def test_bad_host_init_names_the_key(extra, message):
    err, _, _ = _error([json.dumps(init(6, 4)), json.dumps({**init(6, 4), **extra})])
    assert err.startswith("line 2: " + message), err
