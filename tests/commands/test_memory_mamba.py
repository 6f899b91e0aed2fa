"""`kvjax memory` on a tiny Bamba checkpoint (3 Mamba2 layers around 1 attention layer): the pool is vLLM's
attention + Mamba groups, with the attention block size grown to hold a state, and kvjax's cache (one page tensor
per slot, each Mamba state inside its block's page, as vLLM's) reconciles to the byte on CPU and equals vLLM's.

The expected numbers are worked out by hand from the config below, not read from the code under test.
"""
from __future__ import annotations

import json
import math
from fractions import Fraction

import jax

from kvjax.commands import main as cli
from kvjax.commands.memory import render
from kvjax.config.hf import from_hf_config
from kvjax.models import build_model, init_params
from kvjax.models.loader import save_checkpoint

BAMBA = {"architectures": ["BambaForCausalLM"], "model_type": "bamba", "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16,
         "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8,
         "torch_dtype": "float32"}
SMALL = ["--device-memory-gib", "0.004", "--block-size", "16", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
         "--max-model-len", "128"]

# One Mamba layer's state (fp32): conv (d_conv − 1) × (expand × hidden + 2 × groups × d_state) = 3 × 192;
# SSM heads × head dim × d_state = 8 × 16 × 16.
CONV, SSM = 3 * (2 * 64 + 2 * 2 * 16) * 4, 8 * 16 * 16 * 4  # 2,304 B and 8,192 B
# The attention layer: K and V × 2 kv heads × head dim 16 × 4 B = 256 B a token. vLLM grows block 16 to
# 16 × cdiv(10,496, 16 × 256) = 48 tokens, so that a page (48 × 256 = 12,288 B) holds one state.
BLOCK, PAGE = 48, 48 * 256
# Parameters: embed + lm_head 2 × 128 × 64, final norm 64; each layer 2 norms + gate/up/down 3 × 64 × 128;
# attention q, o 64 × 64 and k, v 64 × 32; each Mamba layer in_proj 64 × (2 × 128 + 2 × 2 × 16 + 8), conv
# 192 × 4 + bias 192, dt_bias, A_log, D (8 each), gated norm 128, out_proj 128 × 64.
PARAMS = (2 * 128 * 64 + 64 + 4 * (2 * 64 + 3 * 64 * 128) + (2 * 64 * 64 + 2 * 64 * 32)
          + 3 * (64 * 328 + 192 * 4 + 192 + 3 * 8 + 128 + 128 * 64))


def test_tiny_bamba_reconciles_to_the_byte(tmp_path, capsys):
    params = init_params(build_model(from_hf_config(BAMBA)), jax.random.key(1))
    save_checkpoint(tmp_path, BAMBA, params)
    rc = cli.main(["memory", "--model", str(tmp_path), *SMALL, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    r = json.loads(out)
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == ["weights", "kv pages", "scales + counters", "block tables", "activation peak",
                          "total resident"]
    for device in r["per_device"]:
        for row in device["rows"]:
            assert row["measured"] == row["analytic"] and row["diff"] == 0, row
    assert r["params"] == PARAMS == 218_440 and rows["weights"]["analytic"] == 4 * PARAMS

    # the budget: ceil(total × 0.92) − measured weights and activations, bought in vLLM's blocks of one page
    m, plan = r["mamba"], r["plan"]
    budget = math.ceil(r["total_bytes"] * Fraction("0.92")) - rows["weights"]["measured"] \
        - rows["activation peak"]["measured"]
    assert plan["budget_bytes"] == budget
    assert (m["state_bytes"], m["block_size"], r["block_size"]) == (CONV + SSM, BLOCK, BLOCK)
    assert m["bytes_per_block"] == PAGE
    n = budget // PAGE
    assert m["num_blocks"] == r["num_blocks"] == n
    # groups: one per layer (the smallest bucket, attention, has 1 layer); Mamba types first, as layer 0 is one
    assert [(g["kind"], g["layers"], g["blocks_per_request"]) for g in m["groups"]] == [
        ("mamba", [0], 1), ("mamba", [2], 1), ("mamba", [3], 1), ("full_attention", [1], math.ceil(128 / BLOCK))]
    # every group has 1 layer, so one slot: kvjax and vLLM hold one shared tensor of n pages, the states inside
    assert rows["kv pages"]["analytic"] == rows["kv pages"]["measured"] == n * PAGE
    assert m["kvjax_bytes"] == m["vllm_bytes"] == n * PAGE and m["tensors"] == 1
    assert rows["scales + counters"]["analytic"] == 4  # one i32 non-finite counter: the one tensor's
    assert rows["block tables"]["analytic"] == 4 * 4 * math.ceil(128 / BLOCK) * 4  # i32[seqs, groups, cdiv(len, Z)]
    assert m["max_concurrency"] == n / 6

    text = render(r)
    assert "attention block size 48 (grown from 16" in text
    assert "4 groups (mamba [0], mamba [2], mamba [3], full [1])" in text
    assert f"1 slot tensor of {n:,} pages, each Mamba state inside its block's page = {n * PAGE:,} B; vLLM's" in text
    assert f"= {n * PAGE:,} B (1.00x)" in text
    assert "3×192 fp32 (2,304 B) then 8×16×16 fp32 (8,192 B), padded to the page" in rows["kv pages"]["note"]


def test_tiny_bamba_preset_tensor_parallel_is_refused(capsys):
    rc = cli.main(["memory", "--model", "preset:tiny-bamba", *SMALL, "-tp", "2"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "tensor parallelism with Mamba layers is not implemented" in err
