"""experiments/structured_overhead.py runs end to end on a tiny load and writes its table.

Beside one plain, one constrained or one logit-biased request, the unconstrained greedy batch must decode
the same tokens as alone (the mask and the bias touch only their own request's row), and the constrained
companion must run its regex of exactly --new letters to the end.
"""
from __future__ import annotations

import json

import pytest

from kvjax.experiments import structured_overhead


@pytest.mark.slow  # a whole experiment (five variants compiled); tests/engine/test_structured_output.py checks the same
def test_tiny_run_writes_its_table(tmp_path):
    structured_overhead.main(["--batch", "2", "--prompt", "8", "--new", "12", "--steps-per-call", "4",
                              "--rounds", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "structured_overhead.json").read_text())
    rows = {r["variant"]: r for r in saved["rows"]}
    assert list(rows) == list(structured_overhead.VARIANTS)
    assert all(r["same_tokens"] for r in rows.values()), {v: r["same_tokens"] for v, r in rows.items()}
    assert [rows[v]["companion_tokens"] for v in ("+ plain", "+ constrained", "+ logit_bias")] == [12, 12, 12]
    assert all(r["decode_tok_s"] > 0 for r in rows.values()) and rows["alone"]["vs_alone"] == 1.0
    md = (tmp_path / "structured_overhead.md").read_text()
    assert "| + constrained |" in md and f"{rows['alone, k=1']['vs_alone']:.3f}" in md
