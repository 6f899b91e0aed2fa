"""The Mamba2 mixer and the attention + Mamba hybrids (models.mamba2, models.hybrid) against independent references.

(1) The chunked SSD scan and the one-step recurrence against a NumPy loop over tokens of the recurrence
h_t = exp(dt_t·A) h_{t−1} + dt_t x_t ⊗ B_t, y_t = C_t · h_t, from a saved state, for several chunk sizes and
with padding steps (dt = 0) that must leave the state as it was.
(2) Tiny random Bamba, Granite-4.0-H (with experts and without) and Nemotron-H checkpoints (tests/mamba_fixtures.py), loaded
by kvjax's loader, against transformers' logits (its torch path: no mamba_ssm / causal_conv1d kernels here):
one sequence prefilled whole, and two sequences in one ragged step at different progress, their prefills split
over three steps (the state carried between them through the state block), then decoded token by token — with
every page NaN beforehand and permuted block ids, the states inside the attention layer's page tensor (as vLLM's
shared per-slot tensors), so a state read where none was written or a write into the wrong block shows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import hf_logits, random_model, save_hf_model
from mamba_fixtures import hybrid_config

from kvjax.attention.metadata import build_metadata
from kvjax.config.hf import from_hf_config
from kvjax.models import build_model
from kvjax.models.layers import UnsupportedModelError
from kvjax.models.loader import load_checkpoint
from kvjax.models.mamba2 import ssd_scan, ssd_step
from kvjax.worker.mamba_state import create_hybrid_cache
from kvjax.worker.model_runner import make_step

TOL = 1e-4
Z, P, M = 48, 8, 2  # block size (vLLM's grown: a 12,288 B page holds a 10,496 B state), pool, table width
T, B = 32, 2  # the ragged step's tokens and rows


def _numpy_scan(x, dt, a, b, c, h):
    """The recurrence token by token (f64): x [L, heads, hd], dt [L, heads], b, c [L, heads, n], h [heads, hd, n]."""
    ys = []
    for t in range(x.shape[0]):
        h = h * np.exp(dt[t] * a)[:, None, None] + (dt[t][:, None] * x[t])[..., None] * b[t][:, None, :]
        ys.append(np.einsum("hpn,hn->hp", h, c[t]))
    return np.stack(ys), h


@pytest.mark.parametrize("chunk", [1, 4, 8])
def test_ssd_scan_and_step_match_the_recurrence(chunk):
    rng = np.random.RandomState(chunk)
    nb, length, heads, hd, n = 2, 16, 3, 4, 5
    x = rng.randn(nb, length, heads, hd)
    dt = rng.uniform(0.05, 1.0, (nb, length, heads))
    dt[1, 11:] = 0.0  # row 1 ends after 11 tokens: its padding neither decays nor feeds the state
    a = -rng.uniform(0.2, 2.0, heads)
    b, c = rng.randn(nb, length, heads, n), rng.randn(nb, length, heads, n)
    init = rng.randn(nb, heads, hd, n)
    f32 = [jnp.asarray(t, jnp.float32) for t in (x, dt, a, b, c, init)]
    y, final = ssd_scan(*f32[:5], f32[5], chunk)
    for r in range(nb):
        want_y, want_h = _numpy_scan(x[r], dt[r], a, b[r], c[r], init[r])
        np.testing.assert_allclose(np.asarray(y[r]), want_y, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(final[r]), want_h, rtol=1e-4, atol=1e-4)
    y1, h1 = ssd_step(f32[0][:, 0], f32[1][:, 0], f32[2], f32[3][:, 0], f32[4][:, 0], f32[5])
    for r in range(nb):
        want_y, want_h = _numpy_scan(x[r, :1], dt[r, :1], a, b[r, :1], c[r, :1], init[r])
        np.testing.assert_allclose(np.asarray(y1[r]), want_y[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(h1[r]), want_h, rtol=1e-4, atol=1e-4)


FAMILIES = [pytest.param("bamba")] + [pytest.param(n, marks=pytest.mark.slow) for n in ("granite", "granite-dense",
                                                                                        "nemotron_h")]


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    hf = random_model(*hybrid_config(request.param), seed=0)
    config, params = load_checkpoint(save_hf_model(hf, str(tmp_path_factory.mktemp(request.param))), dtype="float32")
    return hf, config, params, build_model(config, "reference")


def _groups(config):
    """Two KV cache groups: attention (0) and one Mamba group (1) that every Mamba layer's state shares a block of
    (layer j of each group in slot tensor j: the first Mamba layer's state in the attention layer's tensor)."""
    return tuple(int(t == "mamba") for t in config.layer_types)


def _cache(config):
    """A hybrid cache with every page and state slot NaN: what is read before it is written shows."""
    cache = create_hybrid_cache(config.kv_spec(), config.mamba.state_spec(config.dtype), config.layer_types, P, Z)
    return jax.tree.map(lambda a: jnp.full_like(a, jnp.nan) if a.ndim > 1 else a, cache)


def _run(step, params, config, cache, seqs, decode=False):
    """seqs: [(num_computed, new tokens, attention table, state block)] → ([logits per seq], cache)."""
    size = B if decode else T
    md = build_metadata([s[0] for s in seqs], [len(s[1]) for s in seqs], [[s[2], [s[3]]] for s in seqs],
                        block_size=Z, max_tokens=size, max_seqs=B, max_blocks_per_seq=M, decode=decode,
                        windows=(None, "mamba"), layer_groups=_groups(config))
    flat = np.concatenate([s[1] for s in seqs])
    logits, cache = step(params, jnp.asarray(np.pad(flat, (0, size - len(flat))), jnp.int32), md, cache)
    out, t = [], 0
    for s in seqs:
        out.append(np.asarray(logits)[t:t + len(s[1])])
        t += len(s[1])
    return out, cache


def test_hybrid_logits_match_transformers_prefill_chunked_and_decode(case):
    hf, config, params, model = case
    step = make_step(model)
    rng = np.random.RandomState(3)
    blocks = [int(b) for b in rng.permutation(np.arange(1, P))]
    tables, states = [blocks[:M], blocks[M:2 * M]], blocks[2 * M:2 * M + 2]
    seq = [rng.randint(0, 128, 30).astype(np.int32), rng.randint(0, 128, 26).astype(np.int32)]
    want = [hf_logits(hf, s) for s in seq]

    out, _ = _run(step, params, config, _cache(config), [(0, seq[0], tables[0], states[0])])  # whole, 4 SSD chunks
    np.testing.assert_allclose(out[0], want[0], rtol=TOL, atol=TOL)

    cache, got = _cache(config), [[], []]
    for cuts in ((0, 9, 0, 5), (9, 20, 5, 17), (20, 27, 17, 23)):  # prefills split over 3 steps, side by side
        out, cache = _run(step, params, config, cache, [(cuts[0], seq[0][cuts[0]:cuts[1]], tables[0], states[0]),
                                                        (cuts[2], seq[1][cuts[2]:cuts[3]], tables[1], states[1])])
        got[0].append(out[0])
        got[1].append(out[1])
    for i, j in zip(range(27, 30), range(23, 26)):  # then one decode step each
        out, cache = _run(step, params, config, cache, [(i, seq[0][i:i + 1], tables[0], states[0]),
                                                        (j, seq[1][j:j + 1], tables[1], states[1])], decode=True)
        got[0].append(out[0])
        got[1].append(out[1])
    for s in range(2):
        np.testing.assert_allclose(np.concatenate(got[s]), want[s], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name, what", [("falcon_h1", "falcon_h1 decoder is not implemented"),
                                        ("jamba", "jamba decoder is not implemented")])
def test_hybrids_not_built_are_refused_by_name(name, what):
    config = from_hf_config(hybrid_config(name)[0].to_dict())
    with pytest.raises(UnsupportedModelError, match=what):
        build_model(config)
