"""The paged KV cache: a pytree of per-layer pages, slot-mapped writes, block-table gathers.

This reproduces the device side of vLLM V1's paged KV cache (`vllm/v1/worker/gpu_model_runner.py`
allocating one tensor per layer from `KVCacheSpec.page_size_bytes`, `reshape_and_cache_flash`
writing through `slot_mapping`, attention kernels reading through `block_table`):

- Pages. Per layer, K and V are arrays shaped [P, Z, K, H]: P physical blocks of Z token slots
  for K kv heads of dim H. That is vLLM's flash-attention layout for one layer (its
  [2, P, Z, K, H] tensor split into its K and V halves). MLA caches one vector per token, the
  compressed latent c_kv concatenated with the rope key, so its page is [P, Z, C] with
  C = kv_lora_rank + qk_rope_head_dim (SPEC: f = 1, one kv head).
- Per-layer arrays, not one layer-stacked array. They match vLLM's per-layer tensors, let a
  layer skipped by fp8 quantization (`--kv-cache-dtype-skip-layers`) keep its own dtype, and
  under `jax.jit(..., donate_argnums=...)` each layer's write updates its own buffer in place
  (a stacked array would need a dynamic-update-slice per layer into one big buffer).
- Slots. Token slot s = block_id × Z + offset lives at flat row s of the page viewed as
  [P × Z, ...]. A write is one scatter per array; padding tokens carry slots inside the null
  block 0, which the block pool never hands out (SPEC "Budget → blocks"), so whatever they
  write is garbage that no block table points at.
- Reads gather whole blocks by block table: [B, M] block ids → [B, M × Z, ...] positions.
  Table entries past a sequence's last block are 0 (the null block); attention masks them by
  context length, and never lets their values reach an output (see kvjax.attention.reference).

Quantized layers (kvjax.quant.formats) store x / scale in the narrow dtype and keep the scales beside
the pages, in this pytree: fp8 layers a static f32[K] per kv head for K and for V (a
per-tensor scale is broadcast; MLA: f32[C] per latent channel), int8_per_token_head layers
scale pages f32[P, Z, K] (MLA: f32[P, Z]) written with every token, nvfp4 layers uint8 pages
[P, Z, K, H/2 + H/16] of packed E2M1 values and their e4m3 block scales (kvjax.quant.nvfp4) with a
per-tensor f32[K] beside them. Quantizing writes saturate
and count non-finite inputs in each layer's `nonfinite` counter, so a NaN or inf reaching a
quantized cache is reported rather than silently transformed (NaN is kept, visible; ±inf
saturates to ±max). Unquantized pages store NaN and inf as they are and count nothing.

The contiguous cache (`ContiguousCache`) is the baseline paging is measured against: per
layer one row of max_len positions per batch row, K/V [B, S, K, H] (MLA [B, S, C]), written at
(row, position) and read in place, with no block table. Models write every layer through
`write_step` and attend through `kvjax.attention`, which take either kind, so a paged and a
contiguous run execute the same Flax modules and differ only in where K/V live. It stores
unquantized KV only and cannot share prefixes (a row belongs to one request).

Byte accounting is kvjax.core.kv_cache_interface's: `kv_nbytes` (pages, and int8's per-token scale pages, which
the spec counts per vector) equals P × spec.bytes_per_block(Z) exactly; the static fp8 scales
are `scale_nbytes`, outside the per-block formula as in vLLM (SPEC: "left out of the simple
formula: ... quantization scales").
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.core.kv_cache_interface import KVSpec
from kvjax.errors import KvjaxError
from kvjax.quant import formats as quant
from kvjax.quant import nvfp4
from kvjax.quant.kv_formats import KVFormat, kv_format
from kvjax.utils.checks import check_int


class CacheError(KvjaxError):
    """A cache built or used with sizes that break a rule; the message names the value."""


@struct.dataclass
class KVPages:
    """One MHA/GQA/MQA layer: K and V pages, and their dequantization scales if quantized."""

    k: jax.Array  # [P, Z, K, H] in the layer's kv dtype
    v: jax.Array  # [P, Z, K, H]
    k_scale: jax.Array | None = None  # fp8: f32[K]; int8_per_token_head: f32[P, Z, K]; else None
    v_scale: jax.Array | None = None  # as k_scale
    nonfinite: jax.Array | None = None  # i32[]: NaN/inf values written so far
    kv_dtype: str | None = struct.field(pytree_node=False, default=None)  # its kvjax.quant.kv_formats name


@struct.dataclass
class LatentPages:
    """One MLA layer: the latent page, c_kv (first kv_lora_rank lanes) then the rope key."""

    latent: jax.Array  # [P, Z, C]
    scale: jax.Array | None = None  # fp8: f32[C] per channel; int8_per_token_head: f32[P, Z]; else None
    nonfinite: jax.Array | None = None  # i32[]
    kv_dtype: str | None = struct.field(pytree_node=False, default=None)  # its kvjax.quant.kv_formats name
    # decode context parallelism: the mesh whose "dcp" axis splits the token axis Z (kvjax.worker.dcp_pages: which
    # rank holds which token); None: every rank holds every token
    dcp_mesh: Any = struct.field(pytree_node=False, default=None)


LayerPages = KVPages | LatentPages


@struct.dataclass
class ContiguousKV:
    """One MHA/GQA/MQA layer of the contiguous cache: row r holds batch row r's positions."""

    k: jax.Array  # [B, S, K, H]
    v: jax.Array  # [B, S, K, H]


