"""attention_backend="pallas" picks Mosaic GPU or Triton per shape from the measured table
(kvjax.attention.mgpu_dispatch), and the pick reaches the kernel."""
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import get_impl, mgpu_decode, mgpu_dispatch, pallas_decode
from kvjax.attention.mgpu_dispatch import choose, nearest, render_table_module, table_from_rows

H200 = "NVIDIA H200"
BF16, E4M3 = jnp.bfloat16, jnp.float8_e4m3fn
TABLE = {(H200, "gqa", "bfloat16", "bfloat16", 128, 4, 32, 8192): "mosaic",
         (H200, "gqa", "bfloat16", "bfloat16", 128, 4, 1, 32768): "triton",
         (H200, "mla", "bfloat16", "bfloat16", 512, 16, 32, 8192): "mosaic"}
GQA = dict(head_dim=128, block_size=16, group=4)


def test_nearest_measured_shape_decides(monkeypatch):
    monkeypatch.delenv("KVJAX_PALLAS_KERNELS", raising=False)
    pick = lambda **kw: choose("gqa", BF16, BF16, **{**GQA, **kw}, table=TABLE, device=H200)  # noqa: E731
    assert pick(batch=64, context=8192) == "mosaic"
    assert pick(batch=2, context=32768) == "triton"
    assert pick(batch=32, context=8192, group=8) == "triton", "no measured shape with this group: Triton"
    assert choose("gqa", BF16, BF16, **GQA, batch=32, context=8192, table=TABLE, device="NVIDIA H100") == "triton"
    assert choose("mla", BF16, BF16, head_dim=512, block_size=64, group=16, batch=8, context=4096, table=TABLE,
                  device=H200) == "mosaic"
    assert nearest({}, H200, ("gqa",), 1, 1) is None


def test_only_what_the_mosaic_kernels_take(monkeypatch):
    monkeypatch.setenv("KVJAX_PALLAS_KERNELS", "mosaic")
    base = dict(batch=32, context=8192, table=TABLE, device=H200)
    assert choose("gqa", BF16, BF16, **GQA, **base) == "mosaic"
    assert choose("gqa", BF16, E4M3, **GQA, kv_dtype="fp8_e4m3", **base) == "mosaic"
    assert choose("gqa", BF16, jnp.uint8, **GQA, kv_dtype="nvfp4", num_kv_heads=8, **base) == "mosaic"
    assert choose("gqa", BF16, jnp.int8, **GQA, kv_dtype="int8_per_token_head", num_kv_heads=8, **base) == "mosaic"
    assert choose("ragged", BF16, jnp.int8, **GQA, kv_dtype="int8_per_token_head", num_kv_heads=8, **base) == "mosaic"
    assert choose("ragged", BF16, jnp.uint8, **GQA, kv_dtype="nvfp4", num_kv_heads=8, **base) == "mosaic"
    for page, kw in [(jnp.int8, dict(kv_dtype="int8_per_token_head")),  # needs the kv heads
                     (jnp.int8, dict(kv_dtype="int8_per_token_head", num_kv_heads=4)),  # < 8 WGMMA columns
                     (jnp.uint8, dict(kv_dtype="nvfp4", num_kv_heads=1)),  # 72 bytes a row: no TMA tensor
                     (jnp.uint8, dict(kv_dtype="nvfp4", num_kv_heads=8, head_dim=256)),  # SMEM
                     (BF16, dict(block_size=24)),  # default tiles: 2 pages of 24 = 48 positions, no wgmma tile
                     (BF16, dict(block_size=512))]:  # a step of 512 positions
        assert choose("ragged", BF16, page, **{**GQA, **kw}, **base) == "triton", (page, kw)
    for q, page, kw in [(jnp.float32, jnp.float32, {}),  # wgmma: no exact f32
                        (BF16, jnp.uint8, dict(kv_dtype="nvfp4")),  # nvfp4 needs the kv heads (its TMA view)
                        (BF16, jnp.uint8, dict(kv_dtype="nvfp4", num_kv_heads=1)),  # 72 bytes a row: no TMA tensor
                        (BF16, jnp.uint8, dict(kv_dtype="nvfp4", num_kv_heads=8, head_dim=256)),  # SMEM
                        (BF16, jnp.int8, dict(kv_dtype="int8_per_token_head")),  # needs the kv heads
                        (BF16, jnp.int8, dict(kv_dtype="int8_per_token_head", num_kv_heads=4)),  # < 8 WGMMA columns
                        (BF16, jnp.int8, dict(kv_dtype="int8_per_token_head", num_kv_heads=8, block_size=4)),
                        (BF16, BF16, dict(block_size=4))]:
        assert choose("gqa", q, page, **{**GQA, **kw}, **base) == "triton", (q, page, kw)
    monkeypatch.setattr(mgpu_dispatch, "device_kind", lambda: None)  # what a CPU or a pre-Hopper GPU reports
    assert choose("gqa", BF16, BF16, **GQA, batch=32, context=8192, table=TABLE) == "triton", \
        "no Hopper GPU: always Triton"
    monkeypatch.setenv("KVJAX_PALLAS_KERNELS", "triton")
    assert choose("gqa", BF16, BF16, **GQA, **base) == "triton"
    monkeypatch.setenv("KVJAX_PALLAS_KERNELS", "fastest")
    with pytest.raises(ValueError, match="KVJAX_PALLAS_KERNELS='fastest'"):
        choose("gqa", BF16, BF16, **GQA, **base)


