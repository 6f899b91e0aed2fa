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

import functools
import json
import os

from kvjax import budget as bud

# The JAX GPU allocator's settings, recorded with each report (XLA_CLIENT_MEM_FRACTION is the newer
# name of XLA_PYTHON_CLIENT_MEM_FRACTION).
ALLOCATOR_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS")
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

    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = [_leaf_maker(tuple(leaf.shape), str(leaf.dtype), sharding)(key)
            for key, leaf, sharding in zip(keys, leaves, jax.tree_util.tree_leaves(shardings))]
    return jax.tree_util.tree_unflatten(treedef, made)


@functools.lru_cache(maxsize=None)
def _leaf_maker(shape: tuple[int, ...], dtype: str, sharding):
    """One compiled generator per (shape, dtype, sharding): a model's layers share a handful."""
    import jax
    import jax.numpy as jnp

    if len(shape) == 1:
        return jax.jit(lambda key: jnp.ones(shape, dtype), out_shardings=sharding)
    return jax.jit(lambda key: jax.random.normal(key, shape, dtype) * jnp.asarray(0.02, dtype),
                   out_shardings=sharding)


def _load_params(folder, config, layout, shardings, shapes, seed: int):
    """The weights, placed by `shardings` (checkpoint: loaded onto the default device, kv heads
    repeated for tp > Hkv, then put in their shards; preset: random, made in place)."""
    import jax

    from kvjax import sharding as shd
    from models.loader import load_params

    if folder is None:
        return _random_params(shapes, shardings, seed)
    params = shd.replicate_kv_heads(load_params(folder, config), layout, config.head_dim or 0)
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


class _Setup:
    """Everything fixed before a byte is allocated: model, layout, mesh, shapes and shardings."""

    def __init__(self, args):
        import jax

        from kvjax import sharding as shd
        from models import build_model, param_shapes

        self.config, self.folder, self.name = _config(args)
        self.spec = self.config.kv_spec(args.kv_dtype)
        self.layout = shd.tp_layout(self.spec, args.tp)
        self.mesh = shd.make_mesh(args.tp)
        self.devices = list(self.mesh.devices.flat)
        self.platform = self.devices[0].platform
        replicas = self.layout.head_replicas
        # tp > Hkv: the model runs with each kv head repeated (kvjax.sharding), the same function.
        self.model = build_model(self.config if replicas == 1 else
                                 self.config.replace(num_kv_heads=self.layout.cache_kv_heads))
        self.shapes = param_shapes(self.model)
        self.param_shardings = shd.param_shardings(self.shapes, self.mesh)
        self.whole = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self.num_params = sum(x.size for x in jax.tree_util.tree_leaves(param_shapes(build_model(self.config))))
        self.block_size = args.block_size
        self.max_model_len = args.max_model_len or min(self.config.max_position_embeddings, 8192)

    def make_cache(self, num_blocks: int):
        from kvjax.cache import PagedCache

        return lambda: PagedCache.create(self.layout.cache_spec, num_blocks, self.block_size)

    def abstract(self, tree, shardings=None):
        """ShapeDtypeStructs of `tree` carrying shardings (replicated when none are given)."""
        import jax

        if shardings is None:
            shardings = jax.tree_util.tree_map(lambda _: self.whole, tree)
        return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      tree, shardings)


def _profile(setup: _Setup, params, compiled, plan_mem, inputs, profile_blocks) -> dict:
    """Step 2: run the compiled profiling step once; the activation peak per device."""
    import jax

    from kvjax import memory as mem
    from kvjax import sharding as shd

    devices = setup.devices
    cache_shardings = shd.cache_shardings(jax.eval_shape(setup.make_cache(profile_blocks)), setup.mesh)
    cache = jax.jit(setup.make_cache(profile_blocks), out_shardings=cache_shardings)()
    cache_bytes = [mem.tree_bytes_on(cache, d) for d in devices]
    base = mem.snapshot(devices)  # weights + profile cache (+ anything else alive)
    peak_before = [mem.peak_bytes(d) for d in devices]
    ids, md, rows = shd.replicated(setup.mesh, inputs)
    input_bytes = mem.tree_bytes_on((ids, md, rows), devices[0])
    live_at_call = mem.snapshot(devices)
    logits, cache = compiled(params, ids, md, cache, rows)
    jax.block_until_ready((logits, cache))
    peak_after = [mem.peak_bytes(d) for d in devices]
    extra = plan_mem.temp + plan_mem.output - plan_mem.alias
    if peak_after[0] is None:  # CPU: live arrays at the call + XLA's temporaries and new outputs
        peaks = [live + extra for live in live_at_call]
        how = "no allocator stats (cpu): live arrays at the call + XLA temp + unaliased outputs"
    else:
        peaks, how = peak_after, "allocator peak_bytes_in_use"
    # An earlier peak (weight loading) above the profile's hides it: measured is then unknown.
    measured = [None if before is not None and peak <= before else peak - b
                for peak, before, b in zip(peaks, peak_before, base)]
    analytic = input_bytes + extra
    return {"tokens": int(inputs[0].shape[0]), "how": how, "peak_bytes": peaks, "base_bytes": base,
            "xla_temp": plan_mem.temp, "xla_output": plan_mem.output, "xla_alias": plan_mem.alias,
            "inputs": input_bytes, "profile_cache_bytes": cache_bytes, "analytic": analytic,
            "measured": measured, "peak_hidden_by_earlier_peak": any(m is None for m in measured),
            # non-KV uses the measured peak, or XLA's plan where the device could not show it
            "activations": max(analytic if m is None else m for m in measured)}