@struct.dataclass
class ContiguousLatent:
    """One MLA layer of the contiguous cache."""

    latent: jax.Array  # [B, S, C]


LayerRows = ContiguousKV | ContiguousLatent


@struct.dataclass
class PagedCache:
    """All layers' pages. `layers[i]` is layer i's KVPages (or LatentPages for MLA), or, with KV
    cache groups, the i-th of the page tensors the groups share (vLLM's hybrid layout: a block
    belongs to one group at a time, so the j-th layer of every group writes tensor j; layer i's is
    `layers[layer_slots[i]]`, `slot_of(i)`)."""

    layers: tuple[LayerPages, ...]
    block_size: int = struct.field(pytree_node=False)  # Z
    layer_slots: tuple = struct.field(pytree_node=False, default=())  # each layer's tensor; () = its own

    def slot_of(self, layer: int) -> int:
        """The index in `layers` of layer `layer`'s pages."""
        return self.layer_slots[layer] if self.layer_slots else layer

    @property
    def num_layers(self) -> int:
        return len(self.layer_slots) if self.layer_slots else len(self.layers)

    @classmethod
    def create(cls, spec: KVSpec, num_blocks: int, block_size: int,
               scales: quant.KVScales | None = None, layer_slots: tuple = ()) -> "PagedCache":
        """Zeroed pages for `spec`: num_blocks blocks (block 0 the null block) of block_size slots.

        fp8 layers take their static scales from `scales` (per layer: K and V f32[K], or the
        MLA latent's f32[C]); without it they get vLLM's default, 1.0 everywhere. layer_slots:
        with KV cache groups, each layer's tensor (its place in its group); the layers sharing a
        tensor must share its format, so per-layer kv dtypes and calibrated scales are refused.
        """
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            check_int(value, name, 1, None, CacheError)
        if num_blocks < 2:
            raise CacheError(f"num_blocks {num_blocks} leaves no usable block: block 0 is the null block")
        _check_scales(spec, scales)
        if layer_slots:
            layer_slots = tuple(int(j) for j in layer_slots)
            if len(layer_slots) != spec.num_layers or sorted(set(layer_slots)) != list(range(max(layer_slots) + 1)):
                raise CacheError(f"layer_slots {layer_slots} must give each of the {spec.num_layers} layers one of "
                                 "the tensors 0, 1, ..., each used")
            if scales is not None or len({spec.layer_dtype(i).name for i in range(spec.num_layers)}) > 1:
                raise CacheError("KV cache groups share page tensors between layers: per-layer kv dtypes "
                                 "(kv_cache_dtype_skip_layers) and calibrated per-layer scales cannot be shared")
        layers = []
        for i in range(max(layer_slots) + 1 if layer_slots else spec.num_layers):
            kv = spec.layer_dtype(i)
            dtype = kv.dtype
            width = spec.head_dim
            if kv.scale == "per_block":  # nvfp4: packed values and their block scales
                refusal = nvfp4.page_refusal(spec.kind, spec.head_dim)
                if refusal:
                    raise CacheError(f"kv dtype {kv.name!r} {refusal}")
                width = nvfp4.packed_width(spec.head_dim)
            zero = jnp.zeros((), jnp.int32)  # one buffer per layer: the jitted step donates each
            if spec.kind == "mla":
                shape = (num_blocks, block_size, spec.head_dim)
                layers.append(LatentPages(jnp.zeros(shape, dtype), _layer_scale(kv, shape, scales, "k", i), zero,
                                          kv.name))
            else:
                shape = (num_blocks, block_size, spec.num_kv_heads, width)
                layers.append(KVPages(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                                      _layer_scale(kv, shape, scales, "k", i),
                                      _layer_scale(kv, shape, scales, "v", i), zero, kv.name))
        return cls(tuple(layers), block_size, layer_slots)

    @property
    def num_blocks(self) -> int:
        return _first_page(self.layers[0]).shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of every array in the cache: kv_nbytes + scale_nbytes + the counters."""
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(self))

    @property
    def kv_nbytes(self) -> int:
        """Pages and per-token scale pages: equals num_blocks × spec.bytes_per_block(block_size)."""
        return sum(a.nbytes for a in _per_slot_arrays(self))

    @property
    def scale_nbytes(self) -> int:
        """Static per-layer dequantization scales (fp8), outside the per-block formula."""
        return sum(a.nbytes for layer in self.layers for a in _scales(layer) if a.ndim <= 1)

    @property
    def nonfinite(self) -> jax.Array:
        """i32[]: NaN/inf values written into any layer so far (0 in a healthy run)."""
        return sum(layer.nonfinite for layer in self.layers if layer.nonfinite is not None)


@struct.dataclass
class ContiguousCache:
    """All layers' rows: `layers[i]` is layer i's ContiguousKV (or ContiguousLatent for MLA)."""

    layers: tuple[LayerRows, ...]

    def slot_of(self, layer: int) -> int:
        return layer

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def create(cls, spec: KVSpec, num_rows: int, max_len: int) -> "ContiguousCache":
        """Zeroed rows: num_rows batch rows of max_len positions, in the spec's (unquantized) dtype."""
        for name, value in (("num_rows", num_rows), ("max_len", max_len)):
            check_int(value, name, 1, None, CacheError)
        layers = []
        for i in range(spec.num_layers):
            kv = spec.layer_dtype(i)
            if kv.quantized:
                raise CacheError(f"the contiguous cache stores unquantized KV only; layer {i} is {kv.name}")
            dtype = kv.dtype
            if spec.kind == "mla":
                layers.append(ContiguousLatent(jnp.zeros((num_rows, max_len, spec.head_dim), dtype)))
            else:
                shape = (num_rows, max_len, spec.num_kv_heads, spec.head_dim)
                layers.append(ContiguousKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
        return cls(tuple(layers))

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(self))

    @property
    def nonfinite(self) -> jax.Array:
        return jnp.zeros((), jnp.int32)  # unquantized: nothing is counted (as PagedCache's unquantized layers)


