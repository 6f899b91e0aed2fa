"""`kvjax memory`: size the KV cache from a profiled budget, then check it against the device.

vLLM V1 sizes its cache at engine start (`gpu_worker.determine_available_memory`, SPEC "Budget
→ blocks"): load the weights, run one profiling forward over `max_num_batched_tokens` tokens,
read the allocator's peak, and give `ceil(total × gpu_memory_utilization) − non-KV` to KV
blocks. This command does the same on JAX devices and then allocates what it planned:

1. weights: bytes in use on each device before and after loading (or creating) them;
2. profile: one prefill of max_num_batched_tokens tokens (one sequence, logits of its last
   token). GPU: the allocator's `peak_bytes_in_use`; CPU, which keeps no allocator stats: the
   live arrays on the device plus the compiled step's `memory_analysis()` temp bytes.
   non-KV = weights + peak activations (the step's inputs, temporaries and outputs);
3. budget: total = the device's `bytes_limit` (GPU) or --total-gib; kvjax.budget.plan with the
   layout one tensor-parallel rank holds → num_blocks = available // bytes_per_block;
4. allocate the paged cache (pages, then its static scales and counters) and the block tables,
   measuring each increase;
5. reconcile, per device: analytic vs measured for weights, KV pages, scales, block tables and
   the activation peak, with ratio, byte difference and the reason for any difference.

--model takes a checkpoint folder, a built-in name (small-gqa, small-mla), or
`preset:NAME` for a models.config preset with random weights (e.g. preset:llama-3-8b, Llama-3-8B's
published shapes in bf16; nothing is downloaded). --tp N shards weights and cache over N devices
(kvjax.sharding); on CPU the command asks JAX for N host devices when it starts JAX itself.
"""
from __future__ import annotations

import json
import os

from kvjax import budget as bud

DEFAULTS = dict(block_size=bud.DEFAULT_BLOCK_SIZE, max_num_batched_tokens=2048, max_num_seqs=256, tp=1)


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="size the cache from a profiled budget; analytic vs measured bytes",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="small-gqa | small-mla | a Hugging Face folder | preset:NAME (random weights, "
                        "e.g. preset:llama-3-8b)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weights dtype (default: the model's)")
    p.add_argument("--util", help="gpu_memory_utilization in (0, 1] (default 0.92)")
    p.add_argument("--kv-dtype", help="kv cache dtype (default: the weights dtype): fp32, bf16, fp16, fp8, "
                                      "fp8_e5m2, int8_per_token_head")
    p.add_argument("--block-size", type=int, default=DEFAULTS["block_size"], help="tokens per block (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULTS["max_num_batched_tokens"],
                   help="tokens in the profiling forward (default 2048)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS["max_num_seqs"],
                   help="rows of the block tables (default 256)")
    p.add_argument("--max-model-len", type=int,
                   help="tokens per request: block-table width and the plan's context (default: "
                        "min(max_position_embeddings, 8192))")
    p.add_argument("--tp", type=int, default=DEFAULTS["tp"], help="tensor-parallel size (devices)")
    p.add_argument("--total-gib", help="memory of one device in GiB (required on CPU; default: bytes_limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of preset:NAME's random weights")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "tp"):
        value = getattr(args, name)
        if value is None or value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.max_model_len is not None and args.max_model_len <= 0:
        raise ValueError(f"--max-model-len must be a positive integer, got {args.max_model_len}")
    _ask_for_cpu_devices(args.tp)
    report = measure(args)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def _ask_for_cpu_devices(tp: int) -> None:
    """Give JAX's CPU backend tp devices if JAX has not started yet and no flag already says."""
    import jax

    if tp > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", tp)
        except RuntimeError:
            pass  # backends already started (a test, or an embedding program): use what exists


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------
def _config(args):
    """(ModelConfig, checkpoint folder or None for random weights, display name)."""
    from kvjax.commands.common import resolve_model
    from models.config import from_hf_config, preset

    if args.model.startswith("preset:"):
        config = preset(args.model.split(":", 1)[1])
        return (config.replace(dtype=args.dtype) if args.dtype else config), None, args.model
    folder = resolve_model(args.model)
    return from_hf_config(folder, dtype=args.dtype), folder, args.model


