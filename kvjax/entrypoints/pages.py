"""The browser pages: the KV cache calculator and the block pool, each one self-contained HTML file.

Two pages, built from the files in kvjax/entrypoints/static/ (HTML, CSS and plain scripts shipped
as package data; no CDN, no build step, nothing fetched but the page's own JSON):

- the calculator (SPEC "The simulator", the seed's interactive page): its presets (groups A, B, C)
  and every factor of the KV formula as a slider, plus kvjax's own inputs (a preset, a KV format,
  block size, TP, the activations), the readout `kvjax plan --json` gives, a plot of concurrency
  against T and against the utilization, and which term of the requested memory dominates.
  Served by `kvjax serve` at `/`, it asks `POST /api/plan` (kvjax.entrypoints.page_routes: `kvjax
  plan`'s own code, so a pasted config.json and the hybrid groups work too). Written by `kvjax plan
  --html FILE` (`calculator_page(..., static=True)`), it carries kvjax.accounting.formulas compiled
  to JavaScript (kvjax.utils.pyjs) and computes offline: one source for both.
- the block pool (`pool_page`): every block free, cached or in use, shared blocks with their ref
  counts, the free queue from head to tail, the requests' block tables, per KV cache group. Live
  (`kvjax serve`'s `/pool`, polling `GET /api/pool`: kvjax.engine.pool_snapshot) or a trace's
  steps to step through (`kvjax replay --html`), both drawing kvjax.core.pool_view's state.

The pages' data travels as one JSON object in a `<script type="application/json">` element.
"""
from __future__ import annotations

from importlib import resources
from typing import Any

from kvjax.accounting import budget as bud
from kvjax.accounting import formulas
from kvjax.config.engine import resolve_kv_dtype
from kvjax.config.presets import PRESETS
from kvjax.errors import UsageError
from kvjax.quant.kv_formats import KV_FORMATS
from kvjax.utils.pyjs import compile_module
from kvjax.utils.strict_json import dumps

KV_DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head",
                    "nvfp4")
# The seed's three presets, as its buttons name them.
GROUP_LABELS = {"A": "Llama-3-70B · 8K · 160 GiB", "B": "DeepSeek-V3 · 32K · one card of TP 8",
                "C": "Llama-3-70B · 128K · 160 GiB"}
# Plan flags the calculator has no input for: --html refuses them rather than drop them.
_NO_INPUT = ("kv_cache_memory_bytes", "kv_offloading_size", "pooled", "extensible", "params_b", "weight_dtype",
             "async_scheduling", "decode_context_parallel_size")


def asset(name: str) -> str:
    """A file of kvjax/entrypoints/static/ (package data) as text."""
    return resources.files("kvjax.entrypoints").joinpath("static", name).read_text(encoding="utf-8")


def _preset_entry(config, kv_auto: str | None = None) -> dict[str, Any]:
    spec = config.kv_spec(resolve_kv_dtype("auto", config.dtype))
    try:
        params = config.num_params
    except ValueError:  # a config.json that sizes the KV cache but not the weights
        params = None
    return {"title": config.title or config.name or spec.name, "kind": spec.kind, "num_layers": spec.num_layers,
            "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "kv_lora_rank": spec.kv_lora_rank, "qk_rope_head_dim": spec.qk_rope_head_dim, "dtype": spec.kv_dtype,
            "params": params, "hybrid": any(w is not None for w in config.layer_windows)}


def page_data() -> dict[str, Any]:
    """What the calculator's script reads: the presets' shapes, the groups, the KV formats' widths."""
    fmt = {name: {"bits": f.bits, "group": f.group, "group_scale_bytes": f.group_scale_bytes,
                  "vector_scale_bytes": f.vector_scale_bytes} for name, f in KV_FORMATS.items()}
    fmt["fp8"] = fmt["fp8_e4m3"]
    groups = {g: dict(v, label=GROUP_LABELS[g]) for g, v in bud.GROUPS.items()}
    return {"presets": {name: _preset_entry(c) for name, c in PRESETS.items()}, "groups": groups, "formats": fmt,
            "kv_dtypes": list(KV_DTYPE_CHOICES), "bf16_bytes": [2, 1], "default_batched_tokens": 8192,
            "default_context": 8192, "default_block_size": bud.DEFAULT_BLOCK_SIZE, "default_util": "0.92"}


