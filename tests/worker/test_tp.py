"""Tensor parallelism on a mesh of CPU devices (tests/conftest.py forces 8 host devices).

- Decode through the sharded model agrees with the single-device model within 1e-5 (fp32)
  for tp = 2, 4, 8: GQA with 2 kv heads covers both the split (tp 2) and the replicated
  (tp 4, 8: each kv head on tp / 2 ranks) rules; MLA keeps its latent whole on every rank.
- Each device holds exactly spec.per_rank(tp).bytes_per_block(Z) × num_blocks of KV, measured
  as the increase of live bytes on that device, for GQA, MHA and MLA in bf16, fp8 and int8.
- Mixture-of-experts models (the tiny-moe and tiny-moe-mla presets: Qwen3-MoE's and DeepSeek-V3's
  shapes, the latter with a shared expert and a nonzero correction bias) decode to the
  single-device logits within 1e-5 and the same greedy tokens at tp 1, 2, 4; each rank's shard of
  every expert's gate_up_proj is its I / tp slice of the gate and of the up half (vLLM's w1 / w3
  shards) and of down_proj its I / tp rows, the router is whole on every rank, the shared expert is
  split as a dense MLP, and the compiled step gathers no weight (no all-gather, no all-to-all).
  The tiny-gpt-oss preset (4 query heads over 2 kv heads, so tp 4 repeats each kv head; sliding layers,
  biased router and experts, random nonzero sinks) passes the same checks, and each rank holds the
  sinks of its own query heads (rank r: heads r·N/tp onward, q_proj's output split).
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kvjax.accounting import memory as mem
from kvjax.attention.metadata import build_metadata, decode_metadata
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.models import build_model, init_params, preset
from kvjax.worker import sharding as shd
from kvjax.worker.model_runner import make_step
from kvjax.worker.paged_cache import PagedCache

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (jax_num_cpu_devices in tests/conftest.py)")

Z = 4
NUM_BLOCKS = 12
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11]]
TABLES = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
DECODE_STEPS = 4

CONFIGS = {
    "gqa": preset("tiny").replace(num_heads=8, num_kv_heads=2, head_dim=8, name="tiny-gqa8"),
    "mla": preset("tiny-mla").replace(num_heads=8, name="tiny-mla8"),
}


def _decode(step, params, cache, put):
    """Prefill PROMPTS, then greedy-decode DECODE_STEPS tokens: every step's logits, f32[B, V] each."""
    lens = [len(p) for p in PROMPTS]
    md = build_metadata([0] * len(lens), lens, TABLES, block_size=Z, max_tokens=sum(lens), max_seqs=len(lens),
                        max_blocks_per_seq=len(TABLES[0]))
    tokens = jnp.asarray(sum(PROMPTS, []), jnp.int32)
    logits, cache = step(params, put(tokens), put(md), cache, put(md.logits_indices))
    out = [np.asarray(logits)]
    computed = jnp.asarray(lens, jnp.int32)
    for _ in range(DECODE_STEPS):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        dmd = decode_metadata(md.block_tables, computed, jnp.ones(len(lens), bool), Z)
        logits, cache = step(params, put(tok), put(dmd), cache)
        out.append(np.asarray(logits))
        computed = computed + 1
    return out, cache


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gqa", "mla"])
def test_decode_agrees_across_tp(family):
    config = CONFIGS[family]
    model = build_model(config)
    params = init_params(model, jax.random.key(0))
    spec = config.kv_spec()
    want, _ = _decode(make_step(model), params, PagedCache.create(spec, NUM_BLOCKS, Z), lambda x: x)
    for tp in (1, 2, 4, 8):
        layout = shd.tp_layout(spec, tp)
        mesh = shd.make_mesh(tp)
        run_config = shd.tp_model_config(config, layout)
        assert (run_config is config) == (layout.head_replicas == 1)
        sharded = shd.shard_params(shd.tp_params(params, config, layout), mesh)
        cache = shd.create_cache(layout, NUM_BLOCKS, Z, mesh)
        step = make_step(build_model(run_config), mesh, cache)
        got, cache = _decode(step, sharded, cache, lambda x: shd.replicated(mesh, x))
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=f"{family} tp {tp} step {i}")
        assert np.argmax(got[-1], -1).tolist() == np.argmax(want[-1], -1).tolist()
        # The step kept the cache in its shardings: kv heads split (GQA), latent whole (MLA).
        page = cache.layers[0].latent if family == "mla" else cache.layers[0].k
        assert page.sharding.spec == (P() if family == "mla" else P(None, None, "tp", None))
        assert page.addressable_shards[0].data.shape[-2 if family == "gqa" else -1] == (
            layout.kv_heads_per_rank if family == "gqa" else spec.head_dim)


