"""`kvjax plan`: size a vLLM-style KV cache from a model's shape and a memory budget (SPEC "The simulator").

    kvjax plan --group A
    kvjax plan --preset llama-3-8b --kv-cache-dtype fp8 --max-model-len 32k --device-memory-gib 80

The model comes from a SPEC simulator group, a kvjax.config.presets preset, a Hugging Face
config.json, or --kind with its shape flags; the arithmetic is kvjax.accounting.budget.plan:
bytes per token, block and request, the budget (ceil(device memory × gpu_memory_utilization)
minus weights, activations and CUDA graphs, or --kv-cache-memory-bytes), blocks and
concurrency, and the host tier of --kv-offloading-size. A preset's or a config.json's parameters are counted from
its shapes (kvjax.config.model.ModelConfig.num_params: every expert of a MoE model resident, as vLLM keeps
them) and give the weights at --weight-dtype unless --weights-gib or --params-b says. It prints one row per quantity
(`format_plan`, which `kvjax report` prints too), or with --json one object; --plot draws
concurrency against context for bf16 and fp8 KV; --html writes the calculator page set to this plan
(kvjax.entrypoints.pages: every input a slider, the numbers this file's arithmetic compiled into the page). Two rows marked as estimates, outside the budget, give
one layer's prefill attention temporaries for a --max-num-batched-tokens chunk at the end of the context
(kvjax.accounting.prefill): the tiled form kvjax runs and the untiled reference's f32 scores. A model
with sliding-window layers (a preset's or
a config.json's) also gets vLLM's hybrid KV cache beside its fallback that caches every layer as
full attention (kvjax.accounting.hybrid: the groups, bytes per block, blocks, blocks per request,
KV cache size in tokens, max concurrency); one with Mamba layers (Granite-4.0-H, Nemotron-H, Bamba, Falcon-H1,
Jamba) gets vLLM's pool of attention and Mamba groups instead (`format_mamba`: the state per layer, the attention
block size grown to hold it, the padding, the groups and their blocks). Flags the chosen model source or budget would ignore
are refused. The engine's flags (--kv-cache-dtype, --max-model-len, --block-size, the memory
sizes, -tp, --max-num-batched-tokens) come from its one table (kvjax.engine.cli_args), with
plan's defaults and help. Nothing here imports JAX, so the command starts at once.
"""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from kvjax.accounting import budget as bud
from kvjax.accounting import hybrid
from kvjax.accounting.prefill import PrefillTemporaries, prefill_temporaries
from kvjax.commands.common import check_plot_file
from kvjax.commands.plan_dcp import dcp_section, format_dcp
from kvjax.commands.plan_mamba import format_mamba, mamba_plan
from kvjax.config.engine import resolve_kv_dtype
from kvjax.config.hf import from_hf_config
from kvjax.config.model import ModelConfigError
from kvjax.config.presets import PRESETS, preset
from kvjax.core.kv_cache_groups import HybridError, all_full
from kvjax.core.kv_cache_interface import KVSpec, SpecError
from kvjax.engine.cli_args import add_engine_flags
from kvjax.errors import UsageError
from kvjax.utils.checks import int_arg
from kvjax.utils.output_files import check_output_file, save_figure, write_text
from kvjax.utils.plotting import pyplot
from kvjax.utils.strict_json import dumps


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="KV bytes per token/block/request, budget, blocks and concurrency",
                       description="Size a vLLM-style KV cache: bytes per token, per block, per request; "
                                   "requested = ceil(device memory × gpu_memory_utilization); budget = requested − "
                                   "weights − activations − CUDA graphs (or --kv-cache-memory-bytes); "
                                   "blocks = budget // block bytes (block 0 is null).")
    add_sizing_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE", help="plot max concurrency vs context for bf16 and fp8 "
                                                  "(.png, .svg or .pdf)")
    p.add_argument("--html", metavar="FILE", help="write the calculator page, set to this plan, as one self-contained "
                                                  "HTML file that computes offline (kvjax.entrypoints.pages); "
                                                  "without a model: the seed's group A")


