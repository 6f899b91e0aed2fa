"""The fp8-vs-bf16 accuracy evaluation (kvjax.evaluation.accuracy) on a tiny random model: orderings that
must hold, and the full suite's pieces checked against numbers worked out here.

- fp32 KV is closer to bf16 than any quantized variant (its distance is bf16 rounding only).
- With K channels inflated far beyond e4m3's 448 (models.stress: the model's function is
  unchanged), vLLM's unit scale saturates them and is measurably worse than a calibrated
  per-tensor scale.
- Position buckets: a Tally's bucket means equal hand-computed ones; evaluate's long-window
  buckets equal KL computed here in numpy from LLM.score.
- Chunked prefill scoring equals one-step scoring (exactly for one chunk, to f32 rounding else).
- Layer sensitivity ranks first the one layer whose K channels were inflated past 448.
- A continuation replayed through the engine (trace replay) scores as a teacher-forced prefill of it.
- The outlier map's amax equal kvjax.quant.calibration.cache_amax of the same prefill (and so do the scales
  of the one shared prefill, channel_amax), and its channel
  ratios the max over the median of per-channel amax computed here from the pages.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import LLM
from kvjax.commands.accuracy import markdown, write_outputs
from kvjax.evaluation import accuracy, tradeoff
from kvjax.evaluation.layers import kv_outliers, most_sensitive
from kvjax.evaluation.metrics import Tally
from kvjax.evaluation.scoring import ChunkedScorer, chunk_layouts, prefill_caches
from kvjax.experiments.train_small import HF_CONFIGS
from kvjax.models import build_model, from_hf_config, init_params
from kvjax.models.hub import load_model
from kvjax.models.loader import save_checkpoint
from kvjax.models.stress import rope_pairs
from kvjax.quant.calibration import cache_amax, calibrate, channel_amax
from kvjax.quant.formats import FORMATS, scales_from_amax

HF = dict(HF_CONFIGS["gqa"], num_hidden_layers=3, hidden_size=64, intermediate_size=128, head_dim=16)
HOT_LAYER = 1  # the layer whose K channels the "hot" checkpoint inflates
# The hot checkpoint's folder has the plain one's name: a config's name is its folder's, and the model
# module (a static argument of every jitted step) compares configs, so the hot model reuses the plain
# one's compiled engine steps (same shapes) instead of compiling each variant's again.
HOT = "hot/model"


def _inflate_one_layer(config, params, layer: int, factor: float):
    """models.stress's trick on one layer only: K channels 0, 5 (and RoPE partners) × factor,
    the matching q_proj columns ÷ factor; q·k, and so the model's function, is unchanged."""
    params = jax.tree_util.tree_map(np.array, params)
    attn = params[f"layers_{layer}"]["self_attn"]
    h, group = config.head_dim, config.num_heads // config.num_kv_heads
    cols = rope_pairs((0, 5), h, config.rope.layout)
    for kv in range(config.num_kv_heads):
        attn["k_proj"]["kernel"][:, [kv * h + c for c in cols]] *= factor
        for n in range(kv * group, (kv + 1) * group):
            attn["q_proj"]["kernel"][:, [n * h + c for c in cols]] /= factor
    return params


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    config = from_hf_config(HF)
    params = init_params(build_model(config), jax.random.key(3))
    save_checkpoint(root / "model", HF, params)
    save_checkpoint(root / HOT, HF, _inflate_one_layer(config, params, HOT_LAYER, 2000.0))
    rng = np.random.default_rng(0)
    text = bytes(rng.integers(32, 127, 4096).astype(np.uint8))
    (root / "data.txt").write_bytes(text)
    (root / "calib.txt").write_bytes(text[::-1])
    (root / "prose.txt").write_bytes(bytes(rng.integers(97, 123, 4096).astype(np.uint8)))
    return root


def _run(root, outliers, only=None):  # a LoadedModel with inflated channels, a folder name without
    model = load_model(str(root / "model")) if outliers else str(root / "model")
    return accuracy.evaluate(model, str(root / "data.txt"), str(root / "calib.txt"), seq_len=64,
                             max_windows=4, prompts=2, prompt_len=16, decode_tokens=6,
                             outlier_channels=outliers, outlier_factor=2000.0, only=only)