GQA = KVSpec("gqa", 2, 8, 2, 16)
MHA = KVSpec("mha", 2, 8, 8, 16)
MLA = KVSpec.mla(2, 8, kv_lora_rank=32, qk_rope_head_dim=8)


@pytest.mark.parametrize("spec", [GQA, MHA, MLA], ids=["gqa", "mha", "mla"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int8_per_token_head"])
def test_per_device_kv_bytes_equal_per_rank_analytic(spec, kv_dtype):
    spec = spec.replace(kv_dtype=kv_dtype)
    for tp in (1, 2, 4, 8):
        layout = shd.tp_layout(spec, tp)
        mesh = shd.make_mesh(tp)
        devices = list(mesh.devices.flat)
        before = mem.snapshot(devices)
        cache = shd.create_cache(layout, NUM_BLOCKS, Z, mesh)
        jax.block_until_ready(cache)
        after = mem.snapshot(devices)
        kv = NUM_BLOCKS * spec.per_rank(tp).bytes_per_block(Z)
        static = mem.cache_static_bytes(spec.per_rank(tp))
        for d, dev in enumerate(devices):
            slot = sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(cache) if leaf.ndim >= 2
                       for s in leaf.addressable_shards if s.device == dev)
            assert slot == kv, f"{spec.kind} {kv_dtype} tp {tp} device {d}: {slot} != {kv}"
            assert after[d] - before[d] == kv + static, f"{spec.kind} {kv_dtype} tp {tp} device {d}"
        if spec.kind == "mla":  # TP does not shrink per-device MLA KV
            assert kv == NUM_BLOCKS * spec.bytes_per_block(Z)
        elif tp <= spec.num_kv_heads:
            assert kv * tp == NUM_BLOCKS * spec.bytes_per_block(Z)
        del cache


def test_layout_rules():
    layout = shd.tp_layout(GQA, 8)  # 2 kv heads over 8 ranks: each head on 4 ranks
    assert (layout.kv_heads_per_rank, layout.head_replicas, layout.cache_kv_heads) == (1, 4, 8)
    assert layout.cache_spec.num_kv_heads == 8 and layout.rank_spec == GQA.per_rank(8)
    assert shd.tp_layout(GQA, 2).cache_spec is GQA
    assert shd.tp_layout(MLA, 8).cache_spec is MLA and shd.tp_layout(MLA, 8).head_replicas == 1
    with pytest.raises(shd.ShardingError, match="tp 3 does not divide the 8 query heads"):
        shd.tp_layout(GQA, 3)
    with pytest.raises(shd.ShardingError, match="tp 16 needs 16 devices, 8 available"):
        shd.make_mesh(16)


def test_param_rules_and_bytes_per_device():
    config = CONFIGS["gqa"]
    model = build_model(config)
    shapes = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    mesh = shd.make_mesh(4)
    shardings = shd.param_shardings(shapes, mesh)
    attn, mlp = shardings["layers_0"]["self_attn"], shardings["layers_0"]["mlp"]
    assert attn["q_proj"]["kernel"].spec == P(None, "tp") and attn["o_proj"]["kernel"].spec == P("tp", None)
    assert mlp["up_proj"]["kernel"].spec == P(None, "tp") and mlp["down_proj"]["kernel"].spec == P("tp", None)
    assert shardings["embed_tokens"]["embedding"].spec == P() and shardings["lm_head"]["kernel"].spec == P()
    # Per device: split kernels hold a quarter, everything else all of it.
    split = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(shapes)
                if any(getattr(k, "key", "") in shd.COLUMN_PARALLEL + shd.ROW_PARALLEL for k in path))
    whole = sum(x.size for x in jax.tree_util.tree_leaves(shapes)) - split
    assert shd.tree_shard_nbytes(shapes, shardings) == 4 * (split // 4 + whole)
    with pytest.raises(shd.ShardingError, match="mlp/gate_proj/kernel .* does not split over tp 8"):
        shd.param_shardings({"mlp": {"gate_proj": {"kernel": jax.ShapeDtypeStruct((8, 12), jnp.float32)}}},
                            shd.make_mesh(8))


def test_replicated_kv_heads_are_copies():
    params = {"self_attn": {"k_proj": {"kernel": np.arange(2 * 6).reshape(2, 6).astype(np.float32)},
                            "q_proj": {"kernel": np.ones((2, 12), np.float32)}}}
    layout = shd.tp_layout(KVSpec("gqa", 1, 4, 2, 3), 4)  # 2 kv heads of dim 3, each on 2 ranks
    out = shd.replicate_kv_heads(params, layout, head_dim=3)
    k = out["self_attn"]["k_proj"]["kernel"].reshape(2, 4, 3)
    original = params["self_attn"]["k_proj"]["kernel"].reshape(2, 2, 3)
    np.testing.assert_array_equal(k, np.repeat(original, 2, axis=1))  # head k·2 + j = old head k
    assert out["self_attn"]["q_proj"]["kernel"] is params["self_attn"]["q_proj"]["kernel"]


def _moe_params(config):
    """Random params of a tiny MoE preset, DeepSeek-V3's correction bias drawn (Flax starts it at 0) with
    about the sigmoid scores' spread, so that it changes which experts win."""
    params = init_params(build_model(config), jax.random.key(0))
    for i in config.moe_layers:
        gate = params[f"layers_{i}"]["mlp"].get("gate", {})
        if "e_score_correction_bias" in gate:
            gate["e_score_correction_bias"] = 0.2 * jax.random.normal(jax.random.key(i), (config.moe.num_experts,))
        attn = params[f"layers_{i}"]["self_attn"]
        if "sinks" in attn:  # gpt-oss: Flax starts the sinks at 0; std 1 gives them a visible share of each softmax
            attn["sinks"] = jax.random.normal(jax.random.key(100 + i), attn["sinks"].shape)
    return params


@pytest.mark.parametrize("name", [  # the default run: tiny-moe (30 s each)
    "tiny-moe", pytest.param("tiny-moe-mla", marks=pytest.mark.slow), pytest.param("tiny-gpt-oss", marks=pytest.mark.slow)])
def test_moe_decode_agrees_across_tp_with_experts_split(name):
    config = preset(name)
    params = _moe_params(config)
    spec = config.kv_spec()
    want, _ = _decode(make_step(build_model(config)), params, PagedCache.create(spec, NUM_BLOCKS, Z), lambda x: x)
    layer = f"layers_{config.moe_layers[-1]}"
    i = config.moe.intermediate_size
    for tp in (1, 2, 4):
        layout = shd.tp_layout(spec, tp)
        mesh = shd.make_mesh(tp)
        run_config = shd.tp_model_config(config, layout)
        assert run_config.moe.gate_up_blocks == tp
        sharded = shd.shard_params(shd.tp_params(params, config, layout), mesh)
        cache = shd.create_cache(layout, NUM_BLOCKS, Z, mesh)
        step = make_step(build_model(run_config), mesh, cache)
        put = lambda x: shd.replicated(mesh, x)  # noqa: E731
        got, cache = _decode(step, sharded, cache, put)
        for s, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=f"{name} tp {tp} step {s}")
        assert np.argmax(got[-1], -1).tolist() == np.argmax(want[-1], -1).tolist()

        # Every rank holds its slice of each expert: gate and up columns r·I/tp onward, down_proj rows the same.
        moe, whole, whole_attn = sharded[layer]["mlp"], params[layer]["mlp"], params[layer]["self_attn"]
        gate_up, down = moe["experts"]["gate_up_proj"], moe["experts"]["down_proj"]
        assert gate_up.sharding.spec == P(None, None, "tp") and down.sharding.spec == P(None, "tp", None)
        router = moe["router" if "router" in moe else "gate"]  # gpt-oss's router, the others' gate
        assert all(leaf.sharding.spec == P() for leaf in jax.tree_util.tree_leaves(router))
        if "sinks" in whole_attn:  # each rank: the sinks of its own query heads, as q_proj's output columns
            sinks, n = sharded[layer]["self_attn"]["sinks"], config.num_heads
            assert sinks.sharding.spec == P("tp")
            for shard in sinks.addressable_shards:
                r = list(mesh.devices.flat).index(shard.device)
                np.testing.assert_array_equal(np.asarray(shard.data),
                                              np.asarray(whole_attn["sinks"])[r * n // tp:(r + 1) * n // tp])
        original = np.asarray(whole["experts"]["gate_up_proj"])  # [E, D, 2I]: gate | up
        devices = list(mesh.devices.flat)
        for shard in gate_up.addressable_shards:
            r = devices.index(shard.device)
            lo, hi = r * i // tp, (r + 1) * i // tp
            np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate(
                [original[..., lo:hi], original[..., i + lo:i + hi]], axis=-1), err_msg=f"tp {tp} rank {r}")
        for shard in down.addressable_shards:
            r = devices.index(shard.device)
            np.testing.assert_array_equal(np.asarray(shard.data),
                                          np.asarray(whole["experts"]["down_proj"])[:, r * i // tp:(r + 1) * i // tp])
        if config.moe.shared_intermediate_size:
            shared = moe["shared_experts"]
            assert shared["gate_proj"]["kernel"].sharding.spec == P(None, "tp")
            assert shared["down_proj"]["kernel"].sharding.spec == P("tp", None)
        if tp > 1:  # the MoE blocks sum partial outputs and never gather or exchange a weight or an activation
            md = decode_metadata(jnp.asarray([[1]], jnp.int32), jnp.asarray([1], jnp.int32), jnp.ones(1, bool), Z)
            hlo = step.lower(sharded, put(jnp.zeros(1, jnp.int32)), put(md), cache).compile().as_text()
            ops = [op for line in hlo.splitlines() if "/mlp/" in line for op in re.findall(
                r" (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", line)]
            assert set(ops) == {"all-reduce"}, ops


def test_block_gate_up_reorders_columns_into_rank_blocks():
    i, blocks = 6, 3
    gate, up = np.arange(2 * i).reshape(2, i), 100 + np.arange(2 * i).reshape(2, i)  # [D, I] (one expert's, E = 1)
    params = {"mlp": {"experts": {"gate_up_proj": np.concatenate([gate, up], -1)[None],  # [1, D, 2I]
                                  "gate_up_proj_bias": np.concatenate([gate[0], up[0]])[None],  # [1, 2I]
                                  "down_proj": np.ones((1, i, 2))}}}
    out = shd.block_gate_up(params, blocks)["mlp"]["experts"]
    want = np.concatenate([np.concatenate([gate[:, 2 * b:2 * b + 2], up[:, 2 * b:2 * b + 2]], -1)
                           for b in range(blocks)], -1)
    np.testing.assert_array_equal(out["gate_up_proj"][0], want)  # [g0 g1 u0 u1 | g2 g3 u2 u3 | g4 g5 u4 u5]
    np.testing.assert_array_equal(out["gate_up_proj_bias"][0], want[0])
    assert out["down_proj"] is params["mlp"]["experts"]["down_proj"]
    assert shd.block_gate_up(params, 1) is params
    # The blocked columns through the blocked activation: transformers' silu(gate) · up, in order.
    from kvjax.models.moe import activate
    moe = preset("tiny-moe").moe
    h = np.random.default_rng(0).normal(size=(5, 2 * 32)).astype(np.float32)
    blocked = shd.block_gate_up({"experts": {"gate_up_proj": h}}, 4)["experts"]["gate_up_proj"]
    np.testing.assert_allclose(activate(jnp.asarray(blocked), dataclasses.replace(moe, gate_up_blocks=4)),
                               activate(jnp.asarray(h), moe), rtol=0, atol=0)
    six_heads = preset("tiny-moe").replace(num_heads=6, num_kv_heads=3)
    with pytest.raises(shd.ShardingError, match="intermediate_size 32 does not split over tp 3"):
        shd.tp_model_config(six_heads, shd.tp_layout(six_heads.kv_spec(), 3))
