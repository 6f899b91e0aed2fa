"""`kvjax calibrate`: fp8 KV scales from the model's own K/V over calibration text.

The model prefills windows of the data through a bf16 paged cache; the max |value| of every
layer's written K and V per kv head (MLA: of each latent channel, latent and rope key apart)
is the calibration statistic, and scale = amax / format max (448 for e4m3, 57344 for e5m2),
taken per layer (`per_tensor`) or per layer per kv head (`per_head`). vLLM leaves this step to
llm-compressor and defaults to 1.0; the scales file this writes is what `kvjax decode
--scales` and `kvjax accuracy` load.
"""
from __future__ import annotations

import jax.numpy as jnp

from kvjax import quant
from kvjax.commands.common import load_model, read_tokens, resolve_model, windows


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fp8 KV scales from a model run over calibration text",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="small-gqa | small-mla | a Hugging Face folder")
    p.add_argument("--data", required=True, help="calibration text file")
    p.add_argument("--mode", choices=["per_tensor", "per_head"], default="per_tensor")
    p.add_argument("--format", choices=["fp8_e4m3", "fp8_e5m2"], default="fp8_e4m3")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=32)
    p.add_argument("--out", required=True, help="scales file to write (JSON)")


def calibrate(config, model, params, token_windows, fmt: str, mode: str, block_size: int = 16) -> quant.KVScales:
    """Scales for `model` from prefilling token_windows i32[W, S] (batches of 16) in bf16."""
    from models.scoring import cache_amax, prefill_caches

    spec = config.kv_spec("bf16")
    stats = []
    for i in range(0, len(token_windows), 16):
        caches = prefill_caches(model, params, jnp.asarray(token_windows[i:i + 16]), spec, block_size)
        stats.append(cache_amax(caches))
    amax_k = [jnp.max(jnp.stack([s[0][i] for s in stats]), axis=0) for i in range(config.num_layers)]
    amax_v = [jnp.max(jnp.stack([s[1][i] for s in stats]), axis=0) for i in range(len(stats[0][1]))]
    return quant.scales_from_amax(amax_k, amax_v, quant.FORMATS[fmt], mode,
                                  mla_rank=config.kv_lora_rank if config.is_mla else None)


def run(args) -> int:
    for name in ("seq_len", "max_windows"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    config, model, params = load_model(args.model)
    toks = windows(read_tokens(resolve_model(args.model), args.data), args.seq_len, args.max_windows)
    scales = calibrate(config, model, params, toks, args.format, args.mode)
    scales.save(args.out)
    print(f"wrote {args.format} {args.mode} scales for {config.num_layers} layers from {len(toks)} windows "
          f"of {args.seq_len} tokens to {args.out}")
    return 0
