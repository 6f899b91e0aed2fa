"""models.moe against transformers' MoE blocks, its two expert paths against each other, and the loader.

For each tiny random-init checkpoint of tests/moe_fixtures.py (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2 greedy and group-limited, DeepSeek-V3 with groups and a correction bias; float32),
loaded with kvjax's loader from what save_pretrained wrote:

- the router's choices equal transformers' router module's (`block.gate(h)`): the same expert ids
  per token and their weights within 1e-6, on the same random hidden states;
- the whole MoE block equals transformers' block within 1e-5, through both expert paths;
- the ragged_dot path equals the dense all-experts reference within 1e-6 (float32) and 2e-2
  (bfloat16, one rounding step apart), also on hand-made routings (every token on one expert, empty
  experts) that one compiled program serves;
- in bfloat16 (transformers' from_pretrained keeping DeepSeek's router in float32, as the loader
  does) the same experts are chosen, except at near-ties of bfloat16 router logits, and the block
  outputs agree within four bfloat16 steps;
- the model's logits, full-sequence and prefill-then-paged-decode, equal transformers' within 1e-4,
  and the decode step compiles once for every routing the tokens produce;
- save_checkpoint writes the tensors save_pretrained writes, and the loader also reads the fused
  expert tensors of transformers 5's in-memory state dict.

gpt-oss's routing and expert math (MoE on a gpt_oss config) equals transformers' GptOssMLP on random
weights big enough for the SwiGLU clamp to bite (the whole model: tests/models/test_gpt_oss.py).
"""
from __future__ import annotations

import copy
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from hf_fixtures import hf_logits, save_hf_model
from moe_fixtures import MOE_CASES, make_moe_model, moe_blocks
from safetensors.numpy import load_file, save_file

from kvjax.attention.metadata import build_metadata
from kvjax.config.hf import from_hf_config
from kvjax.config.model import MoEConfig
from kvjax.models import build_model
from kvjax.models.loader import load_checkpoint, save_checkpoint
from kvjax.models.moe import MoE, Router, experts_dense, experts_ragged, route
from kvjax.models.tensors import MissingTensorError
from kvjax.worker.model_runner import make_step
from kvjax.worker.paged_cache import PagedCache

T = 24  # tokens of the block-level tests


@dataclasses.dataclass
class Case:
    name: str
    hf: object
    folder: str
    config: object
    params: dict


@pytest.fixture(scope="module", params=MOE_CASES)
def case(request, tmp_path_factory):
    hf = make_moe_model(request.param)
    folder = save_hf_model(hf, str(tmp_path_factory.mktemp(request.param)))
    config, params = load_checkpoint(folder, dtype="float32")
    return Case(request.param, hf, folder, config, params)


def _hidden(seed: int, tokens: int = T, hidden: int = 64) -> np.ndarray:
    return np.random.RandomState(seed).randn(tokens, hidden).astype(np.float32)


def _by_id(ids, weights):
    """(ids, weights) [T, k] with each row ordered by expert id: transformers' DeepSeek routers
    return their top-k unsorted."""
    ids, weights = np.asarray(ids), np.asarray(weights)
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1)


def test_layers_are_moe_where_transformers_has_moe_blocks(case):
    assert case.config.moe_layers == tuple(moe_blocks(case.hf))
    assert case.config.num_params == case.hf.num_parameters()


