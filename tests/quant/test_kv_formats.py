"""The KV format registry (kvjax.quant.kv_formats): its table against JAX's dtypes, and its one lookup."""
import jax.numpy as jnp
import pytest

from kvjax.core.kv_cache_interface import SpecError
from kvjax.quant.kv_formats import FP8_FORMATS, KV_DTYPES, KV_FORMATS, SCALE_KINDS, kv_format, kv_formats


@pytest.mark.parametrize("name", [n for n, f in KV_FORMATS.items() if f.scale != "per_block"])
def test_table_matches_the_storage_dtype(name):
    """max, bits and integer-ness written in the table are the storage dtype's own."""
    f = KV_FORMATS[name]
    dtype = f.dtype
    info = jnp.iinfo(dtype) if f.integer else jnp.finfo(dtype)
    assert f.max == float(info.max) and f.bits == 8 * dtype.itemsize and f.scale in SCALE_KINDS
    assert jnp.issubdtype(dtype, jnp.integer) == f.integer
    assert f.quantized == (f.scale != "none") == (f.bits < 16)


def test_every_alias_names_one_format_and_the_lookup_normalises():
    names = [a for f in KV_FORMATS.values() for a in (f.name, *f.aliases)]
    assert len(names) == len(set(names)) and all(a == a.lower() for a in names)
    for f in KV_FORMATS.values():
        for alias in (f.name, *f.aliases, f.name.upper()):
            assert kv_format(alias) is f
        assert kv_format(f) is f
    assert kv_format("fp8").name == "fp8_e4m3"
    with pytest.raises(SpecError, match="unknown kv dtype .auto."):  # the model's dtype, resolved once elsewhere
        kv_format("auto")
    assert kv_format("bfloat16").name == "bf16" and kv_format("float").name == "fp32"
    assert set(KV_DTYPES) == set(KV_FORMATS) | {"fp8"}
    with pytest.raises(SpecError, match="unknown kv dtype 'fp6'; choose one of fp32, bf16"):
        kv_format("fp6")


def test_scale_kinds_and_what_pages_store():
    assert FP8_FORMATS == ("fp8_e4m3", "fp8_e5m2")
    assert [f.name for f in kv_formats("per_token")] == ["int8_per_token_head", "fp8_per_token_head"]
    assert [f.name for f in kv_formats("none")] == ["fp32", "bf16", "fp16"]
    # nvfp4 packs two E2M1 values (max 6) per uint8 byte and one e4m3 scale byte per 16 values
    nv = kv_format("nvfp4")
    assert nv.dtype == jnp.uint8 and nv.bits == 4 and nv.max == 6.0 and nv.vector_bytes(16) == 8 + 1
