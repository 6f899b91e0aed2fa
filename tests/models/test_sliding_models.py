"""kvjax's sliding-window decoders against transformers (eager attention), through the loader and the paged cache.

The tiny random-init checkpoints of tests/hf_fixtures.py's SLIDING_CASES mix sliding and full
layers: Mistral (every layer slides), Qwen2 and Qwen3 with use_sliding_window (layers from
max_window_layers on), Gemma 2 (alternating, soft-capped scores and logits), Gemma 3 (5 sliding
to 1 full, local and global RoPE bases, q/k norms) and a Gemma 3 with a final soft-cap. Windows
are 4 to 7 tokens and sequences 40 or more, so every sliding layer drops keys many times over.

For each: (1) full-sequence logits, with every unwritten slot NaN; (2) a prefill then
token-by-token paged decode to 4x the window and past, block size 4 with permuted blocks;
(3) four sequences mixing prefill, chunked prefill and decode, then device-built decode steps —
each equal to transformers' logits within 1e-4. Then each feature is shown to matter: the same
weights without the window (or soft-cap, or local RoPE base) miss transformers' logits by far.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from hf_fixtures import SLIDING_CASES, hf_logits, make_hf_model, random_tables, random_tokens, save_hf_model

from kvjax.attention.metadata import build_metadata, decode_metadata
from kvjax.config.hf import from_hf_config
from kvjax.models import build_model
from kvjax.models.loader import load_checkpoint
from kvjax.worker.model_runner import make_step
from kvjax.worker.paged_cache import PagedCache

NUM_BLOCKS, BLOCK, MAX_BLOCKS = 64, 4, 12  # P, Z, M: 48 positions a sequence
MAX_TOKENS, MAX_SEQS = 48, 4  # T, B of the ragged step
LENGTH = 44  # the full-sequence and decode tests' length: over 6 windows of the widest (7)
TOL = 1e-4
QUICK = ("gemma2", "gemma3-capped")  # where the not-slow suite also runs the decode test


def _quick(names):
    """`case` parametrized over SLIDING_CASES, those outside `names` marked slow."""
    return pytest.mark.parametrize("case", [pytest.param(n, marks=() if n in names else pytest.mark.slow)
                                            for n in SLIDING_CASES], indirect=True)


@dataclasses.dataclass
class Case:
    name: str
    hf: object
    config: object
    params: dict
    ragged: object  # jitted step for T=48, B=4
    decode: object  # jitted step for T=B=4, decode=True

    def new_cache(self, fill=0.0) -> PagedCache:
        cache = PagedCache.create(self.config.kv_spec(), NUM_BLOCKS, BLOCK)
        return jax.tree_util.tree_map(lambda a: jnp.full_like(a, fill), cache)

    def run(self, cache, seqs, decode=False, step=None):
        """seqs: [(num_computed, new tokens, block table)] → ([f32[len(new), V] per seq], cache)."""
        size = MAX_SEQS if decode else MAX_TOKENS
        md = build_metadata([s[0] for s in seqs], [len(s[1]) for s in seqs], [s[2] for s in seqs],
                            block_size=BLOCK, max_tokens=size, max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS,
                            decode=decode)
        flat = np.concatenate([s[1] for s in seqs])
        tokens = jnp.asarray(np.pad(flat, (0, size - len(flat))), jnp.int32)
        step = step or (self.decode if decode else self.ragged)
        logits, cache = step(self.params, tokens, md, cache)
        logits, out, t = np.asarray(logits), [], 0
        for s in seqs:
            out.append(logits[t:t + len(s[1])])
            t += len(s[1])
        return out, cache


@pytest.fixture(scope="module", params=SLIDING_CASES)
def case(request, tmp_path_factory):
    hf = make_hf_model(request.param)
    folder = save_hf_model(hf, str(tmp_path_factory.mktemp(request.param)))
    config, params = load_checkpoint(folder, dtype="float32")
    model = build_model(config)
    return Case(request.param, hf, config, params, make_step(model), make_step(model))


_tokens = random_tokens


def _tables(seed, lengths):
    return random_tables(seed, lengths, NUM_BLOCKS, BLOCK)


# ---- what the configs say -------------------------------------------------------------------------
def test_config_marks_the_layers_transformers_slides(case):
    hf_config = case.hf.config
    types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * hf_config.num_hidden_layers  # Mistral
    assert case.config.layer_windows == tuple(hf_config.sliding_window if t == "sliding_attention" else None
                                              for t in types)
    assert 4 * max(w for w in case.config.layer_windows if w) <= LENGTH
    assert case.config.num_params == case.hf.num_parameters()


def test_gemma3_rope_parameters_old_and_new_formats():
    """rope_parameters keyed by layer type (transformers 5) and the older rope_theta / rope_scaling /
    rope_local_base_freq fields give the same two rotations, as transformers' Gemma3TextConfig reads them."""
    base = dict(model_type="gemma3_text", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8)
    old = dict(base, rope_theta=5e5, rope_local_base_freq=500.0, rope_scaling={"rope_type": "linear", "factor": 4.0})
    new = tf.Gemma3TextConfig(**old).to_dict()
    for cfg in (old, new):
        config = from_hf_config(cfg)
        assert (config.rope.rope_type, config.rope.theta, config.rope.factor) == ("linear", 5e5, 4.0)
        assert (config.rope_local.rope_type, config.rope_local.theta) == ("default", 500.0)
        assert config.layer_rope(0) is config.rope_local and config.layer_rope(5) is config.rope
    defaults = from_hf_config(base)  # transformers' default_theta: global 1e6, local 1e4
    assert (defaults.rope.theta, defaults.rope_local.theta) == (1e6, 1e4)
    with pytest.raises(Exception, match="keyed by layer type"):
        from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})