def test_routes_match_transformers(case):
    moe = case.config.moe
    for layer, block in moe_blocks(case.hf).items():
        h = _hidden(layer)
        with torch.no_grad():
            _, hf_weights, hf_ids = block.gate(torch.as_tensor(h))
        gate = case.params[f"layers_{layer}"]["mlp"]["gate"]
        weights, ids = Router(case.config).apply({"params": gate}, jnp.asarray(h))
        assert weights.dtype == jnp.float32 and ids.shape == (T, moe.top_k)
        got_ids, got_w = _by_id(ids, weights)
        want_ids, want_w = _by_id(hf_ids.numpy(), hf_weights.float().numpy())
        np.testing.assert_array_equal(got_ids, want_ids, err_msg=f"layer {layer}")
        np.testing.assert_allclose(got_w, want_w, atol=1e-6, rtol=0, err_msg=f"layer {layer}")
        assert len(np.unique(got_ids)) >= 6  # the tokens spread over the experts
        if moe.grouped or moe.topk_method == "noaux_tc":  # the group limit / the bias changed some choice
            plain = dataclasses.replace(moe, topk_method="greedy")
            logits = jnp.asarray(h) @ gate["kernel"]
            assert (np.sort(np.asarray(route(logits, plain)[1]), 1) != got_ids).any()


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_block_matches_transformers(case, impl):
    for layer, block in moe_blocks(case.hf).items():
        h = _hidden(10 + layer)
        with torch.no_grad():
            want = block(torch.as_tensor(h)[None])[0].numpy()
        got = MoE(case.config, impl).apply({"params": case.params[f"layers_{layer}"]["mlp"]}, jnp.asarray(h))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0, err_msg=f"layer {layer}")


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_ragged_path_equals_the_dense_reference(case, dtype, tol):
    config = case.config.replace(dtype=dtype)
    for layer in config.moe_layers:
        params = _cast(case.params[f"layers_{layer}"]["mlp"], config)
        x = jnp.asarray(_hidden(20 + layer), dtype)
        ragged = MoE(config, "ragged").apply({"params": params}, x)
        dense = MoE(config, "dense").apply({"params": params}, x)
        assert ragged.dtype == dense.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.asarray(ragged, np.float32), np.asarray(dense, np.float32), atol=tol, rtol=0)


def _cast(params, config):
    """params in the dtypes build_model(config) declares (DeepSeek's router stays float32)."""
    router_f32 = config.moe.router_f32

    def one(path, a):
        keys = [getattr(p, "key", "") for p in path]
        keep = router_f32 and keys[0] in ("gate", "router")
        return a if keep else a.astype(config.dtype)
    return jax.tree_util.tree_map_with_path(one, params)


def test_bfloat16_routes_as_transformers(case, tmp_path):
    """A bfloat16 checkpoint loaded by transformers (`from_pretrained(dtype=bfloat16)`, which keeps
    DeepSeek's router in float32) and by kvjax: the same experts for every token whose k-th and
    (k+1)-th router logits are more than two bfloat16 steps apart (Mixtral's and Qwen's logits are
    bfloat16, where the matmuls' rounding can swap a near-tie), and there block outputs within four
    bfloat16 steps at the output's largest magnitude (each matmul, the shared expert, its gate and the
    sum round in bfloat16, in another order than torch's)."""
    copy.deepcopy(case.hf).to(torch.bfloat16).save_pretrained(tmp_path)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    config, params = load_checkpoint(tmp_path)
    for layer, block in moe_blocks(hf).items():
        mlp = params[f"layers_{layer}"]["mlp"]
        assert mlp["gate"]["kernel"].dtype == (jnp.float32 if config.moe.router_f32 else jnp.bfloat16)
        assert block.gate.weight.dtype == (torch.float32 if config.moe.router_f32 else torch.bfloat16)
        h = torch.as_tensor(_hidden(30 + layer, tokens=48)).to(torch.bfloat16)
        with torch.no_grad():
            want = block(h[None])[0].float().numpy()
            logits, _, hf_ids = block.gate(h)
        top = np.sort(logits.float().numpy(), 1)[:, ::-1][:, config.moe.top_k - 1:config.moe.top_k + 1]  # k-th, k+1-th
        clear = top[:, 0] - top[:, 1] > 2 * 2.0 ** (np.floor(np.log2(np.abs(top).max(1))) - 7)
        assert clear.mean() > 0.75
        x = jnp.asarray(h.float().numpy(), jnp.bfloat16)
        _, ids = Router(config).apply({"params": mlp["gate"]}, x)
        np.testing.assert_array_equal(np.sort(np.asarray(ids), 1)[clear], np.sort(hf_ids.numpy(), 1)[clear])
        got = np.asarray(MoE(config).apply({"params": mlp}, x), np.float32)
        step = 2.0 ** (np.floor(np.log2(np.abs(want).max())) - 7)  # bfloat16's spacing there
        np.testing.assert_allclose(got[clear], want[clear], atol=4 * step, rtol=0, err_msg=f"layer {layer}")


# ---- the expert paths on any routing, one compiled program -----------------------------------------
MOES = {"swiglu": MoEConfig(8, 2, 16), "gpt-oss": MoEConfig(8, 3, 16, scoring_func="topk_softmax", router_bias=True,
                                                               expert_bias=True, activation="clamped_swiglu")}


