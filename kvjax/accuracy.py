"""How much accuracy does a quantized KV cache cost against bf16, and how much do scales win back?

For one model and one held-out text, every variant below scores the same teacher-forced
windows (`LLM.score`) and greedily decodes the same prompts (`LLM.generate`) through the paged
cache; only the cache's dtype and scales change:

    bf16                            the baseline (vLLM's kv_cache_dtype auto for a bf16 model)
    fp32                            a control: wider than the baseline, so its distance is rounding only
    fp8_e4m3 unit                   vLLM's default `--kv-cache-dtype fp8`: every scale 1.0
    fp8_e4m3 per_tensor             one calibrated scale per layer for K and for V (amax / 448)
    fp8_e4m3 per_head               one calibrated scale per layer per kv head
    fp8_e5m2 unit                   the wider-range, coarser format at scale 1.0
    int8_per_token_head             a scale per token per head, computed at write time
    fp8_e4m3 per_tensor skip 0,L-1  the first and last layers kept in bf16 (the model dtype in vLLM)

Metrics per variant: perplexity per token, mean KL(bf16 ‖ variant) of the next-token
distributions, top-1 agreement with bf16, and greedy-decode agreement (tokens until the first
divergence from bf16's continuation, over N prompts). `outlier_channels` inflates a few cached
K channels (models.stress; the model's function is unchanged) to mimic the outliers of large
models. `kvjax accuracy` and experiments/fp8_accuracy.py run this and render the results.

This is the API layer: it loads models through `models/` (lazily), as kvjax.llm does.
"""
from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.calibration import calibrate
from kvjax.llm import LLM
from kvjax.sampling import SamplingParams
from kvjax.scoring import windows


def variants(num_layers: int) -> list[dict]:
    return [
        dict(name="bf16", kv_dtype="bf16"),
        dict(name="fp32", kv_dtype="fp32"),
        dict(name="fp8_e4m3 unit", kv_dtype="fp8_e4m3", mode="unit"),
        dict(name="fp8_e4m3 per_tensor", kv_dtype="fp8_e4m3", mode="per_tensor"),
        dict(name="fp8_e4m3 per_head", kv_dtype="fp8_e4m3", mode="per_head"),
        dict(name="fp8_e5m2 unit", kv_dtype="fp8_e5m2", mode="unit"),
        dict(name="int8_per_token_head", kv_dtype="int8_per_token_head"),
        dict(name=f"fp8_e4m3 per_tensor skip 0,{num_layers - 1}", kv_dtype="fp8_e4m3", mode="per_tensor",
             skip=(0, num_layers - 1)),
    ]


