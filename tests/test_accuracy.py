"""The fp8-vs-bf16 accuracy evaluation (kvjax.accuracy) on a tiny random model: orderings that must hold.

- fp32 KV is closer to bf16 than any 8-bit variant (its distance is bf16 rounding only).
- With K channels inflated far beyond e4m3's 448 (models.stress: the model's function is
  unchanged), vLLM's unit scale saturates them and is measurably worse than a calibrated
  per-tensor scale.
"""
import jax
import numpy as np
import pytest

from experiments.train_small import HF_CONFIGS
from kvjax import accuracy
from kvjax.commands.accuracy import write_outputs
from models import build_model, from_hf_config, init_params
from models.loader import save_checkpoint


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    hf = dict(HF_CONFIGS["gqa"], num_hidden_layers=3, hidden_size=64, intermediate_size=128, head_dim=16)
    params = init_params(build_model(from_hf_config(hf)), jax.random.key(3))
    save_checkpoint(root / "model", hf, params)
    rng = np.random.default_rng(0)
    text = bytes(rng.integers(32, 127, 4096).astype(np.uint8))
    (root / "data.txt").write_bytes(text)
    (root / "calib.txt").write_bytes(text[::-1])
    return root


def _run(root, outliers):
    return accuracy.evaluate(str(root / "model"), str(root / "data.txt"), str(root / "calib.txt"), seq_len=64,
                                 max_windows=4, prompts=2, prompt_len=16, decode_tokens=6,
                                 outlier_channels=outliers, outlier_factor=2000.0)


def test_fp32_closer_to_bf16_than_any_8bit_variant(tiny_checkpoint):
    res = {r["variant"]: r for r in _run(tiny_checkpoint, outliers=False)["results"]}
    assert res["bf16"]["kl_vs_bf16"] == 0 and res["bf16"]["top1_agreement"] == 1
    fp32 = res["fp32"]["kl_vs_bf16"]
    for name, r in res.items():
        if r["kv_dtype"] not in ("bf16", "fp32"):
            assert fp32 < r["kl_vs_bf16"], (name, fp32, r["kl_vs_bf16"])


def test_outliers_beyond_448_break_unit_scale_not_calibrated(tiny_checkpoint, tmp_path):
    res = _run(tiny_checkpoint, outliers=True)
    by = {r["variant"]: r for r in res["results"]}
    unit, calibrated = by["fp8_e4m3 unit"], by["fp8_e4m3 per_tensor"]
    assert unit["kl_vs_bf16"] > 10 * calibrated["kl_vs_bf16"], (unit, calibrated)
    assert unit["top1_agreement"] < calibrated["top1_agreement"]
    paths = write_outputs(res, str(tmp_path))
    for p in paths.values():
        assert (tmp_path / p.split("/")[-1]).stat().st_size > 0
