"""The simulator's cost models against arithmetic done by hand."""
from __future__ import annotations

import numpy as np
import pytest

from kvjax.config.presets import preset
from kvjax.config.scheduler import SchedulerConfig
from kvjax.errors import KvjaxError
from kvjax.simulator.cost import (DEVICES, SHAPE_FEATURES, FittedProfile, ModelCost, Roofline, StepFeatures,
                                  active_params)


def test_features_of_a_plan_by_hand():
    class Plan:  # a chunk of 5 new tokens ending at 12, two decodes at 7 and 30
        num_requests = 3
        num_scheduled = np.array([5, 1, 1])
        seq_lens = np.array([12, 7, 30])
        prefill = np.array([True, False, False])

    f = StepFeatures.from_plan(Plan)
    assert (f.prefill_tokens, f.decode_tokens, f.tokens, f.context_tokens) == (5, 2, 7, 49)
    assert f.attention_pairs == (12 + 11 + 10 + 9 + 8) + 7 + 30  # each new token sees its position + 1 keys


def test_roofline_of_llama_3_8b_decode_on_h200_by_hand():
    """Llama-3-8B, bf16 weights and KV, 64 decodes at 4,096 positions each, one H200."""
    config = preset("llama-3-8b")
    spec = config.kv_spec("bfloat16")
    weights = 2 * config.num_params
    cost = Roofline(DEVICES["h200"], ModelCost.from_config(config, spec, weight_bytes=weights), overhead_s=0.0)
    f = StepFeatures(64, 0, 64, 64 * 4096, 64 * 4096)
    kv_token = 2 * 32 * 8 * 128 * 2  # K and V × layers × kv heads × head dim × 2 bytes = 128 KiB
    moved = weights + (64 * 4096 + 64) * kv_token
    flops = 2 * config.num_params * 64 / 989e12 + 2 * 32 * 32 * 256 * 64 * 4096 / 989e12
    assert cost.step_seconds(f) == pytest.approx(max(moved / 4.8e12, flops))
    assert moved / 4.8e12 > flops, "decode is bound by memory"
    # TP 8 with fp8 weights: an eighth of the bytes, and two ring all-reduces per layer
    tp8 = Roofline(DEVICES["h200"], ModelCost.from_config(config, spec, weight_bytes=config.num_params,
                                                          weight_dtype="fp8", tp=8), overhead_s=0.0)
    comm = 32 * 2 * (2 * 7 / 8) * 64 * 4096 * 2 / 450e9
    assert tp8.step_seconds(f) == pytest.approx(
        (config.num_params // 8 + (64 * 4096 + 64) * kv_token // 8) / 4.8e12 + comm)


def test_active_parameters_of_a_moe_model():
    config = preset("qwen3-30b-a3b")
    moe = config.moe
    per_expert = 3 * config.hidden_size * moe.intermediate_size
    assert active_params(config) == config.num_params - len(config.moe_layers) * (moe.num_experts - moe.top_k) * per_expert
    assert 3.0e9 < active_params(config) < 3.6e9  # "A3B": about 3.3B active
    assert active_params(preset("tiny")) == preset("tiny").num_params


def test_fitted_profile_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = np.array([2e-3, 3e-5, 4e-4, 1e-7, 2e-10])
    samples = []
    for _ in range(40):
        f = StepFeatures(4, int(rng.integers(0, 512)), int(rng.integers(0, 16)), int(rng.integers(0, 8192)),
                         int(rng.integers(0, 10 ** 6)))
        samples.append((f, float(truth @ f.vector())))
    prof = FittedProfile.fit(samples)
    np.testing.assert_allclose(prof.coefficients, truth, rtol=1e-6)
    assert prof.rms_error_s < 1e-9
    assert FittedProfile.from_json(prof.to_json()) == prof
    with pytest.raises(KvjaxError, match="needs at least 5 recorded steps, got 2"):
        FittedProfile.fit(samples[:2])


def test_fitted_coefficients_are_never_negative():
    """A feature whose free fit is negative is dropped and the rest refitted: here step time
    falls with decode tokens (noise a real step never has), so decode's coefficient is 0 and the
    others are the least squares of what is left."""
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(30):
        f = StepFeatures(4, int(rng.integers(0, 512)), int(rng.integers(0, 16)), 0, 0)
        samples.append((f, 1e-3 + 2e-5 * f.prefill_tokens - 1e-5 * f.decode_tokens))
    prof = FittedProfile.fit(samples)
    assert min(prof.coefficients) >= 0 and prof.coefficients[2] == 0.0
    x = np.array([[1.0, f.prefill_tokens] for f, _ in samples])
    want, *_ = np.linalg.lstsq(x, np.array([s for _, s in samples]), rcond=None)
    np.testing.assert_allclose(prof.coefficients[:2], want, rtol=1e-6)


def test_a_moe_step_reads_the_experts_its_tokens_touch():
    """DeepSeek-V3 (256 routed experts, top 8) at TP 8 with fp8 weights: a 1-token step reads the
    dense weights and 8 / 256 of the experts; 4,096 tokens touch all but (248/256)^4096 of them."""
    config = preset("deepseek-v3")
    moe = config.moe
    m = ModelCost.from_config(config, config.kv_spec("bfloat16"), weight_bytes=config.num_params, weight_dtype="fp8",
                              tp=8)
    per_expert = 3 * config.hidden_size * moe.intermediate_size
    experts = len(config.moe_layers) * moe.num_experts * per_expert // 8  # one byte per parameter, per rank
    assert (m.num_experts, m.top_k, m.expert_weight_bytes) == (256, 8, experts)
    dense = config.num_params // 8 - experts
    assert m.weight_bytes_read(1) == pytest.approx(dense + experts * 8 / 256)
    assert m.weight_bytes_read(4096) == pytest.approx(dense + experts * (1 - (248 / 256) ** 4096))
    assert m.weight_bytes_read(4096) == pytest.approx(m.weight_bytes, rel=1e-9)
    dense_model = ModelCost.from_config(preset("tiny"), preset("tiny").kv_spec("bfloat16"), weight_bytes=1000)
    assert dense_model.weight_bytes_read(1) == 1000


@pytest.mark.parametrize("seed", range(3))
def test_windowed_features_count_what_a_sliding_layer_reads(seed):
    """Per window: the keys a chunk's tokens see together, and their query-key pairs, against a
    plain count over every new token's window (q − W < k <= q)."""
    rng = np.random.default_rng(seed)

    class Plan:
        num_requests = 6
        num_scheduled = rng.integers(1, 30, 6)
        seq_lens = num_scheduled + rng.integers(0, 60, 6)
        prefill = num_scheduled > 1

    for w in (1, 7, 40, 10 ** 6):
        (window, reads, pairs), = StepFeatures.from_plan(Plan, (w,)).windowed
        seen = [[set(range(max(0, p - w + 1), p + 1)) for p in range(e - n, e)]
                for n, e in zip(Plan.num_scheduled, Plan.seq_lens)]
        assert window == w
        assert reads == sum(len(set().union(*keys)) for keys in seen)
        assert pairs == sum(len(k) for keys in seen for k in keys)
    f = StepFeatures.from_plan(Plan, (10 ** 6,))
    assert f.windowed[0][1:] == (f.context_tokens, f.attention_pairs)  # a window past every position: full
    d = StepFeatures.decoding(np.array([3, 50, 9]), (8,))
    assert d == StepFeatures(3, 0, 3, 62, 62, ((8, 3 + 8 + 8, 3 + 8 + 8),))


def test_roofline_of_a_sliding_window_model_reads_each_layer_its_share():
    """Gemma-3-27B (52 of 62 layers slide over 1,024 tokens), bf16 KV, 64 decodes at 8,192 positions:
    10 full layers read 8,192 tokens each, 52 read 1,024; the pairs likewise."""
    config = preset("gemma-3-27b")
    spec = config.kv_spec("bfloat16")
    m = ModelCost.from_config(config, spec, weight_bytes=2 * config.num_params)
    assert m.sliding == ((1024, 52),) and m.layers == 62
    cost = Roofline(DEVICES["h200"], m, overhead_s=0.0)
    f = StepFeatures.decoding(np.full(64, 8192), (1024,))
    per_layer = spec.bytes_per_token // 62
    moved = 2 * config.num_params + (10 * 64 * 8192 + 52 * 64 * 1024) * per_layer + 64 * spec.bytes_per_token
    pairs = 10 * 64 * 8192 + 52 * 64 * 1024
    flops = 2 * m.active_params * 64 / 989e12 + 2 * m.heads * (m.key_dim + m.value_dim) * pairs / 989e12
    assert cost.step_seconds(f) == pytest.approx(max(moved / 4.8e12, flops), rel=1e-9)
    full = StepFeatures.decoding(np.full(64, 8192))  # features without the window: every layer reads everything
    assert cost.step_seconds(full) > 2 * cost.step_seconds(f)


def test_host_tier_loads_cost_their_bytes_over_pcie():
    config = preset("llama-3-8b")
    spec = config.kv_spec("bfloat16")
    cost = Roofline(DEVICES["h200"], ModelCost.from_config(config, spec, weight_bytes=2 * config.num_params))
    f = StepFeatures(1, 100, 0, 100, 5050)
    loaded = StepFeatures(1, 100, 0, 100, 5050, loaded_tokens=4096)
    assert cost.step_seconds(loaded) - cost.step_seconds(f) == pytest.approx(4096 * spec.bytes_per_token / 64e9)

    class Plan:  # two host blocks copied in before a step of blocks of 16
        num_requests, num_scheduled, seq_lens, prefill = 1, np.array([4]), np.array([36]), np.array([True])
        loads, block_tables, is_decode = np.array([[3, 7], [4, 8]]), np.zeros((1, 8)), False

    config = SchedulerConfig(num_blocks=40, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=128)
    assert StepFeatures.from_plan(Plan, (), config).loaded_tokens == 32


def test_a_shape_profile_fits_the_engines_compiled_steps():
    """The engine's shapes (kvjax.engine.steps.step_shape) of a decode plan and a ragged one, by
    hand, and a profile over them recovering known coefficients."""
    config = SchedulerConfig(num_blocks=80, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                             max_model_len=1024)

    class Decode:  # three decodes, the longest at 150 positions: 10 blocks → a 16-block table (256 tokens)
        num_requests, num_scheduled, seq_lens = 3, np.array([1, 1, 1]), np.array([150, 40, 7])
        prefill, sample, loads, block_tables = np.zeros(3, bool), np.ones(3, bool), np.zeros((0, 2)), np.zeros((3, 64))
        is_decode = True

    class Ragged(Decode):  # 37 tokens → 64; the longest row at 90 positions → 8 blocks (128 tokens)
        num_requests, num_scheduled, seq_lens, is_decode = 2, np.array([30, 7]), np.array([90, 7]), False
        prefill, sample, block_tables = np.array([True, False]), np.array([True, True]), np.zeros((2, 64))

    assert StepFeatures.from_plan(Decode, (), config).shape == (True, 8, 256)
    assert StepFeatures.from_plan(Ragged, (), config).shape == (False, 64, 128)
    assert StepFeatures.decoding(Decode.seq_lens, (), config) == StepFeatures.from_plan(Decode, (), config)
    rng = np.random.default_rng(2)
    truth = np.array([1e-3, 4e-3, 2e-5, 3e-8])
    samples = []
    for _ in range(30):
        f = StepFeatures(1, 0, 1, 1, 1, shape=(bool(rng.integers(0, 2)), int(rng.integers(8, 256)),
                                                int(rng.integers(64, 1024))))
        samples.append((f, float(truth @ f.vector(SHAPE_FEATURES))))
    prof = FittedProfile.fit(samples, SHAPE_FEATURES)
    np.testing.assert_allclose(prof.coefficients, truth, rtol=1e-6)
    assert FittedProfile.from_json(prof.to_json()) == prof and prof.features == SHAPE_FEATURES