@pytest.mark.slow
def test_fp32_closer_to_bf16_than_any_8bit_variant(tiny_checkpoint):
    res = {r["variant"]: r for r in _run(tiny_checkpoint, outliers=False)["results"]}
    assert list(res) == [v["name"] for v in accuracy.variants(3)]  # every variant, the default skip one last
    assert res["bf16"]["kl_vs_bf16"] == 0 and res["bf16"]["top1_agreement"] == 1
    assert res["bf16"]["replay_top1"] == 1  # its own greedy continuation, replayed: its argmax at every step
    assert abs(res["fp32"]["replay_nll"] - res["bf16"]["replay_nll"]) < 0.05
    fp32 = res["fp32"]["kl_vs_bf16"]
    for name, r in res.items():
        if r["kv_dtype"] not in ("bf16", "fp32"):
            assert fp32 < r["kl_vs_bf16"], (name, fp32, r["kl_vs_bf16"])


@pytest.mark.slow
def test_outliers_beyond_448_break_unit_scale_not_calibrated(tiny_checkpoint, tmp_path):
    res = _run(tiny_checkpoint, outliers=True, only=("fp8_e4m3 unit", "fp8_e4m3 per_tensor"))
    by = {r["variant"]: r for r in res["results"]}
    assert list(by) == ["bf16", "fp8_e4m3 unit", "fp8_e4m3 per_tensor", "fp8_e4m3 per_tensor skip 0,2"]
    unit, calibrated = by["fp8_e4m3 unit"], by["fp8_e4m3 per_tensor"]
    assert unit["kl_vs_bf16"] > 10 * calibrated["kl_vs_bf16"], (unit, calibrated)
    assert unit["top1_agreement"] < calibrated["top1_agreement"]
    paths = write_outputs(res, str(tmp_path))
    for p in paths.values():
        assert (tmp_path / p.split("/")[-1]).stat().st_size > 0