def add_sizing_arguments(p) -> None:
    """The model and memory flags plan reads (`_resolve_plan_inputs`); kvjax simulate takes them too."""
    src = p.add_argument_group("model (one of)")
    src.add_argument("--group", choices=sorted(bud.GROUPS), type=str.upper,
                     help="a SPEC simulator group (A, B, C); other flags override its values")
    src.add_argument("--preset", help=f"one of {', '.join(PRESETS)}")
    src.add_argument("--hf-config", metavar="FILE", help="a Hugging Face config.json (or its folder)")
    src.add_argument("--kind", help="mha | gqa | mqa | mla, with --layers --heads --kv-heads --head-dim")
    for flag in _SHAPE_FLAGS:
        src.add_argument(flag, type=int_arg(1))
    _engine_flags(p, "kv_cache_dtype", "max_model_len", "block_size")
    mem = p.add_argument_group("memory")
    _engine_flags(mem, "total_memory_bytes", "gpu_memory_utilization")
    mem.add_argument("--extensible", action="store_true", help="extensible KV cache: utilization unset → 1.0")
    mem.add_argument("--weights-gib", help="weights of the whole model in GiB")
    mem.add_argument("--params-b", help="parameters in billions (weights = params × --weight-dtype bytes)")
    mem.add_argument("--weight-dtype", default=None, help=f"one of {', '.join(bud.WEIGHT_DTYPE_BYTES)} (default bf16)")
    mem.add_argument("--activations-gib", help="peak activations (default 0)")
    mem.add_argument("--cudagraph-gib", help="CUDA-graph memory estimate (default 0)")
    _engine_flags(mem, "kv_cache_memory_bytes", "tensor_parallel_size", "decode_context_parallel_size",
                  "kv_offloading_size")
    mem.add_argument("--pooled", action="store_true", help="seed's pooled multi-GPU arithmetic (not deployable)")
    _engine_flags(mem, "max_num_batched_tokens")
    hyb = p.add_argument_group("hybrid KV cache (models with sliding-window layers)")
    hyb.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                     help="vLLM's default: two batches in flight (--no-async-scheduling: one)")


DEFAULT_BATCHED_TOKENS = 8192
# The engine flags plan takes, from the one table (kvjax.engine.cli_args), in plan's meaning: it is analytic, so a
# simulator group's value stands in for an unset flag (no default: None), the memory sizes are exact decimals
# (kvjax.accounting.budget reads the text), and -tp is not capped at the engine's 256 devices.
_ENGINE_HELPS = {
    "kv_cache_dtype": "auto (the model's dtype; bf16 for --kind), fp8 (= fp8_e4m3), fp8_e5m2, bf16, "
                      "int8_per_token_head, nvfp4, ... (default auto)",
    "max_model_len": "tokens per request, the context concurrency is counted for (default 8192)",
    "block_size": f"tokens per block (default {bud.DEFAULT_BLOCK_SIZE})",
    "total_memory_bytes": "memory of one device (GPU) in GiB (1024³), the total gpu_memory_utilization takes a "
                          "share of",
    "gpu_memory_utilization": "a share in (0, 1] (default 0.92)",
    "kv_cache_memory_bytes": "the KV budget of one device in bytes (4G = 4 GiB, 4g = 4e9): replaces the "
                             "utilization arithmetic",
    "tensor_parallel_size": "ranks (default 1)",
    "decode_context_parallel_size": "split an MLA model's latent cache by token over D of the tp ranks: its per-rank "
                                    "KV and concurrency beside D = 1, 2, 4, 8 (default: that table for MLA at -tp > 1)",
    "kv_offloading_size": "host memory for offloaded KV blocks in GiB, all ranks together (each rank gets 1/N), "
                          "as vLLM; 0 = no host tier",
    "max_num_batched_tokens": "tokens per step: the prefill chunk of the attention estimate, and what a sliding "
                              f"window's blocks also hold while in flight (default {DEFAULT_BATCHED_TOKENS}: vLLM's "
                              "API server on an 80-160 GiB GPU)"}
