"""KV byte accounting against hand arithmetic (SPEC "The per-token formula", Table 1, "KV dtypes").

Every expected number below is written out from the formula f × L × Hkv × D × b, not taken
from the code under test.
"""
import pytest

from kvjax.config.model import ModelConfig
from kvjax.config.presets import preset
from kvjax.core.kv_cache_interface import KVSpec, SpecError, attention_kind
from kvjax.quant.kv_formats import kv_format

KiB, MiB, GiB = 1024, 1024**2, 1024**3


# Table 1: model -> (bf16 bytes/token, fp8 bytes/token, 128K bf16 bytes, mha ratio)
TABLE1 = {
    "llama-2-7b": (2 * 32 * 32 * 128 * 2, 2 * 32 * 32 * 128 * 1, 64 * GiB, 1.0),
    "llama-3-8b": (2 * 32 * 8 * 128 * 2, 2 * 32 * 8 * 128 * 1, 16 * GiB, 4.0),
    "llama-3-70b": (2 * 80 * 8 * 128 * 2, 2 * 80 * 8 * 128 * 1, 40 * GiB, 8.0),
    "deepseek-v3": (1 * 61 * 1 * 576 * 2, 1 * 61 * 1 * 576 * 1, None, 2 * 128 * 128 / 576),
}


@pytest.mark.parametrize("name", list(TABLE1))
def test_table1_bytes_per_token(name):
    bf16, fp8, at_128k, ratio = TABLE1[name]
    spec = preset(name).kv_spec()
    assert spec.replace(kv_dtype="bf16").bytes_per_token == bf16
    assert spec.replace(kv_dtype="fp8").bytes_per_token == fp8
    if at_128k is not None:
        assert spec.replace(kv_dtype="bf16").bytes_per_request(131072) == at_128k
    assert spec.mha_ratio == pytest.approx(ratio)


def test_table1_kib_values():
    # SPEC prints these in KiB; check the KiB figures themselves.
    assert preset("llama-2-7b").kv_spec().bytes_per_token == 512 * KiB
    assert preset("llama-3-8b").kv_spec().bytes_per_token == 128 * KiB
    assert preset("llama-3-70b").kv_spec().bytes_per_token == 320 * KiB
    assert preset("deepseek-v3").kv_spec().bytes_per_token == 68.625 * KiB
    assert preset("deepseek-v3").kv_spec().replace(kv_dtype="fp8").bytes_per_token == 34.3125 * KiB
    assert preset("deepseek-v3").kv_spec().bytes_per_request(131072) / GiB == pytest.approx(8.578, abs=5e-4)
    assert round(preset("deepseek-v3").kv_spec().mha_ratio, 1) == 56.9


def test_llama70b_as_mha_needs_2_5_mib_per_token():
    spec = KVSpec("mha", 80, 64, 64, 128)
    assert spec.bytes_per_token == 2.5 * MiB
    assert spec.bytes_per_request(8192) == 20 * GiB


def test_vllm_page_size_per_layer_and_block():
    # vLLM page = num_heads × block_size × (head_size + head_size_v) × dtype_size
    spec = preset("llama-3-70b").kv_spec()
    assert spec.page_bytes(0, 64) == 8 * 64 * (128 + 128) * 2
    assert spec.bytes_per_block(64) == 80 * 8 * 64 * 256 * 2 == 20 * MiB
    mla = preset("deepseek-v3").kv_spec()
    assert mla.page_bytes(0, 64) == 1 * 64 * (576 + 0) * 2
    assert mla.bytes_per_block(64) == 61 * 64 * 576 * 2


def test_dtype_widths():
    spec = KVSpec("gqa", 2, 8, 2, 64)
    assert spec.replace(kv_dtype="fp32").bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert spec.replace(kv_dtype="fp16").bytes_per_token == 2 * 2 * 2 * 64 * 2
    assert spec.replace(kv_dtype="fp8_e5m2").bytes_per_token == 2 * 2 * 2 * 64
    assert kv_format("fp8") == kv_format("fp8_e4m3")


def test_spec_stores_the_normalised_dtype_name():
    """Any alias, any case, is stored once as the format's own name: readers never normalise."""
    spec = KVSpec("gqa", 2, 8, 2, 64, kv_dtype="FP8", model_dtype="bfloat16")
    assert (spec.kv_dtype, spec.model_dtype) == ("fp8_e4m3", "bf16")
    assert spec == KVSpec("gqa", 2, 8, 2, 64, kv_dtype="fp8_e4m3")
    assert spec.replace(kv_dtype="float16").kv_dtype == "fp16"
    assert spec.replace(kv_dtype=kv_format("half")).kv_dtype == "fp16"
    assert preset("llama-3-8b").kv_spec("fp8").kv_dtype == "fp8_e4m3"
    assert preset("llama-3-8b").kv_spec().kv_dtype == preset("llama-3-8b").kv_spec().model_dtype
    with pytest.raises(SpecError, match="unknown kv dtype 'fp6'"):
        spec.replace(model_dtype="fp6")