def test_a_replayed_continuation_scores_as_teacher_forcing(tiny_checkpoint):
    """accuracy.replay (vLLM's trace replay through the variant's engine, decoding step by step into fp8 pages)
    gives the log-probabilities and ranks of a teacher-forced score of the same tokens (LLM.score_windows: one
    prefill into fp8 pages), to float32 rounding."""
    llm = LLM(str(tiny_checkpoint / "model"), kv_cache_dtype="fp8_e4m3", max_num_seqs=2, max_model_len=40,
              enable_trace_replay=True, steps_per_call=8, use_tqdm_on_load=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(32, 127, 16).tolist(), rng.integers(32, 127, 16).tolist()]
    continuations = rng.integers(32, 127, (2, 6))
    lps, ranks = accuracy.replay(llm, prompts, continuations)
    scores = llm.score_windows(np.concatenate([np.array(prompts), continuations], axis=1))[:, 15:21]  # [2, 6, V]
    want = np.take_along_axis(scores, continuations[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(lps, want, atol=2e-3)
    assert (ranks >= (scores > want[..., None] + 2e-3).sum(-1) + 1).all()
    assert (ranks <= (scores >= want[..., None] - 2e-3).sum(-1)).all()


def test_tally_bucket_means_by_hand():
    tally = Tally((0, 128, 512, 2048))
    positions = np.arange(600)
    kl = np.stack([positions, 2 * positions]).astype(np.float32)  # two rows sharing the positions
    top1 = np.stack([positions < 100, positions < 100])
    tally.add(positions, kl, top1, np.ones_like(kl))
    got = tally.buckets()
    assert [(b["start"], b["end"], b["tokens"]) for b in got] == [(0, 128, 256), (128, 512, 768), (512, 2048, 176)]
    # mean of p and 2p over p in [a, b) is 1.5 × (a + b - 1) / 2
    for b, (lo, hi) in zip(got, [(0, 128), (128, 512), (512, 600)]):
        assert b["kl_vs_bf16"] == pytest.approx(1.5 * (lo + hi - 1) / 2)
        assert b["perplexity"] == pytest.approx(np.e)
    assert [b["top1_agreement"] for b in got] == [pytest.approx(100 / 128), 0.0, 0.0]
    assert tally.overall()["kl_vs_bf16"] == pytest.approx(1.5 * 599 / 2)
    with pytest.raises(ValueError, match="outside the buckets"):
        tally.add(np.arange(2040, 2050), *(np.zeros((1, 10)),) * 3)


@pytest.mark.slow
def test_chunked_scoring_matches_one_step(tiny_checkpoint):
    layouts, num_blocks = chunk_layouts(300, 128, 16)
    assert num_blocks == 1 + 19 and [s for s, _ in layouts] == [0, 128, 256]
    # chunk c's table covers only what it can see: 8, 16, 19 blocks
    assert [md.block_tables.shape[1] for _, md in layouts] == [8, 16, 19]
    assert [md.num_tokens for _, md in layouts] == [128, 128, 44]
    window = np.frombuffer((tiny_checkpoint / "data.txt").read_bytes()[:300], np.uint8).astype(np.int32)
    llm = LLM(str(tiny_checkpoint / "model"), kv_cache_dtype="fp32", max_num_seqs=1, max_model_len=16)
    one_step = llm.score_windows(window[None])[0]  # f32[S, V]
    whole = np.concatenate([np.asarray(lp) for _, lp in ChunkedScorer(llm, 300, 300).chunks(window)])
    np.testing.assert_array_equal(whole, one_step)
    chunked = np.concatenate([np.asarray(lp) for _, lp in ChunkedScorer(llm, 300, 128).chunks(window)])
    np.testing.assert_allclose(chunked, one_step, atol=1e-4)


@pytest.mark.slow
def test_sensitivity_ranks_the_inflated_layer_first(full_suite):
    """On the full suite's own layer_sensitivity rows: the hot model, the calibration text's first 128
    bytes as 2 windows of 64, fp8_e4m3 at unit scale (layer 1's |K| > 448 saturates)."""
    sens = full_suite["sensitivity"]
    assert (sens["variant"], sens["windows"], sens["seq_len"]) == ("fp8_e4m3 unit", 2, 64)
    rows = sens["layers"]
    kl = [r["kl_vs_bf16"] for r in rows]
    assert [r["layer"] for r in rows] == [0, 1, 2]
    assert int(np.argmax(kl)) == HOT_LAYER and kl[HOT_LAYER] > 2 * max(kl[:HOT_LAYER] + kl[HOT_LAYER + 1:]), kl
    assert most_sensitive(rows, 1) == [HOT_LAYER]
    assert most_sensitive(rows, 3) == [0, 1, 2]


@pytest.mark.slow
def test_outlier_map_against_cache_amax(tiny_checkpoint):
    loaded = load_model(str(tiny_checkpoint / HOT))
    windows = np.frombuffer((tiny_checkpoint / "calib.txt").read_bytes()[:3 * 64], np.uint8).astype(np.int32)
    windows = windows.reshape(3, 64)
    got = kv_outliers(loaded.config, loaded.module, loaded.params, windows, batch=2)  # two batches: 2 + 1
    # Every row is prefilled alone into its own cache, so prefilling the same 2 + 1 rows and stacking the
    # caches is prefilling all 3 (and reuses the op-by-op compilations of kv_outliers' two batches).
    caches = jax.tree_util.tree_map(lambda *parts: np.concatenate(parts), *(
        prefill_caches(loaded.module, loaded.params, jnp.asarray(w), loaded.config.kv_spec("bf16"))
        for w in (windows[:2], windows[2:])))
    amax_k, amax_v = cache_amax(caches)
    for i, layer in enumerate(caches.layers):
        np.testing.assert_allclose(got["k_amax"][i], np.asarray(amax_k[i]), rtol=0)
        np.testing.assert_allclose(got["v_amax"][i], np.asarray(amax_v[i]), rtol=0)
        for name, pages in (("k", layer.k), ("v", layer.v)):
            channel = np.abs(np.asarray(pages, np.float32)).max(axis=(0, 1, 2))  # [K, H] (block 0 is all zeros)
            np.testing.assert_allclose(got[f"{name}_channel_ratio"][i],
                                       channel.max(axis=1) / np.median(channel, axis=1), rtol=1e-6)
    hot = [i for i in range(3) if max(np.asarray(amax_k[i]).max(), np.asarray(amax_v[i]).max()) > 448]
    assert hot == [HOT_LAYER] and got["saturated_layers"] == hot
    # the one shared prefill (channel_amax) gives the scales cache_amax's statistic gives
    channels = channel_amax(loaded.config, loaded.module, loaded.params, windows, batch=2)
    for mode in ("per_tensor", "per_head"):
        want = scales_from_amax(amax_k, amax_v, FORMATS["fp8_e4m3"], mode)
        have = calibrate(loaded.config, loaded.module, loaded.params, windows, "fp8_e4m3", mode, channels=channels)
        assert want.to_json() == have.to_json()  # scales and their statistics, exactly
    assert min(got["k_channel_ratio"][HOT_LAYER]) > 100  # the inflated channels stand out


@pytest.fixture(scope="module")
def full_suite(tiny_checkpoint):
    """The full suite on the hot checkpoint, run once: test_full_suite checks it, and
    test_sensitivity_ranks_the_inflated_layer_first its layer sensitivity rows."""
    root = tiny_checkpoint
    return accuracy.evaluate(str(root / HOT), [str(root / "data.txt"), str(root / "prose.txt")],
                             str(root / "calib.txt"), seq_len=64, max_windows=4, calib_windows=2, prompts=2,
                             prompt_len=16, decode_tokens=4, outlier_map=True, sensitivity_windows=2,
                             skip_counts=(1, 2), long_windows=1, long_len=640, long_chunk=640, long_variants="all",
                             only=("fp32", "fp8_e4m3 unit"),  # and the skip variants of fp8_e4m3 unit
                             passkey_lengths=(300,), passkey_depths=(0.5,), passkey_trials=2, passkey_per_haystack=2,
                             passkey_data=str(root / "prose.txt"))


@pytest.mark.slow
def test_full_suite(full_suite, tiny_checkpoint, tmp_path):
    """Two sources, outlier map, sensitivity-chosen skip variants, a long window's position buckets
    against KL computed here in numpy from LLM.score, and every output file."""
    root, res = tiny_checkpoint, full_suite
    assert [s["windows"] for s in res["sources"]] == [2, 2] and res["windows"] == 4
    names = [r["variant"] for r in res["results"]]
    skips = res["sensitivity"]["skip_sets"]
    assert skips[0] == [HOT_LAYER] and len(skips[1]) == 2 and HOT_LAYER in skips[1]
    assert names[-2:] == [f"fp8_e4m3 unit skip {HOT_LAYER}", "fp8_e4m3 unit skip " + ",".join(map(str, skips[1]))]
    by = {r["variant"]: r for r in res["results"]}
    assert by[names[-2]]["kl_vs_bf16"] < by["fp8_e4m3 unit"]["kl_vs_bf16"] / 2  # skipping the hot layer helps

    # the long window is source 0's tokens right after its two 64-token windows
    window = np.frombuffer((root / "data.txt").read_bytes()[128:128 + 640], np.uint8).astype(np.int32)
    loaded = load_model(str(root / HOT))
    base, var = (LLM(loaded, kv_cache_dtype=dt, max_num_seqs=1, max_model_len=16).score_windows(window[None])[0, :-1]
                 .astype(np.float64) for dt in ("bf16", "fp8_e4m3"))  # [639, V] each
    kl = np.sum(np.exp(base) * (base - var), axis=-1)
    got = res["long"]["variants"]["fp8_e4m3 unit"]["buckets"]
    assert [(b["start"], b["tokens"]) for b in got] == [(0, 128), (128, 384), (512, 127)]
    for b, (lo, hi) in zip(got, [(0, 128), (128, 512), (512, 639)]):
        assert b["kl_vs_bf16"] == pytest.approx(kl[lo:hi].mean(), rel=1e-3)
    assert res["long"]["variants"]["bf16"]["kl_vs_bf16"] == 0 and res["long"]["scored_tokens"] == 639
    long = res["long"]["variants"]  # every variant but fp32, each in its own format: skipping the hot layer helps
    assert list(long) == ["bf16"] + [n for n in names if n not in ("bf16", "fp32")]
    assert long[names[-2]]["kl_vs_bf16"] < long["fp8_e4m3 unit"]["kl_vs_bf16"] / 2
    assert res["positions"]["variants"]["fp32"][0]["tokens"] == 4 * 63  # short windows: all in bucket 0-128

    # passkey through every variant but fp32, its trade-off rows beside Llama-3-70B's bytes
    assert list(res["passkey"]["answers"]) == [n for n in names if n != "fp32"]
    assert all(c["trials"] == 2 for c in res["passkey"]["cells"]["bf16"])
    rows = tradeoff.table(res)
    assert [r["variant"] for r in rows] == list(res["passkey"]["answers"])
    assert all(r["passkey"]["length"] == 300 and r["kl_2k_8k"] is None for r in rows)  # 640 tokens: no 2K-8K

    md = markdown(res)
    assert "Passkey retrieval" in md and "The trade-off" in md
    assert "KL(bf16‖variant) by context position" in md and "Layer sensitivity" in md
    assert f"saturates (|K| or |V| > 448): {HOT_LAYER}." in md
    paths = write_outputs(res, str(tmp_path))
    assert set(paths) == {"json", "md", "png", "positions", "layers", "amax", "tradeoff"}
    for p in paths.values():
        assert (tmp_path / p.split("/")[-1]).stat().st_size > 0
