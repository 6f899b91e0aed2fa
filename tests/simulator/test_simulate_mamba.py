"""`kvjax simulate` on a model with Mamba layers schedules vLLM's pool: the attention block size grown to hold a
state, one KV cache group per Mamba layer group beside the attention group, and the blocks vLLM 0.33's own functions
give on the same budget (experiments/results/vllm_mamba_reference.json, committed), without prefix caching."""
from __future__ import annotations

import json
import os

from kvjax.commands import main as cli

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results", "vllm_mamba_reference.json")


def test_bamba_schedules_vllms_hybrid_pool(capsys):
    row = next(r for r in json.load(open(REFERENCE, encoding="utf-8"))
               if r["case"] == ["bamba-9b", 8192, "auto", 16, 1, "auto"])["vllm"]
    assert cli.main(["simulate", "--preset", "bamba-9b", "--device", "h200", "--device-memory-gib", "141",
                     "--max-model-len", "8192", "--block-size", "16", "--num-prompts", "6", "--random-input-len", "64",
                     "--random-output-len", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["blocks"] == row["num_blocks"]
    assert out["kv_cache_groups"] == [None if kind == "full_attention" else kind for kind, _ in row["groups"]]
    assert out["completed"] == 6 and out["total_output_tokens"] == 6 * 4
