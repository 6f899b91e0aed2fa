"""Per-layer views of fp8 KV: where the model's K/V outliers are, and which layers' KV matter.

- `kv_outliers`: the model prefills calibration windows through a bf16 paged cache (as
  kvjax.quant.calibration does) and, per layer × kv head, reports max |K| and max |V| and how far the
  largest channel stands out: the largest channel's amax over the median channel's (a few
  channels far above the rest are the "massive activations" of Sun et al., arXiv 2402.17762,
  that force a per-tensor scale to stretch). Layers whose amax exceeds the format's max (448 for
  e4m3) saturate under vLLM's default scale of 1.0. MLA caches one latent per token: its
  channels are reported as K of a single head, and V is empty.
- `layer_sensitivity`: KL(bf16 ‖ variant) and top-1 agreement when only layer i's KV is in the
  quantized format and every other layer stays bf16 (vLLM's `kv_cache_dtype_skip_layers`
  turned inside out). The most sensitive layers are the ones worth keeping in bf16.

Each configuration is a full `kvjax.LLM` over the same loaded weights, scored through the paged
cache like every other variant (kvjax.evaluation.accuracy). Every layer-i cache has its own pytree
structure, so each compiles once: about L compilations of the scoring step in all.
"""
from __future__ import annotations

import numpy as np

from kvjax.engine.llm import LLM
from kvjax.evaluation.metrics import compare
from kvjax.quant import formats as quant
from kvjax.quant.calibration import channel_amax


def kv_outliers(config, module, params, token_windows, *, fmt: str = "fp8_e4m3", block_size: int = 16,
                batch: int = 16, channels: tuple[list, list] | None = None) -> dict:
    """Per-layer, per-kv-head amax of the K/V the model writes for token_windows i32[W, S].

    Returns {"k_amax", "v_amax", "k_channel_ratio", "v_channel_ratio"}: lists over layers of
    lists over kv heads (V lists are empty for MLA); "saturated_layers": layers with an amax
    above the format's max, {"format", "format_max", "windows", "tokens"}. channels: the
    windows' kvjax.quant.calibration.channel_amax, already measured (then nothing is prefilled).
    """
    channel_k, channel_v = channels if channels is not None else \
        channel_amax(config, module, params, token_windows, block_size, batch)

    def ratio(c):  # largest channel over median channel, per head; 0 where the median is 0
        med = np.median(c, axis=-1)
        return np.where(med > 0, c.max(axis=-1) / np.where(med > 0, med, 1.0), 0.0)

    fmax = quant.FORMATS[fmt].max
    k_amax = [c.max(axis=-1) for c in channel_k]
    v_amax = [np.zeros(0) if c is None else c.max(axis=-1) for c in channel_v]
    saturated = [i for i, (k, v) in enumerate(zip(k_amax, v_amax))
                 if k.max(initial=0.0) > fmax or v.max(initial=0.0) > fmax]
    return dict(format=fmt, format_max=float(fmax), windows=int(len(token_windows)),
                tokens=int(np.asarray(token_windows).size),
                k_amax=[a.tolist() for a in k_amax], v_amax=[a.tolist() for a in v_amax],
                k_channel_ratio=[ratio(c).tolist() for c in channel_k],
                v_channel_ratio=[[] if c is None else ratio(c).tolist() for c in channel_v],
                saturated_layers=saturated)


def layer_sensitivity(loaded, token_windows, kv_dtype: str, scales=None, *, block_size: int = 16,
                      batch_size: int = 8) -> list[dict]:
    """For each layer i: mean KL(bf16 ‖ only layer i in kv_dtype) and top-1 agreement with bf16
    over the next-token distributions of token_windows i32[W, S] (positions 0..S-2).

    loaded: a models.hub.LoadedModel; scales: the fp8 KVScales of the quantized layer (None:
    vLLM's 1.0). Returns [{"layer", "kl_vs_bf16", "top1_agreement"}] in layer order.
    """
    windows = np.asarray(token_windows)
    targets = windows[:, 1:]
    num_layers = loaded.config.num_layers

    def llm(**kw):  # scoring only: the engine's pool is the smallest that builds
        return LLM(loaded, block_size=block_size, max_num_seqs=1, max_model_len=block_size, **kw)

    base = llm(kv_cache_dtype="bf16").score_windows(windows, batch_size)[:, :-1]  # f32[W, S-1, V]
    rows = []
    for i in range(num_layers):
        others = [j for j in range(num_layers) if j != i]
        variant = llm(kv_cache_dtype=kv_dtype, scales=scales, kv_cache_dtype_skip_layers=others, kv_skip_dtype="bf16")
        kl, top1, _ = compare(base, variant.score_windows(windows, batch_size)[:, :-1], targets)
        rows.append(dict(layer=i, kl_vs_bf16=max(float(np.mean(np.asarray(kl, np.float64))), 0.0),
                         top1_agreement=float(np.mean(top1))))
    return rows


def most_sensitive(rows: list[dict], count: int) -> list[int]:
    """The `count` layers with the largest KL in layer_sensitivity's rows, in layer order."""
    ranked = sorted(rows, key=lambda r: -r["kl_vs_bf16"])
    return sorted(r["layer"] for r in ranked[:count])
