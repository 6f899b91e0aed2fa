"""vLLM 0.33's arithmetic for hybrids with Mamba layers (kvjax.core.mamba_spec, kvjax.core.kv_cache_groups,
kvjax.accounting.hybrid.plan_model): worked out by hand from vLLM's rules on Granite-4.0-H-Tiny and on tensor
parallel shards, and compared with vLLM's own functions' figures on the published configs, vendored in
experiments/results/vllm_mamba_reference.json (written by experiments/vllm_mamba_reference.py, which runs vLLM
0.33 from its wheel in a venv of its own; its command is in its docstring; 18 of 18 cases the same)."""
import json
import os

import pytest

from kvjax.accounting import budget as bud
from kvjax.accounting.hybrid import plan_groups, plan_model
from kvjax.config.presets import preset
from kvjax.core.kv_cache_groups import MAMBA, HybridError, all_full, kv_cache_groups
from kvjax.core.kv_cache_interface import KVSpec, SpecError
from kvjax.core.mamba_spec import MambaSpec, extra_groups_for_head_shards, hybrid_block_size, state_dtypes

GIB = 2**30
REFERENCE = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results", "vllm_mamba_reference.json")


def test_granite_4_h_tiny_worked_by_hand():
    config = preset("granite-4.0-h-tiny")
    state = config.mamba.state_spec("bfloat16")
    # conv state: kernel 4 keeps 3 inputs of x (2 × 1536) plus B and C (1 group × 128 each)
    assert state.shapes == ((3, 3072 + 2 * 128), (48, 64, 128)) and state.dtypes == ("bf16", "bf16")
    assert state.page_bytes == 3 * 3328 * 2 + 48 * 64 * 128 * 2 == 806_400
    # attention: 4 kv heads × (128 + 128) × 2 B = 2,048 B a token; 16 × cdiv(806,400, 16 × 2,048) = 16 × 25
    assert hybrid_block_size(2048, 806_400, 16) == 400
    p = plan_model(config, 40 * GIB, block_size=16, max_model_len=8192, max_num_batched_tokens=8192)
    assert p.block_size == 400 and p.requested_block_size == 16
    mamba = [i for i in range(40) if i not in (5, 15, 25, 35)]
    # 36 Mamba and 4 attention layers: group size 4, Mamba (seen first) in 9 groups, the i-th its layers[i::9]
    assert [(g.kind, g.layers) for g in p.groups] == \
        [("mamba", tuple(mamba[i::9])) for i in range(9)] + [("full_attention", (5, 15, 25, 35))]
    page = 400 * 2048  # every page, a state's padded to the attention page: 819,200 B
    assert [g.block_bytes for g in p.groups] == [4 * page] * 10 and p.bytes_per_block == 4 * page
    assert p.num_blocks == 40 * GIB // (4 * page) == 13_107
    # one state block in each Mamba group; the attention group cdiv(8192, 400) = 21
    assert p.blocks_per_request == (1,) * 9 + (21,)
    assert p.max_concurrency == 13_107 / 30 and p.admitted == 13_106 // 30


