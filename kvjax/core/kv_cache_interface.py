"""KV layout of one model, and its exact byte accounting.

This module is the arithmetic of SPEC "The per-token formula" and "KV dtypes" (SPEC and the
`kvjax plan` tables write it f × L × Hkv × D × b; here in the package legend's letters):

    bytes per token = f × L × K × H × b        (f = 2 for MHA/GQA/MQA: K and V; f = 1 for MLA)

and of vLLM V1's per-layer page size (`vllm/v1/kv_cache_interface.py`, `AttentionSpec.page_size_bytes`
and `MLAAttentionSpec`):

    page bytes = num_kv_heads × block_size × (head_size + head_size_v) × dtype_size

with head_size_v = 0 and num_kv_heads = 1 for MLA, whose single cached vector per token is the
compressed latent c_kv (kv_lora_rank) concatenated with the rope key (qk_rope_head_dim).
A block's bytes are the sum of its layers' pages (one KV cache group).

Every byte count here is an exact integer. Element widths that are not whole bytes (nvfp4:
4 bits + one fp8 scale per 16 values) are handled per *vector* (one token × one head), never
by multiplying a float width: see `KVFormat.vector_bytes`. The formats themselves (widths,
aliases, scales) are kvjax.quant.kv_formats's table.

A named or Hugging Face model's layout comes from its parsed config: kvjax.config.model's
`ModelConfig.kv_spec`. Shapes are not used here; this is plain Python with no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.quant.kv_formats import KVFormat, SpecError, kv_format  # SpecError: re-exported for the spec's users
from kvjax.utils.checks import INT32_MAX, check_int

KINDS = ("mha", "gqa", "mqa", "mla")


def attention_kind(num_heads: int, num_kv_heads: int) -> str:
    """The name of a layout with separate K and V per kv head: MHA (a kv head per query head), MQA
    (one kv head) or GQA (in between). One query head with one kv head is MHA."""
    return "mha" if num_kv_heads == num_heads else ("mqa" if num_kv_heads == 1 else "gqa")


# --------------------------------------------------------------------------------------------
# The layout
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KVSpec:
    """One model's KV layout. Frozen: derived values are properties, no given value is changed
    (a dtype alias is only spelt as its format's name, below).

    For MLA, num_kv_heads is 1 and head_dim is kv_lora_rank + qk_rope_head_dim (checked, not
    filled in: pass them consistently or use `KVSpec.mla(...)`). qk_nope_head_dim and
    v_head_dim are only used for the "same-shape MHA" ratio.
    skip_layers keep `model_dtype` instead of `kv_dtype` (vLLM `--kv-cache-dtype-skip-layers`),
    so a block mixes widths; every byte count sums layer by layer.
    kv_dtype and model_dtype are stored as the format's own name, whichever alias was given
    (`fp8` becomes `fp8_e4m3`, `bfloat16` `bf16`: kvjax.quant.kv_formats.kv_format), so no
    reader normalises them again; an unknown name raises SpecError.
    """

    kind: str
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int  # MHA/GQA/MQA: per-head dim of K (and V); MLA: kv_lora_rank + qk_rope_head_dim
    kv_dtype: str = "bf16"  # a kvjax.quant.kv_formats name
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    skip_layers: tuple[int, ...] = ()
    model_dtype: str = "bf16"
    name: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpecError(f"unknown attention kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            check_int(getattr(self, field), field, 1, INT32_MAX, SpecError)
        # The same format under its one name: a frozen field, set once here, before anything reads it.
        object.__setattr__(self, "kv_dtype", kv_format(self.kv_dtype).name)
        object.__setattr__(self, "model_dtype", kv_format(self.model_dtype).name)
        if self.kind == "mla":
            if not self.kv_lora_rank or not self.qk_rope_head_dim:
                raise SpecError("an MLA layout needs kv_lora_rank and qk_rope_head_dim")
            if self.num_kv_heads != 1:
                raise SpecError(f"MLA caches one latent per token: num_kv_heads must be 1, got {self.num_kv_heads}")
            if self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim:
                raise SpecError(f"MLA head_dim must be kv_lora_rank + qk_rope_head_dim = "
                                f"{self.kv_lora_rank + self.qk_rope_head_dim}, got {self.head_dim}")
        else:
            if self.num_heads % self.num_kv_heads:
                raise SpecError(f"num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}")
            expect = {"mha": self.num_kv_heads == self.num_heads, "mqa": self.num_kv_heads == 1,
                      "gqa": 1 <= self.num_kv_heads <= self.num_heads}[self.kind]
            if not expect:
                raise SpecError(f"kind {self.kind!r} does not match {self.num_kv_heads} kv heads for "
                                f"{self.num_heads} query heads")
        for layer in self.skip_layers:
            if not 0 <= layer < self.num_layers:
                raise SpecError(f"skip layer {layer} is outside 0..{self.num_layers - 1}")

    @classmethod
    def mla(cls, num_layers: int, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int,
            qk_nope_head_dim: int | None = None, v_head_dim: int | None = None, **kw) -> "KVSpec":
        return cls("mla", num_layers, num_heads, 1, kv_lora_rank + qk_rope_head_dim,
                   kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                   qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, **kw)

    def replace(self, **changes) -> "KVSpec":
        return dataclasses.replace(self, **changes)

    # ---- per-token and per-block bytes ------------------------------------------------------
    @property
    def factor(self) -> int:
        """f: cached vectors per token per kv head (K and V, or one MLA latent)."""
        return 1 if self.kind == "mla" else 2

    def layer_dtype(self, layer: int) -> KVFormat:
        return kv_format(self.model_dtype if layer in self.skip_layers else self.kv_dtype)

    def layer_bytes_per_token(self, layer: int) -> int:
        return self.factor * self.num_kv_heads * self.layer_dtype(layer).vector_bytes(self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """f × L × K × H × b, summed layer by layer (skip layers at their own width)."""
        return self._sum_layers(self.layer_bytes_per_token)

    def page_bytes(self, layer: int, block_size: int) -> int:
        """vLLM's page for one layer: num_heads × block_size × (head_size + head_size_v) × dtype."""
        check_int(block_size, "block_size", 1, None, SpecError)
        return block_size * self.layer_bytes_per_token(layer)

    def bytes_per_block(self, block_size: int) -> int:
        """One block of the (single) KV cache group: the sum of its layers' pages."""
        return self._sum_layers(lambda layer: self.page_bytes(layer, block_size))

    def _sum_layers(self, per_layer) -> int:
        """per_layer(i) summed over the layers: the skip layers one by one, the others (which all
        have the kv dtype's width) as one product, so that any layer count sums instantly."""
        skipped = sorted(set(self.skip_layers))
        plain = next(i for i in range(len(skipped) + 1) if i not in skipped)  # a layer at the kv dtype
        return sum(per_layer(i) for i in skipped) + (self.num_layers - len(skipped)) * per_layer(plain)

    def bytes_per_request(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens

    # ---- comparisons ------------------------------------------------------------------------
    @property
    def mha_equivalent_bytes_per_token(self) -> int:
        """Bytes per token if every query head had its own K and V ("same-shape MHA").

        For MLA, SPEC Table 1 takes the MHA equivalent as query heads × (qk_nope_head_dim for
        K + v_head_dim for V), e.g. DeepSeek-V3's 128 heads × 128 + 128 dims.
        """
        b = kv_format(self.kv_dtype).vector_bytes
        if self.kind == "mla":
            if not self.qk_nope_head_dim or not self.v_head_dim:
                raise SpecError("the MLA same-shape MHA ratio needs qk_nope_head_dim and v_head_dim")
            return self.num_layers * self.num_heads * (b(self.qk_nope_head_dim) + b(self.v_head_dim))
        return 2 * self.num_layers * self.num_heads * b(self.head_dim)

    @property
    def mha_ratio(self) -> float:
        return self.mha_equivalent_bytes_per_token / self.bytes_per_token

    # ---- tensor parallel ----------------------------------------------------------------------
    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one rank holds (vLLM `ModelConfig.get_num_kv_heads`).

        MHA/GQA split kv heads over ranks; when tp > K each head is replicated on tp / K
        ranks so every rank holds one. MLA's single latent is replicated on every rank.
        """
        check_int(tp, "tp", 1, None, SpecError)
        if self.kind == "mla":
            return 1
        if self.num_heads % tp:
            raise SpecError(f"tp {tp} does not divide the {self.num_heads} query heads")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise SpecError(f"tp {tp} and {self.num_kv_heads} kv heads: one must divide the other")
        return max(1, self.num_kv_heads // tp)

    def per_rank(self, tp: int) -> "KVSpec":
        """The layout one tensor-parallel rank holds."""
        if tp == 1 or self.kind == "mla":
            self.kv_heads_per_rank(tp)  # validates tp
            return self
        kv = self.kv_heads_per_rank(tp)
        heads = self.num_heads // tp
        return self.replace(num_heads=heads, num_kv_heads=kv, kind=attention_kind(heads, kv))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
