"""The profiling step of kvjax.accounting.sizing is the worst prefill step the engine runs: a chunk
of max_num_batched_tokens at the end of a max_model_len context, its block table as wide as the
context. Its measured activation peak therefore holds the prefill attention's temporaries, which
grow with the context below the tiled attention's bound and stay bounded above it."""
import jax
import numpy as np
import pytest

from kvjax.accounting import sizing
from kvjax.attention.tiled import reference_scores_bytes, use_tiled
from kvjax.models import build_model, init_params, preset

T, Z = 64, 16


@pytest.fixture(scope="module")
def tiny():
    config = preset("tiny")
    model = build_model(config)
    return model, init_params(model, jax.random.key(0)), config.kv_spec()


def test_the_profile_is_the_last_chunk_of_the_context():
    ids, md, rows, blocks = sizing._profile_inputs(128, T, Z, 1000)
    assert ids.shape == (T,) and md.max_query_len == T
    np.testing.assert_array_equal(md.positions, np.arange(1000 - T, 1000))
    assert md.context_lens.tolist() == [1000] and md.block_tables.shape == (1, 63)  # cdiv(1000, 16)
    # the table cycles over the profile's own pages 1..5 (cdiv(64, 16) + 1; block 0 null) ...
    assert blocks == 6 and set(md.block_tables[0].tolist()) == set(range(1, 6))
    # ... and the chunk's 64 tokens, unaligned (936 = 58 × 16 + 8), write 64 distinct slots in 5 pages
    assert len(set(md.slot_mapping.tolist())) == T and {int(s) // Z for s in md.slot_mapping} <= set(range(1, 6))
    assert rows.tolist() == [T - 1]
    # no max_model_len beyond the chunk: the chunk from position 0, as before
    _, md0, _, blocks0 = sizing._profile_inputs(128, T, Z, T)
    np.testing.assert_array_equal(md0.positions, np.arange(T))
    assert md0.block_tables.shape == (1, 4) and blocks0 == 6


def test_the_peak_holds_the_attention_temporaries_of_the_context(tiny):
    model, params, spec = tiny
    heads = model.config.num_heads
    short = sizing.compile_profile(model, params, spec, block_size=Z, max_num_batched_tokens=T)
    long = sizing.compile_profile(model, params, spec, block_size=Z, max_num_batched_tokens=T, max_model_len=1024)
    assert (short.context, long.context) == (T, 1024)
    md_short, md_long = short.inputs[1], long.inputs[1]
    assert not use_tiled(md_long, heads, Z, "cpu")  # 1 MiB of scores: the reference runs, O(T × S)
    grown = reference_scores_bytes(md_long, heads, Z) - reference_scores_bytes(md_short, heads, Z)
    assert long.xla.temp - short.xla.temp >= grown > 0
    # past the bound the tiled form runs and the peak stays bounded, far below the reference's scores
    far = sizing.compile_profile(model, params, spec, block_size=Z, max_num_batched_tokens=T, max_model_len=65536)
    md_far = far.inputs[1]
    assert use_tiled(md_far, heads, Z, "cpu") and md_far.block_tables.shape == (1, 4096)
    assert far.xla.temp < reference_scores_bytes(md_far, heads, Z) / 8


def test_profile_and_size_profiles_its_max_model_len(tiny):
    model, params, spec = tiny
    r = sizing.profile_and_size(model, params, spec, total_bytes=4 * 1024**2, block_size=Z,
                                max_num_batched_tokens=T, max_num_seqs=4, max_model_len=1024)
    assert (r.profile.tokens, r.profile.context) == (T, 1024) and r.profile.to_json()["context"] == 1024
    step = sizing.compile_profile(model, params, spec, block_size=Z, max_num_batched_tokens=T, max_model_len=128)
    with pytest.raises(sizing.SizingError, match="over a context of 128 .* over 1024 \\(max_model_len 1024\\)"):
        sizing.profile_and_size(model, params, spec, total_bytes=4 * 1024**2, block_size=Z, max_num_batched_tokens=T,
                                max_num_seqs=4, max_model_len=1024, step=step)
