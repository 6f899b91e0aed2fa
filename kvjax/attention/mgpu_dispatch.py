"""Which Pallas kernel family runs a step under attention_backend="pallas": Mosaic GPU or Triton, by measurement.

kvjax has each Pallas kernel twice: on Pallas's Triton backend (kvjax.attention.pallas_decode,
pallas_mla, pallas_ragged), which runs on any CUDA GPU, and on Mosaic GPU (mgpu_decode, mgpu_mla,
mgpu_ragged, mgpu_ragged_mla), which runs on Hopper only (TMA, wgmma). They take the same arguments and
give the same results within the same tolerances, so the choice is speed alone, and speed is measured, not assumed:
experiments/kernel_bench.py times both on the GPU's shapes and writes `mgpu_table.py` (a dict of
measured shapes → winner) for the lead to commit beside this module. `choose` reads it:

1. Mosaic GPU only where it can run: a CUDA device of compute capability 9.x, and a shape and
   format its kernels take (`eligible`: bf16 / f16 queries, pages of q's dtype, static-scale
   fp8 or (GQA decode and ragged) nvfp4 and per-token-head pages, pages of a multiple of 8
   tokens, ...).
   Everything else is Triton, as before.
2. Among the measured shapes of the same kind, dtypes and head layout on this device kind, the
   nearest in (log batch, log context) decides; a shape with no measured neighbour gets Triton
   (the default until a GPU run has measured it).
3. `KVJAX_PALLAS_KERNELS=mosaic|triton` forces one family where it can run (tests, benchmarks);
   unset or "table": the table decides.

The choice is made at trace time from static shapes (context: the block table's width × Z), so a
jitted step compiles one kernel.
"""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

FAMILIES = ("mosaic", "triton")
_ENV = "KVJAX_PALLAS_KERNELS"


def device_kind() -> str | None:
    """The first device's kind ("NVIDIA H200") when it is a Hopper GPU (compute capability 9.x), else None."""
    if jax.default_backend() != "gpu":
        return None
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", ""))
    return dev.device_kind if cc.startswith("9") else None


