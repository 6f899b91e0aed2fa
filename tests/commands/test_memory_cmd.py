"""`kvjax memory` on tiny checkpoints written here and on the tiny MoE presets: the JSON report, the
table, the errors.

On CPU every measured row must equal its analytic value to the byte (the CPU client counts
exact nbytes), and the block count must be the budget arithmetic of kvjax.accounting.budget applied to
the measured non-KV bytes.
"""
from __future__ import annotations

import json
import math
from fractions import Fraction

import jax
import pytest

from kvjax.accounting import budget as bud
from kvjax.commands import main as cli
from kvjax.models import build_model, from_hf_config, init_params
from kvjax.models.loader import save_checkpoint

HF = {
    "gqa": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "tie_word_embeddings": False, "dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "mla": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 128,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "first_k_dense_replace": 2, "n_group": 1, "topk_group": 1,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_interleave": True,
            "tie_word_embeddings": False, "dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}
SMALL = ["--device-memory-gib", "0.004", "--block-size", "16", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
         "--max-model-len", "128"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, hf in HF.items():
        folder = tmp_path_factory.mktemp(name)
        params = init_params(build_model(from_hf_config(hf)), jax.random.key(1))
        save_checkpoint(folder, hf, params)
        out[name] = str(folder)
    return out


def _memory(capsys, *argv):
    rc = cli.main(["memory", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _check_exact(report):
    for device in report["per_device"]:
        for row in device["rows"]:
            assert row["measured"] == row["analytic"], (device["device"], row)
            assert row["ratio"] == 1.0 and row["diff"] == 0
    assert report["devices_agree"] and report["kv_measured_over_analytic"] == 1.0


def _check_budget(report):
    plan = report["plan"]
    requested = math.ceil(report["total_bytes"] * Fraction("0.92"))
    weights, activations = report["rows"][0]["measured"], report["rows"][4]["measured"]
    assert plan["requested_bytes"] == requested
    assert report["non_kv_bytes"] == weights + activations == plan["weights_bytes"] + plan["activations_bytes"]
    assert report["num_blocks"] == (requested - weights - activations) // plan["bytes_per_block"]
    assert report["rows"][1]["analytic"] == report["num_blocks"] * plan["bytes_per_block"]


def test_gqa_json_reconciles_to_the_byte(checkpoints, capsys):
    rc, out, err = _memory(capsys, "--model", checkpoints["gqa"], *SMALL, "--json")
    assert rc == 0, err
    report = json.loads(out)
    _check_exact(report)
    _check_budget(report)
    names = [r["name"] for r in report["rows"]]
    assert names == ["weights", "kv pages", "scales + counters", "block tables", "activation peak", "total resident"]
    # embed + lm_head + per layer (q, o [64, 64]; k, v [64, 32]; gate, up, down; 2 norms) + final norm
    params = 128 * 64 * 2 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert report["params"] == params and report["rows"][0]["analytic"] == params * 4
    # fp32 checkpoint, kv defaults to the weights dtype: 2 layers × K,V × 16 slots × 2 heads × 16 × 4 B
    assert report["plan"]["bytes_per_block"] == 2 * 2 * 16 * 2 * 16 * 4
    assert report["rows"][3]["analytic"] == 4 * (128 // 16) * 4  # i32[max_num_seqs, cdiv(len, Z)]
    assert report["profile"]["xla_temp"] > 0 and report["rows"][4]["measured"] > 0


def test_gqa_tp4_fp8_replicates_kv_heads(checkpoints, capsys):
    rc, out, err = _memory(capsys, "--model", checkpoints["gqa"], *SMALL, "--tensor-parallel-size", "4",
                           "--kv-cache-dtype", "fp8", "--json")
    assert rc == 0, err
    report = json.loads(out)
    _check_exact(report)
    _check_budget(report)
    assert (report["kv_heads_per_rank"], report["kv_head_replicas"]) == (1, 2) and len(report["per_device"]) == 4
    assert report["plan"]["bytes_per_block"] == 2 * 2 * 16 * 1 * 16 * 1  # one kv head per rank, 1 B
    assert report["rows"][2]["analytic"] == 2 * (2 * 1 * 4 + 4)  # per layer: K, V scale of 1 head + counter


def test_mla_tp2_keeps_the_latent_whole_on_every_rank(checkpoints, capsys):
    rc, out, err = _memory(capsys, "--model", checkpoints["mla"], *SMALL, "-tp", "2", "--kv-cache-dtype", "bf16")
    assert rc == 0, err
    lines = out.splitlines()
    assert "MLA latent replicated on every rank" in out and "all 2 devices measure the same" in out
    table = {line.split()[0]: line.split() for line in lines if line.startswith(("weights", "kv pages"))}
    assert table["kv"][4:6] == ["1.000000", "+0"]  # "kv pages" splits into two words
    assert table["weights"][3:5] == ["1.000000", "+0"]
    # per rank = the whole latent: 2 layers × 16 slots × (16 + 8) × 2 B
    assert "// 1,536 B per block" in out


def test_errors_are_one_line(checkpoints, capsys):
    cases = [
        (["--model", checkpoints["gqa"], "--max-num-batched-tokens", "64"],
         "kvjax memory: error: the cpu device reports no memory limit: pass --device-memory-gib"),
        (["--model", checkpoints["gqa"], *SMALL, "--tensor-parallel-size", "3"],
         "kvjax memory: error: tp 3 does not divide the 4 query heads"),
        (["--model", "no-such-model", *SMALL],
         "kvjax memory: error: model 'no-such-model' is neither a built-in model"),
        (["--model", "preset:nope", *SMALL], "kvjax memory: error: unknown model preset 'nope'"),
        (["--model", checkpoints["gqa"], *SMALL, "--block-size", "0"],
         "kvjax memory: error: argument --block-size: must be in [1, 2147483647], got '0'"),
        (["--model", checkpoints["gqa"], "--device-memory-gib", "0.0005", "--block-size", "16",
          "--max-num-batched-tokens",
          "64", "--max-model-len", "128"], "no usable block"),
    ]
    for args, want in cases:
        rc, out, err = _memory(capsys, *args)
        assert rc == 2 and out == "", (args, out)
        assert len(err.strip().splitlines()) == 1 and want in err and "Traceback" not in err, (args, err)


@pytest.mark.slow
def test_preset_random_weights_runs_on_cpu(capsys):
    rc, out, err = _memory(capsys, "--model", "preset:tiny-mla", *SMALL, "--kv-cache-dtype", "fp8", "--json")
    assert rc == 0, err
    report = json.loads(out)
    _check_exact(report)
    assert report["model"] == "preset:tiny-mla" and report["kv_dtype"] == "fp8_e4m3"
    assert report["total_bytes"] == bud.gib("0.004")


# Hand counts of the tiny MoE presets' parameters (kvjax.config.presets), as (split over tp, whole on every rank).
# tiny-moe (Qwen3-MoE's shape), 2 layers, each: q, o [64, 64] and k, v [64, 32] (split by heads); 8 experts'
# gate_up [64, 2 × 32] and down [32, 64] (split by each expert's width, kvjax.worker.sharding); the router
# [64, 8], 2 norms and q/k norms of 16 (whole); embed, lm_head [128, 64] and the final norm (whole).
# tiny-moe-mla (DeepSeek-V3's shape), 2 layers, each: q_b_proj [32, 4 × 24], kv_b_proj [16, 4 × 32], o_proj
# [64, 64] (split); q_a_proj [64, 32], its norm 32, kv_a_proj [64, 24], its norm 16, 2 norms (whole); layer 0's
# dense MLP 3 × 64 × 128 (split); layer 1's experts as tiny-moe's and a shared expert 3 × 64 × 32 (split),
# router [64, 8] and the correction bias f32[8] (whole: a buffer transformers does not count, an array here).
MOE_PARAMS = {
    "tiny-moe": (2 * (2 * 64 * 64 + 2 * 64 * 32 + 8 * 64 * 64 + 8 * 32 * 64),
                 2 * (64 * 8 + 2 * 64 + 2 * 16) + 2 * 128 * 64 + 64),
    "tiny-moe-mla": (2 * (32 * 96 + 16 * 128 + 64 * 64) + 3 * 64 * 128 + 8 * 64 * 64 + 8 * 32 * 64 + 3 * 64 * 32,
                     2 * (64 * 32 + 32 + 64 * 24 + 16 + 2 * 64) + 64 * 8 + 8 + 2 * 128 * 64 + 64),
}


@pytest.mark.parametrize("name, tp", [("tiny-moe", 1), ("tiny-moe", 2), ("tiny-moe-mla", 1), ("tiny-moe-mla", 4)])
def test_moe_presets_reconcile_to_the_byte(name, tp, capsys):
    """Mixture-of-experts presets with random weights: every row analytic == measured, and the weights row is
    the hand count above × 4 bytes (float32) on each device, every expert resident and split over the ranks."""
    rc, out, err = _memory(capsys, "--model", f"preset:{name}", *SMALL, "-tp", str(tp), "--json")
    assert rc == 0, err
    report = json.loads(out)
    _check_exact(report)
    _check_budget(report)
    split, whole = MOE_PARAMS[name]
    assert report["params"] == split + whole
    assert report["rows"][0]["analytic"] == report["rows"][0]["measured"] == 4 * (split // tp + whole)
    assert len(report["per_device"]) == tp


def test_progress_bar_on_a_terminal_and_never_with_no_progress(checkpoints, capsys, monkeypatch):
    """The phases show on stderr when it is a terminal; --no-progress silences them; stdout keeps
    the JSON alone either way."""
    import kvjax.commands.common

    monkeypatch.setattr(kvjax.commands.common, "stderr_is_terminal", lambda: True)
    rc, out, err = _memory(capsys, "--model", checkpoints["gqa"], *SMALL, "--json")
    assert rc == 0 and json.loads(out)["num_blocks"] > 0
    assert "memory:" in err and "phases" in err and "profile one step" in err
    rc, out, err = _memory(capsys, "--model", checkpoints["gqa"], *SMALL, "--json", "--no-progress")
    assert rc == 0 and json.loads(out)["num_blocks"] > 0 and err == ""


GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "sliding_window": 20,
          "sliding_window_pattern": 6, "query_pre_attn_scalar": 16, "torch_dtype": "float32"}


def test_hybrid_model_reconciles_to_the_byte(tmp_path, capsys):
    """A Gemma 3 shape (5 sliding : 1 full, 7 layers): the pool is sized as vLLM's hybrid KV cache
    (7 groups of one layer, a block = one layer's page), its page tensors shared by the groups,
    and every row analytic == measured."""
    params = init_params(build_model(from_hf_config(GEMMA3)), jax.random.key(1))
    save_checkpoint(tmp_path, GEMMA3, params)
    rc, out, err = _memory(capsys, "--model", str(tmp_path), *SMALL, "--json")
    assert rc == 0, err
    report = json.loads(out)
    _check_exact(report)
    hy, plan = report["hybrid"], report["plan"]
    assert [g["window"] for g in hy["groups"]] == [20] * 6 + [None] and all(len(g["layers"]) == 1 for g in hy["groups"])
    page = 2 * 16 * 2 * 16 * 4  # K and V × 16 slots × 2 kv heads × 16 dims × 4 B: one layer
    assert hy["bytes_per_block"] == page and plan["bytes_per_block"] == 7 * page
    assert report["num_blocks"] == hy["num_blocks"] == plan["budget_bytes"] // page
    assert report["rows"][1]["analytic"] == report["num_blocks"] * page
    assert report["rows"][3]["analytic"] == 4 * 7 * (128 // 16) * 4  # i32[max_num_seqs, G, cdiv(len, Z)]
    # per request: a full group cdiv(128, 16) = 8; a sliding one cdiv(min(19 + 64, 128), 16) + 1 = 7
    assert hy["blocks_per_request"] == [7] * 6 + [8]
