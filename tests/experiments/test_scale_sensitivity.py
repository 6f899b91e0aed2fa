"""experiments/scale_sensitivity.py: its fractions on hand-picked values, and a smoke run on the
built-in small model that writes every output."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.experiments import scale_sensitivity as ss


def test_fractions_by_hand():
    # one kv head, scale 0.5: |x| / s = 0, 2e-4 (subnormal), 1.25 (normal, rounds to 1.25 exactly),
    # 1.3 (normal: e4m3 → 1.25, relative error 0.05 / 1.3), 1000 (clipped)
    x = jnp.asarray(np.array([0.0, 1e-4, 0.625, -0.65, 500.0], np.float32).reshape(1, 1, 5, 1, 1))
    clipped, sub, normal, rel, n = (float(a) for a in ss._fractions(x, jnp.asarray([0.5], jnp.float32)))
    assert (clipped, sub, normal, n) == (1, 1, 2, 5)
    assert rel == pytest.approx(0.05 / 1.3, rel=1e-5)
    assert ss._ratios(np.array([clipped, sub, normal, rel, n])) == pytest.approx(
        dict(clipped=0.2, subnormal=0.2, rel_error=0.05 / 2.6), rel=1e-5)


@pytest.mark.slow
def test_quick_run_writes_every_output(tmp_path):
    res = ss.main(["--model", "small-gqa", "--windows", "4", "--seq-len", "64", "--calib-windows", "2", "--quick",
                   "--out", str(tmp_path)])
    (r,) = res["results"]
    assert [(x["mode"], x["calibrated_on"]) for x in r["rows"][:2]] == [("unit", "-"), ("per_tensor", "code")]
    assert len(r["rows"]) == 1 + 2 * 2 * 3  # unit, then 2 calibration sources × 2 modes × 3 multipliers
    for row in r["rows"]:
        assert row["kl"] >= 0 and 0 <= row["k_clipped"] <= 1 and 0 <= row["v_subnormal"] <= 1
    # a quarter of the calibrated scale puts the calibration's largest values at 4 × 448: some clip
    quarter = [x for x in r["rows"] if x["multiplier"] == 0.25 and x["mode"] == "per_tensor"]
    assert all(x["k_clipped"] > 0 for x in quarter)
    saved = json.loads((tmp_path / "scale_sensitivity.json").read_text())
    assert saved["results"][0]["rows"] == r["rows"]
    assert (tmp_path / "scale_sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    assert "| unit | - | 1 |" in (tmp_path / "scale_sensitivity.md").read_text()
