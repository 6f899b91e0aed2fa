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


def _part(labels, command, seconds, requests=4, **extra) -> dict:
    point = dict(rate=4, blocks=100, host_blocks=0, steps=10, preemptions=2, recompute_tax=0.02, host_loaded_tokens=0,
                 peak_running=5, mean_ttft_ms=9.0, p90_ttft_ms=10.0, mean_tpot_ms=1.0, p90_tpot_ms=2.0,
                 mean_e2el_ms=50.0, output_throughput=100.0)
    return dict(command=command, assumptions="a", slo={}, seconds=seconds, **extra, deployments=[
        dict(label=x, deployment=dict(host_gib=0), cost_model="c", requests=requests, points=[point]) for x in labels])


def test_simulate_h200_merges_parts_in_its_own_order(tmp_path):
    from kvjax.experiments import simulate_h200

    labels = [d.label for d in simulate_h200.DEPLOYMENTS]
    first = tmp_path / "a.json"
    first.write_text(json.dumps(_part([labels[2], labels[0]], "python experiments/simulate_h200.py --only X", 5.0,
                                      parts=["--only A", "--only B"])))
    second = tmp_path / "b.json"
    second.write_text(json.dumps(_part([labels[1], labels[0]], "python experiments/simulate_h200.py --only Y", 2.5,
                                       requests=8)))
    res = simulate_h200.main(["--merge", str(first), str(second), "--out", str(tmp_path / "out")])
    assert [d["label"] for d in res["deployments"]] == labels[:3]  # the script's order
    assert [d["requests"] for d in res["deployments"]] == [8, 8, 4]  # b's labels[0] replaced a's
    assert res["seconds"] == 7.5 and res["parts"] == ["--only A", "--only B", "--only Y"]
    assert res["command"] == "python experiments/simulate_h200.py" and f"not run: {labels[3]}" in res["note"]
    assert (tmp_path / "out" / "simulate_h200.md").read_text().count("## ") == 3
    stray = tmp_path / "c.json"
    stray.write_text(json.dumps(_part(["a deployment renamed since"], "python experiments/simulate_h200.py", 1.0)))
    with pytest.raises(SystemExit, match="a deployment renamed since"):
        simulate_h200.main(["--merge", str(first), str(stray), "--out", str(tmp_path / "out2")])


def test_simulate_h200_compares_a_host_tier_with_the_same_deployment_without(tmp_path):
    from kvjax.experiments import simulate_h200

    tier = next(d for d in simulate_h200.DEPLOYMENTS if d.host_gib)
    base = tier.label.rsplit(", ", 1)[0]
    part = _part([base, tier.label], "python experiments/simulate_h200.py", 1.0)
    part["deployments"][1]["deployment"]["host_gib"] = tier.host_gib
    part["deployments"][1]["points"] = [dict(part["deployments"][0]["points"][0], preemptions=1, recompute_tax=-0.004,
                                             host_loaded_tokens=640)]
    (tmp_path / "a.json").write_text(json.dumps(part))
    simulate_h200.main(["--merge", str(tmp_path / "a.json"), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "simulate_h200.md").read_text()
    assert "4 req/s: preemptions 2 → 1, recompute tax 2.0% → -0.4% (640 tokens loaded from host instead)" in md
    assert "A recompute tax below 0" in md