def evaluate(model_name: str, data: str, calib: str, *, seq_len: int = 256, max_windows: int = 32,
             prompts: int = 8, prompt_len: int = 64, decode_tokens: int = 32, outlier_channels: bool = False,
             outlier_factor: float = 200.0, block_size: int = 16) -> dict:
    """Run every variant on `model_name` (anything models.hub.load_model takes) with held-out
    text `data` and calibration text `calib`; returns the results as a JSON-safe dict."""
    from models.hub import load_model

    for name, value in (("seq_len", seq_len), ("max_windows", max_windows), ("prompts", prompts),
                        ("prompt_len", prompt_len), ("decode_tokens", decode_tokens)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    start = time.time()
    loaded = load_model(model_name)
    config = loaded.config
    if outlier_channels:
        from models.stress import inflate_k_channels
        params = inflate_k_channels(config, loaded.params, (0, 5), outlier_factor)
        loaded = loaded.replace(params=jax.tree_util.tree_map(jnp.asarray, params))
    tokens = loaded.tokenizer.encode_file(data)
    eval_windows = windows(tokens, seq_len, max_windows)
    calib_windows = windows(loaded.tokenizer.encode_file(calib), seq_len, max_windows)
    # greedy prompts: from the held-out text after the scored windows (or its start if short)
    rest = tokens[len(eval_windows) * seq_len:]
    rest = rest if len(rest) >= prompts * prompt_len else tokens
    prompt_list = [rest[i * prompt_len:(i + 1) * prompt_len].tolist() for i in range(prompts)]
    greedy_params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)  # always decode_tokens tokens
    calibrated = {}

    results, base_logp, base_greedy = [], None, None
    for v in variants(config.num_layers):
        mode = v.get("mode", "unit")
        if mode != "unit" and (v["kv_dtype"], mode) not in calibrated:
            calibrated[v["kv_dtype"], mode] = calibrate(config, loaded.module, loaded.params, calib_windows,
                                                        v["kv_dtype"], mode)
        # Skipped layers stay at the baseline's bf16 (vLLM keeps them in the model dtype, bf16 there);
        # one pool with a row per prompt, long enough for prompt and continuation: nothing is preempted.
        llm = LLM(loaded, kv_dtype=v["kv_dtype"], scales=calibrated.get((v["kv_dtype"], mode)),
                  kv_skip_layers=v.get("skip", ()), kv_skip_dtype="bf16", block_size=block_size,
                  max_num_seqs=prompts, max_model_len=prompt_len + decode_tokens + 1, steps_per_call=8)
        logp = llm.score(eval_windows)[:, :-1]  # [W, S-1, V] predicting tokens 1..S-1
        target = eval_windows[:, 1:]
        nll = float(-np.mean(np.take_along_axis(logp, target[..., None], axis=-1)))
        greedy = np.asarray([o.token_ids for o in llm.generate(prompt_list, greedy_params)])
        if base_logp is None:
            base_logp, base_greedy = logp, greedy
        kl = float(np.mean(np.sum(np.exp(base_logp) * (base_logp - logp), axis=-1)))
        top1 = float(np.mean(np.argmax(logp, -1) == np.argmax(base_logp, -1)))
        same = greedy == base_greedy
        until = np.where(same.all(1), decode_tokens, np.argmin(same, axis=1))
        results.append(dict(variant=v["name"], kv_dtype=v["kv_dtype"], scale_mode=v.get("mode", "-"),
                            skip_layers=list(v.get("skip", ())), bytes_per_token=llm.kv_spec.bytes_per_token,
                            perplexity=math.exp(nll), nll=nll, kl_vs_bf16=max(kl, 0.0), top1_agreement=top1,
                            greedy_tokens_until_divergence=float(until.mean()),
                            greedy_identical=int(same.all(1).sum())))
    return dict(model=model_name, data=os.path.relpath(data), calibration=os.path.relpath(calib),
                windows=int(len(eval_windows)), seq_len=seq_len, scored_tokens=int(len(eval_windows) * (seq_len - 1)),
                prompts=prompts, prompt_len=prompt_len, decode_tokens=decode_tokens,
                outlier_channels=outlier_channels, outlier_factor=outlier_factor if outlier_channels else None,
                machine=f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}",
                seconds=round(time.time() - start, 1), results=results)


def markdown(res: dict) -> str:
    """The results table as markdown, with a one-line header saying what was measured."""
    head = (f"**{res['model']}**{' with inflated K channels ×' + str(res['outlier_factor']) if res['outlier_channels'] else ''}: "
            f"{res['scored_tokens']:,} held-out tokens ({res['windows']} windows of {res['seq_len']}), "
            f"{res['prompts']} greedy prompts × {res['decode_tokens']} tokens; {res['machine']}.\n\n")
    rows = ["| KV variant | bytes/token | perplexity | KL(bf16‖variant) | top-1 agree | greedy tokens to divergence |",
            "|---|---:|---:|---:|---:|---:|"]
    for r in res["results"]:
        rows.append(f"| {r['variant']} | {r['bytes_per_token']:,} | {r['perplexity']:.4f} | {r['kl_vs_bf16']:.2e} | "
                    f"{100 * r['top1_agreement']:.2f}% | {r['greedy_tokens_until_divergence']:.1f} / "
                    f"{res['decode_tokens']} |")
    return head + "\n".join(rows) + "\n"
