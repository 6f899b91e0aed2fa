"""The prefill attention's temporaries (kvjax.accounting.prefill): hand-worked numbers for
Llama-3-8B, 70B under TP and DeepSeek-V3's MLA, the estimate against XLA's memory_analysis of
the tiled attention it describes, and the rows `kvjax plan` prints and writes in --json."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from kvjax.accounting.memory import compiled_memory
from kvjax.accounting.prefill import KV_TOKENS, Q_TILE, prefill_temporaries
from kvjax.attention.metadata import build_metadata
from kvjax.attention.tiled import PrefillTiles, paged_attention_tiled
from kvjax.config.presets import preset
from kvjax.core.kv_cache_interface import KVSpec, SpecError

GiB, MiB = 1024**3, 1024**2


def test_llama_3_8b_chunk_of_8192_over_32k_by_hand():
    p = prefill_temporaries(preset("llama-3-8b").kv_spec("bf16"), 8192, 32768, 16)
    assert (p.tokens, p.positions, p.heads) == (8192, 32768, 32)
    assert p.reference_scores_bytes == 8192 * 32 * 32768 * 4 == 32 * GiB
    assert p.reference_bytes == 64 * GiB  # what issue 40 measured for the old reference
    q_and_out = (8192 + 128) * 32 * (128 + 128) * 2  # bf16 [T + Tq, N, H] twice
    scores = 2 * 32 * 128 * 256 * 4  # f32 [N, Tq, Tk] and its exponentials
    q_tile_and_acc = 32 * 128 * (128 + 128) * 4
    kv_tiles = 256 * 8 * (128 + 128) * 4
    assert p.tiled_bytes == q_and_out + scores + q_tile_and_acc + kv_tiles == 144 * MiB


def test_tensor_parallel_and_mla_shapes():
    p = prefill_temporaries(preset("llama-3-70b").kv_spec("bf16"), 8192, 131072, 64, tp=8)
    assert p.heads == 8 and p.reference_scores_bytes == 8192 * 8 * 131072 * 4
    assert p.tiled_bytes == (8192 + 128) * 8 * 256 * 2 + 2 * 8 * 128 * 256 * 4 + 8 * 128 * 256 * 4 + 256 * 1 * 256 * 4
    mla = prefill_temporaries(preset("deepseek-v3").kv_spec("bf16"), 2048, 4000, 64, tp=8)
    assert (mla.heads, mla.positions) == (16, 4032)  # 63 blocks of 64
    keys, values = 512 + 64, 512  # the whole latent against its c_kv lanes
    assert mla.tiled_bytes == ((2048 + 128) * 16 * (keys + values) * 2 + 2 * 16 * 128 * 256 * 4
                               + 16 * 128 * (keys + values) * 4 + 256 * 1 * (keys + values) * 4)


def test_short_chunks_and_contexts_shrink_the_tiles():
    p = prefill_temporaries(KVSpec("gqa", 1, 4, 2, 16), 10, 40, 16)
    # Tq = 10 tokens, Tk = the whole 3-block table (48 positions) rather than 256
    assert p.positions == 48 and p.reference_scores_bytes == 10 * 4 * 48 * 4
    assert p.tiled_bytes == 20 * 4 * 32 * 2 + 2 * 4 * 10 * 48 * 4 + 4 * 10 * 32 * 4 + 48 * 2 * 32 * 4


@pytest.mark.parametrize("kw, message", [
    (dict(tokens=0), "tokens must be a positive integer, got 0"),
    (dict(max_model_len=-5), "max_model_len must be a positive integer, got -5"),
    (dict(tp=3), "tp 3 does not divide the 32 query heads"),
    (dict(block_size=0), "block_size must be a positive integer, got 0"),
])
def test_refusals_name_the_value(kw, message):
    args = dict(tokens=8192, max_model_len=32768, block_size=16) | kw
    tp = args.pop("tp", 1)
    with pytest.raises(SpecError, match=message):
        prefill_temporaries(preset("llama-3-8b").kv_spec("bf16"), tp=tp, **args)


def test_tiles_are_the_tiled_attentions_defaults():
    assert (Q_TILE, KV_TOKENS) == (PrefillTiles().q_tile, PrefillTiles().kv_tokens)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_estimate_against_xla_memory_analysis(dtype):
    """Within 15% of the temporaries XLA plans for `paged_attention_tiled`, once the CPU backend's
    copy of the page pool (tiled.as_bits: narrow floats only) is set aside."""
    t, s, n, k, h, z = 512, 4096, 8, 2, 64, 16
    width, pages = s // z, t // z + 2
    md = build_metadata([s - t], [t], [[1 + j % (pages - 1) for j in range(width)]], block_size=z, max_tokens=t,
                        max_seqs=1, max_blocks_per_seq=width)
    q = jax.ShapeDtypeStruct((t, n, h), dtype)
    kp = jax.ShapeDtypeStruct((pages, z, k, h), dtype)
    temp = compiled_memory(jax.jit(lambda q, k, v, md: paged_attention_tiled(q, k, v, md, scale=0.125)),
                           q, kp, kp, md).temp
    itemsize = jnp.dtype(dtype).itemsize
    pool_copy = 2 * pages * z * k * h * itemsize if itemsize < 4 else 0
    est = prefill_temporaries(KVSpec("gqa", 1, n, k, h), t, s, z, activation_bytes=itemsize).tiled_bytes
    assert 0.85 * (temp - pool_copy) <= est <= 1.15 * temp, (est, temp, pool_copy)


def _plan(*args):
    p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "plan", *args], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_plan_prints_and_writes_the_estimate_outside_the_budget():
    args = ("--preset", "llama-3-8b", "--max-model-len", "32768", "--block-size", "16", "--device-memory-gib", "80")
    got = json.loads(_plan(*args, "--json"))
    want = prefill_temporaries(preset("llama-3-8b").kv_spec("bf16"), 8192, 32768, 16)
    assert {k: v for k, v in got["prefill_attention"].items() if k != "estimate"} == want.to_json()
    assert got["activations_bytes"] == 0  # the budget keeps --activations-gib's default
    text = _plan(*args)
    rows = {line[:22].strip(): line[22:].split() for line in text.splitlines()}
    assert rows["prefill attn, tiled*"][:2] == ["144", "MiB"] and rows["untiled scores*"][:2] == ["32", "GiB"]
    assert "f32 8,192 × 32 × 32,768 × 4 B per score array" in text and "not in the budget" in text
    chunk = json.loads(_plan(*args, "--max-num-batched-tokens", "2048", "--tensor-parallel-size", "2", "--json"))
    assert chunk["prefill_attention"]["reference_scores_bytes"] == 2048 * 16 * 32768 * 4
