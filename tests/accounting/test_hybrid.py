"""vLLM 0.33's hybrid KV cache arithmetic (kvjax.core.kv_cache_groups, kvjax.accounting.hybrid) on layer
patterns worked out by hand from vLLM's rules (kv_cache_planning._get_kv_cache_groups_uniform_page_size,
get_kv_cache_config_from_groups, SlidingWindowSpec.max_admission_blocks_per_request,
kv_cache_utils.get_max_concurrency_for_kv_cache_config). vLLM's own functions give the same groups,
bytes per block, blocks and concurrency on these patterns and on the presets with sliding-window layers
(Gemma 2 and 3, gpt-oss, Mistral-7B-v0.1 at 8K, 32K and 128K on an H200's budget):
experiments/vllm_hybrid_reference.py, run on vLLM 0.33's unzipped wheel (22 of 22 the same)."""
import pytest

from kvjax.accounting.hybrid import plan_groups
from kvjax.core.kv_cache_groups import HybridError, KVGroup, all_full, check_layer_windows, kv_cache_groups
from kvjax.core.kv_cache_interface import KVSpec

GIB = 2**30


def gemma3_27b_shape():
    """62 layers, 16 kv heads of 128, bf16; every 6th layer full, the others a 1024-token window."""
    return KVSpec("gqa", 62, 32, 16, 128, kv_dtype="bf16"), [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]


def test_five_to_one_pattern_groups_as_vllm():
    spec, windows = gemma3_27b_shape()
    groups = kv_cache_groups(spec, windows, 16)
    sliding = [i for i in range(62) if (i + 1) % 6]
    full = [i for i in range(62) if (i + 1) % 6 == 0]
    # 52 sliding and 10 full layers: group size 10 (52 >= 1.5 × 10); the sliding bucket (first seen)
    # splits into cdiv(52, 10) = 6 groups, the i-th its layers[i::6]; the full bucket is one group
    assert [g.window for g in groups] == [1024] * 6 + [None]
    assert [g.layers for g in groups] == [tuple(sliding[i::6]) for i in range(6)] + [tuple(full)]
    assert [len(g.layers) for g in groups] == [9, 9, 9, 9, 8, 8, 10]
    page = 16 * 16 * (128 + 128) * 2  # kv heads × Z × (K + V dims) × bf16
    assert [g.block_bytes for g in groups] == [9 * page] * 4 + [8 * page] * 2 + [10 * page]


def test_five_to_one_pattern_pool_and_concurrency():
    spec, windows = gemma3_27b_shape()
    p = plan_groups(spec, windows, 60 * GIB, block_size=16, max_model_len=8192, max_num_batched_tokens=2048)
    page = 131_072
    assert p.bytes_per_block == 10 * page  # the largest group: the full one
    assert p.num_blocks == 60 * GIB // (10 * page) == 49_152
    # full: cdiv(8192, 16) = 512; sliding: cdiv(min(1023 + 2048, 8192), 16) + 1 = 192 + 1
    assert p.blocks_per_request == (193,) * 6 + (512,)
    assert p.max_concurrency == 49_152 / (6 * 193 + 512)
    assert p.kv_cache_tokens == int(49_152 / 1670 * 8192) == 241_109
    assert p.admitted == 49_151 // 1670 == 29
    # the fallback: one group of 62 full layers
    f = plan_groups(spec, all_full(windows), 60 * GIB, block_size=16, max_model_len=8192, max_num_batched_tokens=2048)
    assert [len(g.layers) for g in f.groups] == [62] and f.groups[0].window is None
    assert f.bytes_per_block == 62 * page == spec.bytes_per_block(16)
    assert f.num_blocks == 60 * GIB // (62 * page) == 7_927
    assert f.blocks_per_request == (512,) and f.max_concurrency == 7_927 / 512


def test_close_counts_use_the_larger_as_group_size():
    # vLLM's own example: 12 sliding + 13 full layers is padded to (13 sw, 13 full), not (12 sw, 24 full)
    spec = KVSpec("gqa", 25, 8, 8, 64, kv_dtype="bf16")
    windows = [128] * 12 + [None] * 13
    groups = kv_cache_groups(spec, windows, 16)
    assert [(g.window, len(g.layers)) for g in groups] == [(128, 12), (None, 13)]
    assert max(g.block_bytes for g in groups) == 13 * spec.page_bytes(0, 16)
    # alternating 12 : 12 (gpt-oss-20b's pattern): two groups of 12
    spec = KVSpec("gqa", 24, 64, 8, 64, kv_dtype="bf16")
    groups = kv_cache_groups(spec, [128 if i % 2 == 0 else None for i in range(24)], 16)
    assert [(g.window, g.layers) for g in groups] == [(128, tuple(range(0, 24, 2))), (None, tuple(range(1, 24, 2)))]