def test_gemma_scalars_take_transformers_defaults_and_null_turns_a_cap_off():
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    g2 = from_hf_config(dict(base, model_type="gemma2"))
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    off = from_hf_config(dict(base, model_type="gemma2", attn_logit_softcapping=None, final_logit_softcapping=None))
    assert (off.attn_logit_softcap, off.final_logit_softcap) == (None, None)
    g3 = from_hf_config(dict(base, model_type="gemma3_text"))
    assert (g3.attn_logit_softcap, g3.final_logit_softcap, g3.qk_norm) == (None, None, True)


def test_refusals_name_what_transformers_cannot_run_either():
    from kvjax.models import UnsupportedModelError

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(UnsupportedModelError, match="sliding_window null"):
        build_model(from_hf_config(dict(base, model_type="gemma2", sliding_window=None)))
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping 50.0 on a gemma3_text model"):
        build_model(from_hf_config(dict(base, model_type="gemma3_text", attn_logit_softcapping=50.0)))
    with pytest.raises(UnsupportedModelError, match=r"hidden_act 'silu' is not supported \(only gelu_pytorch_tanh"):
        build_model(from_hf_config(dict(base, model_type="gemma2", hidden_activation="silu")))


def test_gemma_rmsnorm_is_transformers_in_bf16():
    """(x * (1 + w)) in f32, then one rounding to bf16: bit for bit transformers' Gemma2RMSNorm, where
    Llama's order (round x, then times the weight) differs in many elements."""
    import torch
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from kvjax.models.gemma import GemmaRMSNorm
    from kvjax.models.layers import RMSNorm

    torch.manual_seed(0)
    with torch.no_grad():
        norm = Gemma2RMSNorm(48).to(torch.bfloat16)
        norm.weight.add_(0.5 * torch.randn(48))
        x = (3 * torch.randn(50, 48)).to(torch.bfloat16)
        want = norm(x).float().numpy()
        w = norm.weight.float().numpy()
    xj = jnp.asarray(x.float().numpy(), jnp.bfloat16)
    got = GemmaRMSNorm(1e-6, "bfloat16").apply({"params": {"weight": jnp.asarray(w, jnp.bfloat16)}}, xj)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    llama = RMSNorm(1e-6, "bfloat16").apply({"params": {"weight": jnp.asarray(1 + w, jnp.bfloat16)}}, xj)
    assert (np.asarray(llama.astype(jnp.float32)) != want).mean() > 0.1


# ---- logits against transformers ------------------------------------------------------------------
def test_full_sequence_logits_match_transformers(case):
    """Every slot but this step's writes holds NaN, block 0 included: logits stay exact."""
    tokens = _tokens(1, LENGTH)
    (table,) = _tables(1, [LENGTH])
    (logits,), _ = case.run(case.new_cache(fill=np.nan), [(0, tokens, table)])
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits, hf_logits(case.hf, tokens), atol=TOL, rtol=0)


