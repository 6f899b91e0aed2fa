"""The tiled ragged attention (kvjax.attention.tiled) against the jnp reference, elementwise, on
the same pages: every variant and page format the reference reads, and its memory bound.

Every batch mixes prefill and decode: prompts, chunks that start mid-sequence (chunked prefill
and prefix hits), single decode tokens and a padding row, in rows that are not in token order
(the engine keeps a request in its row), through permuted block tables, with context lengths
that do not fill their last page. Every slot no query of the step may read holds NaN (for
integer pages: a NaN scale; for nvfp4: the byte 0x7F, whose block scale is e4m3's NaN), so a
stray read shows up as NaN. Windowed layers get vLLM's sliding tables (null blocks before the
window of each sequence's first new token). Tiles are tiny, so every sequence spans several
query tiles and several kv tiles, and windows are both shorter and longer than a kv tile.

Stated tolerance, f32 queries: |tiled − reference| ≤ 1e-5 × |reference| + 1e-6 × max |V|
elementwise (the two differ only in the order of the softmax's sums). bf16 queries: one bf16
unit in the last place (both round the same f32 result, which may sit on either side of a
rounding boundary).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import get_impl, mla_paged_attention, paged_attention, tiled
from kvjax.attention.metadata import build_metadata
from kvjax.attention.reference import mla_paged_attention_reference, paged_attention_reference
from kvjax.attention.tiled import PrefillTiles, mla_paged_attention_tiled, paged_attention_tiled
from kvjax.worker.paged_cache import KVPages, LatentPages

from ragged_cases import (ATOL, MAX_BLOCKS, MAX_QUERY, MAX_SEQS, MAX_TOKENS, N, RTOL, SCALE, SEQS, H, VARIANTS, Z,
                          assert_equal_to_reference, first_seen, gqa_case, jitted, mla_case, values_max,
                          with_variant)

TILES = [PrefillTiles(q_tile=4, kv_tokens=2 * Z), PrefillTiles(q_tile=3, kv_tokens=Z), PrefillTiles()]
WINDOWS = [None, 1, 3, 2 * Z + 1, 64]  # shorter than a kv tile, longer than one, longer than every context


# The default run covers each head layout and each window once (the README's "every check once");
# the rest of the grid is marked slow.
QUICK_GRID = {(None, 2), (3, 4), (2 * Z + 1, 1)}  # windows 1 and 2Z + 1 also in test_pallas_ragged's default run


@pytest.mark.parametrize("window, kv_heads", [  # kv_heads 4, 2, 1: MHA, GQA (group 2), MQA
    pytest.param(w, k, marks=() if (w, k) in QUICK_GRID else pytest.mark.slow) for w in WINDOWS for k in (4, 2, 1)])
def test_gqa_mqa_mha_every_window_and_variant(kv_heads, window):
    q, k_pages, v_pages, md, kw = gqa_case(kv_heads, window)
    rng = np.random.default_rng(kv_heads)
    for name in VARIANTS:
        args = with_variant(kw, name, rng)
        want = jitted(paged_attention_reference, q, k_pages, v_pages, md, **args)
        for tiles in TILES:
            got = jitted(paged_attention_tiled, q, k_pages, v_pages, md, tiles=tiles, **args)
            assert_equal_to_reference(got, want, values_max(v_pages, kw))
        assert not np.asarray(got)[sum(n for _, n in SEQS):].any(), "padding tokens attend to nothing"


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head",
                                 "fp8_per_token_head", "nvfp4"])
@pytest.mark.parametrize("window", [None, pytest.param(3, marks=pytest.mark.slow)])  # windows: the test above
def test_every_page_format(fmt, window):
    """Each tile is dequantized by the reference's own gather_dequant: the same values, the same output."""
    q, k_pages, v_pages, md, kw = gqa_case(2, window, fmt, seed=1)
    kw = with_variant(kw, "sinks+softcap", np.random.default_rng(1))
    want = jitted(paged_attention_reference, q, k_pages, v_pages, md, **kw)
    for tiles in TILES[:2]:
        got = jitted(paged_attention_tiled, q, k_pages, v_pages, md, tiles=tiles, **kw)
        assert_equal_to_reference(got, want, values_max(v_pages, kw))