@pytest.mark.parametrize("heads, kv, kind", [(8, 8, "mha"), (8, 1, "mqa"), (8, 2, "gqa"), (1, 1, "mha")])
def test_attention_kind_names_the_layout_for_the_spec_and_the_config(heads, kv, kind):
    assert attention_kind(heads, kv) == kind
    config = ModelConfig("llama", 32, 64, 128, 1, heads, kv, head_dim=8)
    assert config.kv_spec().kind == kind
    assert KVSpec("gqa", 1, heads * 2, kv * 2, 8).per_rank(2).kind == kind


def test_nvfp4_bytes_are_exact():
    # 4 bits per element + one 1-byte fp8 scale per 16 elements: 128 dims → 64 + 8 = 72 bytes,
    # i.e. 0.5625 B/element. Llama-3-8B: 2 × 32 × 8 × 72 = 36,864 B/token.
    spec = preset("llama-3-8b").kv_spec().replace(kv_dtype="nvfp4")
    assert spec.bytes_per_token == 2 * 32 * 8 * (64 + 8) == 36864
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 0.5625
    assert spec.bytes_per_block(64) == 36864 * 64
    # MLA latent of 576 = 36 groups of 16
    mla = preset("deepseek-v3").kv_spec().replace(kv_dtype="nvfp4")
    assert mla.bytes_per_token == 61 * (288 + 36)
    with pytest.raises(SpecError, match="not a whole number of bytes"):
        KVSpec("mha", 1, 1, 1, 3, kv_dtype="nvfp4").bytes_per_token


def test_int8_per_token_head_counts_its_scales():
    # 1 byte per element + one fp32 scale per token per kv head, for K and for V.
    spec = preset("llama-3-8b").kv_spec().replace(kv_dtype="int8_per_token_head")
    assert spec.bytes_per_token == 2 * 32 * 8 * (128 + 4) == 67584
    assert spec.bytes_per_block(16) == 67584 * 16


def test_skip_layers_count_at_model_width():
    # Layers 0 and 31 stay bf16 (2 B), the other 30 are fp8 (1 B).
    spec = preset("llama-3-8b").kv_spec().replace(kv_dtype="fp8", skip_layers=(0, 31))
    per_layer_fp8 = 2 * 8 * 128
    assert spec.bytes_per_token == 30 * per_layer_fp8 + 2 * 2 * per_layer_fp8
    assert spec.bytes_per_block(64) == 64 * (30 * per_layer_fp8 + 4 * per_layer_fp8)
    with pytest.raises(SpecError, match="skip layer 32"):
        preset("llama-3-8b").kv_spec().replace(skip_layers=(32,))


def test_tp_rules():
    l70 = preset("llama-3-70b").kv_spec()
    assert l70.kv_heads_per_rank(8) == 1
    assert l70.per_rank(8).bytes_per_token == 2 * 80 * 1 * 128 * 2
    assert l70.kv_heads_per_rank(2) == 4
    # tp 16 > 8 kv heads: each head replicated on 2 ranks, still 1 per rank
    assert l70.kv_heads_per_rank(16) == 1
    with pytest.raises(SpecError, match="tp 3"):
        l70.kv_heads_per_rank(3)
    ds = preset("deepseek-v3").kv_spec()
    assert ds.per_rank(8).bytes_per_token == 68.625 * KiB
    with pytest.raises(SpecError, match="kv heads: one must divide the other"):
        KVSpec("gqa", 1, 12, 6, 64).kv_heads_per_rank(4)


@pytest.mark.parametrize("kw, message", [
    (dict(kind="gqa", num_layers=2, num_heads=8, num_kv_heads=3, head_dim=64), "num_kv_heads 3 does not divide"),
    (dict(kind="gqa", num_layers=0, num_heads=8, num_kv_heads=2, head_dim=64), r"num_layers must be an integer in \[1, 2147483647\], got 0"),
    (dict(kind="mha", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64), "kind 'mha' does not match"),
    (dict(kind="xqa", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64), "unknown attention kind 'xqa'"),
    (dict(kind="gqa", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, kv_dtype="fp6"), "unknown kv dtype 'fp6'"),
])
def test_bad_layouts(kw, message):
    with pytest.raises(SpecError, match=message):
        KVSpec(**kw)

