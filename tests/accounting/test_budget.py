"""Budget → blocks → concurrency against SPEC's worked example, Table 2 and simulator groups.

Expected values are computed here by hand from SPEC's rules (integers, ceil/floor as stated).
"""
import math

import pytest

from kvjax.accounting import budget as bud
from kvjax.accounting import spec_tables as tables
from kvjax.config.presets import preset
from kvjax.core.kv_cache_interface import KVSpec

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def test_worked_example_llama70b():
    # 160 GiB × 0.92 = 147.2 GiB − 130 GiB = 17.2 GiB; block = 320 KiB × 64 = 20 MiB.
    requested = math.ceil(160 * GiB * 92 / 100)  # 158,054,796,492.8 → ceil
    assert requested == 158_054_796_493
    budget = requested - 130 * GiB
    pl = bud.plan(preset("llama-3-70b").kv_spec(), context=8192, total_bytes=160 * GiB, util="0.92",
                  weights_bytes=130 * GiB)
    assert pl.requested_bytes == requested
    assert pl.budget_bytes == budget == 18_468_359_373
    assert pl.bytes_per_block == 20 * MiB
    assert pl.num_blocks == 880 and pl.usable_blocks == 879
    assert pl.token_slots == 56_256
    assert pl.blocks_per_request == 128
    assert pl.concurrency == 6 and pl.concurrency_blocks == 6
    assert pl.concurrency_exact == pytest.approx(56_256 / 8192, abs=0.02)  # 6.867..6.88
    assert pl.concurrency_exact == pytest.approx(6.88, abs=1e-6)
    assert pl.warnings == ()


# scenario -> (budget GiB, KV/request bytes, budget/request, concurrency), from SPEC Table 2
TABLE2 = [
    (58.6, 1 * GiB, 58.6, 58),
    (17.2, 2.5 * GiB, 6.88, 6),
    (17.2, 1.25 * GiB, 13.76, 13),
    (82.0, 1.25 * GiB, 65.6, 65),
    (412.76, 2.14453125 * GiB, 192.47, 192),
    (51.595, 2.14453125 * GiB, 24.06, 24),
]


def test_table2_every_cell():
    rows = tables.table2()
    assert [r["scenario"] for r in rows] == [sc["scenario"] for sc in bud.TABLE2]
    assert [r["gpu_gib"] for r in rows] == [80, 160, 160, 160, 1128, 141]
    assert [r["weights_gib"] for r in rows] == pytest.approx([15, 130, 130, 65.2, 625, 78.125], abs=1e-9)
    assert all(r["util"] == 0.92 for r in rows)
    assert [r["context"] for r in rows] == [8192] * 4 + [32768] * 2
    for row, (budget_gib, per_request, ratio, conc) in zip(rows, TABLE2):
        assert row["budget_gib"] == pytest.approx(budget_gib, abs=1e-6), row["scenario"]
        assert row["kv_bytes_per_request"] == per_request, row["scenario"]
        assert row["budget_per_request"] == pytest.approx(ratio, abs=0.005), row["scenario"]
        assert row["concurrency"] == conc, row["scenario"]


def test_table1_rows_in_spec_order():
    rows = tables.table1()
    assert [r["model"] for r in rows] == ["Llama-2-7B", "Llama-3-8B", "Llama-3-70B", "DeepSeek-V3"]
    assert [r["bf16_bytes_per_token"] for r in rows] == [512 * KiB, 128 * KiB, 320 * KiB, 70272]
    assert [r["kind"] for r in rows] == ["MHA", "GQA", "GQA", "MLA"]


def test_group_b_one_card_of_tp8():
    # 141 × 0.92 = 129.72 − 625/8 = 51.595 GiB; 32K × 68.625 KiB = 2.14453125 GiB → 24.06 → 24.
    pl = tables.scenario_plan(bud.GROUPS["B"])
    assert pl.weights_bytes == 625 * GiB // 8
    assert pl.bytes_per_token == 70272
    assert pl.kv_bytes_per_request == 70272 * 32768
    assert pl.budget_bytes == math.ceil(141 * GiB * 92 / 100) - 625 * GiB // 8
    assert pl.concurrency == 24
    assert pl.bytes_per_block == 70272 * 64
    assert pl.num_blocks == pl.budget_bytes // (70272 * 64) == 12318