def test_table_from_bench_rows_round_trips():
    row = dict(kind="gqa", q_dtype="bfloat16", dtype="float8_e4m3fn", head_dim=128, group=4, batch=32, context=8192)
    rows = [dict(row, impl="triton", seconds=3e-4), dict(row, impl="mosaic", seconds=2e-4),
            dict(row, impl="xla_ref", seconds=1e-5),  # not a Pallas family: ignored
            dict(row, batch=8, impl="mosaic", seconds=1e-4),  # Triton not measured there: left out
            dict(row, batch=128, impl="triton", seconds=1e-3), dict(row, batch=128, impl="mosaic", seconds=2e-3)]
    table = table_from_rows(rows, H200)
    assert table == {(H200, "gqa", "bfloat16", "float8_e4m3fn", 128, 4, 32, 8192): "mosaic",
                     (H200, "gqa", "bfloat16", "float8_e4m3fn", 128, 4, 128, 8192): "triton"}
    namespace = {}
    exec(render_table_module(table, source="a test"), namespace)
    assert namespace["MEASURED"] == table


def test_pallas_impl_runs_the_chosen_kernel(monkeypatch):
    """On a (pretended) H200 the "pallas" decode runs the Mosaic GPU kernel when chosen — here in
    the CPU interpreter — with the reference's result, and the Triton kernel otherwise."""
    calls = []
    for module in (mgpu_decode, pallas_decode):
        original = module.paged_decode
        monkeypatch.setattr(module, "paged_decode",
                            lambda *a, _o=original, _m=module.__name__, **kw: calls.append(_m) or _o(*a, **kw))
    monkeypatch.setattr(mgpu_dispatch, "device_kind", lambda: H200)
    rng = np.random.default_rng(0)
    k_pages = jnp.asarray(rng.standard_normal((9, 16, 2, 64)), BF16)
    v_pages = jnp.asarray(rng.standard_normal((9, 16, 2, 64)), BF16)
    q = jnp.asarray(rng.standard_normal((2, 8, 64)), BF16)
    tables, lens = jnp.asarray([[3, 1, 7, 5], [2, 8, 4, 6]], jnp.int32), jnp.asarray([50, 17], jnp.int32)
    want = get_impl("reference").decode(q, k_pages, v_pages, tables, lens, scale=0.125)
    for forced, module in (("mosaic", "kvjax.attention.mgpu_decode"), ("triton", "kvjax.attention.pallas_decode")):
        monkeypatch.setenv("KVJAX_PALLAS_KERNELS", forced)
        calls.clear()
        got = get_impl("pallas").decode(q, k_pages, v_pages, tables, lens, scale=0.125)
        assert calls == [module]
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=2e-2)


def test_pallas_ragged_passes_the_pages_format_through(monkeypatch):
    """The "pallas" ragged function hands the Mosaic GPU kernel, when chosen, the pages' format and
    their per-token scale pages as they are (the kernel itself: test_mgpu_ragged_quant.py)."""
    from kvjax.attention import mgpu_ragged
    from kvjax.attention.metadata import build_metadata

    seen = {}
    monkeypatch.setattr(mgpu_ragged, "ragged_paged_attention", lambda q, k, v, md, **kw: seen.update(kw) or q)
    monkeypatch.setattr(mgpu_dispatch, "device_kind", lambda: H200)
    monkeypatch.setenv("KVJAX_PALLAS_KERNELS", "mosaic")
    md = build_metadata([3], [2], [[1]], block_size=16, max_tokens=4, max_seqs=1, max_blocks_per_seq=2)
    pages, scales = jnp.zeros((4, 16, 8, 64), jnp.int8), jnp.ones((4, 16, 8), jnp.float32)
    q = jnp.zeros((4, 16, 64), BF16)
    get_impl("pallas").ragged(q, pages, pages, md, scale=0.5, k_scale=scales, v_scale=2 * scales, window=7,
                              kv_dtype="int8_per_token_head")
    assert seen["kv_dtype"] == "int8_per_token_head" and seen["window"] == 7 and seen["scale"] == 0.5
    assert seen["k_scale"] is scales and float(seen["v_scale"][0, 0, 0]) == 2.0


