"""The trade-off table (kvjax.evaluation.tradeoff): Llama-3-70B's bytes and 8K concurrency on
SPEC's group A worked out here by hand, and the table's rows picked from a result made here."""
import math
from fractions import Fraction

import pytest

from kvjax.evaluation import tradeoff

GiB = 2 ** 30


def by_hand(bytes_per_token: int, weights_gib: str) -> int:
    """SPEC: budget = ceil(160 GiB × 0.92) − weights; concurrency = floor(budget / (bytes × 8,192))."""
    budget = math.ceil(160 * GiB * Fraction("0.92")) - Fraction(weights_gib) * GiB
    return math.floor(budget / (bytes_per_token * 8192))


@pytest.mark.parametrize("kv_dtype, skipped, per_token", [
    ("bf16", 0, 80 * 2 * 8 * 128 * 2),                    # 320 KiB (SPEC Table 1)
    ("fp8_e4m3", 0, 80 * 2 * 8 * 128),                    # 160 KiB
    ("fp8_e4m3", 3, 77 * 2 * 8 * 128 + 3 * 2 * 8 * 128 * 2),  # three layers kept in bf16
    ("nvfp4", 0, 80 * 2 * 8 * (128 // 2 + 128 // 16)),    # E2M1 pairs + one e4m3 scale per 16
])
def test_deployment_by_hand(kv_dtype, skipped, per_token):
    got = tradeoff.deployment(kv_dtype, skipped)
    assert got["bytes_per_token"] == per_token
    assert got["concurrency"] == by_hand(per_token, "130")
    assert got["concurrency_fp8_weights"] == by_hand(per_token, "65.2")


def test_spec_table2_concurrency():
    assert [tradeoff.deployment(d)["concurrency"] for d in ("bf16", "fp8_e4m3")] == [6, 13]  # SPEC Table 2
    assert tradeoff.deployment("fp8_e4m3")["concurrency_fp8_weights"] == 65


def test_table_rows():
    bucket = lambda a, b, kl: dict(start=a, end=b, kl_vs_bf16=kl)  # noqa: E731
    result = lambda name, dt, skip=(): dict(variant=name, kv_dtype=dt, skip_layers=list(skip),  # noqa: E731
                                            bytes_per_token=1, perplexity=2.0, kl_vs_bf16=0.5, top1_agreement=0.9,
                                            greedy_tokens_until_divergence=7.0)
    res = dict(results=[result("bf16", "bf16"), result("fp32", "fp32"), result("fp8_e4m3 unit", "fp8_e4m3"),
                        result("fp8_e4m3 unit skip 4,7", "fp8_e4m3", (4, 7))],
               long=dict(variants={"bf16": dict(buckets=[bucket(2048, 8192, 0.0)]),
                                   "fp8_e4m3 unit": dict(buckets=[bucket(512, 2048, 1.0), bucket(2048, 8192, 3.0)])}),
               passkey=dict(trials=[dict(length=512), dict(length=2048)],
                            lengths={"bf16": [dict(length=512, success=1.0), dict(length=2048, success=0.75)]}))
    rows = tradeoff.table(res)
    assert [r["variant"] for r in rows] == ["bf16", "fp8_e4m3 unit", "fp8_e4m3 unit skip 4,7"]  # no fp32 control
    assert [r["kl_2k_8k"] for r in rows] == [0.0, 3.0, None]
    assert rows[0]["passkey"]["success"] == 0.75 and rows[1]["passkey"] is None
    assert rows[0]["passkey_length"] == 2048
    assert rows[2]["bytes_per_token"] == tradeoff.deployment("fp8_e4m3", 2)["bytes_per_token"]
