"""`kvjax plan` on mixture-of-experts models: weights from the counted parameters, every expert resident.

For DeepSeek-V3, DeepSeek-V2-Lite, Qwen3-30B-A3B, Mixtral-8x7B, gpt-oss-20b and gpt-oss-120b, through the
preset and through its config.json given as --hf-config:

- the parameter count `kvjax plan` prints is the model card's total at the card's rounding (671B, 15.7B,
  30.5B, 46.7B, 21B, 117B), and the weights row is that count × 2 bytes (bf16);
- the count is exactly transformers' `num_parameters()` of the same config.json built on the meta device
  (no memory, no weights) by its own model class;
- each preset's expert shapes (E routed experts, top-k, expert width I, hidden D) are the ones vLLM 0.33's
  MoE kernel benchmarks list for the model (benchmarks/kernels/benchmark_moe_defaults.py: Qwen3-30B-A3B
  E=128 topk=8 N=768 K=2048, DeepSeek-V3 E=256 topk=8 N=2048 K=7168; benchmark_shapes.py
  WEIGHT_SHAPES_MOE: DeepSeek-V2-Lite [64, 6, 2048, 1408], Mixtral-8x7B [8, 2, 4096, 2 × 14336]);
- budget, blocks and concurrency of Qwen3-30B-A3B on an 80 GiB device, and of DeepSeek-V3 on one 141 GiB
  card of TP 8 with fp8 weights, equal SPEC "Budget → blocks" worked by hand below.
"""
import json
import math
import subprocess
import sys

import pytest

from kvjax.config.presets import HF_CONFIGS, MOE_CONFIGS, preset

GiB = 1024**3
# name: (the card's total in billions, its decimals, where it is published)
PUBLISHED = {
    "deepseek-v3": (671, 0, "https://huggingface.co/deepseek-ai/DeepSeek-V3: 671B total, 37B activated"),
    "deepseek-v2-lite": (15.7, 1, "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite: 15.7B total, 2.4B active"),
    "qwen3-30b-a3b": (30.5, 1, "https://huggingface.co/Qwen/Qwen3-30B-A3B: 30.5B in total, 3.3B activated"),
    "mixtral-8x7b": (46.7, 1, "https://mistral.ai/news/mixtral-of-experts: 46.7B total parameters"),
    "gpt-oss-20b": (21, 0, "https://huggingface.co/openai/gpt-oss-20b: 21B parameters with 3.6B active"),
    "gpt-oss-120b": (117, 0, "https://huggingface.co/openai/gpt-oss-120b: 117B parameters with 5.1B active"),
}
# (E, k, I, D) as vLLM's benchmarks list them (the module docstring); gpt-oss: its config.json's
# num_local_experts, experts_per_token, intermediate_size and hidden_size.
EXPERT_SHAPES = {"deepseek-v3": (256, 8, 2048, 7168), "deepseek-v2-lite": (64, 6, 1408, 2048),
                 "qwen3-30b-a3b": (128, 8, 768, 2048), "mixtral-8x7b": (8, 2, 14336, 4096),
                 "gpt-oss-20b": (32, 4, 2880, 2880), "gpt-oss-120b": (128, 4, 2880, 2880)}
TRANSFORMERS_CLASSES = {"deepseek-v3": "DeepseekV3", "deepseek-v2-lite": "DeepseekV2", "qwen3-30b-a3b": "Qwen3Moe",
                        "mixtral-8x7b": "Mixtral", "gpt-oss-20b": "GptOss", "gpt-oss-120b": "GptOss"}


# Where each is planned (one 141 GiB H200 a rank, 8K context, bf16 KV): the bf16 weights of DeepSeek-V3 (1.25 TiB)
# and gpt-oss-120b (218 GiB) fit on no single card, so V3 runs as its fp8 checkpoint on one card of TP 8 and
# gpt-oss-120b over two cards. (tp, weight bytes a parameter)
DEPLOY = {"deepseek-v3": (8, "fp8", 1), "gpt-oss-120b": (2, "bf16", 2)}


def _config_json(name):
    return MOE_CONFIGS.get(name) or HF_CONFIGS[name]