_ENGINE_DEFAULTS = {"kv_cache_dtype": None, "block_size": bud.DEFAULT_BLOCK_SIZE, "tensor_parallel_size": None,
                    "decode_context_parallel_size": None}
_ENGINE_TYPES = {"total_memory_bytes": str, "gpu_memory_utilization": str, "kv_offloading_size": str,
                 "tensor_parallel_size": int_arg(1)}


def _engine_flags(group, *fields: str) -> None:
    """Add these engine flags to group (the parser or one of its argument groups), in plan's meaning."""
    def pick(by_field: dict) -> dict:
        return {name: value for name, value in by_field.items() if name in fields}

    add_engine_flags(group, fields, None, defaults=pick(_ENGINE_DEFAULTS), helps=pick(_ENGINE_HELPS),
                     types=pick(_ENGINE_TYPES))


_SHAPE_FLAGS = ("--layers", "--heads", "--kv-heads", "--head-dim", "--kv-lora-rank", "--qk-rope-head-dim")
_MLA_ONLY, _NOT_MLA = ("--kv-lora-rank", "--qk-rope-head-dim"), ("--kv-heads", "--head-dim")


def _check_plan_flags(args) -> None:
    """Refuse flags that the chosen model source would ignore, before any work."""
    given = [f for f in _SHAPE_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    if given and not args.kind:
        source = (f"--preset {args.preset}" if args.preset else f"--hf-config {args.hf_config}" if args.hf_config
                  else f"--group {args.group}" if args.group else "no --kind")
        raise UsageError(f"{given[0]} describes a custom model (--kind); {source} fixes the model's shape")
    if args.kind:
        wrong = [f for f in given if f in (_NOT_MLA if args.kind.lower() == "mla" else _MLA_ONLY)]
        if wrong:
            raise UsageError(f"{wrong[0]} does not apply to --kind {args.kind}")
    if args.kv_cache_memory_bytes is not None:  # vLLM: the KV budget, in place of the whole subtraction
        fixed = [f for f in _BUDGET_FLAGS if getattr(args, f[2:].replace("-", "_")) not in (None, False)]
        if fixed:
            raise UsageError(f"{fixed[0]} with --kv-cache-memory-bytes: the KV budget is given, so the budget's "
                             "subtraction, and this flag, would be ignored")
    if args.plot:
        check_plot_file(args.plot)


# The flags of the budget's subtraction, which --kv-cache-memory-bytes replaces.
_BUDGET_FLAGS = ("--gpu-memory-utilization", "--extensible", "--weights-gib", "--params-b", "--weight-dtype",
                 "--activations-gib", "--cudagraph-gib")


def _resolve_plan_inputs(args) -> dict[str, Any]:
    """Merge a simulator group's values with explicit flags (flags win) into plan() inputs."""
    g = dict(bud.GROUPS[args.group]) if args.group else {}
    model_flags = [f for f in ("preset", "hf_config", "kind") if getattr(args, f)]
    if len(model_flags) > 1:
        raise UsageError(f"choose one model source, got --{' and --'.join(f.replace('_', '-') for f in model_flags)}")
    _check_plan_flags(args)
    kv_dtype = args.kv_cache_dtype or g.get("kv_dtype", "auto")
    params = config = None
    uncounted = ""  # why a config.json's parameters could not be counted
    windows: tuple = ()
    if args.preset or (g and not model_flags):
        config = preset(args.preset or g["preset"])
        spec, params = config.kv_spec(resolve_kv_dtype(kv_dtype, config.dtype)), config.num_params
        title = config.title or config.name
        windows = config.layer_windows
    elif args.hf_config:
        config = from_hf_config(args.hf_config)
        spec, windows = config.kv_spec(resolve_kv_dtype(kv_dtype, config.dtype)), config.layer_windows
        title = spec.name
        try:  # every expert of a MoE model counts: vLLM keeps them all resident
            params = config.num_params
        except ModelConfigError as e:  # a file that sizes the KV cache but not the weights (no vocab_size)
            uncounted = f" ({e})"
    elif args.kind:
        # a model given by its shapes has no dtype of its own: its weights are bf16 (--weight-dtype's default)
        spec, title = _manual_spec(args, resolve_kv_dtype(kv_dtype, "bfloat16")), f"custom {args.kind.upper()}"
    else:
        raise UsageError("no model: give --group, --preset, --hf-config, or --kind with --layers --heads "
                         "--kv-heads --head-dim")
    tp = args.tensor_parallel_size if args.tensor_parallel_size is not None else g.get("tp", 1)
    weight_dtype = args.weight_dtype or "bf16"
    if weight_dtype not in bud.WEIGHT_DTYPE_BYTES:
        raise UsageError(f"--weight-dtype {weight_dtype!r}: choose one of {', '.join(bud.WEIGHT_DTYPE_BYTES)}")
    if args.weights_gib is not None and args.params_b is not None:
        raise UsageError("give --weights-gib or --params-b, not both")
    counted = args.params_b is not None or (args.weights_gib is None and "weights_gib" not in g and params is not None)
    if args.weight_dtype is not None and not counted:
        raise UsageError("--weight-dtype converts a parameter count (--params-b or a preset's) to bytes; "
                         "here the weights are given in GiB, so it would be ignored")
    warnings = []
    if args.weights_gib is not None:
        weights = bud.gib(args.weights_gib, "--weights-gib")
    elif args.params_b is not None:
        weights = bud.weight_bytes(bud.exact(args.params_b, "--params-b") * 10**9, weight_dtype)
    elif "weights_gib" in g:
        weights = bud.gib(g["weights_gib"])
    elif params is not None:
        weights = bud.weight_bytes(params, weight_dtype)
    else:
        weights = 0
        warnings.append(f"no --weights-gib or --params-b: weights counted as 0{uncounted}")
    util_flag = args.gpu_memory_utilization
    if util_flag is not None:
        bud.utilization(util_flag, "--gpu-memory-utilization")  # named by its flag before plan() checks it again
    # GiB: --device-memory-gib's text (kept under its field's name, total_memory_bytes) or the group's
    device = args.total_memory_bytes if args.total_memory_bytes is not None else g.get("gpu_gib")
    util = util_flag if util_flag is not None else (None if args.extensible else g.get("util"))
    host = bud.gib(args.kv_offloading_size or 0, "--kv-offloading-size")
    # The kv dtype is shown as it was asked for (fp8 stays fp8, as vLLM prints its --kv-cache-dtype); the spec holds
    # the format's own name.
    label = None if kv_dtype == "auto" else kv_dtype
    windows = windows if any(w is not None for w in windows) else ()
    if not windows and args.async_scheduling is not None:
        raise UsageError("--async-scheduling sizes a sliding window's blocks; "
                         f"{title} has no sliding-window layers, so it would be ignored")
    weights_from = f"{params:,} parameters × {weight_dtype}" if counted and args.params_b is None else None
    mamba = config if config is not None and config.mamba is not None else None  # a hybrid with Mamba layers
    if mamba is not None:
        warnings.append(f"the KV rows count the {spec.num_layers} attention layers alone; vLLM's pool, with the "
                        f"{len(mamba.mamba_layers)} Mamba layers' state, is the hybrid section below")
    return dict(spec=spec, title=g.get("title", title), warnings=warnings, kv_label=label, windows=windows, mamba=mamba,
                params=params, moe=config is not None and config.moe is not None, weights_from=weights_from, kw=dict(
        context=args.max_model_len if args.max_model_len is not None else g.get("context", 8192),
        block_size=args.block_size,
        total_bytes=None if device is None else bud.gib(device, "--device-memory-gib"),
        util=util, extensible=args.extensible, weights_bytes=weights,
        activations_bytes=bud.gib(args.activations_gib or 0, "--activations-gib"),
        cudagraph_bytes=bud.gib(args.cudagraph_gib or 0, "--cudagraph-gib"),
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, tp=tp, pooled=args.pooled,
        host_offload_bytes=host or None))  # 0: no host tier


def _manual_spec(args, kv_dtype: str) -> KVSpec:
    kind = args.kind.lower()
    if kind == "mla":
        missing = [f for f in ("layers", "kv_lora_rank", "qk_rope_head_dim") if getattr(args, f) is None]
        if missing:
            raise UsageError(f"--kind mla needs --{', --'.join(m.replace('_', '-') for m in missing)}")
        return KVSpec.mla(args.layers, args.heads or 1, kv_lora_rank=args.kv_lora_rank,
                          qk_rope_head_dim=args.qk_rope_head_dim, kv_dtype=kv_dtype)
    missing = [f for f in ("layers", "kv_heads", "head_dim") if getattr(args, f) is None]
    if missing:
        raise UsageError(f"--kind {kind} needs --{', --'.join(m.replace('_', '-') for m in missing)}")
    return KVSpec(kind, args.layers, args.heads if args.heads is not None else args.kv_heads, args.kv_heads,
                  args.head_dim, kv_dtype=kv_dtype)


def run(args) -> int:
    if args.html and not any(getattr(args, f[2:].replace("-", "_")) for f in ("--group", "--preset", "--hf-config",
                                                                              "--kind", *_SHAPE_FLAGS)):
        args.group = "A"  # no model: the page opens at the seed's first preset, and plan prints that plan
    inputs, result, prefill, groups = _planned(args)
    if args.html:  # checked (its flags, its file) before any file is written
        from kvjax.entrypoints import pages

        page = pages.calculator_page(pages.calculator_state(args))
        check_output_file(args.html, "--html")
    if args.plot:
        _plot_concurrency(inputs, args.plot)
    if args.html:
        write_text(args.html, page, "--html")
    if args.json:
        print(dumps(_json(inputs, result, prefill, groups), indent=2))
    else:
        print(format_plan(result, inputs["title"], inputs["warnings"] + list(result.warnings), inputs["kv_label"],
                          params=inputs["params"], moe=inputs["moe"], weights_from=inputs["weights_from"],
                          prefill=prefill))
        if groups:
            print("\n" + format_hybrid(*groups))
        if inputs["dcp_rows"]:
            print("\n" + format_dcp(inputs["dcp_rows"], args.decode_context_parallel_size))
    return 0


def plan_json(args) -> dict[str, Any]:
    """What `kvjax plan ... --json` prints for these parsed flags (the calculator page's endpoint serves it)."""
    return _json(*_planned(args))


def _planned(args):
    """(inputs, Plan, prefill estimate, hybrid groups or None) for the parsed flags."""
    inputs = _resolve_plan_inputs(args)
    result = bud.plan(inputs["spec"], **inputs["kw"])
    inputs["dcp_rows"] = dcp_section(result, args.decode_context_parallel_size)  # MLA under TP: kvjax.accounting.dcp
    prefill = _prefill(inputs["spec"], result, args)
    if result.num_host_blocks == 0:
        raise UsageError(f"--kv-offloading-size {args.kv_offloading_size}: {result.host_bytes} bytes per device is "
                         f"smaller than one block of {result.bytes_per_block} bytes")
    groups = _hybrid(result, inputs["windows"], args) if inputs["windows"] else None
    if inputs["mamba"] is not None:  # vLLM's pool of attention and Mamba groups (it has no all-full fallback)
        gp = mamba_plan(result, inputs["mamba"], args.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS)
        groups = None if gp is None else (gp, None)
    return inputs, result, prefill, groups


def _json(inputs, result: bud.Plan, prefill: PrefillTemporaries, groups) -> dict[str, Any]:
    out = result.to_json()
    if groups:
        out["hybrid"] = {name: _group_json(gp) for name, gp in zip(("hybrid", "all_full"), groups)}
    out["prefill_attention"] = dict(prefill.to_json(), estimate=PREFILL_NOTE)
    out["model"] = inputs["title"]
    if inputs.get("dcp_rows"):
        out["decode_context_parallel"] = [row.to_json() for row in inputs["dcp_rows"]]
    out["params"] = inputs["params"]
    out["warnings"] = inputs["warnings"] + list(result.warnings)
    if inputs["kv_label"]:
        out["spec"]["kv_dtype"] = inputs["kv_label"]
    return out


def format_plan(pl: bud.Plan, title: str, warnings: Sequence[str], kv_label: str | None = None, *,
                params: int | None = None, moe: bool = False, weights_from: str | None = None,
                prefill: PrefillTemporaries | None = None) -> str:
    """The human readout: one row per quantity, exact bytes beside 1024-based units. kv_label: the kv dtype
    as the user spelled it (default: the spec's format name); params: the model's counted parameters (a row
    of its own; moe: every expert counted); weights_from: how the weights row was computed from them;
    prefill: the prefill attention's estimated temporaries, two rows outside the budget."""
    h = bud.human_bytes
    s = pl.spec
    rows: list[tuple[str, str, str]] = [
        ("model", title, f"{s.kind.upper()}, L={s.num_layers}, Hkv/rank={s.num_kv_heads}, D={s.head_dim}, "
                         f"f={s.factor}, kv dtype {kv_label or s.kv_dtype}" + (f", tp={pl.tp}" if pl.tp > 1 else "")),
    ]
    if params is not None:
        rows.append(("parameters", f"{params / 1e9:,.2f} billion", f"{params:,}" + (", every expert resident" if moe
                                                                                      else "")))
    rows += [
        ("KV bytes / token", h(pl.bytes_per_token), f"{pl.bytes_per_token:,} B"),
        ("KV bytes / block", h(pl.bytes_per_block), f"{pl.bytes_per_block:,} B = {pl.block_size} tokens"),
        ("KV bytes / request", h(pl.kv_bytes_per_request), f"{pl.kv_bytes_per_request:,} B = {pl.context:,} tokens"),
    ]
    if pl.budget_bytes is not None:
        if pl.requested_bytes is not None:
            rows += [("GPU memory", h(pl.total_bytes), f"{pl.total_bytes:,} B" + (" (pooled)" if pl.pooled else "")),
                     ("requested", h(pl.requested_bytes), f"ceil(GPU × {float(pl.util):g}) = {pl.requested_bytes:,} B"),
                     ("weights", h(pl.weights_bytes), f"{pl.weights_bytes:,} B" + _weights_note(pl, weights_from)),
                     ("activations", h(pl.activations_bytes), f"{pl.activations_bytes:,} B"),
                     ("CUDA graphs", h(pl.cudagraph_bytes), f"{pl.cudagraph_bytes:,} B")]
        rows += [
            ("KV budget", h(pl.budget_bytes), f"{pl.budget_bytes:,} B" +
             (" (kv_cache_memory_bytes)" if pl.kv_cache_memory_bytes is not None else "")),
            ("blocks", f"{pl.num_blocks:,}", f"{pl.budget_bytes / pl.bytes_per_block:,.4f} unrounded; block 0 is null"),
            ("usable blocks", f"{pl.usable_blocks:,}", f"{pl.token_slots:,} token slots"),
            ("blocks / request", f"{pl.blocks_per_request:,}", f"cdiv({pl.context:,}, {pl.block_size}); "
                                                                f"tail waste {pl.tail_waste_tokens} slots"),
            ("concurrency", f"{pl.concurrency:,}", f"{pl.concurrency_exact:,.4f} = budget / KV per request"),
            ("block-pool concurrency", f"{pl.concurrency_blocks:,}", "usable blocks // blocks per request"),
        ]
    if pl.host_offload_bytes is not None:
        rows += _host_rows(pl)
    if prefill is not None:
        rows += _prefill_rows(prefill)
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{a:<{w[0]}}  {b:>{w[1]}}  {c}" for a, b, c in rows]
    lines += [f"warning: {x}" for x in warnings]
    return "\n".join(lines)


PREFILL_NOTE = ("one layer's prefill attention temporaries on one rank, estimated from shapes "
                "(kvjax.accounting.prefill); not in the budget, whose activations are --activations-gib")


def _prefill(spec: KVSpec, pl: bud.Plan, args) -> PrefillTemporaries:
    """The estimate for the whole model's `spec` (one rank's share of it under pl's TP), a chunk of
    --max-num-batched-tokens at the end of the plan's context."""
    tokens = args.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    try:
        return prefill_temporaries(spec, tokens, pl.context, pl.block_size, tp=1 if pl.pooled else pl.tp)
    except SpecError as e:
        raise UsageError(str(e)) from None


def _prefill_rows(p: PrefillTemporaries) -> list[tuple[str, str, str]]:
    """Two labelled estimates, outside the budget: the tiled attention kvjax runs, and the untiled scores."""
    h = bud.human_bytes
    return [("prefill attn, tiled*", h(p.tiled_bytes),
             f"{p.tiled_bytes:,} B: one layer, {p.tokens:,} new tokens over {p.positions:,} positions, {p.heads} "
             "query heads per rank"),
            ("untiled scores*", h(p.reference_scores_bytes),
             f"f32 {p.tokens:,} × {p.heads} × {p.positions:,} × 4 B per score array (the reference holds two)"),
            ("", "", "* estimates, not in the budget (its activations: --activations-gib); kvjax memory measures")]


def _weights_note(pl: bud.Plan, weights_from: str | None) -> str:
    """How the weights row came about: from the parameters (" = N parameters × bf16"), and a rank's share."""
    split = pl.tp > 1 and not pl.pooled
    if weights_from:
        return f" = {weights_from}" + (f" ÷ {pl.tp} ranks" if split else "")
    return f" (1/{pl.tp} per rank)" if split else ""


def _hybrid(pl: bud.Plan, windows, args) -> tuple[hybrid.GroupPlan, hybrid.GroupPlan] | None:
    """vLLM's hybrid KV cache groups and their all-full fallback on the plan's budget (None without one,
    or when the weights leave none: the plan's warning says so)."""
    if pl.budget_bytes is None or pl.budget_bytes <= 0:
        return None
    kw = dict(block_size=pl.block_size, max_model_len=pl.context,
              max_num_batched_tokens=args.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS,
              max_concurrent_batches=1 if args.async_scheduling is False else 2)
    try:
        return (hybrid.plan_groups(pl.spec, windows, pl.budget_bytes, **kw),
                hybrid.plan_groups(pl.spec, all_full(windows), pl.budget_bytes, **kw))
    except HybridError as e:
        raise UsageError(str(e)) from None


def _group_names(gp: hybrid.GroupPlan) -> str:
    """"6 × sliding_window 1024 (9, 9, 9, 9, 8, 8 layers) + 1 × full_attention (10)"."""
    kinds: dict[str, list[int]] = {}
    for g in gp.groups:
        kinds.setdefault(g.kind + (f" {g.window}" if g.kind == "sliding_window" else ""), []).append(len(g.layers))
    return " + ".join(f"{len(n)} × {k} ({', '.join(map(str, n))} layers)" for k, n in kinds.items())


def format_hybrid(hyb: hybrid.GroupPlan, full: hybrid.GroupPlan | None) -> str:
    """The hybrid KV cache beside vLLM's fallback that caches every layer as full attention (a model with
    Mamba layers has none: `format_mamba`)."""
    if full is None:
        return format_mamba(hyb, _group_names(hyb))
    in_flight = f"in flight: {hyb.in_flight_tokens:,} tokens"
    rows = [("", "hybrid KV cache", "every layer full (--disable-hybrid-kv-cache-manager)"),
            ("KV cache groups", _group_names(hyb), _group_names(full)),
            ("bytes / block", f"{hyb.bytes_per_block:,} B", f"{full.bytes_per_block:,} B"),
            ("blocks", f"{hyb.num_blocks:,}", f"{full.num_blocks:,}"),
            ("blocks / request", f"{sum(hyb.blocks_per_request):,} ({in_flight})", f"{sum(full.blocks_per_request):,}"),
            ("KV cache size", f"{hyb.kv_cache_tokens:,} tokens", f"{full.kv_cache_tokens:,} tokens"),
            ("max concurrency", f"{hyb.max_concurrency:,.2f}x", f"{full.max_concurrency:,.2f}x"),
            ("block-pool concurrency", f"{hyb.admitted:,}", f"{full.admitted:,}")]
    w = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join(f"{a:<{w[0]}}  {b:<{w[1]}}  {c}".rstrip() for a, b, c in rows)


def _group_json(gp: hybrid.GroupPlan | None) -> dict[str, Any] | None:
    if gp is None:
        return None
    mamba = {} if gp.state is None else {"mamba_state": {
        "shapes": [list(s) for s in gp.state.shapes], "dtypes": list(gp.state.dtypes), "bytes": gp.state.page_bytes},
        "requested_block_size": gp.requested_block_size, "block_size": gp.block_size}
    return {**mamba, "groups": [{"type": g.kind, "sliding_window": g.window if g.kind == "sliding_window" else None, "layers": list(g.layers),
                        "block_bytes": g.block_bytes} for g in gp.groups],
            "bytes_per_block": gp.bytes_per_block, "num_blocks": gp.num_blocks,
            "blocks_per_request": list(gp.blocks_per_request), "in_flight_tokens": gp.in_flight_tokens,
            "kv_cache_tokens": gp.kv_cache_tokens, "max_concurrency": gp.max_concurrency,
            "block_pool_concurrency": gp.admitted}


def _host_rows(pl: bud.Plan) -> list[tuple[str, str, str]]:
    """The host tier beside the device: vLLM's kv_offloading_size, split over the TP ranks."""
    h = bud.human_bytes
    split = pl.tp > 1 and not pl.pooled
    rows = [("host tier", h(pl.host_offload_bytes), f"{pl.host_offload_bytes:,} B" +
             (f", 1/{pl.tp} per rank = {h(pl.host_bytes)}" if split else "")),
            ("host blocks", f"{pl.num_host_blocks:,}", f"{pl.host_bytes / pl.bytes_per_block:,.4f} unrounded"
                                                       + (" per rank" if split else "") + "; no null block"),
            ("host token slots", f"{pl.host_tokens:,}", f"{pl.num_host_blocks:,} × {pl.block_size}")]
    if pl.total_tokens is not None:
        rows.append(("device + host tokens", f"{pl.total_tokens:,}", f"{pl.token_slots:,} + {pl.host_tokens:,}"))
    return rows


def _plot_concurrency(inputs: dict[str, Any], path: str) -> None:
    plt = pyplot()
    contexts = [2**k for k in range(10, 18)]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for dtype in ("bf16", "fp8"):
        spec = inputs["spec"].replace(kv_dtype=dtype)
        ys = [bud.plan(spec, **{**inputs["kw"], "context": c}).concurrency or 0 for c in contexts]
        ax.plot(contexts, ys, marker="o", label=f"{dtype} KV")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("max concurrent requests")
    ax.set_title(f"{inputs['title']}: concurrency vs context")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, "--plot", dpi=120)
    plt.close(fig)

