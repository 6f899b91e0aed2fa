"""The outlier stress transform, calibration statistics, `kvjax calibrate`, and reading data
files through a checkpoint's tokenizer."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.evaluation.scoring import prefill_caches, sequence_logits
from kvjax.experiments.train_small import HF_CONFIGS
from kvjax.models import build_model, from_hf_config, init_params, preset
from kvjax.models.loader import save_checkpoint
from kvjax.models.stress import inflate_k_channels, rope_pairs
from kvjax.models.tokenizer import Tokenizer as ModelTokenizer
from kvjax.quant.calibration import cache_amax


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny-mla"])
def test_stress_inflates_cached_k_without_changing_the_model(name):
    cfg = preset(name)
    model = build_model(cfg)
    params = init_params(model, jax.random.key(2))
    stressed = inflate_k_channels(cfg, params, (0, 3), 50.0)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)))
    spec = cfg.kv_spec("fp32")
    a = sequence_logits(model, params, toks, spec, 4)
    b = sequence_logits(model, stressed, toks, spec, 4)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    before = np.asarray(cache_amax(prefill_caches(model, params, toks, spec, 4))[0][0])
    after = np.asarray(cache_amax(prefill_caches(model, stressed, toks, spec, 4))[0][0])
    inflated = [0, 3] if cfg.is_mla else None
    if cfg.is_mla:
        np.testing.assert_allclose(after[inflated], before[inflated] * 50.0, rtol=1e-4)
    else:
        assert after.min() > 10 * before.max()  # every kv head has inflated channels


def test_rope_pairs():
    assert rope_pairs([0, 5], 16, "half") == [0, 5, 8, 13]
    assert rope_pairs([0, 5], 16, "interleaved") == [0, 1, 4, 5]


@pytest.mark.slow
def test_calibrate_command(tmp_path):
    hf = dict(HF_CONFIGS["gqa"], num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16)
    params = init_params(build_model(from_hf_config(hf)), jax.random.key(3))
    save_checkpoint(tmp_path / "m", hf, params)
    (tmp_path / "calib.txt").write_bytes(bytes(range(32, 127)) * 8)
    out = tmp_path / "scales.json"
    p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "calibrate", "--model", str(tmp_path / "m"), "--data",
                        str(tmp_path / "calib.txt"), "--mode", "per_head", "--seq-len", "64", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    scales = json.loads(out.read_text())
    assert scales["mode"] == "per_head" and len(scales["k"]) == 2 and len(scales["k"][0]) == 2
    amax = np.asarray(scales["amax_k"][0])
    np.testing.assert_allclose(scales["k"][0], amax / 448.0, rtol=1e-6)
    bad = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "calibrate", "--model", "nope", "--data",
                          str(tmp_path / "calib.txt"), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_data_files_go_through_the_checkpoints_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "def": 1, "return": 2, "x": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "data.txt").write_text("def x return y")
    assert ModelTokenizer(str(tmp_path)).encode_file(str(tmp_path / "data.txt")).tolist() == [1, 3, 2, 0]
    plain = tmp_path / "plain"
    plain.mkdir()
    assert ModelTokenizer(str(plain)).encode_file(str(tmp_path / "data.txt")).tolist() == list(b"def x return y")
    assert ModelTokenizer(str(plain)).decode([104, 105, 255]) == "hi\ufffd"
