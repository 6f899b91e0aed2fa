"""experiments/kernel_bench.py's bookkeeping, which the GPU run cannot check: the KV bytes each page
format moves (counted by hand, and against the arrays the bench builds) and the order the shapes run
in (a time budget cuts the last ones, so the issue's targets come first)."""
import jax.numpy as jnp
import pytest

from kvjax.experiments import kernel_bench as kb

GQA, MLA = kb.GPU_MODELS  # 32 q heads, 8 kv heads of 128; 16 heads over a 512 + 64 latent


@pytest.mark.parametrize("fmt, per_head", [("bf16", 256), ("fp8_e4m3", 128), ("fp8_per_token_head", 132),
                                           ("nvfp4", 72)])  # nvfp4: 64 bytes of values, 8 of block scales
def test_gqa_bytes_by_hand(fmt, per_head):
    assert GQA.kv_bytes(32, 8192, fmt) == 32 * 8192 * 2 * 8 * per_head


def test_mla_bytes_by_hand():
    assert MLA.kv_bytes(32, 8192, "bf16") == 32 * 8192 * 576 * 2
    assert MLA.kv_bytes(32, 8192, "fp8_e4m3") == 32 * 8192 * 576


@pytest.mark.parametrize("fmt", list(kb.FORMATS))
def test_the_built_pages_hold_what_the_bytes_count(fmt):
    model, z = kb.TINY_MODELS[0], 16
    q, pages, tables, lens, scales, kv_dtype = kb.build_case(model, 2, 64, z, fmt, seed=0)
    slots = pages[0].shape[0] * z  # every page's token slots, the null page's too
    per_token = sum(p.nbytes for p in pages) + sum(s.nbytes for s in scales if s is not None and s.ndim == 3)
    assert per_token / slots * 2 * 64 == model.kv_bytes(2, 64, fmt)
    assert kv_dtype == kb.FORMATS[fmt][1] and pages[0].dtype == jnp.dtype(kb.FORMATS[fmt][0])


def test_the_targets_run_first():
    shapes = [(m.kind, f, b, c) for m, f, b, c in kb.plan(kb.GPU_MODELS, [1, 8, 32, 128], [8192, 32768],
                                                           list(kb.FORMATS))]
    gqa_targets = [("gqa", f, b, 8192) for b in (32, 128) for f in ("bf16", "fp8_e4m3")]
    assert sorted(shapes[:4]) == sorted(gqa_targets) and shapes[0][2] == 32
    assert sorted(shapes[4:8]) == sorted(("mla", f, b, 8192) for b in (32, 128) for f in ("bf16", "fp8_e4m3"))
    assert sorted(shapes[8:12]) == sorted(("gqa", f, b, 8192) for b in (32, 128)
                                          for f in ("fp8_per_token_head", "nvfp4"))
    assert all(s[1] not in kb.SCALED for s in shapes[12:])  # the scaled formats at the targets only
    assert {(s[2], s[3]) for s in shapes[12:16]} == {(1, 32768), (8, 32768)}  # then batch 1 / 8 at the longest
    assert len(shapes) == 2 * 2 * 4 * 2 + 4


def test_the_jobs_put_each_kinds_targets_before_the_rest():
    shapes = kb.plan(kb.GPU_MODELS, [1, 8, 32, 128], [8192, 32768], list(kb.FORMATS))
    jobs = kb.jobs_in_order(kb.GPU_MODELS, shapes, [8192, 32768], tiny=False, prefill=True)
    names = [(job, s[0].kind, s[1], s[2] if job == "decode" else s[3]) for job, s in jobs]
    assert [n[0] for n in names[4:6]] == ["prefill", "prefill"] and {n[3] for n in names[4:6]} == {8192, 32768}
    assert names[10] == ("prefill", "mla", "bf16", 8192)  # after MLA's four decode targets
    assert [n[2] for n in names[15:17]] == ["fp8_per_token_head", "nvfp4"]  # after the scaled decode targets
    assert [n[0] for n in names[17:]] == ["decode"] * (len(shapes) - 12)
    key = lambda s: (s[0].name, *s[1:])  # noqa: E731
    assert sorted(key(s) for job, s in jobs if job == "decode") == sorted(map(key, shapes))  # each shape, once
    assert [j for j, _ in kb.jobs_in_order(kb.GPU_MODELS, shapes, [8192, 32768], tiny=False,
                                           prefill=False)] == ["decode"] * len(shapes)


def test_prefill_flops_by_hand():
    visible = sum(8192 - 2048 + i + 1 for i in range(2048))  # causal: each new token sees its prefix
    assert kb.prefill_flops(GQA, 2048, 8192) == 4 * 32 * 128 * visible
    assert kb.prefill_flops(MLA, 2048, 8192) == 16 * (2 * 576 + 2 * 512) * visible  # QKᵀ over C, PV over the rank
