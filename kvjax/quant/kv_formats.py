"""The KV format registry: every kv dtype kvjax knows, its aliases, storage and scales, in one table.

vLLM names a KV cache's element format with `--kv-cache-dtype` (`vllm/config/cache.py`:
"auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", ...; "auto", the model's dtype, is resolved once, by
kvjax.config.engine.resolve_kv_dtype, and is no format here). Each row of `KV_FORMATS` says, for one
such format, everything the rest of kvjax needs to know about it:

    name                 aliases             storage         max      scale      bits  + scales
    fp32                 float32, float      float32         3.4e38   none       32
    bf16                 bfloat16            bfloat16        3.4e38   none       16
    fp16                 float16, half       float16         65504    none       16
    fp8_e4m3             fp8                 float8_e4m3fn   448      static      8
    fp8_e5m2                                 float8_e5m2     57344    static      8
    int8_per_token_head                      int8            127      per_token   8    f32 per vector
    fp8_per_token_head                       float8_e4m3fn   448      per_token   8    f32 per vector
    nvfp4                                    (no page)       6        per_block   4    fp8 per 16 values

Scale kinds: `none`, stored as is; `static`, one dequantization scale per layer per kv head (or
per MLA latent channel) kept beside the pages, vLLM's k_scale / v_scale (kvjax.quant.formats);
`per_token`, a scale written with every token for each kv head (scale pages [P, Z, K]);
`per_block`, one scale per `group` elements inside a vector, stored in the vector's own bytes, and a
static per-tensor scale per layer per kv head beside the pages (nvfp4: kvjax.quant.nvfp4's packed
layout, pages of uint8 [P, Z, K, H/2 + H/16]).

`kv_format(name)` is the one lookup: any alias, any case, → the format, whose `name` is the
normalised name a `KVSpec` carries. Plain Python with no JAX or NumPy at import, so that
`kvjax plan` and the byte accounting (kvjax.core.kv_cache_interface) start instantly: storage
dtypes are names, resolved to JAX dtypes on first use by `KVFormat.dtype`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv

SCALE_KINDS = ("none", "static", "per_token", "per_block")


class SpecError(KvjaxError):
    """A model layout or dtype that breaks a rule; the message names the value and the rule.

    Defined here, below kvjax.core.kv_cache_interface (which re-exports it), because an unknown
    kv dtype name is the first such rule."""


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """Storage format of one cached element (one row of the table in the module docstring).

    bits: storage bits per element. group/group_scale_bytes: a block-scaled format stores one
    scale of `group_scale_bytes` per `group` elements (nvfp4: one fp8 scale per 16 fp4 values).
    vector_scale_bytes: a scale stored per vector, i.e. per token per kv head, for K and for V
    separately (int8_per_token_head: one fp32 per token per head).
    """

    name: str
    aliases: tuple[str, ...]  # other names kv_format accepts (lower case)
    storage: str  # the dtype pages store, by name (kvjax.worker.paged_cache); "" if there is no page format
    max: float  # largest finite magnitude of the storage dtype: quantizing saturates here
    scale: str  # one of SCALE_KINDS
    bits: int
    group: int = 0
    group_scale_bytes: int = 0
    vector_scale_bytes: int = 0

    def vector_bytes(self, dim: int) -> int:
        """Exact bytes of one cached vector of `dim` elements, including its own scales."""
        if (dim * self.bits) % 8:
            raise SpecError(f"kv dtype {self.name}: head dim {dim} × {self.bits} bits is not a whole number of bytes")
        data = dim * self.bits // 8
        scales = cdiv(dim, self.group) * self.group_scale_bytes if self.group else 0
        return data + scales + self.vector_scale_bytes

    @property
    def quantized(self) -> bool:
        """Stored with a dequantization scale: x ≈ stored × scale."""
        return self.scale != "none"

    @property
    def integer(self) -> bool:
        return self.storage.startswith("int")

    @property
    def dtype(self) -> Any:
        """The JAX dtype of the pages (imports JAX: only code that builds arrays asks)."""
        if not self.storage:
            raise SpecError(f"kv dtype {self.name!r} has no page format")
        import jax.numpy as jnp

        return jnp.dtype(self.storage)


_F32_MAX, _BF16_MAX = 3.4028234663852886e38, 3.3895313892515355e38  # jnp.finfo(...).max, checked by a test

KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("fp32", ("float32", "float"), "float32", _F32_MAX, "none", 32),
    KVFormat("bf16", ("bfloat16",), "bfloat16", _BF16_MAX, "none", 16),
    KVFormat("fp16", ("float16", "half"), "float16", 65504.0, "none", 16),
    KVFormat("fp8_e4m3", ("fp8",), "float8_e4m3fn", 448.0, "static", 8),  # no inf: a bare cast of 470 gives NaN
    KVFormat("fp8_e5m2", (), "float8_e5m2", 57344.0, "static", 8),  # a bare cast of >= 61440 gives inf
    KVFormat("int8_per_token_head", (), "int8", 127.0, "per_token", 8, vector_scale_bytes=4),
    KVFormat("fp8_per_token_head", (), "float8_e4m3fn", 448.0, "per_token", 8, vector_scale_bytes=4),
    KVFormat("nvfp4", (), "uint8", 6.0, "per_block", 4, group=16, group_scale_bytes=1),
)}
KV_DTYPES = tuple(KV_FORMATS) + ("fp8",)  # the names error messages offer (vLLM's fp8 among them)
_BY_NAME = {alias: f for f in KV_FORMATS.values() for alias in (f.name, *f.aliases)}


def kv_format(name: str | KVFormat) -> KVFormat:
    """The format called `name`: its own name or an alias, any case (`fp8` = `fp8_e4m3`, `float32`
    = fp32). Unknown names raise SpecError ("auto" too: it names the model's dtype, not a format;
    kvjax.config.engine.resolve_kv_dtype)."""
    if isinstance(name, KVFormat):
        return name
    key = str(name).lower()
    if key not in _BY_NAME:
        raise SpecError(f"unknown kv dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")
    return _BY_NAME[key]


def kv_formats(*scales: str) -> tuple[KVFormat, ...]:
    """The formats whose scale kind is one of `scales`, in table order."""
    return tuple(f for f in KV_FORMATS.values() if f.scale in scales)


FP8_FORMATS = tuple(f.name for f in kv_formats("static"))  # what a scales file may be made for