def test_tensor_parallel_splits_heads_and_replicates_a_lone_group():
    # Bamba-9B on 4 ranks: 1 B/C group does not split, so each rank holds 4 (vLLM's extra_groups_for_head_shards)
    assert extra_groups_for_head_shards(1, 4) == 3 and extra_groups_for_head_shards(8, 2) == 0
    state = preset("bamba-9b").mamba.state_spec("bfloat16", tp=4)
    assert state.shapes == ((3, (8192 + 2 * 4 * 128) // 4), (32, 64, 128))
    assert state.page_bytes == 3 * 2304 * 2 + 32 * 64 * 128 * 2 == 538_112
    # Nemotron-H's 8 groups split over 2 ranks; its SSM state is float32 by default (vLLM's NemotronH rule)
    state = preset("nemotron-h-8b").mamba.state_spec("bfloat16", tp=2)
    assert state.shapes == ((3, (8192 + 2 * 8 * 128) // 2), (64, 64, 128)) and state.dtypes == ("bf16", "fp32")
    with pytest.raises(SpecError, match="tensor parallel size 3 does not divide the Mamba"):
        preset("bamba-9b").mamba.state_spec("bfloat16", tp=3)


def test_state_dtypes_follow_vllms_flags():
    assert state_dtypes("bfloat16") == ("bf16", "bf16")
    assert state_dtypes("bfloat16", mamba_ssm_cache_dtype="float32") == ("bf16", "fp32")
    assert state_dtypes("bfloat16", "float32") == ("fp32", "fp32")  # the SSM state's auto is the conv state's
    with pytest.raises(SpecError, match="mamba_ssm_cache_dtype 'fp8' is not one of"):
        state_dtypes("bfloat16", mamba_ssm_cache_dtype="fp8")
    # fp8 KV shrinks the attention page, not the state: the block grows to twice the tokens
    small = preset("granite-4.0-h-small")
    assert plan_model(small, GIB, kv_dtype="fp8", block_size=16, max_model_len=4096,
                      max_num_batched_tokens=4096).block_size == 2 * 528


def test_block_size_grows_in_steps_of_the_larger_of_kernel_block_and_block_size():
    assert hybrid_block_size(2048, 806_400, 64) == 64 * 7  # cdiv(806,400, 131,072) = 7 blocks of 64
    assert hybrid_block_size(2048, 2048 * 16, 16) == 16  # a page that already holds the state stays
    assert hybrid_block_size(2048, 1000, 16) == 16
    assert hybrid_block_size(100, 1000, 8) == 16  # never below the kernel block's multiple


def _vllm_rows():
    with open(REFERENCE) as f:
        return json.load(f)


@pytest.mark.parametrize("row", _vllm_rows(), ids=lambda r: "-".join(map(str, r["case"])))
def test_the_published_configs_give_vllms_figures(row):
    name, ctx, kv_dtype, block, tp, ssm_dtype = row["case"]
    v = row["vllm"]  # vLLM's own functions' figures
    config = preset(name)
    budget = bud.plan(config.kv_spec(), context=8192, block_size=16, total_bytes=bud.gib("141"),
                      weights_bytes=bud.weight_bytes(config.num_params, "bf16"), tp=tp).budget_bytes
    p = plan_model(config, budget, kv_dtype=None if kv_dtype == "auto" else kv_dtype, block_size=block,
                   max_model_len=ctx, max_num_batched_tokens=8192, tp=tp, mamba_ssm_cache_dtype=ssm_dtype)
    names = {"bfloat16": "bf16", "float32": "fp32"}
    assert [list(s) for s in p.state.shapes] == v["state_shapes"]
    assert list(p.state.dtypes) == [names[d] for d in v["state_dtypes"]]
    assert p.state.page_bytes == v["state_bytes"] and p.block_size == v["block_size"]
    assert [[g.kind, list(g.layers)] for g in p.groups] == v["groups"]
    assert (p.bytes_per_block, p.num_blocks) == (v["bytes_per_block"], v["num_blocks"])
    assert p.max_concurrency == v["max_concurrency"]


def test_falcon_h1_layers_are_attention_and_mamba_side_by_side():
    p = plan_model(preset("falcon-h1-0.5b"), GIB, block_size=16, max_model_len=8192, max_num_batched_tokens=8192)
    # 36 attention and 36 Mamba entries (each layer both, attention first): two groups of 36
    assert [(g.kind, g.layers) for g in p.groups] == [("full_attention", tuple(range(36))), ("mamba", tuple(range(36)))]
    assert p.blocks_per_request == (-(-8192 // 800), 1)


def test_a_mamba_state_must_fit_the_attention_page():
    spec = KVSpec("gqa", 2, 4, 2, 8, kv_dtype="bf16")  # 64 B a token a layer
    windows = [None, MAMBA, MAMBA, None]
    groups = kv_cache_groups(spec, windows, 16, mamba_page=1000)  # pages of 1,024 B
    assert [(g.kind, g.layers, g.block_bytes) for g in groups] == [("full_attention", (0, 3), 2048),
                                                                  ("mamba", (1, 2), 2048)]
    with pytest.raises(HybridError, match="a Mamba state of 1,025 B does not fit an attention page of 1,024 B"):
        kv_cache_groups(spec, windows, 16, mamba_page=1025)
    with pytest.raises(HybridError, match="needs the hybrid KV cache manager"):
        all_full(windows)
    with pytest.raises(HybridError, match="0 layer windows for 1 layers"):  # the windows name no attention layer
        kv_cache_groups(KVSpec("gqa", 1, 4, 2, 8), [MAMBA], 16, mamba_page=10)
    assert plan_groups(spec, windows, 10 * 2048, block_size=16, max_model_len=64, max_num_batched_tokens=64,
                       state=MambaSpec(((3, 4),), ("bf16",))).blocks_per_request == (4, 1)


def test_plan_prints_the_mamba_section(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "plan", "--preset", "granite-4.0-h-tiny",
                        "--device-memory-gib", "80", "--block-size", "16", "--max-model-len", "32768", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    hyb = got["hybrid"]["hybrid"]
    assert got["hybrid"]["all_full"] is None
    assert hyb["mamba_state"] == {"shapes": [[3, 3328], [48, 64, 128]], "dtypes": ["bf16", "bf16"], "bytes": 806_400}
    assert (hyb["requested_block_size"], hyb["block_size"]) == (16, 400)
    assert hyb["bytes_per_block"] == 3_276_800 and hyb["num_blocks"] == got["budget_bytes"] // 3_276_800
    assert hyb["blocks_per_request"] == [1] * 9 + [-(-32768 // 400)]
    assert any("4 attention layers alone" in w for w in got["warnings"])