@pytest.mark.parametrize("kind", list(MOES))
def test_expert_paths_agree_on_any_routing_and_compile_once(kind):
    moe = MOES[kind]
    tokens, d, i, k = 16, 32, moe.intermediate_size, moe.top_k
    rng = np.random.RandomState(0)
    w = {"gate_up_proj": rng.randn(8, d, 2 * i) * 0.5, "down_proj": rng.randn(8, i, d) * 0.3}
    if moe.expert_bias:
        w.update(gate_up_proj_bias=rng.randn(8, 2 * i), down_proj_bias=rng.randn(8, d))
    w = {key: jnp.asarray(v, jnp.float32) for key, v in w.items()}
    x = jnp.asarray(rng.randn(tokens, d) * 2, jnp.float32)
    ragged = jax.jit(experts_ragged, static_argnums=3)
    dense = jax.jit(experts_dense, static_argnums=3)
    routings = {"random": np.stack([rng.permutation(8)[:k] for _ in range(tokens)]),
                "one expert first": np.stack([[3] + list(rng.permutation([e for e in range(8) if e != 3])[:k - 1])
                                              for _ in range(tokens)]),
                "two experts only": np.stack([[0, 7, 0][:k] if t % 2 else [7, 0, 7][:k] for t in range(tokens)]),
                "last expert empty": np.stack([rng.permutation(7)[:k] for _ in range(tokens)])}
    compiled = None
    for name, ids in routings.items():
        ids = jnp.asarray(ids, jnp.int32)
        got, want = ragged(x, ids, w, moe), dense(x, ids, w, moe)
        assert got.shape == (tokens, k, d)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5, err_msg=name)
        compiled = compiled or ragged._cache_size()  # (jit's cache is per function, shared by both kinds)
        assert ragged._cache_size() == compiled, f"the ragged path recompiled for routing {name!r}"


# ---- the whole model --------------------------------------------------------------------------
NUM_BLOCKS, BLOCK, MAX_BLOCKS, MAX_TOKENS, ROWS = 24, 4, 8, 16, 4


def _run(step, params, cache, seqs, decode=False):
    """seqs: [(num_computed, new tokens, block table)] → (logits per seq, cache)."""
    size = ROWS if decode else MAX_TOKENS
    md = build_metadata([s[0] for s in seqs], [len(s[1]) for s in seqs], [s[2] for s in seqs], block_size=BLOCK,
                        max_tokens=size, max_seqs=ROWS, max_blocks_per_seq=MAX_BLOCKS, decode=decode)
    flat = np.concatenate([s[1] for s in seqs])
    logits, cache = step(params, jnp.asarray(np.pad(flat, (0, size - len(flat))), jnp.int32), md, cache)
    logits, out, t = np.asarray(logits), [], 0
    for s in seqs:
        out.append(logits[t:t + len(s[1])])
        t += len(s[1])
    return out, cache


def test_logits_match_transformers_and_decode_compiles_once(case):
    """A 13-token sequence: prefill 6, then 7 decode steps in blocks 9, 3, 17, 5 (a permuted table),
    beside three other sequences decoding their own tokens: transformers' logits for each, and one
    compiled decode step whatever the tokens route to."""
    prefill, decode = make_step(build_model(case.config)), make_step(build_model(case.config))
    rng = np.random.RandomState(3)
    seqs = [rng.randint(0, 128, size=13).astype(np.int32) for _ in range(ROWS)]
    tables = [[9, 3, 17, 5], [1, 2, 4, 6], [7, 8, 10, 11], [12, 13, 14, 15]]
    cache = PagedCache.create(case.config.kv_spec(), NUM_BLOCKS, BLOCK)
    out, cache = _run(prefill, case.params, cache, [(0, s[:6], t) for s, t in zip(seqs[:2], tables)])
    got = [[o] for o in out] + [[], []]
    out, cache = _run(prefill, case.params, cache, [(0, s[:6], t) for s, t in zip(seqs[2:], tables[2:])])
    got[2].append(out[0])
    got[3].append(out[1])
    for pos in range(6, 13):
        out, cache = _run(decode, case.params, cache,
                          [(pos, s[pos:pos + 1], t) for s, t in zip(seqs, tables)], decode=True)
        for row, o in zip(got, out):
            row.append(o)
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(np.concatenate(got[i]), hf_logits(case.hf, s), atol=1e-4, rtol=0,
                                   err_msg=f"sequence {i}")
    assert decode._cache_size() == 1 and prefill._cache_size() == 1, "a step recompiled"