def plan_json(*args):
    p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "plan", *map(str, args), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_plan_counts_the_model_cards_total_with_every_expert(name, tmp_path):
    total, decimals, _ = PUBLISHED[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config_json(name)))
    tp, dtype, width = DEPLOY.get(name, (1, "bf16", 2))
    for source in (("--preset", name), ("--hf-config", path)):
        got = plan_json(*source, "--device-memory-gib", "141", "-tp", tp, "--weight-dtype", dtype)
        assert round(got["params"] / 1e9, decimals) == total, (source, got["params"])
        assert got["weights_bytes"] == math.ceil(got["params"] * width / tp)  # all experts resident, 1/tp a rank
        assert got["warnings"] == [] and got["concurrency"] > 0
    assert got["params"] == preset(name).num_params


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_counted_params_are_transformers_num_parameters(name):
    import torch
    import transformers

    prefix = TRANSFORMERS_CLASSES[name]
    config = getattr(transformers, f"{prefix}Config")(**{k: v for k, v in _config_json(name).items()
                                                         if k != "model_type"})
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    assert preset(name).num_params == model.num_parameters()


@pytest.mark.parametrize("name", list(EXPERT_SHAPES))
def test_expert_shapes_are_vllms(name):
    p = preset(name)
    assert (p.moe.num_experts, p.moe.top_k, p.moe.intermediate_size, p.hidden_size) == EXPERT_SHAPES[name]


def test_moe_layers_and_shared_experts():
    assert preset("deepseek-v3").moe_layers == tuple(range(3, 61))  # first_k_dense_replace 3
    assert preset("deepseek-v3").moe.shared_intermediate_size == 2048  # 1 shared expert
    lite = preset("deepseek-v2-lite")
    assert lite.moe_layers == tuple(range(1, 27)) and lite.moe.shared_intermediate_size == 2 * 1408
    assert lite.q_lora_rank is None and lite.kv_spec().head_dim == 512 + 64
    for name in ("qwen3-30b-a3b", "mixtral-8x7b"):
        p = preset(name)
        assert p.moe_layers == tuple(range(p.num_layers)) and p.moe.shared_intermediate_size == 0
        assert p.sliding_layers == ()


def test_qwen3_30b_a3b_budget_blocks_and_concurrency_by_hand():
    got = plan_json("--preset", "qwen3-30b-a3b", "--device-memory-gib", "80")
    # SPEC: bytes per token = f × L × Hkv × D × b = 2 × 48 layers × 4 kv heads × 128 × 2 bytes (bf16)
    per_token = 2 * 48 * 4 * 128 * 2
    per_block = per_token * 64  # vLLM's default block of 64 tokens
    requested = math.ceil(80 * GiB * 92 / 100)  # ceil(total × 0.92)
    weights = 30_532_122_624 * 2  # every expert of 48 × 128, bf16
    budget = requested - weights  # no activations or CUDA graphs in the simulator
    assert (per_token, per_block, requested, budget) == (98_304, 6_291_456, 79_027_398_247, 17_963_152_999)
    assert got["bytes_per_token"] == per_token and got["bytes_per_block"] == per_block
    assert got["requested_bytes"] == requested and got["weights_bytes"] == weights and got["budget_bytes"] == budget
    blocks = budget // per_block  # 2855.17 → 2855, block 0 null
    assert (got["num_blocks"], got["usable_blocks"], got["token_slots"]) == (blocks, blocks - 1, (blocks - 1) * 64)
    assert blocks == 2855
    # 8K context: 128 blocks a request; 17.96 GB / 805 MB per request = 22.3 → 22; the pool: 2854 // 128 = 22
    assert got["blocks_per_request"] == 8192 // 64 == 128
    assert got["concurrency"] == budget // (per_token * 8192) == 22
    assert got["concurrency_blocks"] == (blocks - 1) // 128 == 22


def test_deepseek_v3_one_card_of_tp8_with_fp8_weights_by_hand():
    got = plan_json("--preset", "deepseek-v3", "-tp", "8", "--weight-dtype", "fp8", "--device-memory-gib", "141",
                    "--max-model-len", "32768")
    # MLA: f = 1, Hkv = 1, D = kv_lora_rank 512 + qk_rope_head_dim 64, replicated on every rank (not split by TP)
    per_token = 61 * 576 * 2
    requested = math.ceil(141 * GiB * 92 / 100)
    weights = math.ceil(671_026_404_352 / 8)  # fp8: 1 byte a parameter, an eighth on each rank
    budget = requested - weights
    assert (per_token, requested, weights) == (70_272, 139_285_789_410, 83_878_300_544)
    assert got["bytes_per_token"] == per_token and got["weights_bytes"] == weights and got["budget_bytes"] == budget
    blocks = budget // (per_token * 64)
    assert got["num_blocks"] == blocks == 12_319
    assert got["concurrency"] == budget // (per_token * 32768) == 24  # SPEC Table 2's one-card row: 24
    assert got["concurrency_blocks"] == (blocks - 1) // 512 == 24
