"""Sliding windows, attention sinks and logit soft-capping in the jnp reference forms, against
float64 NumPy loops written here, and against transformers' own eager attention.

The caches are laid out as vLLM's SlidingWindowManager leaves them: blocks wholly before the
window of a sequence's first new token are the null block 0 in its table, and every slot no
query of the step may see (the null block, the rest of those blocks, garbage past the end)
holds NaN, so a read outside the window shows up as NaN or a mismatch.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import get_impl, paged_attention
from kvjax.attention.metadata import build_metadata
from kvjax.attention.reference import (contiguous_attention_reference, contiguous_decode_reference,
                                       paged_attention_reference, paged_decode_reference)
from kvjax.errors import KvjaxError
from kvjax.worker.paged_cache import ContiguousKV, KVPages

Z, H, N, SCALE = 4, 8, 4, 0.3  # block size, head dim, query heads, softmax scale
WINDOWS = [1, 2, Z - 1, Z, Z + 1, 64]  # 64: longer than every context here
SEQS = [(13, 5), (0, 9), (22, 1), (8, 4), (16, 3)]  # (cached, new): chunks past the window, a prompt, a decode
VARIANTS = {"plain": {}, "sinks": dict(sinks=True), "softcap": dict(softcap=2.0),
            "sinks+softcap": dict(sinks=True, softcap=1.5)}
# (kv heads, window, variant): every window for MHA, GQA (group 2) and MQA, every variant for GQA
CASES = ([(kv, w, "plain") for kv in (4, 2, 1) for w in WINDOWS + [None]]
         + [(2, w, v) for w in WINDOWS + [None] for v in list(VARIANTS)[1:]]
         + [(4, 2, "sinks+softcap"), (1, Z + 1, "sinks+softcap")])


def attend64(q, keys, values, pos, *, scale, window=None, sinks=None, softcap=None):
    """One query q f64[N, H] at position pos over keys, values [S, K, H] (positions 0..S-1),
    in float64 loops: keys at pos - window < s <= pos; softmax over [scores..., sink]."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    out = np.zeros((heads, values.shape[-1]))
    seen = [s for s in range(len(keys)) if s <= pos and (window is None or s > pos - window)]
    for n in range(heads):
        h = n // (heads // kv_heads)
        logits = [float(np.dot(keys[s, h].astype(np.float64), q[n].astype(np.float64))) * scale for s in seen]
        if softcap is not None:
            logits = [softcap * np.tanh(x / softcap) for x in logits]
        extra = [float(sinks[n])] if sinks is not None else []
        if not logits:
            continue  # no visible key: zero output, sink or not
        top = max(logits + extra)
        weights = [np.exp(x - top) for x in logits]
        total = sum(weights) + sum(np.exp(x - top) for x in extra)
        for w, s in zip(weights, seen):
            out[n] += w / total * values[s, h].astype(np.float64)
    return out


def variant(name, rng):
    """The keyword arguments of a variant, with sinks drawn as real logits would be."""
    kw = dict(VARIANTS[name])
    if kw.pop("sinks", False):
        kw["sinks"] = rng.normal(0.5, 1.5, N).astype(np.float32)
    return kw


def first_kept(done, window):
    """The first position the earliest new token (at `done`) sees."""
    return 0 if window is None else max(0, done - window + 1)


