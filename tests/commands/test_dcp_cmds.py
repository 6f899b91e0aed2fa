"""`kvjax plan` and `kvjax memory` under decode context parallelism (kvjax.accounting.dcp, kvjax.attention.dcp),
against hand arithmetic:

- plan: DeepSeek-V3 at TP 8 on 141 GiB (fp8 weights, 32K context; the issue's command): a rank's KV per token is
  61 layers × (512 + 64) lanes × 2 B / D, its scheduler block 64·D tokens, and token slots and concurrency grow D
  times (usable blocks unchanged); D that breaks vLLM's rule, or D > 1 on a GQA model, refused by name.
- memory: tiny-mla on a CPU mesh of 4 at DCP 4: each device measures its latent pages to the byte as the analytic
  num_blocks × 16 tokens × 24 lanes × 4 B, 48 B per token per rank (192 / 4), the blocks holding 4 × 16 tokens.
"""
from __future__ import annotations

import json

import pytest

from kvjax.commands import main as cli

V3 = ["plan", "--preset", "deepseek-v3", "-tp", "8", "--device-memory-gib", "141", "--max-model-len", "32768",
      "--weight-dtype", "fp8"]


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_plan_deepseek_v3_per_rank_kv_and_concurrency(capsys):
    rc, out, err = _run(capsys, *V3, "--decode-context-parallel-size", "8", "--json")
    assert rc == 0, err
    report = json.loads(out)
    rows = {row["dcp"]: row for row in report["decode_context_parallel"]}
    assert sorted(rows) == [1, 2, 4, 8]
    per_token = 61 * (512 + 64) * 2  # bf16 latent + rope key per layer, on every rank at D = 1
    usable = rows[1]["usable_blocks"]
    assert usable > 0
    for d, row in rows.items():
        assert row["kv_bytes_per_token"] == per_token / d
        assert row["block_tokens"] == 64 * d and row["page_bytes"] == 64 * per_token
        assert row["blocks_per_request"] == 32768 // (64 * d)
        assert row["kv_bytes_per_request"] == 32768 // d * per_token
        assert row["usable_blocks"] == usable and row["token_slots"] == usable * 64 * d
        assert row["concurrency"] == usable // (512 // d)
    rc, out, _ = _run(capsys, *V3, "--decode-context-parallel-size", "8")
    assert "decode context parallelism" in out and "← --decode-context-parallel-size" in out


@pytest.mark.parametrize("argv,words", [
    (V3 + ["--decode-context-parallel-size", "3"], "tp_size=8 must be divisible by dcp_size=3"),
    (["plan", "--preset", "llama-3-8b", "-tp", "2", "--decode-context-parallel-size", "2"], "MLA"),
])
def test_plan_refuses_a_dcp_it_cannot_take(capsys, argv, words):
    rc, out, err = _run(capsys, *argv)
    assert rc != 0 and words in err and "Traceback" not in err


def test_memory_measures_dcp_bytes_per_rank(capsys):
    rc, out, err = _run(capsys, "memory", "--model", "preset:tiny-mla", "-tp", "4", "--decode-context-parallel-size",
                        "4", "--device-memory-gib", "0.004", "--block-size", "16", "--max-num-batched-tokens", "64",
                        "--max-num-seqs", "4", "--max-model-len", "128", "--json", "--no-progress")
    assert rc == 0, err
    report = json.loads(out)
    assert report["dcp"] == 4 and len(report["per_device"]) == 4 and report["devices_agree"]
    blocks = report["num_blocks"]
    page = 2 * 16 * (16 + 8) * 4  # a rank's block: 2 layers × 16 of its 64 tokens × 24 f32 lanes
    assert report["plan"]["bytes_per_block"] == page
    for device in report["per_device"]:
        kv = next(row for row in device["rows"] if row["name"] == "kv pages")
        assert kv["measured"] == kv["analytic"] == blocks * page
    assert report["plan"]["bytes_per_token"] / 4 == 48


def test_simulate_takes_dcp():
    """kvjax simulate's deployment at D: the scheduler's blocks are 64·D tokens of plan's pool, and the roofline
    reads 1/D of a rank's KV per token (the whole simulation takes about a minute on CPU: not run here)."""
    from kvjax.accounting import budget as bud
    from kvjax.config.presets import preset
    from kvjax.simulator.cost import ModelCost
    from kvjax.simulator.deployment import scheduler_config

    config = preset("deepseek-v3")
    spec = config.kv_spec()
    weights = config.num_params  # fp8: one byte a parameter
    pl = bud.plan(spec, context=32768, block_size=64, total_bytes=141 * 2**30, util=0.92, weights_bytes=weights, tp=8)
    for d in (1, 8):
        sched = scheduler_config(pl, (), max_num_seqs=256, max_num_batched_tokens=8192, dcp=d)
        assert sched.block_size == 64 * d and sched.num_blocks == pl.num_blocks
        cost = ModelCost.from_config(config, spec, weight_bytes=weights, weight_dtype="fp8", tp=8, dcp=d)
        assert cost.kv_bytes_per_token == 61 * 576 * 2 // d
