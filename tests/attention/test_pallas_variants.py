"""The Pallas GQA decode kernel with sliding windows, attention sinks and logit soft-capping,
against float64 NumPy loops (interpret mode on CPU; `KVJAX_INTERPRET=0` compiles on a GPU).

Every slot outside a query's window holds NaN: the null block 0 that vLLM's SlidingWindowManager
leaves in the table for blocks wholly before the window (even rows), the real pages it has not
freed yet (odd rows), and the window's first page up to position len - W. Table entries past a
sequence's end are random garbage. `test_kernel_reads_only_the_window` records which pages the
kernel loads, since masking alone would also keep NaN out.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from kvjax.attention import pallas_decode as pd
from kvjax.attention import pallas_steps
from kvjax.attention.pallas_decode import paged_decode, split_block_tables, split_pages, window_pages
from kvjax.attention.reference import paged_decode_reference
from kvjax.attention.tiles import DecodeTiles, default_tiles

_ENV = os.environ.get("KVJAX_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV.lower() not in ("0", "false", "no")

F32, BF16, E4M3 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
TOL = {F32: 1e-5, BF16: 1e-2}  # by q dtype, as test_pallas_decode.py: rtol, and atol × the largest value
HEAD_DIM = 32
VARIANTS = {"plain": (False, None), "sinks": (True, None), "softcap": (False, 2.0), "sinks+softcap": (True, 1.5)}

# (Z, group, kv heads, pages_per_block, splits, window, variant, q dtype, page dtype)
CASES = [
    (16, 1, 4, 1, 1, 1, "plain", F32, F32),
    (16, 4, 2, 1, 4, 2, "sinks", F32, F32),
    (16, 4, 2, 2, 3, 15, "softcap", F32, F32),
    (16, 8, 1, 1, 2, 16, "sinks+softcap", F32, F32),
    (16, 4, 2, 4, 1, 17, "sinks", BF16, BF16),
    (16, 1, 4, 1, 4, 1000, "sinks+softcap", F32, F32),
    (16, 4, 2, 1, 3, 33, "plain", F32, E4M3),
    (16, 4, 2, 2, 2, None, "sinks", F32, F32),
    (16, 8, 1, 1, 4, None, "softcap", BF16, BF16),
    (16, 4, 2, 1, 1, None, "sinks+softcap", F32, F32),
    (4, 2, 2, 4, 1, 1, "sinks", F32, F32),
    (4, 2, 2, 4, 4, 2, "plain", F32, F32),
    (4, 7, 1, 8, 2, 3, "sinks+softcap", F32, F32),
    (4, 2, 2, 4, 3, 4, "softcap", F32, F32),
    (4, 1, 4, 4, 2, 5, "sinks", F32, F32),
    (4, 2, 2, 8, 4, 1000, "sinks+softcap", BF16, BF16),
    (4, 4, 2, 4, 1, 9, "sinks+softcap", F32, F32),
]


def lens_for(z):
    """Mixed decode lengths: padding, 1, part of a page, a page, a page + 1, several pages."""
    return [0, 1, 5, z, z + 1, 3 * z + 7, 9 * z + 2]


def build(seed, z, group, kv_heads, window, q_dtype, page_dtype):
    """(q, k_pages, v_pages, tables, lens, k f64 per row, v f64 per row, per-head dequant scale)."""
    rng = np.random.default_rng(seed)
    lens = lens_for(z)
    blocks = [-(-n // z) for n in lens]
    num_pages = 1 + sum(blocks) + 3
    physical = rng.permutation(np.arange(1, num_pages))
    tables = rng.integers(-1000, num_pages + 1000, size=(len(lens), max(blocks) + 1)).astype(np.int32)
    fp8 = jnp.dtype(page_dtype) == jnp.dtype(E4M3)
    scale = rng.uniform(0.5, 2.0, kv_heads).astype(np.float32) / 64 if fp8 else np.ones(kv_heads, np.float32)
    k_pages = np.full((num_pages, z, kv_heads, HEAD_DIM), np.nan, np.float32).astype(page_dtype)
    v_pages = k_pages.copy()
    keys, values, used = [], [], 0
    for b, n in enumerate(lens):
        table = physical[used:used + blocks[b]]
        used += blocks[b]
        lo = 0 if window is None else max(0, n - window)  # the first position the query at n - 1 sees
        k = np.asarray(rng.standard_normal((n, kv_heads, HEAD_DIM)) * (scale[:, None] * 64 if fp8 else 1))
        v = np.asarray(rng.standard_normal((n, kv_heads, HEAD_DIM)) * (scale[:, None] * 64 if fp8 else 1))
        k_stored = (k / scale[:, None]).astype(np.float32).astype(page_dtype)
        v_stored = (v / scale[:, None]).astype(np.float32).astype(page_dtype)
        for t in range(lo, n):
            k_pages[table[t // z], t % z], v_pages[table[t // z], t % z] = k_stored[t], v_stored[t]
        deq = lambda x: np.asarray(x, np.float64) * scale[:, None]  # what the kernel sees, in f64
        keys.append(deq(k_stored))
        values.append(deq(v_stored))
        tables[b, :blocks[b]] = [0 if b % 2 == 0 and (j + 1) * z <= lo else p for j, p in enumerate(table)]
    q = rng.standard_normal((len(lens), group * kv_heads, HEAD_DIM)).astype(np.float32).astype(q_dtype)
    return q, k_pages, v_pages, tables, np.asarray(lens, np.int32), keys, values, (scale if fp8 else None)


def decode64(q, keys, values, lens, scale, window, sinks, softcap):
    """f64[B, N, H]: query b at position lens[b] - 1 over positions > lens[b] - 1 - window, plain loops."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    batch, heads, _ = q.shape
    out = np.zeros(q.shape)
    for b in range(batch):
        n = int(lens[b])
        seen = [s for s in range(n) if window is None or s >= n - window]
        if not seen:
            continue
        group = heads // keys[b].shape[1]
        for i in range(heads):
            logits = np.array([keys[b][s, i // group] @ q[b, i] for s in seen]) * scale
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            top = max(logits.max(), sinks[i]) if sinks is not None else logits.max()
            w = np.exp(logits - top)
            total = w.sum() + (np.exp(sinks[i] - top) if sinks is not None else 0.0)
            out[b, i] = (w / total) @ np.stack([values[b][s, i // group] for s in seen])
    return out


def assert_close(out, want, q_dtype, values):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "kernel output has NaN/inf: a slot outside the window leaked"
    vmax = max(np.abs(v).max() for v in values if v.size)
    np.testing.assert_allclose(out, want, rtol=TOL[q_dtype], atol=TOL[q_dtype] * vmax)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "Z{}-G{}-K{}-p{}-S{}-W{}-{}-{}-{}".format(
    *c[:7], jnp.dtype(c[7]).name, jnp.dtype(c[8]).name))
def test_kernel_matches_numpy(case):
    z, group, kv_heads, ppb, splits, window, name, q_dtype, page_dtype = case
    q, k_pages, v_pages, tables, lens, keys, values, deq = build(CASES.index(case), z, group, kv_heads, window,
                                                                 q_dtype, page_dtype)
    with_sinks, softcap = VARIANTS[name]
    sinks = np.random.default_rng(7).normal(0.5, 1.5, q.shape[1]).astype(np.float32) if with_sinks else None
    scale = HEAD_DIM ** -0.5
    want = decode64(q, keys, values, lens, scale, window, sinks, softcap)
    tiles = DecodeTiles(pages_per_block=ppb, num_splits=splits, block_h=max(16, 1 << (group - 1).bit_length()))
    args = [jnp.asarray(a) for a in (q, k_pages, v_pages, tables, lens)]
    out = paged_decode(*args, scale=scale, k_scale=deq, v_scale=deq, window=window, sinks=sinks, softcap=softcap,
                       tiles=tiles, interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, want, q_dtype, values)
    assert not np.asarray(out[0], np.float32).any(), "a padding row gets zero, sink or not"
    kv_dtype = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}.get(jnp.dtype(page_dtype).name)
    ref = paged_decode_reference(*args, scale=scale, k_scale=deq, v_scale=deq, window=window, sinks=sinks,
                                 softcap=softcap, kv_dtype=kv_dtype)
    assert_close(ref, want, q_dtype, values)


def test_kernel_reads_only_the_window(monkeypatch):
    """Record what the kernel does: each (sequence, kv head) program's splits cover exactly the
    pages holding a position of the window, and the physical pages it loads are those pages,
    each once per kv head; no page before the window (a NaN page, null or not) is loaded."""
    z, window, splits, ppb, kv_heads = 4, 6, 3, 4, 2
    q, k_pages, v_pages, tables, lens, keys, values, _ = build(1, z, 2, kv_heads, window, F32, F32)
    schedule, loaded = [], []
    split_pages_, step_pages_ = pd.split_pages, pd.step_pages

    def record(store):
        return lambda *a: store.append(tuple(int(x) if np.ndim(x) == 0 else np.asarray(x) for x in a))

    def recording_split(split, length, **kw):  # at the kernel's top level, where program_id is defined
        first, n_pages, steps = split_pages_(split, length, **kw)
        jax.debug.callback(record(schedule), pl.program_id(0), pl.program_id(1), first, n_pages)
        return first, n_pages, steps

    def recording_step(*args):  # inside the page loop: the physical pages about to be loaded
        pages, pos = step_pages_(*args)
        jax.debug.callback(record(loaded), pages)
        return pages, pos

    jax.clear_caches()  # trace the kernel again, with the recording helpers
    monkeypatch.setattr(pallas_steps, "split_pages", recording_split)  # called by the kernel's program_split
    monkeypatch.setattr(pd, "step_pages", recording_step)
    try:
        out = paged_decode(*[jnp.asarray(a) for a in (q, k_pages, v_pages, tables, lens)], scale=0.2,
                           window=window, tiles=DecodeTiles(ppb, splits, 16), interpret=True)
    finally:
        jax.clear_caches()
    assert_close(out, decode64(q, keys, values, lens, 0.2, window, None, None), F32, values)
    want_loaded = []
    for b, n in enumerate(lens):
        start, end = max(0, n - window) // z, -(-n // z)
        for h in range(kv_heads):
            ranges = sorted((first, count) for bb, hh, first, count in schedule if (bb, hh) == (b, h))
            assert len(ranges) == splits
            covered = [p for first, count in ranges for p in range(first, first + count)]
            assert covered == list(range(start, end)), (b, h, ranges)
            want_loaded += [int(tables[b, j]) for j in range(start, end)]
    got_loaded = sorted(int(p) for (pages,) in loaded for p in pages if p != 0)
    assert got_loaded == sorted(p for p in want_loaded if p != 0)


@pytest.mark.parametrize("z, ppb, splits", [(4, 4, 1), (4, 4, 3), (16, 1, 4), (16, 2, 2)])
@pytest.mark.parametrize("window", [None, 1, 2, 3, 4, 5, 16, 17, 40, 1000])
def test_splits_tile_the_window(z, ppb, splits, window):
    """split_pages (the kernel's page schedule): over every length that fits the table, the
    splits' page ranges are disjoint, start at the page of position len - W and cover the
    sequence's pages from there to its end; steps = ceil(pages / pages_per_block)."""
    max_blocks = 12
    view = None if window is None else window_pages(window, z)
    _, per_split = split_block_tables(jnp.zeros((1, max_blocks), jnp.int32), splits, ppb, view)
    lens = jnp.arange(max_blocks * z + 1, dtype=jnp.int32)
    ranges = [[np.broadcast_to(np.asarray(x), lens.shape) for x in
               split_pages(s, lens, block_size=z, pages_per_block=ppb, pages_per_split=per_split,
                           max_blocks=max_blocks, window=window)] for s in range(splits)]
    for i, n in enumerate(np.asarray(lens)):
        start = 0 if window is None else max(0, n - window) // z
        pages = []
        for first, count, steps in ranges:
            first, count, steps = int(first[i]), int(count[i]), int(steps[i])
            assert steps == -(-count // ppb)
            pages += list(range(first, first + count))
        assert pages == list(range(start, -(-n // z))), (n, pages)


def test_window_pages_and_default_tiles():
    """A window touches at most cdiv(W - 1, Z) + 1 pages; the default tiles are sized for those."""
    for w in range(1, 40):
        touched = max(len({p // 4 for p in range(s, s + w)}) for s in range(8))
        assert window_pages(w, 4) == touched
    q, k_pages, v_pages, tables, lens, keys, values, _ = build(3, 16, 4, 2, 17, F32, F32)
    want = decode64(q, keys, values, lens, 0.1, 17, None, 3.0)
    out = paged_decode(*[jnp.asarray(a) for a in (q, k_pages, v_pages, tables, lens)], scale=0.1, window=17,
                       softcap=3.0, interpret=INTERPRET)
    assert_close(out, want, F32, values)
    full = default_tiles(batch=1, num_kv_heads=1, group=4, head_dim=128, block_size=16, max_blocks=2048)
    windowed = default_tiles(batch=1, num_kv_heads=1, group=4, head_dim=128, block_size=16,
                             max_blocks=window_pages(4096, 16))
    assert full.num_splits > windowed.num_splits > 1  # the window's 257 pages, not the table's 2048


def test_sinks_count_once_across_splits():
    """One sink per head in the merged denominator, not one per split: 1, 2 and 4 splits of a
    long context (every split sees keys) all give the float64 softmax with one sink column."""
    q, k_pages, v_pages, tables, lens, keys, values, _ = build(4, 16, 4, 2, None, F32, F32)
    sinks = np.linspace(-2, 3, q.shape[1]).astype(np.float32)
    args = [jnp.asarray(a) for a in (q, k_pages, v_pages, tables, lens)]
    want = decode64(q, keys, values, lens, 0.15, None, sinks, None)
    for splits in (1, 2, 4):
        out = paged_decode(*args, scale=0.15, sinks=sinks, tiles=DecodeTiles(1, splits, 16), interpret=INTERPRET)
        assert_close(out, want, F32, values)


def test_bad_variants_refused_by_the_kernel():
    q, pages = jnp.zeros((2, 8, 32)), jnp.zeros((3, 16, 2, 32))
    tables, lens = jnp.ones((2, 2), jnp.int32), jnp.ones(2, jnp.int32)
    for kw, match in [(dict(window=0), "window"), (dict(sinks=jnp.zeros(2)), r"sinks must be f32\[N=8\]"),
                      (dict(softcap=-2.0), "softcap must be a static finite number > 0, got -2.0")]:
        with pytest.raises(ValueError, match=match):
            paged_decode(q, pages, pages, tables, lens, scale=1.0, interpret=True, **kw)
