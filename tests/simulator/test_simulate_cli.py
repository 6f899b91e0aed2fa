"""`kvjax simulate` end to end: plan's arithmetic gives the scheduler its blocks, the roofline its shapes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvjax.commands import main as cli


def kvjax(*argv):
    return subprocess.run([sys.executable, "-m", "kvjax.commands.main", *argv], capture_output=True, text=True,
                          timeout=300)


def test_json_result_uses_plans_blocks_and_bench_serves_metrics(capsys):
    argv = ["--preset", "llama-3-8b", "--device", "h200", "--device-memory-gib", "141", "--max-model-len", "4096",
            "--num-prompts", "24", "--random-input-len", "256", "--random-output-len", "16", "--request-rate", "4",
            "--json"]
    assert cli.main(["plan", *argv[:8], "--json"]) == 0
    blocks = json.loads(capsys.readouterr().out)["num_blocks"]
    assert cli.main(["simulate", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"] and out["blocks"] == blocks and out["completed"] == 24
    assert out["total_output_tokens"] == 24 * 16 and out["preemptions"] == 0
    assert 0 < out["mean_ttft_ms"] < out["mean_e2el_ms"] and out["mean_tpot_ms"] > 0
    assert "H200 SXM" in out["cost_model"]


@pytest.mark.parametrize("argv, message", [
    (["--kind", "gqa", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"], "needs the model's shapes"),
    (["--preset", "tiny", "--request-rate", "0"], "--request-rate 0.0 and --burstiness 1.0 must be > 0"),
])
def test_bad_input_is_refused_by_name(argv, message):
    p = kvjax("simulate", *argv)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_a_hybrid_model_gets_its_kv_cache_groups_and_a_shared_prefix_hits(capsys):
    """gpt-oss-20b (alternate layers slide over 128 tokens): vLLM's hybrid groups on plan's budget;
    bench serve's prefix_repetition dataset: prompts sharing a prefix hit the blocks cached by the first."""
    base = ["--preset", "gpt-oss-20b", "--device-memory-gib", "80", "--max-model-len", "4096", "--json"]
    assert cli.main(["plan", *base]) == 0
    hybrid = json.loads(capsys.readouterr().out)["hybrid"]["hybrid"]
    argv = [*base, "--dataset-name", "prefix_repetition", "--num-prompts", "12", "--prefix-repetition-prefix-len",
            "512", "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "2",
            "--prefix-repetition-output-len", "8", "--request-rate", "4"]
    assert cli.main(["simulate", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["blocks"] == hybrid["num_blocks"]
    assert out["kv_cache_groups"] == [g["sliding_window"] for g in hybrid["groups"]]
    assert None in out["kv_cache_groups"] and 128 in out["kv_cache_groups"]
    assert out["completed"] == 12 and out["total_input_tokens"] == 12 * 576
    assert out["prefilled_tokens"] <= 12 * 576 - 8 * 512  # most prompts after each prefix's first hit its blocks
    assert "sliding over 128 tokens" in out["cost_model"]


def test_a_host_tier_from_plans_offloading_size(capsys):
    argv = ["--preset", "llama-3-8b", "--device-memory-gib", "24", "--max-model-len", "4096", "--kv-offloading-size",
            "8", "--num-prompts", "8", "--random-input-len", "256", "--random-output-len", "4", "--json"]
    assert cli.main(["plan", *argv[:8], "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["num_host_blocks"]
    assert cli.main(["simulate", *argv]) == 0
    assert json.loads(capsys.readouterr().out)["host_blocks"] == host > 0


def test_a_text_dataset_needs_a_tokenizer():
    p = kvjax("simulate", "--preset", "tiny", "--dataset-name", "corpus")
    assert p.returncode == 2 and "--dataset-name corpus needs --tokenizer" in p.stderr, p.stderr
