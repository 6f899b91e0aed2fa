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
