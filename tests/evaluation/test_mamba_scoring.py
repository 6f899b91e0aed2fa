"""The accuracy lab's scoring paths take attention + Mamba hybrids: `LLM.score_windows` (each window prefilled
alone) and `ChunkedScorer` (one window prefilled chunk by chunk, the Mamba state carried in its state block) give
transformers' log-probabilities on a tiny random Bamba checkpoint (tests/mamba_fixtures.py); with fp8 KV on the
attention layers (the states stay in their dtype) they move, but stay close. The whole lab (`evaluate`) runs on the
tiny-bamba preset."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_fixtures import random_model, save_hf_model
from mamba_fixtures import hybrid_config

import kvjax
from kvjax.errors import KvjaxError
from kvjax.evaluation import accuracy
from kvjax.evaluation.scoring import ChunkedScorer

TOL = 1e-4


def test_bamba_scores_equal_transformers_whole_and_chunked(tmp_path):
    hf = random_model(*hybrid_config("bamba"), seed=0)
    folder = save_hf_model(hf, str(tmp_path / "bamba"))
    windows = np.random.RandomState(5).randint(0, 128, size=(2, 40))
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.as_tensor(windows)).logits.float(), -1).numpy()  # [2, 40, V]
    llm = kvjax.LLM(folder, dtype="float32", max_model_len=64, max_num_seqs=2)
    np.testing.assert_allclose(llm.score_windows(windows), want, rtol=TOL, atol=TOL)
    chunks = [np.asarray(logp) for _, logp in ChunkedScorer(llm, seq_len=40, chunk=16).chunks(windows[1])]
    np.testing.assert_allclose(np.concatenate(chunks), want[1], rtol=TOL, atol=TOL)
    fp8 = kvjax.LLM(folder, dtype="float32", max_model_len=64, max_num_seqs=2, kv_cache_dtype="fp8")
    got = fp8.score_windows(windows)
    assert np.isfinite(got).all() and 0 < np.abs(got - want).max() < 0.5


@pytest.mark.slow
def test_the_accuracy_lab_runs_on_a_hybrid(tmp_path):
    """`kvjax accuracy`'s evaluate on the random-weight tiny-bamba preset with calibrated fp8, int8 and fp8 with
    per-head scales on its attention layer (the Mamba states stay in their dtype): the bf16 baseline at distance 0
    from itself, every variant's bytes per token below bf16's, every KL finite and non-negative."""
    rng = np.random.default_rng(0)
    for f in ("data.txt", "calib.txt"):
        (tmp_path / f).write_bytes(bytes(rng.integers(32, 127, 2048).astype(np.uint8)))
    variants = ("fp8_e4m3 dynamic", "fp8_e4m3 per_head", "int8_per_token_head")
    out = accuracy.evaluate("preset:tiny-bamba", str(tmp_path / "data.txt"), str(tmp_path / "calib.txt"), seq_len=32,
                            max_windows=2, prompts=1, prompt_len=8, decode_tokens=4, skip_counts=(), only=variants)
    rows = {r["variant"]: r for r in out["results"]}
    assert set(rows) == {"bf16", *variants}, set(rows)
    assert rows["bf16"]["kl_vs_bf16"] == 0.0
    for v in variants:
        assert 0.0 <= rows[v]["kl_vs_bf16"] < float("inf"), v
        assert rows[v]["bytes_per_token"] < rows["bf16"]["bytes_per_token"], v
    with pytest.raises(KvjaxError, match="sensitivity_windows=0"):
        accuracy.evaluate("preset:tiny-bamba", str(tmp_path / "data.txt"), str(tmp_path / "calib.txt"),
                          sensitivity_windows=1)