def _allocate(setup: _Setup, num_blocks: int, max_num_seqs: int) -> dict:
    """Step 4: pages (with int8's per-slot scale pages), then static scales and counters, then the
    block tables, each measured as the increase of bytes in use on every device."""
    import jax
    import jax.numpy as jnp

    from kvjax import memory as mem
    from kvjax import sharding as shd

    make = setup.make_cache(num_blocks)
    shapes = jax.eval_shape(make)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    shardings = jax.tree_util.tree_leaves(shd.cache_shardings(shapes, setup.mesh))
    groups = {"pages": [i for i, x in enumerate(leaves) if x.ndim >= 2],
              "static": [i for i, x in enumerate(leaves) if x.ndim < 2]}
    made, snaps = [None] * len(leaves), [mem.snapshot(setup.devices)]
    for want in groups.values():
        arrays = jax.jit(lambda want=want: [jax.tree_util.tree_leaves(make())[i] for i in want],
                         out_shardings=[shardings[i] for i in want])()
        jax.block_until_ready(arrays)
        snaps.append(mem.snapshot(setup.devices))
        for i, a in zip(want, arrays):
            made[i] = a
    cache = jax.tree_util.tree_unflatten(treedef, made)
    width = -(-setup.max_model_len // setup.block_size)
    tables = jax.device_put(jnp.zeros((max_num_seqs, width), jnp.int32), setup.whole)  # i32[B, M]
    jax.block_until_ready(tables)
    snaps.append(mem.snapshot(setup.devices))
    return {"cache": cache, "tables": tables, "snapshots": snaps,
            "page_arrays": [shd.shard_nbytes(leaves[i], shardings[i]) for i in groups["pages"]],
            "static_arrays": [shd.shard_nbytes(leaves[i], shardings[i]) for i in groups["static"]],
            "table_bytes": max_num_seqs * width * 4}


def measure(args) -> dict:
    """Steps 1-5 of the module docstring; returns the report `render` prints."""
    import jax

    from kvjax import memory as mem
    from kvjax import sharding as shd

    setup = _Setup(args)
    devices, platform, z = setup.devices, setup.platform, args.block_size

    # Compile the profiling step from shapes alone, before any weight is on the device: a GPU
    # compile's autotuning scratch then peaks while the device is empty and cannot hide the
    # profile's peak later.
    ids, md, rows, profile_blocks = _profile_inputs(setup.config, args.max_num_batched_tokens, z)
    cache_shapes = jax.eval_shape(setup.make_cache(profile_blocks))
    step = shd.make_sharded_step(setup.model, setup.mesh, cache_shapes)
    compiled = step.lower(setup.abstract(setup.shapes, setup.param_shardings), setup.abstract(ids),
                          setup.abstract(md),
                          setup.abstract(cache_shapes, shd.cache_shardings(cache_shapes, setup.mesh)),
                          setup.abstract(rows)).compile()
    plan_mem = mem.analyse(compiled)

    # 1. Weights.
    start = mem.snapshot(devices)
    params = _load_params(setup.folder, setup.config, setup.layout, setup.param_shardings, setup.shapes, args.seed)
    jax.block_until_ready(params)
    loaded = mem.snapshot(devices)
    weights_measured = [b - a for a, b in zip(start, loaded)]

    # 2. Profile.
    profile = _profile(setup, params, compiled, plan_mem, (ids, md, rows), profile_blocks)
    del ids, md, rows

    # 3. Budget, for the layout one rank holds, on one device.
    total = bud.gib(args.total_gib, "--total-gib") if args.total_gib is not None else mem.bytes_limit(devices[0])
    if total is None:
        raise ValueError(f"the {platform} device reports no memory limit: pass --total-gib")
    weights_used, activations = max(weights_measured), profile["activations"]
    plan = bud.plan(setup.layout.rank_spec, context=setup.max_model_len, block_size=z, total_bytes=total,
                    util=args.util, weights_bytes=weights_used, activations_bytes=activations)
    if plan.num_blocks < 2:
        raise ValueError(f"the budget leaves {plan.num_blocks} blocks of {plan.bytes_per_block:,} B "
                         f"(requested {plan.requested_bytes:,} B, non-KV {weights_used + activations:,} B): "
                         "no usable block; raise --total-gib or --util, or lower --max-num-batched-tokens")

    # 4. Allocate.
    alloc = _allocate(setup, plan.num_blocks, args.max_num_seqs)
    before_kv, after_pages, after_static, after_tables = alloc["snapshots"]

    # 5. Reconcile, device by device.
    weight_arrays = [shd.shard_nbytes(x, s) for x, s in zip(jax.tree_util.tree_leaves(setup.shapes),
                                                            jax.tree_util.tree_leaves(setup.param_shardings))]
    analytic = {"weights": shd.tree_shard_nbytes(setup.shapes, setup.param_shardings),
                "kv pages": plan.num_blocks * setup.layout.rank_spec.bytes_per_block(z),
                "scales + counters": mem.cache_static_bytes(setup.layout.rank_spec),
                "block tables": alloc["table_bytes"]}
    arrays = {"weights": weight_arrays, "kv pages": alloc["page_arrays"],
              "scales + counters": alloc["static_arrays"], "block tables": [alloc["table_bytes"]]}
    per_device = []
    for d, dev in enumerate(devices):
        measured = {"weights": weights_measured[d], "kv pages": after_pages[d] - before_kv[d],
                    "scales + counters": after_static[d] - after_pages[d],
                    "block tables": after_tables[d] - after_static[d]}
        rows_d = [mem.Row(k, analytic[k], measured[k], mem.explain_arrays(analytic[k], measured[k], arrays[k],
                                                                           platform)) for k in analytic]
        act = profile["measured"][d]
        rows_d.append(mem.Row("activation peak", profile["analytic"], act,
                              _explain_activations(profile["analytic"], act, platform)))
        resident, expected = after_tables[d] - start[d], sum(analytic.values())
        rows_d.append(mem.Row("total resident", expected, resident,
                              "weights + KV + scales + tables; the profile's buffers were freed"
                              if resident == expected else
                              "in use now − in use before the weights; beyond the rows above: buffers the "
                              "runtime keeps for the compiled step (constants) and allocator rounding"))
        per_device.append({"device": str(dev), "rows": [r.to_json() for r in rows_d],
                           "shard_kv_bytes": mem.tree_bytes_on(
                               [x for x in jax.tree_util.tree_leaves(alloc["cache"]) if x.ndim >= 2], dev)})
    rows0 = per_device[0]["rows"]
    same = all([r["measured"] for r in p["rows"]] == [r["measured"] for r in rows0] for p in per_device)
    del alloc, params
    return {
        "model": setup.name, "model_type": setup.config.model_type, "dtype": setup.config.dtype,
        "kv_dtype": setup.spec.kv_dtype, "params": setup.num_params, "platform": platform,
        "devices": [str(d) for d in devices], "tp": args.tp,
        "kv_heads_per_rank": setup.layout.kv_heads_per_rank, "kv_head_replicas": setup.layout.head_replicas,
        "block_size": z, "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "max_model_len": setup.max_model_len, "weights_bytes_before": start, "weights_bytes_after": loaded,
        "profile": profile, "non_kv_bytes": weights_used + activations, "total_bytes": total,
        "total_source": "--total-gib" if args.total_gib is not None else
        "device bytes_limit: the JAX allocator's pool, XLA_CLIENT_MEM_FRACTION × memory",
        "plan": plan.to_json(), "num_blocks": plan.num_blocks, "device_stats": devices[0].memory_stats(),
        "allocator_env": {k: os.environ.get(k) for k in ALLOCATOR_ENV},
        "kv_measured_over_analytic": rows0[1]["ratio"], "devices_agree": same,
        "rows": rows0, "per_device": per_device,
    }


def _explain_activations(analytic: int, measured: int | None, platform: str) -> str:
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
