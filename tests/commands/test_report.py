"""`kvjax report` end to end, in its quick form (the accuracy and memory sections have their own tests),
and its real-model section on SmolLM2-135M (the GGUF fetched once into $KVJAX_CACHE, as in test_gguf).

.ci/run makes the whole quick report first (the README's main job, in a venv with no extras) and
names its folder in KVJAX_QUICK_REPORT: these tests then check that report instead of making the
same one again. Without it they run `kvjax report --quick` themselves, on the sections they check."""
import json
import os
import pathlib
import subprocess
import sys

import pytest


def _quick_report(out, skip: str) -> tuple[pathlib.Path, str]:
    """The quick report's folder and REPORT.md's text: CI's (KVJAX_QUICK_REPORT), or else
    `kvjax report --quick --skip SKIP --out OUT` in a fresh process."""
    made = os.environ.get("KVJAX_QUICK_REPORT")
    if made:
        out = pathlib.Path(made)
    else:
        p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "report", "--quick", "--skip", skip,
                            "--out", str(out)], capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr
    return out, (out / "REPORT.md").read_text()


@pytest.mark.slow
def test_quick_report_writes_markdown_plots_and_json(tmp_path):
    out, text = _quick_report(tmp_path / "rep", "accuracy,memory,smollm")
    assert "Table 1" in text and "Simulator group C" in text and "concurrency 0" in text
    assert "## 2. Decoding" in text and "| preemptions |" in text and "| quantity | value |\n|---|---|\n" in text
    for png in ("concurrency_vs_context.png", "blocks_in_use.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "report.json").read_text())
    assert [r["concurrency"] for r in data["tables"]["table2"]] == [58, 6, 13, 65, 192, 24]
    s = data["decode"]["summary"]
    assert s["failed"] == 0 and s["generated_tokens"] == 8 * 48
    assert s["preemptions"] > 0 and s["prefix_hit_tokens"] > 0  # the run is sized to show both
    assert s["peak_blocks_used"] <= s["usable_blocks"] == 48
    # the warm-up run and the timed run are separated by reset_prefix_cache(): the timed run's first
    # request finds nothing cached (without the reset it would find its whole prompt's full blocks)
    cached = data["decode"]["num_cached_tokens"]
    assert cached[0] == 0 and all(c % 16 == 0 for c in cached) and max(cached) >= 96


def test_report_rejects_unknown_sections(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "report", "--skip", "tables", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "tables" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_quick_report_real_model_section(tmp_path):
    out, text = _quick_report(tmp_path / "rep", "decode,accuracy,memory")
    assert "## 5. A real pretrained LLM: SmolLM2-135M-Instruct" in text and "### Chat decoding" in text
    assert "| question | answer |" in text
    data = json.loads((out / "report.json").read_text())["smollm"]
    s = data["decode"]["summary"]
    assert s["requests"] == 4 and s["failed"] == 0 and 0 < s["generated_tokens"] <= 4 * 24
    assert s["prefix_hit_tokens"] > 0  # the chat template's system prompt, shared by every request
    assert data["accuracy"] is None and "the cut-down accuracy table is left out" in text  # --quick
    rows = {r["name"]: r for r in data["memory"]["rows"]}
    for item in ("weights", "kv pages", "total resident"):
        assert rows[item]["analytic"] == rows[item]["measured"], rows[item]
    per_block = 64 * 2 * 30 * 3 * 64 * 4  # block 64 × (K, V) × 30 layers × 3 kv heads × 64 × fp32 bytes
    assert rows["kv pages"]["analytic"] % per_block == 0 and rows["kv pages"]["analytic"] // per_block > 400