def calculator_state(args) -> dict[str, Any]:
    """The calculator's inputs set to `kvjax plan`'s parsed flags (--html); a flag the page has no
    input for is refused (UsageError), not dropped."""
    for name in _NO_INPUT:
        if getattr(args, name, None) not in (None, False):
            raise UsageError(f"--html: the calculator page has no input for --{name.replace('_', '-')}; "
                             "leave it out (kvjax plan prints its effect)")
    state: dict[str, Any] = {"source": "custom", "group": None, "preset": None, "hf": None,
                             "kind": (args.kind or "gqa").lower(), "layers": args.layers, "heads": args.heads,
                             "kv_heads": args.kv_heads, "head_dim": args.head_dim, "kv_lora_rank": args.kv_lora_rank,
                             "qk_rope_head_dim": args.qk_rope_head_dim}
    group = bud.GROUPS.get(args.group, {})
    if args.group:
        state.update(source="group", group=args.group)
    if args.preset or (args.group and not args.kind):
        state.update(source="group" if args.group else "preset", preset=args.preset or group["preset"])
    elif args.hf_config:
        from kvjax.config.hf import from_hf_config

        state.update(source="hf", hf={"path": args.hf_config, **_preset_entry(from_hf_config(args.hf_config))})
    state.update(
        kv_dtype=args.kv_cache_dtype or group.get("kv_dtype", "auto"),
        context=args.max_model_len or group.get("context", 8192), block_size=args.block_size,
        gpu_gib=args.total_memory_bytes or group.get("gpu_gib", ""),
        util=args.gpu_memory_utilization or group.get("util", "0.92"),
        weights_gib=args.weights_gib or group.get("weights_gib", ""),
        activations_gib=args.activations_gib or "0", cudagraph_gib=args.cudagraph_gib or "0",
        tp=args.tensor_parallel_size or group.get("tp", 1), batched_tokens=args.max_num_batched_tokens or 8192)
    return state


def _json_script(element_id: str, obj: Any) -> str:
    text = dumps(obj).replace("</", "<\\/")  # never ends the script element
    return f'<script id="{element_id}" type="application/json">{text}</script>'


def _fill(template: str, **parts: str) -> str:
    for key, value in parts.items():
        template = template.replace(f"<!--{key}-->", value)
    return template


def calculator_page(state: dict[str, Any] | None = None, *, static: bool = True) -> str:
    """The calculator as one HTML file, its inputs set to `state` (calculator_state; default group
    A). static: the arithmetic compiled into the page (kvjax plan --html); else the page asks the
    server's POST api/plan (kvjax serve)."""
    data = dict(page_data(), initial=state or calculator_state_default(), mode="static" if static else "server")
    scripts = [asset("plot.js"), asset("calculator.js")]
    if static:
        scripts.insert(0, "const kvjaxFormulas = " + compile_module(formulas) + ";")
    return _fill(asset("calculator.html"), CSS=f"<style>{asset('kvjax.css')}</style>",
                 DATA=_json_script("kvjax-data", data),
                 SCRIPTS="\n".join(f"<script>\n{s}\n</script>" for s in scripts))


def calculator_state_default() -> dict[str, Any]:
    """Group A, the seed's first preset."""
    g = bud.GROUPS["A"]
    return {"source": "group", "group": "A", "preset": g["preset"], "hf": None, "kind": "gqa", "layers": None,
            "heads": None, "kv_heads": None, "head_dim": None, "kv_lora_rank": None, "qk_rope_head_dim": None,
            "kv_dtype": g["kv_dtype"], "context": g["context"], "block_size": bud.DEFAULT_BLOCK_SIZE,
            "gpu_gib": g["gpu_gib"], "util": g["util"], "weights_gib": g["weights_gib"], "activations_gib": "0",
            "cudagraph_gib": "0", "tp": g["tp"], "batched_tokens": 8192}


def pool_page(data: dict[str, Any]) -> str:
    """The block pool page. data: {"mode": "live"} (it polls api/pool), or {"mode": "replay",
    "title": ..., "steps": [...]} (a trace's ops and the pool after each, kvjax replay --html)."""
    return _fill(asset("pool.html"), CSS=f"<style>{asset('kvjax.css')}</style>", DATA=_json_script("kvjax-data", data),
                 SCRIPTS=f"<script>\n{asset('pool.js')}\n</script>")
