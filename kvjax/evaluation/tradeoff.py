"""The accuracy lab's one table: what each KV format saves on a large deployment and what it costs
on the model measured.

Per format (every scored variant but the fp32 control), from an `evaluate` result:

- Llama-3-70B's KV bytes per token in that format, and the concurrency of 8K requests on SPEC's
  simulator group A (160 GiB at utilization 0.92 less 130 GiB of bf16 weights) and on the same
  card with fp8 weights (65.2 GiB, SPEC Table 2), from kvjax.accounting.budget.plan. A skip
  variant keeps as many of Llama-3-70B's 80 layers in bf16 as it keeps of the measured model's
  (which ones does not change the bytes);
- on the measured model: perplexity, KL(bf16 ‖ format), top-1 agreement (the short windows),
  KL at context positions 2K–8K (the long windows, where scored), passkey success at the longest
  passkey length with its Wilson interval and agreement with bf16's answers, and the mean first
  greedy divergence of the free generations.

Missing measurements (a format not scored on the long windows, no passkey) are None.
"""
from __future__ import annotations

from kvjax.accounting import budget as bud
from kvjax.config.presets import preset

DEPLOYMENT = dict(preset="llama-3-70b", context=8192, gpu_gib=bud.GROUPS["A"]["gpu_gib"],
                  util=bud.GROUPS["A"]["util"], weights_gib=bud.GROUPS["A"]["weights_gib"],
                  fp8_weights_gib=next(sc["weights_gib"] for sc in bud.TABLE2
                                       if sc["scenario"] == "Llama-3-70B, fp8 KV + fp8 weights"))


def deployment(kv_dtype: str, skipped: int = 0) -> dict:
    """Llama-3-70B in kv_dtype with `skipped` layers in bf16: bytes per token and 8K concurrency
    on group A with bf16 and with fp8 weights."""
    config = preset(DEPLOYMENT["preset"])
    spec = config.kv_spec(kv_dtype, skip_layers=tuple(range(skipped)))
    plans = [bud.plan(spec, context=DEPLOYMENT["context"], total_bytes=bud.gib(DEPLOYMENT["gpu_gib"]),
                      util=DEPLOYMENT["util"], weights_bytes=bud.gib(w))
             for w in (DEPLOYMENT["weights_gib"], DEPLOYMENT["fp8_weights_gib"])]
    return dict(bytes_per_token=spec.bytes_per_token, concurrency=plans[0].concurrency,
                concurrency_fp8_weights=plans[1].concurrency)


def _bucket(buckets: list[dict], start: int, end: int) -> dict | None:
    return next((b for b in buckets if b["start"] == start and b["end"] == end), None)


def table(res: dict) -> list[dict]:
    """One row per format of an `evaluate` result (module docstring)."""
    long = res.get("long", {}).get("variants", {})
    pk = res.get("passkey")
    longest = max(t["length"] for t in pk["trials"]) if pk else None
    rows = []
    for r in res["results"]:
        name = r["variant"]
        if name == "fp32":
            continue
        row = dict(variant=name, kv_dtype=r["kv_dtype"], **deployment(r["kv_dtype"], len(r["skip_layers"])),
                   bytes_per_token_measured=r["bytes_per_token"], perplexity=r["perplexity"],
                   kl_vs_bf16=r["kl_vs_bf16"], top1_agreement=r["top1_agreement"],
                   greedy_tokens_until_divergence=r["greedy_tokens_until_divergence"], kl_2k_8k=None,
                   passkey_length=longest, passkey=None)
        far = _bucket(long[name]["buckets"], 2048, 8192) if name in long else None
        if far is not None:
            row["kl_2k_8k"] = far["kl_vs_bf16"]
        if pk and name in pk["lengths"]:
            row["passkey"] = next(c for c in pk["lengths"][name] if c["length"] == longest)
        rows.append(row)
    return rows