def test_every_layer_one_window_is_one_group():
    # Mistral-7B-v0.1: 32 layers, all with a 4096-token window: one group, the page the sum of the layers'
    spec = KVSpec("gqa", 32, 32, 8, 128, kv_dtype="bf16")
    p = plan_groups(spec, [4096] * 32, 10 * GIB, block_size=16, max_model_len=32768, max_num_batched_tokens=8192)
    assert len(p.groups) == 1 and p.groups[0].layers == tuple(range(32))
    assert p.bytes_per_block == spec.bytes_per_block(16) == 32 * 8 * 16 * 256 * 2
    assert p.blocks_per_request == ((4095 + 8192 + 15) // 16 + 1,) == (769,)
    # two batches in flight (async scheduling) hold the window's blocks for twice the tokens
    p2 = plan_groups(spec, [4096] * 32, 10 * GIB, block_size=16, max_model_len=32768, max_num_batched_tokens=8192,
                     max_concurrent_batches=2)
    assert p2.blocks_per_request == ((4095 + 16384 + 15) // 16 + 1,) == (1281,)
    # never more than max_model_len
    p3 = plan_groups(spec, [4096] * 32, 10 * GIB, block_size=16, max_model_len=1000, max_num_batched_tokens=8192)
    assert p3.blocks_per_request == ((1000 + 15) // 16 + 1,) == (64,)


def test_a_full_attention_model_is_todays_single_group():
    spec = KVSpec("gqa", 80, 64, 8, 128, kv_dtype="fp8", skip_layers=(0, 79), model_dtype="bf16")
    (group,) = kv_cache_groups(spec, all_full(range(80)), 16)
    assert group.layers == tuple(range(80)) and group.block_bytes == spec.bytes_per_block(16)
    assert KVGroup(None, (0,), 1).kind == "full_attention" and KVGroup(4, (0,), 1).kind == "sliding_window"


@pytest.mark.parametrize("windows, says", [
    ([None] * 3, "3 layer windows for 4 layers"),
    ([None, 0, None, None], "layer 1's sliding window must be a positive integer, got 0"),
    ([None, 2.5, None, None], "layer 1's sliding window must be a positive integer, got 2.5"),
])
def test_bad_windows_are_named(windows, says):
    with pytest.raises(HybridError, match=says.replace("(", r"\(").replace(")", r"\)")):
        kv_cache_groups(KVSpec("gqa", 4, 4, 4, 8), windows, 16)


def test_hybrid_layers_of_different_pages_are_refused():
    # a skip layer keeps bf16 beside fp8 sliding layers: vLLM would scale block sizes per group
    spec = KVSpec("gqa", 4, 4, 4, 8, kv_dtype="fp8", skip_layers=(3,), model_dtype="bf16")
    with pytest.raises(HybridError, match="pages of 1,024, 2,048 B"):
        kv_cache_groups(spec, [64, 64, 64, None], 16)
    assert check_layer_windows([None, 5], 2) == (None, 5)


def test_a_configs_sliding_layers_become_its_layer_windows():
    from kvjax.config.hf import from_hf_config

    # Qwen2 with use_sliding_window: layers from max_window_layers on slide (transformers' rule)
    cfg = from_hf_config({"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
                          "max_position_embeddings": 4096, "use_sliding_window": True, "sliding_window": 512,
                          "max_window_layers": 4})
    assert cfg.layer_windows == (None, None, None, None, 512, 512)
    groups = kv_cache_groups(cfg.kv_spec(), cfg.layer_windows, 16)
    # 4 full + 2 sliding: group size 2; full (first seen) in cdiv(4, 2) = 2 groups, layers[i::2]
    assert [(g.window, g.layers) for g in groups] == [(None, (0, 2)), (None, (1, 3)), (512, (4, 5))]


MISTRAL = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
           "sliding_window": 4096, "vocab_size": 32000, "torch_dtype": "bfloat16"}
QWEN2_SW = {"model_type": "qwen2", "hidden_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 8,
            "num_key_value_heads": 2, "intermediate_size": 2048, "vocab_size": 1000, "max_position_embeddings": 8192,
            "use_sliding_window": True, "sliding_window": 512, "max_window_layers": 4, "torch_dtype": "bfloat16"}
MEM = ["--device-memory-gib", "80", "--weights-gib", "13.5", "--block-size", "16"]


def _plan(tmp_path, cfg, *args):
    import json
    import subprocess
    import sys

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "plan", "--hf-config", str(path), *args],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def test_plan_shows_the_hybrid_pool_beside_the_all_full_fallback(tmp_path):
    import json

    code, out, err = _plan(tmp_path, MISTRAL, "--max-model-len", "32768", *MEM, "--json")
    assert code == 0, err
    got = json.loads(out)
    hyb, full = got["hybrid"]["hybrid"], got["hybrid"]["all_full"]
    # one group either way (every layer has the window), so the pool is the plan's own
    assert hyb["num_blocks"] == full["num_blocks"] == got["num_blocks"] == got["budget_bytes"] // (32 * 8 * 16 * 256 * 2)
    # async scheduling (vLLM's default): 2 × 8192 tokens in flight: cdiv(4095 + 16384, 16) + 1
    assert hyb["in_flight_tokens"] == 16384 and hyb["blocks_per_request"] == [1281]
    assert full["blocks_per_request"] == [got["blocks_per_request"]] == [2048]
    assert hyb["max_concurrency"] == got["num_blocks"] / 1281 and full["max_concurrency"] == got["num_blocks"] / 2048
    assert hyb["kv_cache_tokens"] == int(got["num_blocks"] / 1281 * 32768)
    code, out, err = _plan(tmp_path, MISTRAL, "--max-model-len", "32768", *MEM, "--json", "--no-async-scheduling",
                           "--max-num-batched-tokens", "2048")
    assert json.loads(out)["hybrid"]["hybrid"]["blocks_per_request"] == [(4095 + 2048 + 15) // 16 + 1]
    # three groups of two layers (4 full + 2 sliding): a block is two layers' pages, not six
    code, out, err = _plan(tmp_path, QWEN2_SW, "--max-model-len", "8192", *MEM)
    assert code == 0, err
    page = 2 * 16 * 128 * 2 * 2  # kv heads × Z × (K + V dims of 128) × bf16
    assert "2 × full_attention (2, 2 layers) + 1 × sliding_window 512 (2 layers)" in out
    row = next(line for line in out.splitlines() if line.startswith("bytes / block "))
    assert row.split()[3:] == [f"{2 * page:,}", "B", f"{6 * page:,}", "B"]
    assert "1 × full_attention (6 layers)" in out


def test_plan_refuses_hybrid_flags_for_a_model_without_windows(tmp_path):
    code, out, err = _plan(tmp_path, {**MISTRAL, "sliding_window": None}, *MEM, "--no-async-scheduling")
    assert code == 2 and err.count("\n") == 1
    assert "--async-scheduling sizes a sliding window's blocks" in err and "no sliding-window layers" in err
    # --max-num-batched-tokens also sizes the prefill attention estimate, so every model takes it
    code, out, err = _plan(tmp_path, {**MISTRAL, "sliding_window": None}, *MEM, "--max-num-batched-tokens", "4096")
    assert code == 0 and "4,096 new tokens" in out, err


def _plan_preset(name, *args):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "plan", "--preset", name, *args],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


H200 = ["--device-memory-gib", "141", "--max-model-len", "32768"]


def test_plan_of_the_gemma_3_27b_preset_groups_as_vllm():
    import json

    code, out, err = _plan_preset("gemma-3-27b", *H200, "--json")
    assert code == 0, err
    got = json.loads(out)
    hyb, full = got["hybrid"]["hybrid"], got["hybrid"]["all_full"]
    page = 64 * 16 * (128 + 128) * 2  # Z (kvjax plan's default block) × kv heads × (K + V dims) × bf16
    sliding = [i for i in range(62) if (i + 1) % 6]
    assert [g["layers"] for g in hyb["groups"]] == [sliding[i::6] for i in range(6)] + [list(range(5, 62, 6))]
    assert hyb["bytes_per_block"] == 10 * page and full["bytes_per_block"] == 62 * page
    assert hyb["num_blocks"] == got["budget_bytes"] // (10 * page)
    # two batches of 8192 tokens in flight: sliding cdiv(1023 + 16384, 64) + 1 = 273, full cdiv(32768, 64) = 512
    assert hyb["blocks_per_request"] == [273] * 6 + [512] and full["blocks_per_request"] == [512]
    assert hyb["max_concurrency"] == hyb["num_blocks"] / (6 * 273 + 512)


@pytest.mark.parametrize("name, groups", [
    ("gemma-3-270m", "5 × sliding_window 512 (3, 3, 3, 3, 3 layers) + 1 × full_attention (3 layers)"),
    ("gemma-2-9b", "1 × sliding_window 4096 (21 layers) + 1 × full_attention (21 layers)"),
    ("gpt-oss-20b", "1 × sliding_window 128 (12 layers) + 1 × full_attention (12 layers)"),
    ("mistral-7b-v0.1", "1 × sliding_window 4096 (32 layers)"),
])
def test_plan_prints_the_hybrid_section_of_each_preset(name, groups):
    from kvjax.config.presets import preset

    code, out, err = _plan_preset(name, *H200)
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("KV cache groups"))
    # the hybrid groups, then the fallback's one group of every layer
    assert groups in row and row.rstrip().endswith(f"1 × full_attention ({preset(name).num_layers} layers)")


def test_plan_of_gpt_oss_120b_needs_its_checkpoint_size_on_one_h200():
    # its 117B parameters in bf16 exceed the card; the MXFP4 checkpoint is 60.8 GiB
    code, out, err = _plan_preset("gpt-oss-120b", *H200, "--weights-gib", "60.8")
    assert code == 0, err
    assert "1 × sliding_window 128 (18 layers) + 1 × full_attention (18 layers)" in out
