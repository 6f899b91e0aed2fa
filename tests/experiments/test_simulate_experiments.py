"""The simulator's experiments end to end on small settings (their tables and files)."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_simulate_h200_quick(tmp_path):
    from kvjax.experiments import simulate_h200

    res = simulate_h200.main(["--quick", "--out", str(tmp_path)])
    (d,) = res["deployments"]
    assert [p["rate"] for p in d["points"]] == [2, 4] and all(p["p90_tpot_ms"] > 0 for p in d["points"])
    assert json.loads((tmp_path / "simulate_h200.json").read_text())["deployments"][0]["label"] == d["label"]
    assert "SIMULATED" in (tmp_path / "simulate_h200.md").read_text() and (tmp_path / "simulate_h200.png").stat().st_size


@pytest.mark.slow
def test_simulate_validation_quick(tmp_path):
    from kvjax.experiments import simulate_validation

    res = simulate_validation.main(["--quick", "--out", str(tmp_path)])
    assert len(res["validation"]) == 2
    assert all(min(res["fit"][name]["coefficients"]["coefficients"]) >= 0 for name in simulate_validation.PROFILES)
    for row in res["validation"]:
        assert row["measured"]["mean_ttft_ms"] > 0
        assert all(row["simulated"][name]["mean_ttft_ms"] > 0 for name in simulate_validation.PROFILES)
    assert "meas. / sim." in (tmp_path / "simulate_validation.md").read_text()


@pytest.mark.slow
def test_simulate_speed_small(tmp_path):
    from kvjax.experiments import simulate_speed

    res = simulate_speed.main(["--requests", "40", "--side-by-side", "20", "--out", str(tmp_path)])
    assert res["steps"] > 40 and res["side_by_side"]["steps"] > 20 and res["wall_s"] > 0
    assert "host loop" in (tmp_path / "simulate_speed.md").read_text()