@_quick(QUICK)
def test_prefill_then_paged_decode(case):
    tokens = _tokens(2, LENGTH)  # 9 prompt tokens, then 35 decode steps
    (table,) = _tables(2, [LENGTH])
    want = hf_logits(case.hf, tokens)
    cache = case.new_cache()
    (logits,), cache = case.run(cache, [(0, tokens[:9], table)])
    got = [logits]
    for pos in range(9, LENGTH):
        (logits,), cache = case.run(cache, [(pos, tokens[pos:pos + 1], table)], decode=True)
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got), want, atol=TOL, rtol=0)
    assert case.decode._cache_size() == 1, "decode steps recompiled"


@pytest.mark.slow
def test_mixed_batch_matches_each_sequence_alone(case):
    """Prefill, chunked prefill, idle and decode sequences share steps; then decode-only steps
    built on device (decode_metadata) with sequences finishing at different times."""
    lengths = [30, 36, 27, 33]
    seqs = [_tokens(10 + i, n) for i, n in enumerate(lengths)]
    tables = _tables(3, lengths)
    done = [0, 0, 0, 0]
    got = [[] for _ in seqs]
    cache = case.new_cache()
    schedule = [{0: 13, 1: 20}, {0: 1, 1: 9, 2: 11, 3: 4}, {0: 1, 2: 1, 3: 14}]  # seq → new tokens
    for step in schedule:
        order = list(step)
        out, cache = case.run(cache, [(done[i], seqs[i][done[i]:done[i] + step[i]], tables[i]) for i in order])
        for i, logits in zip(order, out):
            got[i].append(logits)
            done[i] += step[i]
    block_tables = jnp.asarray([t + [0] * (MAX_BLOCKS - len(t)) for t in tables], jnp.int32)
    while any(d < n for d, n in zip(done, lengths)):
        active = np.array([d < n for d, n in zip(done, lengths)])
        tokens = jnp.asarray([s[d] if a else 0 for s, d, a in zip(seqs, done, active)], jnp.int32)
        md = decode_metadata(block_tables, jnp.asarray(done, jnp.int32), jnp.asarray(active), BLOCK)
        logits, cache = case.decode(case.params, tokens, md, cache)
        for i in np.flatnonzero(active):
            got[i].append(np.asarray(logits[i:i + 1]))
            done[i] += 1
    for i, tokens in enumerate(seqs):
        np.testing.assert_allclose(np.concatenate(got[i]), hf_logits(case.hf, tokens), atol=TOL, rtol=0,
                                   err_msg=f"sequence {i}")
    assert case.decode._cache_size() == 1, "decode steps recompiled"
    assert case.ragged._cache_size() == 1, "ragged steps recompiled"


# ---- each feature matters ---------------------------------------------------------------------------
def _without(config):
    """The config changes each of which transformers' logits must notice."""
    changes = {"no window": dict(sliding_window=10**6)}  # the sliding layers (and their RoPE) kept
    if config.attn_logit_softcap is not None:
        changes["no attention soft-cap"] = dict(attn_logit_softcap=None)
    if config.final_logit_softcap is not None:
        changes["no final soft-cap"] = dict(final_logit_softcap=None)
    if config.rope_local is not None:
        changes["one RoPE base"] = dict(rope_local=None)
    return changes


@pytest.mark.slow
def test_each_feature_changes_the_logits(case):
    tokens = _tokens(1, LENGTH)
    (table,) = _tables(1, [LENGTH])
    want = hf_logits(case.hf, tokens)
    for what, change in _without(case.config).items():
        step = make_step(build_model(case.config.replace(**change)))
        (logits,), _ = case.run(case.new_cache(), [(0, tokens, table)], step=step)
        assert np.abs(logits - want).max() > 100 * TOL, f"{case.name}: {what} still matches transformers"


def test_outlier_stress_keeps_the_function(case):
    """models.stress inflates cached K channels through q/k norm weights where there are some
    (Qwen3, Gemma 3's (1 + weight) norm) and through the projections elsewhere: same logits."""
    from kvjax.models.stress import inflate_k_channels

    tokens = _tokens(1, LENGTH)
    (table,) = _tables(1, [LENGTH])
    (want,), cache = case.run(case.new_cache(), [(0, tokens, table)])
    plain = np.abs(np.asarray(cache.layers[0].k)).max()
    stressed = dataclasses.replace(case, params=inflate_k_channels(case.config, case.params, factor=50.0))
    (logits,), cache = stressed.run(case.new_cache(), [(0, tokens, table)])
    np.testing.assert_allclose(logits, want, atol=1e-3, rtol=0)
    assert np.abs(np.asarray(cache.layers[0].k)).max() > 10 * plain
