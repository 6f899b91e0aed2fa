"""Capacity truth: the concurrency `kvjax plan` promises is what the scheduler really admits.

For a budget where the plan says the block pool holds C requests of T tokens
(`concurrency_blocks` = usable blocks // cdiv(T, Z)), running C such requests (prompt +
generated tokens = T) through the scheduler never preempts, and C + 1 preempts at least once.

T is chosen with T mod Z ≠ 1: a request's last sampled token is never fed back, so its KV
holds T − 1 tokens, which needs cdiv(T, Z) blocks exactly when T − 1 does not end a block.
The budgets also show the tail-block waste: the bytes-only concurrency (budget / KV per
request, SPEC's simulator) says one more request fits than the block pool can hold.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.accounting import budget as bud
from kvjax.commands import main as cli
from kvjax.config.scheduler import SchedulerConfig
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.core.sched.scheduler import Scheduler

SPEC = KVSpec("gqa", 2, 4, 2, 16, kv_dtype="bf16")  # 256 B per token
VOCAB = 100


def _run(num_blocks: int, block_size: int, context: int, prompt_len: int, n: int) -> Scheduler:
    """n requests of prompt_len distinct tokens + (context − prompt_len) generated, all at once."""
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=n,
                                      max_num_batched_tokens=n * prompt_len, max_model_len=context))
    for i in range(n):  # distinct first tokens: no prefix-cache sharing between requests
        sched.add_request(f"r{i}", [(i * 7 + j) % VOCAB + 1 for j in range(prompt_len)], context - prompt_len)
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        # A deterministic fake model: next token = (last scheduled token + 1) mod VOCAB.
        last = plan.token_ids[np.cumsum(plan.num_scheduled) - 1] if plan.num_requests else np.zeros(0, np.int32)
        sched.update(plan, (last + 1) % VOCAB)
        steps += 1
        assert steps < 500, "the scheduler made no progress"
    assert all(len(r.output) == context - prompt_len for r in sched.requests.values())
    return sched


@pytest.mark.parametrize("block_size, context, prompt_len, concurrency", [
    (4, 14, 6, 3),  # 4 blocks per request, 2 slots of tail waste each
    pytest.param(8, 20, 7, 2, marks=pytest.mark.slow),  # 3 blocks per request, 4 slots of tail waste each
])
def test_plan_concurrency_is_what_the_scheduler_admits(block_size, context, prompt_len, concurrency):
    per_request = -(-context // block_size)
    assert context % block_size != 1 and -(-(context - 1) // block_size) == per_request
    per_block = SPEC.bytes_per_block(block_size)
    # Budget: the null block + C requests' blocks + all but one block of another request.
    budget = (1 + concurrency * per_request + per_request - 1) * per_block + per_block // 3
    weights = 12_345
    plan = bud.plan(SPEC, context=context, block_size=block_size, total_bytes=budget + weights, util=1,
                    weights_bytes=weights)
    assert plan.budget_bytes == budget and plan.concurrency_blocks == concurrency
    assert plan.concurrency == concurrency + 1  # bytes alone ignore the tail blocks' waste
    # All C + 1 prompts fit at once, so the extra request is admitted and must be preempted later.
    assert (concurrency + 1) * -(-prompt_len // block_size) <= plan.usable_blocks

    fits = _run(plan.num_blocks, block_size, context, prompt_len, concurrency)
    assert fits.num_preemptions == 0
    over = _run(plan.num_blocks, block_size, context, prompt_len, concurrency + 1)
    assert over.num_preemptions >= 1


def test_cli_plan_reports_the_same_concurrency(capsys):
    """`kvjax plan --json` with the same budget as the first case above gives the same numbers."""
    block_size, context = 4, 14
    budget = (1 + 3 * 4 + 3) * SPEC.bytes_per_block(block_size) + 100
    argv = ["plan", "--kind", "gqa", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--kv-cache-dtype", "bf16", "--max-model-len", str(context), "--block-size", str(block_size),
            "--kv-cache-memory-bytes", str(budget), "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget_bytes"] == budget and out["concurrency_blocks"] == 3 and out["num_blocks"] == 16
    assert out["concurrency"] == 4  # the bytes-only figure, one more than the pool holds