def eligible(kind: str, q_dtype, page_dtype, *, head_dim: int, block_size: int, group: int = 1,
             kv_dtype: str | None = None, num_kv_heads: int | None = None, channels: int | None = None) -> bool:
    """Whether the Mosaic GPU kernel of `kind` ("gqa", "mla" decode; "ragged", "mla_ragged" steps)
    takes this shape (their ValueError rules). nvfp4 and per-token-head pages: GQA decode and ragged
    steps, which need num_kv_heads (both read boxes spanning every kv head's bytes or scales).
    Ragged steps ask the kernels' own `check_shapes` (mgpu_ragged; mgpu_ragged_mla, which needs the
    latent width `channels`) at their default tiles, so the two cannot disagree."""
    from kvjax.attention.mgpu_decode import FP8_DTYPES, Q_DTYPES
    from kvjax.attention.mgpu_nvfp4 import MAX_HEAD_DIM
    from kvjax.quant.kv_formats import kv_format

    scale = "none" if kv_dtype is None else kv_format(kv_dtype).scale
    if kind == "mla_ragged":  # head_dim: kv_lora_rank
        from kvjax.attention.mgpu_ragged_mla import check_shapes as check_mla

        try:
            check_mla(q_dtype, page_dtype, rank=head_dim, channels=channels or 0, block_size=block_size,
                      scale_kind=scale, kv_dtype=kv_dtype)
        except ValueError:
            return False
        return channels is not None
    if kind == "ragged":  # MHA/GQA/MQA prefill / mixed steps, every format mgpu_ragged reads
        from kvjax.attention.mgpu_ragged import check_shapes

        if num_kv_heads is None and scale in ("per_token", "per_block"):
            return False
        try:
            check_shapes(q_dtype, page_dtype, head_dim=head_dim, block_size=block_size, num_kv_heads=num_kv_heads or 1,
                         group=group, kv_dtype=kv_dtype)
        except ValueError:  # the kernel's refusal: Triton runs the step
            return False
        return True
    if scale == "per_block":  # nvfp4's packed pages (mgpu_nvfp4.check_pages' rules)
        return (kind == "gqa" and num_kv_heads is not None and jnp.dtype(q_dtype) in Q_DTYPES
                and jnp.dtype(page_dtype) == jnp.dtype(jnp.uint8) and block_size % 8 == 0 and head_dim % 16 == 0
                and 64 <= head_dim <= MAX_HEAD_DIM and group <= 64
                and (num_kv_heads * (head_dim // 2 + head_dim // 16)) % 16 == 0)
    if scale == "per_token":  # mgpu_decode's check_shapes: a page's [Z, K] scales fill WGMMA columns
        return (kind == "gqa" and num_kv_heads is not None and num_kv_heads % 8 == 0
                and jnp.dtype(q_dtype) in Q_DTYPES and jnp.dtype(page_dtype) == jnp.dtype(kv_format(kv_dtype).dtype)
                and block_size % 8 == 0 and head_dim % 16 == 0 and group <= 64)
    if scale not in ("none", "static"):
        return False
    q_dtype, page_dtype = jnp.dtype(q_dtype), jnp.dtype(page_dtype)
    if q_dtype not in Q_DTYPES or page_dtype not in (q_dtype, *FP8_DTYPES) or block_size % 8:
        return False
    if kind == "gqa":  # decode steps of MHA/GQA/MQA layers
        return head_dim % 16 == 0 and group <= 64
    return kind == "mla" and head_dim % 128 == 0  # head_dim: kv_lora_rank


def shape_key(kind: str, q_dtype, page_dtype, head_dim: int, group: int, kv_dtype: str | None = None) -> tuple:
    """The part of a measured shape that must match exactly: kind, dtypes, head layout (GQA: the
    group; MLA: the number of heads). Pages with scales per token or per block are keyed by their
    format's name (fp8_per_token_head, nvfp4), since their dtype alone is static fp8's or a byte's."""
    from kvjax.quant.kv_formats import kv_format

    scaled = kv_dtype is not None and kv_format(kv_dtype).scale in ("per_token", "per_block")
    return kind, jnp.dtype(q_dtype).name, kv_dtype if scaled else jnp.dtype(page_dtype).name, int(head_dim), int(group)


def nearest(table: dict, device: str, key: tuple, batch: int, context: int) -> str | None:
    """The winner of the measured shape nearest (log2 batch, log2 context) with this device and key."""
    best, best_d = None, math.inf
    for (dev, *k, b, ctx), winner in table.items():
        if dev != device or tuple(k) != key:
            continue
        d = abs(math.log2(max(b, 1) / max(batch, 1))) + abs(math.log2(max(ctx, 1) / max(context, 1)))
        if d < best_d:
            best, best_d = winner, d
    return best


def measured_table() -> dict:
    """The committed table (kvjax.attention.mgpu_table.MEASURED), or {} before a GPU run wrote one."""
    try:
        from kvjax.attention.mgpu_table import MEASURED
    except ImportError:
        return {}
    return MEASURED


def choose(kind: str, q_dtype, page_dtype, *, head_dim: int, block_size: int, group: int, batch: int,
           context: int, kv_dtype: str | None = None, table: dict | None = None, device: str | None = None,
           num_kv_heads: int | None = None, channels: int | None = None) -> str:
    """"mosaic" or "triton" for one step's kernel (module docstring). device: the device kind
    (None: this process's, when it is a Hopper GPU); table: None → `measured_table()`."""
    device = device_kind() if device is None else device
    if device is None or not eligible(kind, q_dtype, page_dtype, head_dim=head_dim, block_size=block_size,
                                      group=group, kv_dtype=kv_dtype, num_kv_heads=num_kv_heads, channels=channels):
        return "triton"
    forced = os.environ.get(_ENV, "table").strip().lower()
    if forced in FAMILIES:
        return forced
    if forced not in ("", "table"):
        raise ValueError(f"{_ENV}={forced!r}: use mosaic, triton or table")
    winner = nearest(measured_table() if table is None else table, device,
                     shape_key(kind, q_dtype, page_dtype, head_dim, group, kv_dtype), batch, context)
    return winner if winner in FAMILIES else "triton"


def table_from_rows(rows: list[dict], device: str) -> dict:
    """{(device, kind, q dtype, page dtype, head dim, group, batch, context): winner} from
    kernel_bench rows (impl "triton" or "mosaic"; each row has kind, q_dtype, dtype, head_dim, group,
    batch, context and seconds when it ran): the faster where both ran; Mosaic where only it ran
    would be a guess, so such shapes are left out."""
    timed: dict = {}
    for r in rows:
        if r.get("impl") in FAMILIES and r.get("seconds"):
            key = (device, *shape_key(r["kind"], r["q_dtype"], r["dtype"], r["head_dim"], r["group"],
                                      r.get("kv_dtype")), r["batch"], r["context"])
            timed.setdefault(key, {})[r["impl"]] = r["seconds"]
    return {key: ("mosaic" if t["mosaic"] < t["triton"] else "triton")
            for key, t in sorted(timed.items()) if len(t) == 2}


def render_table_module(table: dict, *, source: str) -> str:
    """The text of kvjax/attention/mgpu_table.py holding `table` (source: where it was measured)."""
    import textwrap

    lines = ['"""Pallas kernel family per measured shape, read by kvjax.attention.mgpu_dispatch.', "",
             *textwrap.wrap(f"Written by {source}; regenerate it there rather than editing it.", 100), '"""', "",
             "# (device kind, kind, q dtype, page dtype, head dim, group (MLA: heads), batch, context) -> winner",
             "MEASURED = {"]
    lines += [f"    {key!r}: {winner!r}," for key, winner in table.items()]
    return "\n".join(lines + ["}", ""])