def _random_params(shapes, shardings, seed: int):
    """Random weights created in place, one leaf at a time (so the temporaries of one leaf, not of
    the whole tree, sit beside the weights): N(0, 0.02²) kernels and embeddings, 1.0 norm weights."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    out_shardings = jax.tree_util.tree_leaves(shardings)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = []
    for key, leaf, sharding in zip(keys, leaves, out_shardings):
        if leaf.ndim == 1:
            make = lambda k, leaf=leaf: jnp.ones(leaf.shape, leaf.dtype)  # noqa: E731
        else:
            make = lambda k, leaf=leaf: jax.random.normal(k, leaf.shape, leaf.dtype) * jnp.asarray(0.02, leaf.dtype)  # noqa: E731
        made.append(jax.jit(make, out_shardings=sharding)(key))
    return jax.tree_util.tree_unflatten(treedef, made)


def _load_params(folder, config, run_config, layout, mesh, shardings, shapes, seed):
    from kvjax import sharding as shd
    from models.loader import load_params

    if folder is None:
        return _random_params(shapes, shardings, seed)
    params = shd.replicate_kv_heads(load_params(folder, config), layout, config.head_dim or 0)
    import jax

    return jax.device_put(params, shardings)  # the unsharded tree is dropped on return


def _profile_inputs(config, tokens: int, block_size: int):
    """One sequence of `tokens` tokens in blocks 1..cdiv(tokens, Z): (tokens, metadata, logits row,
    blocks), as host arrays, so that they reach the devices only when the profile measures them."""
    import jax
    import numpy as np

    from kvjax.attention.metadata import build_metadata

    blocks = -(-tokens // block_size)
    md = build_metadata([0], [tokens], [list(range(1, blocks + 1))], block_size=block_size, max_tokens=tokens,
                        max_seqs=1, max_blocks_per_seq=blocks)
    md = jax.tree_util.tree_map(np.array, md)  # copies: a numpy view would keep the device buffer alive
    ids = (np.arange(tokens) % config.vocab_size).astype(np.int32)
    return ids, md, md.logits_indices.copy(), blocks + 1


def measure(args) -> dict:
    """Steps 1-5 of the module docstring; returns the report `render` prints."""
    import jax
    import jax.numpy as jnp

    from kvjax import memory as mem
    from kvjax import sharding as shd
    from kvjax.cache import PagedCache
    from models import build_model, param_shapes

    config, folder, name = _config(args)
    spec = config.kv_spec(args.kv_dtype)
    layout = shd.tp_layout(spec, args.tp)
    mesh = shd.make_mesh(args.tp)
    devices = list(mesh.devices.flat)
    platform = devices[0].platform
    run_config = config if layout.head_replicas == 1 else config.replace(num_kv_heads=layout.cache_kv_heads)
    model = build_model(run_config)
    shapes = param_shapes(model)
    p_shardings = shd.param_shardings(shapes, mesh)
    z, tokens = args.block_size, args.max_num_batched_tokens
    max_model_len = args.max_model_len or min(config.max_position_embeddings, 8192)

    # Compile the profiling step from shapes alone, before any weight is on the device: a GPU
    # compile's autotuning scratch then peaks while the device is empty and cannot hide the
    # profile's peak later.
    ids, md, rows, profile_blocks = _profile_inputs(config, tokens, z)
    make_profile_cache = lambda: PagedCache.create(layout.cache_spec, profile_blocks, z)  # noqa: E731
    cache_shapes = jax.eval_shape(make_profile_cache)
    c_shardings = shd.cache_shardings(cache_shapes, mesh)
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = lambda tree, s: jax.tree_util.tree_map(  # noqa: E731
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, s)
    step = shd.make_sharded_step(model, mesh, cache_shapes)
    inputs = (ids, md, rows)
    compiled = step.lower(abstract(shapes, p_shardings), *[abstract(x, jax.tree_util.tree_map(lambda _: whole, x))
                                                           for x in inputs[:2]],
                          abstract(cache_shapes, c_shardings), abstract(rows, whole)).compile()
    plan_mem = mem.analyse(compiled)

    # 1. Weights.
    start = mem.snapshot(devices)
    params = _load_params(folder, config, run_config, layout, mesh, p_shardings, shapes, args.seed)
    jax.block_until_ready(params)
    loaded = mem.snapshot(devices)
    weights_analytic = shd.tree_shard_nbytes(shapes, p_shardings)
    weight_arrays = [shd.shard_nbytes(x, s) for x, s in zip(jax.tree_util.tree_leaves(shapes),
                                                            jax.tree_util.tree_leaves(p_shardings))]
    weights_measured = [b - a for a, b in zip(start, loaded)]

    # 2. Profile.
    profile_cache = jax.jit(make_profile_cache, out_shardings=c_shardings)()
    profile_cache_bytes = [mem.tree_bytes_on(profile_cache, d) for d in devices]
    base = mem.snapshot(devices)  # weights + profile cache (+ anything else alive)
    peak_before = [mem.peak_bytes(d) for d in devices]
    ids, md, rows = shd.replicated(mesh, (ids, md, rows))
    input_bytes = mem.tree_bytes_on((ids, md, rows), devices[0])
    live_at_call = mem.snapshot(devices)
    logits, profile_cache = compiled(params, ids, md, profile_cache, rows)
    jax.block_until_ready((logits, profile_cache))
    peak_after = [mem.peak_bytes(d) for d in devices]
    act_analytic = input_bytes + plan_mem.temp + plan_mem.output - plan_mem.alias
    if peak_after[0] is None:  # CPU: live arrays at the call + XLA's temporaries
        peaks = [live + plan_mem.temp + plan_mem.output - plan_mem.alias for live in live_at_call]
        how = "cpu: live arrays at the call + XLA temp + unaliased outputs"
    else:
        peaks = peak_after
        how = "allocator peak_bytes_in_use"
    act_measured, hidden = [], False
    for d, (peak, before, b) in enumerate(zip(peaks, peak_before, base)):
        if before is not None and peak <= before:
            hidden = True  # an earlier peak (weight loading) stays above the profile's
            act_measured.append(None)
        else:
            act_measured.append(peak - b)
    del logits, profile_cache, ids, md, rows
    activations = max(a if a is not None else act_analytic for a in act_measured)

    # 3. Budget, for the layout one rank holds, on one device.
    total = bud.gib(args.total_gib, "--total-gib") if args.total_gib is not None else mem.bytes_limit(devices[0])
    if total is None:
        raise ValueError(f"the {platform} device reports no memory limit: pass --total-gib")
    weights_used = max(weights_measured)
    plan = bud.plan(layout.rank_spec, context=max_model_len, block_size=z, total_bytes=total, util=args.util,
                    weights_bytes=weights_used, activations_bytes=activations)
    if plan.num_blocks < 2:
        raise ValueError(f"the budget leaves {plan.num_blocks} blocks of {plan.bytes_per_block:,} B "
                         f"(requested {plan.requested_bytes:,} B, non-KV {weights_used + activations:,} B): "
                         "no usable block; raise --total-gib or --util, or lower --max-num-batched-tokens")

    # 4. Allocate: pages (and int8's per-slot scale pages), then static scales and counters, then tables.
    num_blocks = plan.num_blocks
    make_cache = lambda: PagedCache.create(layout.cache_spec, num_blocks, z)  # noqa: E731
    shapes_kv = jax.eval_shape(make_cache)
    leaves, treedef = jax.tree_util.tree_flatten(shapes_kv)
    kv_shardings = jax.tree_util.tree_leaves(shd.cache_shardings(shapes_kv, mesh))
    per_slot = [leaf.ndim >= 2 for leaf in leaves]

    def part(slot: bool):
        want = [i for i, s in enumerate(per_slot) if s == slot]
        make = lambda: [jax.tree_util.tree_leaves(make_cache())[i] for i in want]  # noqa: E731
        return want, jax.jit(make, out_shardings=[kv_shardings[i] for i in want])()

    before_kv = mem.snapshot(devices)
    page_idx, pages = part(True)
    jax.block_until_ready(pages)
    after_pages = mem.snapshot(devices)
    static_idx, static = part(False)
    jax.block_until_ready(static)
    after_static = mem.snapshot(devices)
    merged = [None] * len(leaves)
    for i, a in zip(page_idx + static_idx, pages + static):
        merged[i] = a
    cache = jax.tree_util.tree_unflatten(treedef, merged)
    table_width = -(-max_model_len // z)
    tables = jax.device_put(jnp.zeros((args.max_num_seqs, table_width), jnp.int32), whole)
    jax.block_until_ready(tables)
    after_tables = mem.snapshot(devices)

    # 5. Reconcile, device by device.
    kv_analytic = num_blocks * layout.rank_spec.bytes_per_block(z)
    static_analytic = mem.cache_static_bytes(layout.rank_spec)
    table_analytic = args.max_num_seqs * table_width * 4
    page_arrays = [shd.shard_nbytes(leaves[i], kv_shardings[i]) for i in page_idx]
    static_arrays = [shd.shard_nbytes(leaves[i], kv_shardings[i]) for i in static_idx]
    per_device = []
    for d, dev in enumerate(devices):
        measured = dict(weights=weights_measured[d], kv_pages=after_pages[d] - before_kv[d],
                        scales=after_static[d] - after_pages[d], block_tables=after_tables[d] - after_static[d])
        rows_d = [
            mem.Row("weights", weights_analytic, measured["weights"],
                    mem.explain_arrays(weights_analytic, measured["weights"], weight_arrays, platform)),
            mem.Row("kv pages", kv_analytic, measured["kv_pages"],
                    mem.explain_arrays(kv_analytic, measured["kv_pages"], page_arrays, platform)),
            mem.Row("scales + counters", static_analytic, measured["scales"],
                    mem.explain_arrays(static_analytic, measured["scales"], static_arrays, platform)),
            mem.Row("block tables", table_analytic, measured["block_tables"],
                    mem.explain_arrays(table_analytic, measured["block_tables"], [table_analytic], platform)),
            mem.Row("activation peak", act_analytic, act_measured[d],
                    _explain_activations(act_analytic, act_measured[d], platform, hidden)),
        ]
        total_analytic = weights_analytic + kv_analytic + static_analytic + table_analytic
        rows_d.append(mem.Row("total resident", total_analytic, after_tables[d] - start[d],
                              "weights + KV + scales + tables; the profile's buffers were freed"
                              if after_tables[d] - start[d] == total_analytic else
                              f"in use now minus in use before the weights: "
                              f"{after_tables[d] - start[d] - total_analytic:+,} B from the rows above"))
        per_device.append({"device": str(dev), "rows": [r.to_json() for r in rows_d],
                           "shard_kv_bytes": sum(x.nbytes for layer in cache.layers for x in _slot_arrays(layer, dev))})
    rows0 = per_device[0]["rows"]
    same = all([r["measured"] for r in p["rows"]] == [r["measured"] for r in rows0] for p in per_device)
    kv_row = rows0[1]
    del cache, pages, static, tables, params
    return {
        "model": name, "model_type": config.model_type, "dtype": config.dtype, "kv_dtype": spec.kv_dtype,
        "params": sum(x.size for x in jax.tree_util.tree_leaves(param_shapes(build_model(config)))),
        "platform": platform, "devices": [str(d) for d in devices], "tp": args.tp,
        "kv_heads_per_rank": layout.kv_heads_per_rank, "kv_head_replicas": layout.head_replicas,
        "block_size": z, "max_num_batched_tokens": tokens, "max_num_seqs": args.max_num_seqs,
        "max_model_len": max_model_len,
        "weights_bytes_before": start, "weights_bytes_after": loaded,
        "profile": {"tokens": tokens, "how": how, "peak_bytes": peaks, "base_bytes": base,
                    "xla_temp": plan_mem.temp, "xla_output": plan_mem.output, "xla_alias": plan_mem.alias,
                    "inputs": input_bytes, "profile_cache_bytes": profile_cache_bytes,
                    "peak_hidden_by_earlier_peak": hidden},
        "non_kv_bytes": weights_used + activations, "total_bytes": total,
        "total_source": "--total-gib" if args.total_gib is not None else "device bytes_limit",
        "plan": plan.to_json(), "num_blocks": num_blocks,
        "kv_measured_over_analytic": kv_row["ratio"], "devices_agree": same,
        "rows": rows0, "per_device": per_device,
    }


def _slot_arrays(layer, device):
    from kvjax.cache import KVPages

    arrays = [layer.k, layer.v] if isinstance(layer, KVPages) else [layer.latent]
    arrays += [a for a in ([layer.k_scale, layer.v_scale] if isinstance(layer, KVPages) else [layer.scale])
               if a is not None and a.ndim >= 2]
    return [s.data for a in arrays for s in a.addressable_shards if s.device == device]


def _explain_activations(analytic: int, measured: int | None, platform: str, hidden: bool) -> str:
    if measured is None:
        return ("the allocator's peak was set earlier (weight loading) and the profile stayed below it; "
                "the budget uses XLA's plan")
    if platform == "cpu":
        return "cpu keeps no allocator peak: measured is live arrays + XLA temp, so it equals XLA's plan"
    diff = measured - analytic
    if diff == 0:
        return "exact"
    return (f"allocator peak vs XLA's buffer plan: {diff:+,} B (256 B rounding of each buffer, buffers the "
            "runtime adds around the call)")


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------
def render(r: dict) -> str:
    p = r["plan"]
    h = bud.human_bytes
    lines = [
        f"kvjax memory: {r['model']} ({r['model_type']}, {r['params']:,} params, {r['dtype']}), kv {r['kv_dtype']}, "
        f"block {r['block_size']}, tp {r['tp']} on {r['platform']} ({', '.join(r['devices'])})",
        f"profile: one prefill of {r['max_num_batched_tokens']} tokens; peak from {r['profile']['how']}",
        f"budget: total {h(r['total_bytes'])} ({r['total_source']}) × util {p['util']:g} = requested "
        f"{p['requested_bytes']:,} B − non-KV {r['non_kv_bytes']:,} B (weights {p['weights_bytes']:,} + "
        f"activations {p['activations_bytes']:,}) = {p['budget_bytes']:,} B for KV",
        f"blocks: {p['budget_bytes']:,} // {p['bytes_per_block']:,} B per block = {r['num_blocks']:,} "
        f"({p['usable_blocks']:,} usable, {p['token_slots']:,} token slots); {p['concurrency_blocks']} concurrent "
        f"requests of {r['max_model_len']} tokens",
    ]
    if r["tp"] > 1:
        lines.append(f"tensor parallel: {r['kv_heads_per_rank']} kv head(s) per rank"
                     + (f", each kv head on {r['kv_head_replicas']} ranks" if r["kv_head_replicas"] > 1 else "")
                     + ("; MLA latent replicated on every rank" if r["kv_dtype"] and p["spec"]["kind"] == "mla" else "")
                     + f"; rows are device 0, all {r['tp']} devices "
                     + ("measure the same" if r["devices_agree"] else "DIFFER (see --json per_device)"))
    head = f"{'item':<18} {'analytic B':>16} {'measured B':>16} {'ratio':>10} {'diff B':>10}  note"
    lines += ["", head, "-" * len(head)]
    for row in r["rows"]:
        measured = "n/a" if row["measured"] is None else f"{row['measured']:,}"
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.6f}"
        diff = "n/a" if row["diff"] is None else f"{row['diff']:+,}"
        lines.append(f"{row['name']:<18} {row['analytic']:>16,} {measured:>16} {ratio:>10} {diff:>10}  {row['note']}")
    lines += ["", "analytic: weights = params × dtype bytes per device; kv pages = num_blocks × bytes_per_block "
                  "(kvjax.spec, per rank); activation peak = XLA memory_analysis of the profiled step (temp + "
                  "unaliased outputs + its inputs)"]
    for w in p["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