def _layer_scale(kv: KVFormat, shape: tuple[int, ...], scales: quant.KVScales | None, which: str,
                 layer: int) -> jax.Array | None:
    """The scale array stored beside one layer's K (or V, or MLA latent) pages."""
    if kv.scale == "per_token":  # int8_per_token_head
        return jnp.ones(shape[:-1], jnp.float32)  # [P, Z, K] or [P, Z], written with each token
    if kv.scale == "per_block":  # nvfp4: its per-tensor scale, broadcast per kv head (vLLM's default 1.0)
        return jnp.ones((shape[-2],), jnp.float32)
    if kv.scale != "static":  # fp8 has one static scale per kv head
        return None  # fp32 / bf16 / fp16: stored as is
    width = shape[-2] if len(shape) == 4 else shape[-1]  # K heads, or C latent channels
    if scales is None:
        return jnp.ones((width,), jnp.float32)  # vLLM's default: every scale 1.0
    return jnp.asarray(getattr(scales, which)[layer], jnp.float32).reshape(width)


def _check_scales(spec: KVSpec, scales: quant.KVScales | None) -> None:
    if scales is None:
        return
    width = spec.head_dim if spec.kind == "mla" else spec.num_kv_heads
    groups = {"k": scales.k} if spec.kind == "mla" else {"k": scales.k, "v": scales.v}
    for name, per_layer in groups.items():
        if len(per_layer) != spec.num_layers:
            raise CacheError(f"scales hold {len(per_layer)} {name} layers, the model has {spec.num_layers}")
        for i, s in enumerate(per_layer):
            if s.size != width:
                raise CacheError(f"layer {i} {name} scale has {s.size} values; this layout needs {width} "
                                 f"({'latent channels' if spec.kind == 'mla' else 'kv heads'})")