def test_mla_ragged_steps_take_the_mosaic_kernel_where_it_can_run(monkeypatch):
    """MLA's ragged (prefill / mixed) steps: mgpu_ragged_mla's own rules decide (kv_lora_rank a
    multiple of 128, C of 64, Z of 8; per-token latent scales with Z a multiple of 32), and the
    "pallas" function hands the chosen kernel the pages' format and scale pages as they are."""
    from kvjax.attention import mgpu_ragged_mla
    from kvjax.attention.metadata import build_metadata

    monkeypatch.setenv("KVJAX_PALLAS_KERNELS", "mosaic")
    mla = dict(head_dim=512, block_size=64, group=16, batch=1, context=8192, table=TABLE, device=H200)
    assert choose("mla_ragged", BF16, BF16, **mla, channels=576) == "mosaic"
    assert choose("mla_ragged", BF16, E4M3, **mla, channels=576, kv_dtype="fp8_e4m3") == "mosaic"
    assert choose("mla_ragged", BF16, jnp.int8, **mla, channels=576, kv_dtype="int8_per_token_head") == "mosaic"
    for page, kw in [(BF16, dict(channels=None)),  # the latent width unknown: no guess
                     (BF16, dict(channels=576, head_dim=448)),  # kv_lora_rank not a multiple of 128
                     (BF16, dict(channels=560)),  # C not a multiple of 64
                     (jnp.int8, dict(channels=576, block_size=16, kv_dtype="int8_per_token_head")),  # Z % 32
                     (jnp.uint8, dict(channels=576, kv_dtype="nvfp4"))]:  # neither MLA kernel reads nvfp4
        assert choose("mla_ragged", BF16, page, **{**mla, **kw}) == "triton", (page, kw)
    seen = {}
    monkeypatch.setattr(mgpu_ragged_mla, "mla_ragged_paged_attention",
                        lambda ql, qr, c, md, **kw: seen.update(kw) or ql)
    monkeypatch.setattr(mgpu_dispatch, "device_kind", lambda: H200)
    md = build_metadata([3], [2], [[1]], block_size=32, max_tokens=4, max_seqs=1, max_blocks_per_seq=2)
    latent, scales = jnp.zeros((4, 32, 192), jnp.int8), jnp.ones((4, 32), jnp.float32)
    get_impl("pallas").mla_ragged(jnp.zeros((4, 16, 128), BF16), jnp.zeros((4, 16, 64), BF16), latent, md, scale=0.5,
                                  latent_scale=scales, kv_dtype="int8_per_token_head")
    assert seen["kv_dtype"] == "int8_per_token_head" and seen["latent_scale"] is scales and seen["scale"] == 0.5


def test_scaled_formats_have_table_entries_of_their_own(monkeypatch):
    """Per-token fp8 pages are float8_e4m3fn as static fp8's are, and nvfp4's are bytes: the table
    keys them by format, so a measurement of one never decides for the other."""
    monkeypatch.delenv("KVJAX_PALLAS_KERNELS", raising=False)
    row = dict(kind="gqa", q_dtype="bfloat16", dtype="float8_e4m3fn", head_dim=128, group=4, batch=32, context=8192)
    rows = [dict(row, kv_dtype="fp8_e4m3", impl="triton", seconds=1e-4), dict(row, kv_dtype="fp8_e4m3", impl="mosaic",
                                                                           seconds=2e-4),
            dict(row, kv_dtype="fp8_per_token_head", impl="triton", seconds=2e-4),
            dict(row, kv_dtype="fp8_per_token_head", impl="mosaic", seconds=1e-4)]
    table = table_from_rows(rows, H200)
    assert table == {(H200, "gqa", "bfloat16", "float8_e4m3fn", 128, 4, 32, 8192): "triton",
                     (H200, "gqa", "bfloat16", "fp8_per_token_head", 128, 4, 32, 8192): "mosaic"}
    base = dict(**GQA, batch=32, context=8192, table=table, device=H200, num_kv_heads=8)
    assert choose("gqa", BF16, E4M3, kv_dtype="fp8_e4m3", **base) == "triton"
    assert choose("gqa", BF16, E4M3, kv_dtype="fp8_per_token_head", **base) == "mosaic"
