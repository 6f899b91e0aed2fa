"""experiments/decode_bench.py runs end to end on the tiny preset and writes its tables.

Both layouts of the paged-vs-contiguous comparison are `kvjax.LLM`s over the same modules and
engine: their greedy tokens must agree (tests/engine/test_llm.py checks the contiguous layout against
the paged one and transformers in detail).
"""
from __future__ import annotations

import json

import pytest

from kvjax.experiments import decode_bench


@pytest.mark.slow
def test_tiny_run_writes_its_tables(tmp_path):
    result = decode_bench.main(["--tiny", "--repeats", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "decode_bench.json").read_text())
    pc = saved["paged_vs_contiguous"]
    assert pc["same_tokens"] and all(c["same_tokens"] for c in saved["context_sweep"])
    assert {c["s_max"] for c in saved["context_sweep"]} == {32, 64}
    assert pc["paged_tok_s"] > 0 and pc["contiguous_tok_s"] > 0
    assert saved["loop_vs_host"]["same_tokens"] and saved["prefix_caching"]["same_tokens"]
    assert saved["prefix_caching"]["on"]["prefill_tokens"] < saved["prefix_caching"]["off"]["prefill_tokens"]
    md = (tmp_path / "decode_bench.md").read_text()
    assert f"{pc['ratio']:.2f}×" in md and result["targets"].keys() == saved["targets"].keys()


@pytest.mark.slow
def test_tiny_kv_sweep_writes_every_variant(tmp_path):
    result = decode_bench.main(["--sweep-kv", "--tiny", "--out", str(tmp_path)])
    rows = {(r["kv_dtype"], r["attn_impl"]): r for r in result["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), [r["status"] for r in rows.values()]
    # The Pallas kernel (interpreted on CPU) and the reference decode the same greedy tokens.
    assert rows["bf16", "pallas"]["outputs_head"] == rows["bf16", "reference"]["outputs_head"]
    assert (tmp_path / "decode_sweep.md").exists()


@pytest.mark.slow
def test_tiny_vs_transformers_decodes_the_same_tokens(tmp_path):
    """kvjax and transformers (torch eager, its own KV cache) greedily decode the same tokens from
    the same random tiny-preset weights, and the benchmark writes both rates and their ratio."""
    result = decode_bench.main(["--vs-transformers", "--tiny", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "vs_transformers.json").read_text())
    assert [row["batch"] for row in saved["rows"]] == [1, 2]
    for row in saved["rows"]:
        assert row["token_agreement"] == {"1": 1.0, "8": 1.0}
        assert row["transformers"]["decode_tok_s"] > 0 and all(r["decode_tok_s"] > 0 for r in row["kvjax"].values())
        assert len(row["kvjax"]["1"]["prefill_samples"]) == 1  # --tiny: one warm run
    md = (tmp_path / "vs_transformers.md").read_text()
    assert f"{result['rows'][0]['ratios']['decode_K8']:.2f}× (K=8)" in md