# ---- the loader -----------------------------------------------------------------------------------
def test_save_checkpoint_writes_what_save_pretrained_writes(case, tmp_path):
    save_checkpoint(tmp_path, case.hf.config.to_dict(), case.params)
    ours = load_file(os.path.join(tmp_path, "model.safetensors"))
    theirs = load_file(os.path.join(case.folder, "model.safetensors"))
    assert sorted(ours) == sorted(theirs)  # per-expert tensors (Mixtral: block_sparse_moe.experts.{e}.w1 ...)
    for name, array in theirs.items():
        np.testing.assert_array_equal(ours[name], array, err_msg=name)
    _, again = load_checkpoint(tmp_path, dtype="float32")
    jax.tree_util.tree_map(np.testing.assert_array_equal, again, case.params)


def test_loads_transformers_fused_expert_tensors(case, tmp_path):
    """transformers 5's state dict holds `mlp.experts.gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I]
    (and Mixtral's router as `mlp.gate`): a checkpoint saved from it loads to the same parameters."""
    state = {k: v.numpy() for k, v in case.hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    os.makedirs(tmp_path / "fused")
    save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    case.hf.config.to_json_file(str(tmp_path / "fused" / "config.json"))
    _, fused = load_checkpoint(tmp_path / "fused", dtype="float32")
    jax.tree_util.tree_map(np.testing.assert_array_equal, fused, case.params)


def test_a_missing_expert_is_named(case, tmp_path):
    tensors = load_file(os.path.join(case.folder, "model.safetensors"))
    layer = case.config.moe_layers[-1]
    name = next(k for k in tensors if k.startswith(f"model.layers.{layer}.") and ".experts.5." in k)
    del tensors[name]
    os.makedirs(tmp_path / "broken")
    save_file(tensors, str(tmp_path / "broken" / "model.safetensors"), metadata={"format": "pt"})
    case.hf.config.to_json_file(str(tmp_path / "broken" / "config.json"))
    with pytest.raises(MissingTensorError, match=f"no tensor '{name}'"):
        load_checkpoint(tmp_path / "broken", dtype="float32")


# ---- gpt-oss: the routing and expert math alone, with the clamp biting (the model: test_gpt_oss.py) ----
def test_gpt_oss_mlp_matches_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = tf.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                          num_experts_per_tok=2)
    torch.manual_seed(0)
    block = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            torch.nn.init.normal_(p, std=0.3 if name.endswith("bias") else 0.15)
    config = from_hf_config(cfg.to_dict(), dtype="float32")
    assert config.moe == MoEConfig(8, 2, 32, scoring_func="topk_softmax", router_bias=True, expert_bias=True,
                                   activation="clamped_swiglu", f32_weights=False)
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gate_up, gate_up_bias = sd["experts.gate_up_proj"], sd["experts.gate_up_proj_bias"]  # gate, up interleaved
    params = {"router": {"kernel": sd["router.weight"].T, "bias": sd["router.bias"]},
              "experts": {"gate_up_proj": np.concatenate([gate_up[..., ::2], gate_up[..., 1::2]], -1),
                          "gate_up_proj_bias": np.concatenate([gate_up_bias[:, ::2], gate_up_bias[:, 1::2]], -1),
                          "down_proj": sd["experts.down_proj"], "down_proj_bias": sd["experts.down_proj_bias"]}}
    x = _hidden(5) * 3  # large enough that gate and up pass the ±7 clamp
    assert np.abs(np.einsum("td,edf->tef", x, gate_up)).max() > 2 * cfg.swiglu_limit
    with torch.no_grad():
        want, hf_scores = block(torch.as_tensor(x)[None])
        _, _, hf_ids = block.router(torch.as_tensor(x))
    weights, ids = Router(config).apply({"params": params["router"]}, jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(ids), hf_ids.numpy())  # sorted by logit in both
    np.testing.assert_allclose(np.asarray(weights), hf_scores.numpy(), atol=1e-6, rtol=0)
    for impl in ("ragged", "dense"):
        got = MoE(config, impl).apply({"params": params}, jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(got), want[0].numpy(), atol=2e-5, rtol=1e-5, err_msg=impl)