def test_bf16_queries_round_as_the_reference_does():
    q, k_pages, v_pages, md, kw = gqa_case(2, 5, "bf16", seed=2)
    q = q.astype(jnp.bfloat16)
    want = paged_attention_reference(q, k_pages, v_pages, md, **kw)
    got = paged_attention_tiled(q, k_pages, v_pages, md, tiles=TILES[0], **kw)
    assert got.dtype == jnp.bfloat16
    want32, got32 = np.asarray(want, np.float32), np.asarray(got, np.float32)
    np.testing.assert_allclose(got32, want32, rtol=2.0 ** -7, atol=2.0 ** -8 * values_max(v_pages, kw))
    assert (got32 == want32).mean() > 0.95, "most elements round to the very same bf16"


def test_chunked_prefill_equals_one_prefill():
    """A 27-token prompt in chunks of 10, 1, 12 and 4, each over the sliding table of its moment,
    gives what one whole prefill gives (both tiled), which is what the reference gives."""
    window, rng = 6, np.random.default_rng(3)
    total, kv_heads = 27, 2
    keys = rng.standard_normal((total, kv_heads, H)).astype(np.float32)
    values = rng.standard_normal((total, kv_heads, H)).astype(np.float32)
    q_all = rng.standard_normal((total, N, H)).astype(np.float32)
    sinks = jnp.asarray(rng.normal(0, 1, N), jnp.float32)
    table = [int(p) for p in rng.permutation(np.arange(1, 12))[:7]]

    def run(done, new, fn):
        lo = first_seen(done, window)
        k_pages = np.full((12, Z, kv_heads, H), np.nan, np.float32)
        v_pages = k_pages.copy()
        for s in range(lo, done + new):
            k_pages[table[s // Z], s % Z], v_pages[table[s // Z], s % Z] = keys[s], values[s]
        own = table[:-(-(done + new) // Z)]
        md = build_metadata([done], [new], [own], block_size=Z, max_tokens=32, max_seqs=2, max_blocks_per_seq=8)
        md = md.replace(block_tables=md.block_tables.at[0, :len(own)].set(
            jnp.asarray([0 if (j + 1) * Z <= lo else p for j, p in enumerate(own)])))
        q = np.zeros((32, N, H), np.float32)
        q[:new] = q_all[done:done + new]
        kw = dict(scale=SCALE, window=window, sinks=sinks, softcap=3.0)
        if fn is paged_attention_tiled:
            kw["tiles"] = PrefillTiles(q_tile=4, kv_tokens=Z)
        return np.asarray(fn(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), md, **kw))[:new]

    chunks, done = [], 0
    for new in (10, 1, 12, 4):
        chunks.append(run(done, new, paged_attention_tiled))
        np.testing.assert_allclose(chunks[-1], run(done, new, paged_attention_reference), rtol=RTOL, atol=ATOL * 4)
        done += new
    np.testing.assert_allclose(np.concatenate(chunks), run(0, total, paged_attention_tiled), rtol=RTOL, atol=ATOL * 4)


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3", "int8_per_token_head"])
def test_mla_latent_pages(fmt):
    """Absorbed MLA: one kv head whose key is the whole latent [c_kv, k_rope] and whose value is c_kv."""
    q_latent, q_rope, latent, md, kw = mla_case(fmt, 4)
    rank, heads, scale = q_latent.shape[2], q_latent.shape[1], kw["latent_scale"]
    want = jitted(mla_paged_attention_reference, q_latent, q_rope, latent, md, **kw)
    for tiles in TILES:
        got = jitted(mla_paged_attention_tiled, q_latent, q_rope, latent, md, tiles=tiles, **kw)
        assert got.shape == (MAX_TOKENS, heads, rank)
        assert_equal_to_reference(got, want, values_max(latent, dict(v_scale=scale)))


def test_dispatch_runs_the_tiled_form_above_the_bound(monkeypatch):
    """`paged_attention` / `mla_paged_attention` ("reference"'s ragged forms; "pallas" runs its ragged kernel,
    test_pallas_ragged.py) run the reference while its scores fit REFERENCE_SCORES_BYTES and the tiled
    form above it; decode steps keep their own forms."""
    q, k_pages, v_pages, md, kw = gqa_case(2, None, "fp8_e4m3")
    pages = KVPages(k_pages, v_pages, kw["k_scale"], kw["v_scale"], kv_dtype="fp8_e4m3")
    assert get_impl("reference").ragged is tiled.ragged_attention
    assert get_impl("reference").mla_ragged is tiled.mla_ragged_attention
    assert tiled.reference_scores_bytes(md, N, Z) == MAX_SEQS * MAX_QUERY * N * MAX_BLOCKS * Z * 4

    def traced(fn):
        return "while" in str(jax.make_jaxpr(fn)(q))

    assert not traced(lambda x: paged_attention(x, pages, md, scale=SCALE))
    assert not tiled.use_tiled(md, N, Z, "gpu") and tiled.use_tiled(md.replace(max_query_len=1 << 17), N, Z, "gpu")
    monkeypatch.setitem(tiled.REFERENCE_SCORES_BYTES, "cpu", tiled.reference_scores_bytes(md, N, Z) - 1)
    assert traced(lambda x: paged_attention(x, pages, md, scale=SCALE))
    np.testing.assert_allclose(np.asarray(paged_attention(q, pages, md, scale=SCALE)),
                               np.asarray(paged_attention_reference(q, k_pages, v_pages, md, **kw)), rtol=RTOL,
                               atol=ATOL * values_max(v_pages, kw))
    latent = LatentPages(jnp.asarray(np.random.default_rng(5).standard_normal((40, Z, 12)), jnp.float32))
    assert "while" in str(jax.make_jaxpr(lambda x: mla_paged_attention(x, x[..., :4], latent, md, scale=SCALE))(
        q[..., :8]))


def test_tiles_and_shapes_are_checked():
    with pytest.raises(ValueError, match="PrefillTiles.q_tile must be a positive int, got 0"):
        PrefillTiles(q_tile=0)
    with pytest.raises(ValueError, match="PrefillTiles.kv_tokens must be a positive int"):
        PrefillTiles(kv_tokens=2.5)
    q, k_pages, v_pages, md, kw = gqa_case(2, None)
    with pytest.raises(ValueError, match="2 kv heads do not divide 3 query heads"):
        paged_attention_tiled(q[:, :3], k_pages, v_pages, md, **kw)
    with pytest.raises(ValueError, match="sinks must be f32\\[N=4\\]"):
        paged_attention_tiled(q, k_pages, v_pages, md, **kw, sinks=jnp.zeros(3))


# --------------------------------------------------------------------------------------------
# Memory: compiled temporaries, from XLA's own buffer assignment (nothing is allocated)
# --------------------------------------------------------------------------------------------
def temp_bytes(fn, queries, positions, heads=4, kv_heads=1, head_dim=16, z=16, dtype=jnp.float32):
    """XLA's compiled temporary bytes of fn on one sequence prefilling `queries` tokens that end at
    `positions`, over pages of exactly that context (ShapeDtypeStructs: lowered, never run)."""
    s = jax.ShapeDtypeStruct
    blocks = positions // z
    md = build_metadata([positions - queries], [queries], [list(range(1, blocks + 1))], block_size=z,
                        max_tokens=queries, max_seqs=1, max_blocks_per_seq=blocks)
    md = jax.tree_util.tree_map(lambda a: s(a.shape, a.dtype), md)
    page = s((blocks + 1, z, kv_heads, head_dim), dtype)
    compiled = jax.jit(lambda q, k, v, m: fn(q, k, v, m, scale=0.25)).lower(
        s((queries, heads, head_dim), jnp.float32), page, page, md).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_temporaries_are_bounded_by_the_tiles():
    """2,048 queries over 8K keys: the reference holds f32 scores for every (query, head, key), the
    tiled form a few [Tq·N, Tk] tiles plus O(T) rows, whatever the context."""
    tiles = PrefillTiles()
    heads, head_dim, queries = 4, 16, 2048
    tile = tiles.q_tile * heads * tiles.kv_tokens * 4  # one f32 [K, Tq·G, Tk] tile
    rows = queries * heads * head_dim * 4  # one f32 [T, N, H]
    bound = 8 * tile + 4 * rows + (1 << 20)
    tiled_8k = temp_bytes(paged_attention_tiled, queries, 8192)
    old_8k = temp_bytes(paged_attention_reference, queries, 8192)
    assert tiled_8k <= bound, (tiled_8k, bound)
    assert old_8k >= queries * heads * 8192 * 4, "the reference's scores: one f32 per query, head and position"
    assert old_8k / tiled_8k > 20
    # f32 pages (no bitcast to integers, see tiled.as_bits): not a byte more for 4× the context
    assert temp_bytes(paged_attention_tiled, queries, 32768) == tiled_8k
    # bf16 pages: the same, plus the CPU backend's one copy of the pages as integers (2 × pool bytes at most)
    pool = 2 * (32768 // 16 + 1) * 16 * 1 * head_dim * 2
    assert temp_bytes(paged_attention_tiled, queries, 32768, dtype=jnp.bfloat16) <= bound + pool


# --------------------------------------------------------------------------------------------
# The engine: the same greedy tokens with every ragged step tiled
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", pytest.param("tiny-mla", marks=pytest.mark.slow)])
def test_engine_generates_the_same_tokens_with_every_prefill_tiled(name, monkeypatch):
    """Chunked prefill at a 16-token budget (chunks that start mid-sequence, steps mixing chunks
    and decodes, a shared prefix) gives the same greedy tokens when every ragged step runs tiled."""
    from engine_fixtures import engine_config

    from kvjax.config.presets import preset
    from kvjax.engine.core import Engine
    from kvjax.engine.sampling import SamplingParams
    from kvjax.models import build_model, init_params

    config = preset(name).replace(dtype="float32")
    model = build_model(config)
    params = init_params(model, jax.random.key(0))
    rng = np.random.RandomState(0)
    shared = rng.randint(0, 128, size=8).tolist()
    prompts = [shared + rng.randint(0, 128, size=n).tolist() for n in (21, 3)] + [[5]]

    def run():
        cfg = engine_config(config, num_blocks=48, block_size=4, max_num_seqs=3, max_model_len=64,
                            max_num_batched_tokens=16)
        out = Engine(model, params, cfg).generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
        return [r.output for r in out.results]

    calls = []
    for fn in ("paged_attention_tiled", "mla_paged_attention_tiled"):
        real = getattr(tiled, fn)
        monkeypatch.setattr(tiled, fn, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    want = run()
    assert not calls, "the reference runs these small steps"
    monkeypatch.setitem(tiled.REFERENCE_SCORES_BYTES, "cpu", -1)
    jax.clear_caches()  # the engine's jitted steps are shared by engines of one model: trace them anew
    assert run() == want
    assert calls, "the tiled form ran"


@pytest.mark.slow
def test_long_context_experiment_runs(tmp_path):
    """experiments/long_context.py --quick end to end: its tables, and the tiled form below the old one."""
    import json

    from kvjax.experiments import long_context

    result = long_context.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "long_context.json").read_text())
    assert saved["temporaries"] == result["temporaries"] and saved["speed"] and saved["tiles"]
    assert all(r["tiled_temp_bytes"] * 10 < r["old_temp_bytes"] for r in saved["temporaries"])
    assert "## (a) Compiled temporaries" in (tmp_path / "long_context.md").read_text()