def layout(seqs, window, kv_heads, seed=0, extra_blocks=3):
    """K/V per sequence, pages [P, Z, K, H] NaN outside what the step may see, and two tables:
    the real blocks (to build metadata) and vLLM's sliding table (null blocks before the window)."""
    rng = np.random.default_rng(seed)
    ctxs = [d + n for d, n in seqs]
    blocks = [-(-c // Z) for c in ctxs]
    num_pages = 1 + sum(blocks) + extra_blocks
    physical = list(rng.permutation(np.arange(1, num_pages)))
    keys = [rng.standard_normal((c, kv_heads, H)).astype(np.float32) for c in ctxs]
    values = [rng.standard_normal((c, kv_heads, H)).astype(np.float32) for c in ctxs]
    k_pages = np.full((num_pages, Z, kv_heads, H), np.nan, np.float32)
    v_pages = k_pages.copy()
    real, sliding = [], []
    for b, ((done, _), ctx) in enumerate(zip(seqs, ctxs)):
        table = [int(physical.pop()) for _ in range(blocks[b])]
        lo = first_kept(done, window)
        for s in range(lo, ctx):
            k_pages[table[s // Z], s % Z], v_pages[table[s // Z], s % Z] = keys[b][s], values[b][s]
        real.append(table)
        sliding.append([0 if (j + 1) * Z <= lo else p for j, p in enumerate(table)])  # vLLM frees these
    return keys, values, jnp.asarray(k_pages), jnp.asarray(v_pages), real, sliding


def ragged_md(seqs, real, sliding, max_blocks=8, max_tokens=24):
    """Metadata of the step built on the real tables, then given the sliding ones (build_metadata
    refuses the null block inside a table)."""
    md = build_metadata([d for d, _ in seqs], [n for _, n in seqs], real, block_size=Z, max_tokens=max_tokens,
                        max_seqs=len(seqs) + 1, max_blocks_per_seq=max_blocks)
    tables = np.zeros(md.block_tables.shape, np.int32)
    for b, t in enumerate(sliding):
        tables[b, :len(t)] = t
    return md.replace(block_tables=jnp.asarray(tables))


def ragged_expected(q, seqs, keys, values, **kw):
    out, t = [], 0
    for b, (done, new) in enumerate(seqs):
        for p in range(done, done + new):
            out.append(attend64(q[t], keys[b], values[b], p, scale=SCALE, **kw))
            t += 1
    return np.stack(out)


@pytest.mark.parametrize("kv_heads, window, name", CASES)
def test_ragged_matches_numpy(kv_heads, window, name):
    rng = np.random.default_rng(kv_heads)
    keys, values, k_pages, v_pages, real, sliding = layout(SEQS, window, kv_heads)
    md = ragged_md(SEQS, real, sliding)
    kw = variant(name, rng)
    total = sum(n for _, n in SEQS)
    q = rng.standard_normal((24, N, H)).astype(np.float32)
    got = np.asarray(paged_attention_reference(jnp.asarray(q), k_pages, v_pages, md, scale=SCALE, window=window,
                                               **kw))
    want = ragged_expected(q, SEQS, keys, values, window=window, **kw)
    np.testing.assert_allclose(got[:total], want, atol=2e-5, rtol=1e-5)
    assert not got[total:].any(), "padding tokens attend to nothing"


DECODE_LENS = [1, 3, Z, Z + 1, 4 * Z + 3, 9 * Z, 0]  # the last row is padding


@pytest.mark.parametrize("kv_heads, window, name", CASES)
def test_decode_matches_numpy(kv_heads, window, name):
    """A decode batch of mixed lengths: each query at position len - 1, null blocks and NaN before the window."""
    rng = np.random.default_rng(10 + kv_heads)
    seqs = [(max(n - 1, 0), min(n, 1)) for n in DECODE_LENS]
    keys, values, k_pages, v_pages, _, sliding = layout(seqs, window, kv_heads, seed=1)
    tables = jnp.asarray([t + [0] * (10 - len(t)) for t in sliding], jnp.int32)
    lens = jnp.asarray(DECODE_LENS, jnp.int32)
    kw = variant(name, rng)
    q = rng.standard_normal((len(DECODE_LENS), N, H)).astype(np.float32)
    got = np.asarray(paged_decode_reference(jnp.asarray(q), k_pages, v_pages, tables, lens, scale=SCALE,
                                            window=window, **kw))
    want = np.stack([attend64(q[b], keys[b], values[b], n - 1, scale=SCALE, window=window, **kw)
                     for b, n in enumerate(DECODE_LENS)])
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert not got[-1].any(), "a row with no visible key gets zero, sink or not"
    md = build_metadata([d for d, _ in seqs[:-1]], [1] * (len(seqs) - 1), [[1] * len(t) for t in sliding[:-1]],
                        block_size=Z, max_tokens=len(seqs), max_seqs=len(seqs), max_blocks_per_seq=10, decode=True)
    md = md.replace(block_tables=tables, context_lens=lens)
    for impl in ("reference", "pallas") if name == "sinks+softcap" else ("reference",):  # both decode forms take them
        via = paged_attention(jnp.asarray(q), KVPages(k_pages, v_pages), md, scale=SCALE, impl=impl,
                              window=window, **kw)
        np.testing.assert_allclose(np.asarray(via), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [3, Z + 1, 11])
def test_chunked_prefill_equals_whole_sequence(window):
    """A 30-token prompt in chunks of 7, 9, 1 and 13, each over vLLM's sliding table of the
    moment (null blocks before the chunk's window, NaN wherever no query of it looks), gives what
    one whole prefill and the float64 window mask give; so does a prefix hit that resumes at a
    block boundary past the window (chunk start 16)."""
    rng = np.random.default_rng(window)
    kw = dict(sinks=rng.normal(0, 1, N).astype(np.float32), softcap=3.0)
    keys = rng.standard_normal((30, 2, H)).astype(np.float32)
    values = rng.standard_normal((30, 2, H)).astype(np.float32)
    q = rng.standard_normal((30, N, H)).astype(np.float32)
    table = [int(p) for p in rng.permutation(np.arange(1, 12))[:8]]
    want = np.stack([attend64(q[p], keys, values, p, scale=SCALE, window=window, **kw) for p in range(30)])

    def run(done, new):
        lo = first_kept(done, window)
        k_pages = np.full((12, Z, 2, H), np.nan, np.float32)
        v_pages = k_pages.copy()
        for s in range(lo, done + new):
            k_pages[table[s // Z], s % Z], v_pages[table[s // Z], s % Z] = keys[s], values[s]
        own = table[:-(-(done + new) // Z)]  # the blocks up to the chunk's end
        md = ragged_md([(done, new)], [own], [[0 if (j + 1) * Z <= lo else p for j, p in enumerate(own)]],
                       max_tokens=32)
        qs = np.zeros((32, N, H), np.float32)
        qs[:new] = q[done:done + new]
        out = paged_attention_reference(jnp.asarray(qs), jnp.asarray(k_pages), jnp.asarray(v_pages), md,
                                        scale=SCALE, window=window, **kw)
        return np.asarray(out)[:new]

    chunks, done = [], 0
    for new in (7, 9, 1, 13):
        chunks.append(run(done, new))
        done += new
    np.testing.assert_allclose(np.concatenate(chunks), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(run(16, 8), want[16:24], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(run(0, 30), np.concatenate(chunks), atol=1e-6)


@pytest.mark.parametrize("window", [1, Z + 1, None])
def test_contiguous_rows_honour_the_variants(window):
    """ContiguousKV rows (read in place, whatever the impl): NaN outside the window never leaks."""
    rng = np.random.default_rng(3)
    kw = dict(sinks=rng.normal(0, 1, N).astype(np.float32), softcap=2.5)
    seqs = [(13, 5), (0, 9), (6, 1)]
    k_rows = np.full((3, 20, 2, H), np.nan, np.float32)
    v_rows = k_rows.copy()
    keys, values = [], []
    for b, (done, new) in enumerate(seqs):
        keys.append(rng.standard_normal((done + new, 2, H)).astype(np.float32))
        values.append(rng.standard_normal((done + new, 2, H)).astype(np.float32))
        lo = first_kept(done, window)
        k_rows[b, lo:done + new], v_rows[b, lo:done + new] = keys[b][lo:], values[b][lo:]
    rows = ContiguousKV(jnp.asarray(k_rows), jnp.asarray(v_rows))
    md = build_metadata([d for d, _ in seqs], [n for _, n in seqs], [[1] * 5] * 3, block_size=Z, max_tokens=16,
                        max_seqs=3, max_blocks_per_seq=5)
    q = rng.standard_normal((16, N, H)).astype(np.float32)
    want = ragged_expected(q, seqs, keys, values, window=window, **kw)
    for impl in ("reference", "pallas"):
        got = np.asarray(paged_attention(jnp.asarray(q), rows, md, scale=SCALE, impl=impl, window=window, **kw))
        np.testing.assert_allclose(got[:15], want, atol=2e-5, rtol=1e-5)
    got = contiguous_attention_reference(jnp.asarray(q), rows.k, rows.v, md, scale=SCALE, window=window, **kw)
    np.testing.assert_allclose(np.asarray(got)[:15], want, atol=2e-5, rtol=1e-5)
    lens = jnp.asarray([d + n for d, n in seqs], jnp.int32)
    got = contiguous_decode_reference(jnp.asarray(q[:3]), rows.k, rows.v, lens, scale=SCALE, window=window, **kw)
    want = np.stack([attend64(q[b], keys[b], values[b], d + n - 1, scale=SCALE, window=window, **kw)
                     for b, (d, n) in enumerate(seqs)])
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)


def test_matches_transformers_eager_attention():
    """transformers 5.24's own pieces: the sliding-window causal mask function, gpt-oss's
    eager attention with sinks and Gemma 2's with soft-capping, on one contiguous prefill."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    rng = np.random.default_rng(5)
    seq, window, kv_heads = 11, 3, 2
    q = rng.standard_normal((seq, N, H)).astype(np.float32)
    k = rng.standard_normal((seq, kv_heads, H)).astype(np.float32)
    v = rng.standard_normal((seq, kv_heads, H)).astype(np.float32)
    sinks = rng.normal(0, 1, N).astype(np.float32)
    mask_fn = sliding_window_causal_mask_function(window)
    allowed = torch.tensor([[bool(mask_fn(torch.tensor(0), torch.tensor(0), torch.tensor(i), torch.tensor(j)))
                             for j in range(seq)] for i in range(seq)])
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]  # [1, 1, S, S]
    tq, tk, tv = (torch.tensor(a).transpose(0, 1)[None] for a in (q, k, v))  # [1, heads, S, H]
    module = SimpleNamespace(num_key_value_groups=N // kv_heads, training=False,
                             sinks=torch.tensor(sinks), head_dim=H)
    oss, _ = gpt_oss_eager(module, tq, tk, tv, additive, scaling=SCALE)
    gemma, _ = gemma2_eager(module, tq, tk, tv, additive, scaling=SCALE, softcap=2.0)
    md = build_metadata([0], [seq], [[1, 2, 3]], block_size=Z, max_tokens=seq, max_seqs=1, max_blocks_per_seq=3)
    rows = ContiguousKV(jnp.asarray(np.pad(k, ((0, 1), (0, 0), (0, 0))))[None],
                        jnp.asarray(np.pad(v, ((0, 1), (0, 0), (0, 0))))[None])
    ours = paged_attention(jnp.asarray(q), rows, md, scale=SCALE, window=window, sinks=jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(ours), oss[0].numpy(), atol=1e-5)
    ours = paged_attention(jnp.asarray(q), rows, md, scale=SCALE, window=window, softcap=2.0)
    np.testing.assert_allclose(np.asarray(ours), gemma[0].numpy(), atol=1e-5)
    assert allowed.sum(-1).tolist() == [min(i + 1, window) for i in range(seq)]  # q - W < k <= q


def test_sinks_only_shrink_the_weights():
    """A very negative sink is no sink; a large one takes weight from every key; no key: zero."""
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, N, H)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((2, 9, 1, H)), jnp.float32)
    lens = jnp.asarray([9, 0], jnp.int32)
    plain = np.asarray(contiguous_decode_reference(q, rows, rows, lens, scale=SCALE))
    none = np.asarray(contiguous_decode_reference(q, rows, rows, lens, scale=SCALE, sinks=jnp.full(N, -1e4)))
    np.testing.assert_allclose(none, plain, atol=1e-7)
    big = np.asarray(contiguous_decode_reference(q, rows, rows, lens, scale=SCALE, sinks=jnp.full(N, 30.0)))
    assert np.abs(big[0]).max() < 1e-6 * np.abs(plain[0]).max() and not big[1].any()


BAD = [
    (dict(window=0), r"window \(the sliding window, in tokens\) must be an integer in \[1, \d+\], got 0"),
    (dict(window=-3), "got -3"),
    (dict(window=2.5), "window .* must be an integer .* got 2.5"),
    (dict(window=True), "window .* got true"),
    (dict(sinks=np.zeros(N + 1, np.float32)),
     r"sinks must be f32\[N=4\] \(one logit per query head\), got shape \(5,\)"),
    (dict(sinks=np.zeros((1, N), np.float32)), r"got shape \(1, 4\)"),
    (dict(sinks=np.zeros(N, np.int32)), "sinks must be floating point, got dtype int32"),
    (dict(softcap=0.0), "softcap must be a static finite number > 0, got 0.0"),
    (dict(softcap=-1), "got -1"),
    (dict(softcap=float("inf")), "got inf"),
    (dict(softcap=jnp.float32(2.0)), "softcap must be a static finite number"),
]


@pytest.mark.parametrize("kw, match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_variants_name_the_value(kw, match):
    q = jnp.zeros((2, N, H))
    pages = jnp.zeros((3, Z, 2, H))
    tables, lens = jnp.ones((2, 2), jnp.int32), jnp.ones(2, jnp.int32)
    md = build_metadata([0, 0], [1, 1], [[1], [2]], block_size=Z, max_tokens=2, max_seqs=2, max_blocks_per_seq=2)
    calls = [lambda: paged_decode_reference(q, pages, pages, tables, lens, scale=1.0, **kw),
             lambda: paged_attention_reference(q, pages, pages, md, scale=1.0, **kw),
             lambda: get_impl("pallas").decode(q, jnp.zeros((3, 16, 2, H)), jnp.zeros((3, 16, 2, H)), tables, lens,
                                               scale=1.0, **kw),
             lambda: paged_attention(q, ContiguousKV(pages[:2], pages[:2]), md, scale=1.0, **kw)]
    for call in calls:
        with pytest.raises(KvjaxError, match=match):
            call()