def _scales(layer: LayerPages) -> list[jax.Array]:
    if not isinstance(layer, (KVPages, LatentPages)):  # a Mamba layer's state (kvjax.worker.mamba_state): no scales
        return []
    found = [layer.k_scale, layer.v_scale] if isinstance(layer, KVPages) else [layer.scale]
    return [a for a in found if a is not None]


def _per_slot_arrays(cache: "PagedCache") -> list[jax.Array]:
    """Arrays with a value per token slot: pages, and per-token scale pages."""
    out = []
    for layer in cache.layers:
        if not isinstance(layer, (KVPages, LatentPages)):  # a Mamba state: one per block, not per token slot
            continue
        out += [layer.k, layer.v] if isinstance(layer, KVPages) else [layer.latent]
        out += [a for a in _scales(layer) if a.ndim >= 2]
    return out


def _first_page(pages: LayerPages) -> jax.Array:
    return pages.latent if isinstance(pages, LatentPages) else pages.k


# --------------------------------------------------------------------------------------------
# Writes: one scatter per page array through the slot mapping.
# --------------------------------------------------------------------------------------------
def _as_bytes(page: jax.Array) -> jax.Array:
    """fp8 pages viewed as uint8 (a bitcast, free); other pages as they are.

    XLA's CPU backend has no fp8 gather, scatter or dynamic-update-slice: it converts the whole
    page array to f16, moves the slots there and converts it back, on every write of every
    layer. For SmolLM2 at batch 1 that made one jitted e4m3 decode step cost 111 ms against bf16's
    28 (35 ms as bytes, on 2 CPU cores); on the bytes the same moves are native and exact."""
    return jax.lax.bitcast_convert_type(page, jnp.uint8) if jnp.dtype(page.dtype).itemsize == 1 and \
        jnp.issubdtype(page.dtype, jnp.floating) else page


