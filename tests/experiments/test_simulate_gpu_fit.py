"""experiments/simulate_gpu_fit.py on a GPU bench file whose step times are made by hand from a
known cost (a fixed 2 ms, plus every byte a decode step reads at 3 TB/s, plus 1 µs per prefill token):
the fitted profile recovers it and predicts the held-back cases exactly; the datasheet roofline
(4.8 TB/s, 1 ms) comes out faster than these steps, by the amount the arithmetic says."""
import json

import pytest

from kvjax.config.presets import preset
from kvjax.experiments import simulate_gpu_fit as fit


def _bench(tmp_path):
    config = preset("llama-3-8b")
    weights = config.num_params * 2
    kv = config.kv_spec("bf16").bytes_per_token
    rows = []
    for b, s in [(32, 512), (32, 8192), (8, 512), (128, 512), (1, 8192)]:
        read = weights + b * s * kv
        rows.append({"case": f"decode:{b}:{s}:bf16:pallas:8", "kind": "decode", "batch": b, "context": s, "kv": "bf16",
                     "impl": "pallas", "k": 8, "step_ms": (2e-3 + read / 3e12) * 1e3})
    for b, s in [(32, 512), (1, 8192)]:
        rows.append({"case": f"prefill:{b}:{s}:bf16:pallas:8", "kind": "prefill", "batch": b, "context": s, "kv": "bf16",
                     "impl": "pallas", "k": 8, "ttft_ms": (2e-3 + weights / 3e12 + b * s * 1e-6) * 1e3})
    bench = {"model": "llama-3-8b", "layers": 32, "device": "NVIDIA H200", "weight_bytes": weights,
             "peaks": {"read_gb_s": 4478.0, "matmul_tflop_s": 733.0}, "rows": rows}
    path = tmp_path / "gpu_model_bench.json"
    path.write_text(json.dumps(bench))
    return path, weights, kv


def test_fitted_profile_predicts_the_held_back_cases(tmp_path):
    path, weights, kv = _bench(tmp_path)
    r = fit.main([str(path), "--out", str(tmp_path)])
    assert r["fit_cases"] == ["decode:32:512:bf16:pallas:8", "decode:32:8192:bf16:pallas:8",
                              "prefill:32:512:bf16:pallas:8"]
    held = [x for x in r["rows"] if x["held_back"]]
    assert len(held) == 4
    # Three fitting cases, three regressors that matter (1, decode tokens and context, prefill tokens): exact.
    for x in r["rows"]:
        assert x["error"]["fitted_profile"] == pytest.approx(0, abs=0.02), x
    decode = next(x for x in r["rows"] if x["case"] == "decode:128:512:bf16:pallas:8")
    by_hand = (weights + 128 * 512 * kv) / 4.8e12 + 1e-3  # the datasheet roofline of that step
    assert decode["predicted_s"]["datasheet"] == pytest.approx(by_hand, rel=0.02)
    assert (tmp_path / "simulate_gpu_fit.md").read_text().count("(held back)") == 4