def test_group_c_cannot_hold_one_request():
    pl = tables.scenario_plan(bud.GROUPS["C"])
    assert pl.kv_bytes_per_request == 40 * GiB
    assert pl.concurrency == 0 and pl.concurrency_blocks == 0
    assert pl.concurrency_exact == pytest.approx(0.43, abs=1e-6)
    assert any("cannot hold one request" in w for w in pl.warnings)


def test_pooled_is_labelled():
    pl = tables.scenario_plan(bud.TABLE2[4])
    assert pl.pooled and pl.total_bytes == 8 * 141 * GiB
    assert any("not a deployable concurrency" in w for w in pl.warnings)


def test_extensible_and_override():
    spec = preset("llama-3-8b").kv_spec()
    pl = bud.plan(spec, context=8192, total_bytes=80 * GiB, extensible=True, weights_bytes=15 * GiB)
    assert pl.util == 1 and pl.requested_bytes == 80 * GiB and pl.budget_bytes == 65 * GiB
    # an explicit util still wins with extensible set
    assert bud.plan(spec, context=8192, total_bytes=80 * GiB, extensible=True, util=0.5).requested_bytes == 40 * GiB
    # kv_cache_memory_bytes overrides everything
    pl = bud.plan(spec, context=8192, total_bytes=80 * GiB, weights_bytes=79 * GiB, kv_cache_memory_bytes=4 * GiB)
    assert pl.budget_bytes == 4 * GiB and pl.concurrency == 4
    assert pl.num_blocks == 4 * GiB // (128 * KiB * 64) == 512


def test_activations_and_cudagraphs_subtract():
    spec = preset("llama-3-8b").kv_spec()
    pl = bud.plan(spec, context=1000, total_bytes=10 * GiB, util=1, weights_bytes=2 * GiB,
                  activations_bytes=GiB, cudagraph_bytes=GiB // 2)
    assert pl.budget_bytes == 10 * GiB - 2 * GiB - GiB - GiB // 2
    # 1000 tokens need cdiv(1000, 64) = 16 blocks; the last wastes 24 slots
    assert pl.blocks_per_request == 16 and pl.tail_waste_tokens == 24
    assert pl.num_blocks == (13 * GiB // 2) // (128 * KiB * 64) == 832
    assert pl.concurrency_blocks == 831 // 16 == 51
    assert pl.concurrency == (13 * GiB // 2) // (128 * KiB * 1000) == 53  # no tail waste in the simulator


def test_weights_split_by_tp():
    pl = bud.plan(preset("llama-3-70b").kv_spec(), context=8192, total_bytes=80 * GiB, weights_bytes=130 * GiB, tp=8)
    assert pl.weights_bytes == 130 * GiB // 8
    assert pl.bytes_per_token == 2 * 80 * 1 * 128 * 2
    assert pl.spec.num_kv_heads == 1


def test_weight_bytes_from_params():
    assert bud.weight_bytes(8_030_261_248, "bf16") == 16_060_522_496
    assert bud.weight_bytes("70.5e9", "fp8") == 70_500_000_000
    assert bud.gib("65.2") == math.ceil(652 * GiB / 10)


@pytest.mark.parametrize("kw, message", [
    (dict(util=1.5), r"util must be in \(0, 1\], got 1.5"),
    (dict(util=0), r"util must be in \(0, 1\], got 0"),
    (dict(context=0), "context must be a positive integer, got 0"),
    (dict(block_size=-16), "block_size must be a positive integer, got -16"),
    (dict(tp=3), "tp 3"),
    (dict(total_bytes=-1), "total GPU memory must be positive"),
    (dict(weights_bytes=-5), "weights bytes must be ≥ 0, got -5"),
])
def test_bad_budget_inputs(kw, message):
    base = dict(context=8192, total_bytes=80 * GiB, weights_bytes=0)
    with pytest.raises(ValueError, match=message):
        bud.plan(preset("llama-3-70b").kv_spec(), **{**base, **kw})


def test_negative_budget_warns():
    pl = bud.plan(KVSpec("mha", 2, 4, 4, 64), context=16, total_bytes=GiB, util=1, weights_bytes=2 * GiB)
    assert pl.budget_bytes == -GiB and pl.num_blocks == 0 and pl.concurrency == 0
    assert any("non-KV memory exceeds" in w for w in pl.warnings)