def scatter_slots(page: jax.Array, values: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Write values[t] into slot slot_mapping[t] of `page`.

    page: [P, Z, ...] (any trailing shape); values: [T, ...]; slot_mapping: i32[T].
    Padding tokens point into the null block; several of them may hit the same slot, and which
    one wins does not matter because block 0 is never read.
    """
    block_size = page.shape[1]
    values = values.astype(page.dtype)
    # Indexed as [block, offset] rather than as rows of a [P × Z, ...] view: XLA updates the
    # donated page in place either way for a batch of slots, but a single slot (batch 1) becomes
    # a dynamic-update-slice that the reshape made XLA copy the whole page around, up to 4 times.
    out = _as_bytes(page).at[slot_mapping // block_size, slot_mapping % block_size].set(_as_bytes(values))
    return out if out.dtype == page.dtype else jax.lax.bitcast_convert_type(out, page.dtype)


def _encode(page: jax.Array, scale: jax.Array | None, values: jax.Array, slot_mapping: jax.Array,
            kv_dtype: str | None):
    """Quantize values [T, ...] for `page` (of format kv_dtype) and scatter them: returns (page,
    scale, nonfinite)."""
    if scale is None:  # stored as is: a NaN or inf stays what it is, nothing to count
        return scatter_slots(page, values, slot_mapping), None, jnp.zeros((), jnp.int32)
    bad = quant.count_nonfinite(values)  # a cast would hide them: count every one
    fmt = kv_format(kv_dtype)
    if fmt.scale == "per_token":  # int8_per_token_head: a fresh scale per token per head
        q, token_scale = quant.quantize_per_token_head(values, fmt)
        return scatter_slots(page, q, slot_mapping), scatter_slots(scale, token_scale, slot_mapping), bad
    static = scale[:, None] if page.ndim == 4 else scale  # per head [K, 1], or per channel [C]
    if fmt.scale == "per_block":  # nvfp4: the kept scale decodes, its inverse encodes
        return scatter_slots(page, nvfp4.quantize(values, 1.0 / static), slot_mapping), scale, bad
    return scatter_slots(page, quant.quantize(values, static, fmt), slot_mapping), scale, bad


def write_kv(pages: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVPages:
    """k, v: [T, K, H]; slot_mapping: i32[T] → pages with those T tokens written (quantized if
    the pages are)."""
    k_page, k_scale, k_bad = _encode(pages.k, pages.k_scale, k, slot_mapping, pages.kv_dtype)
    v_page, v_scale, v_bad = _encode(pages.v, pages.v_scale, v, slot_mapping, pages.kv_dtype)
    counted = None if pages.nonfinite is None else pages.nonfinite + k_bad + v_bad
    return pages.replace(k=k_page, v=v_page, k_scale=k_scale, v_scale=v_scale, nonfinite=counted)


def write_latent(pages: LatentPages, latent: jax.Array, slot_mapping: jax.Array) -> LatentPages:
    """latent: [T, C] (c_kv then rope key); slot_mapping: i32[T]. Pages split by token over a DCP mesh write on
    each rank the tokens it holds (kvjax.worker.dcp_pages)."""
    if pages.dcp_mesh is not None:
        from kvjax.worker.dcp_pages import write_latent_dcp

        return write_latent_dcp(pages, latent, slot_mapping, write_latent)
    page, scale, bad = _encode(pages.latent, pages.scale, latent, slot_mapping, pages.kv_dtype)
    return pages.replace(latent=page, scale=scale, nonfinite=None if pages.nonfinite is None else pages.nonfinite + bad)


def write_rows(rows: jax.Array, values: jax.Array, md) -> jax.Array:
    """Contiguous write: values[t] ([T, ...]) at row md.seq_ids[t], position md.positions[t] of
    rows [B, S, ...]. Padding tokens (valid False) are dropped: a contiguous cache has no null block."""
    row = jnp.where(md.valid, md.seq_ids, rows.shape[0])  # out of range: dropped
    return rows.at[row, md.positions].set(values.astype(rows.dtype), mode="drop")


def write_step(layer, md, k: jax.Array, v: jax.Array | None = None):
    """Write one layer's new tokens where the step's metadata (`BatchMetadata`) puts them, for
    either cache: k, v [T, K, H], or for MLA the latent [T, C] as k (v None). Paged layers take
    md.slot_mapping; contiguous rows take (md.seq_ids, md.positions). Returns the new layer."""
    if isinstance(layer, KVPages):
        return write_kv(layer, k, v, md.slot_mapping)
    if isinstance(layer, LatentPages):
        return write_latent(layer, k, md.slot_mapping)
    if isinstance(layer, ContiguousKV):
        return ContiguousKV(write_rows(layer.k, k, md), write_rows(layer.v, v, md))
    if isinstance(layer, ContiguousLatent):
        return ContiguousLatent(write_rows(layer.latent, k, md))
    raise CacheError(f"not a cache layer: {type(layer).__name__}")


# --------------------------------------------------------------------------------------------
# Reads: gather whole blocks by block table.
# --------------------------------------------------------------------------------------------
def gather_pages(page: jax.Array, block_tables: jax.Array) -> jax.Array:
    """page: [P, Z, ...]; block_tables: i32[B, M] → [B, M × Z, ...], position s at row s."""
    blocks = _as_bytes(page)[block_tables]  # [B, M, Z, ...]: fp8 gathered as bytes (`_as_bytes`)
    b, m, z = blocks.shape[:3]
    blocks = blocks.reshape(b, m * z, *blocks.shape[3:])
    return blocks if blocks.dtype == page.dtype else jax.lax.bitcast_convert_type(blocks, page.dtype)
