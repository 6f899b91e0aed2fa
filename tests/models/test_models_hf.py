"""kvjax's decoders against transformers, through the loader and the paged cache (issue 4).

For each tiny random-init checkpoint (Llama MHA/GQA/MQA, Qwen2, Qwen3, DeepSeek-V3 with and
without q_lora_rank, DeepSeek-V2): (1) full-sequence logits, (2) prefill then token-by-token
decode with block size 4, a length that is not a multiple of 4 and permuted physical blocks,
(3) four sequences mixing prefill, chunked prefill and decode in the same steps — each equal
to transformers' logits within 1e-4. Each case compiles one ragged step (T=32, B=4) and one
decode step (T=B=4) and every test reuses them; the tests check they never recompile.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import CASES, hf_logits, make_hf_model, save_hf_model

from kvjax.attention.metadata import build_metadata, decode_metadata
from kvjax.models import build_model, init_params, preset
from kvjax.models.loader import load_checkpoint
from kvjax.worker.model_runner import make_step
from kvjax.worker.paged_cache import PagedCache

NUM_BLOCKS, BLOCK, MAX_BLOCKS = 48, 4, 8  # P, Z, M
MAX_TOKENS, MAX_SEQS = 32, 4  # T, B of the ragged step
TOL = 1e-4


@dataclasses.dataclass
class Case:
    name: str
    hf: object
    config: object
    params: dict
    ragged: object  # jitted step for T=32, B=4
    decode: object  # jitted step for T=B=4, decode=True

    def new_cache(self, fill=0.0) -> PagedCache:
        cache = PagedCache.create(self.config.kv_spec(), NUM_BLOCKS, BLOCK)
        return jax.tree_util.tree_map(lambda a: jnp.full_like(a, fill), cache)

    def run(self, cache, seqs, decode=False):
        """seqs: [(num_computed, new tokens, block table)] → ([f32[len(new), V] per seq], cache)."""
        size = MAX_SEQS if decode else MAX_TOKENS
        md = build_metadata([s[0] for s in seqs], [len(s[1]) for s in seqs], [s[2] for s in seqs],
                            block_size=BLOCK, max_tokens=size, max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS,
                            decode=decode)
        flat = np.concatenate([s[1] for s in seqs])
        tokens = jnp.asarray(np.pad(flat, (0, size - len(flat))), jnp.int32)
        logits, cache = (self.decode if decode else self.ragged)(self.params, tokens, md, cache)
        logits, out, t = np.asarray(logits), [], 0
        for s in seqs:
            out.append(logits[t:t + len(s[1])])
            t += len(s[1])
        return out, cache


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    hf = make_hf_model(request.param)
    folder = save_hf_model(hf, str(tmp_path_factory.mktemp(request.param)))
    config, params = load_checkpoint(folder, dtype="float32")
    model = build_model(config)
    return Case(request.param, hf, config, params, make_step(model), make_step(model))


def _tokens(seed, n):
    return np.random.RandomState(seed).randint(0, 128, size=n).astype(np.int32)


def _tables(seed, lengths):
    """Disjoint block tables drawn from a random permutation of the usable blocks 1..P-1."""
    free = list(np.random.RandomState(seed).permutation(np.arange(1, NUM_BLOCKS)))
    return [[int(free.pop()) for _ in range(-(-n // BLOCK))] for n in lengths]


def test_full_sequence_logits_match_transformers(case):
    tokens = _tokens(1, 13)
    (table,) = _tables(1, [13])
    (logits,), _ = case.run(case.new_cache(), [(0, tokens, table)])
    np.testing.assert_allclose(logits, hf_logits(case.hf, tokens), atol=TOL, rtol=0)


def test_only_written_slots_are_read(case):
    """Every slot but this step's writes holds NaN, block 0 included: logits stay exact."""
    tokens = _tokens(1, 13)
    (table,) = _tables(1, [13])
    (logits,), _ = case.run(case.new_cache(fill=np.nan), [(0, tokens, table)])
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits, hf_logits(case.hf, tokens), atol=TOL, rtol=0)


def test_prefill_then_paged_decode(case):
    tokens = _tokens(2, 13)  # 6 prompt tokens, then 7 decode steps; 13 is not a multiple of 4
    (table,) = _tables(2, [13])
    want = hf_logits(case.hf, tokens)
    cache = case.new_cache()
    (logits,), cache = case.run(cache, [(0, tokens[:6], table)])
    got = [logits]
    for pos in range(6, 13):
        old = jax.tree_util.tree_leaves(cache)[0]
        (logits,), cache = case.run(cache, [(pos, tokens[pos:pos + 1], table)], decode=True)
        assert old.is_deleted(), "the step should donate the cache and update it in place"
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got), want, atol=TOL, rtol=0)
    assert case.decode._cache_size() == 1, "decode steps recompiled"
    assert case.ragged._cache_size() == 1


def test_mixed_batch_matches_each_sequence_alone(case):
    """Prefill, chunked prefill, idle and decode sequences share steps; then decode-only steps
    built on device (decode_metadata) with sequences finishing at different times."""
    lengths = [10, 12, 9, 11]
    seqs = [_tokens(10 + i, n) for i, n in enumerate(lengths)]
    tables = _tables(3, lengths)
    done = [0, 0, 0, 0]
    got = [[] for _ in seqs]
    cache = case.new_cache()
    schedule = [{0: 5, 1: 9}, {0: 1, 1: 1, 2: 3, 3: 4}, {0: 1, 2: 1, 3: 3}]  # seq → new tokens
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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny-mla"])
def test_logits_indices_select_rows(name):
    config = preset(name)
    model = build_model(config)
    params = init_params(model, jax.random.key(0))
    md = build_metadata([0, 0], [5, 3], [[2, 3], [4]], block_size=4, max_tokens=8, max_seqs=2, max_blocks_per_seq=2)
    tokens = jnp.asarray(_tokens(4, 8))
    step = make_step(model)
    full, _ = step(params, tokens, md, PagedCache.create(config.kv_spec(), 6, 4))
    last, _ = step(params, tokens, md, PagedCache.create(config.kv_spec(), 6, 4), md.logits_indices)
    assert last.shape == (2, config.vocab_size)
    np.testing.assert_allclose(np.asarray(last), np.asarray(full)[[4, 7]], atol=1e-6)
