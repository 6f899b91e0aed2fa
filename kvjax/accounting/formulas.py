"""The simulator's arithmetic in one place, written so that it also runs in a browser.

`kvjax plan` (through kvjax.accounting.budget and kvjax.accounting.prefill) and the calculator page
(`kvjax plan --html FILE`, `kvjax serve`'s `/`) compute the same numbers with these functions:
Python calls them, and kvjax.utils.pyjs compiles this file to JavaScript for the static page, so
the page's arithmetic is this file, never a second implementation by hand (SPEC "The simulator",
"Budget → blocks"):

    bytes per token = f × L × K × (bytes of one vector of H elements)      (per rank)
    requested       = ceil(total × util)
    budget          = requested − weights / tp − activations − CUDA graphs (or kv_cache_memory_bytes)
    num_blocks      = budget // bytes per block; usable = num_blocks − 1 (block 0 is the null block)
    concurrency     = budget // (bytes per token × T), beside budget / that unrounded, and
                      usable // cdiv(T, Z), what the block pool admits

The file keeps to the part of Python the compiler knows (kvjax.utils.pyjs): functions of ints,
strings, None, lists and dicts with string keys; `//`, `%` and comparisons on ints, `/` giving a
float; f-strings with the format specs `,` `,.0f` `,.6g`; `for` over a list or a tuple; `cdiv`,
`max`, `min`, `abs`, `int`, `len`; and `raise FormulaError(...)`. Exact decimals (GiB, the
utilization) come in as (numerator, denominator) pairs, so every byte count is an exact integer
in both languages (JavaScript runs these ints as BigInt). No imports beyond these, no JAX.
"""
from __future__ import annotations

from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv

KiB = 1024
MiB = 1024 * 1024
GiB = 1024 * 1024 * 1024
DEFAULT_UTIL = [23, 25]  # 0.92, vLLM's default gpu_memory_utilization
# The points the calculator plots concurrency at: contexts 1K .. 1M and utilizations 0.50 .. 1.00.
CONTEXT_POINTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576]
UTIL_POINTS = [[50, 100], [55, 100], [60, 100], [65, 100], [70, 100], [75, 100], [80, 100], [85, 100], [90, 100],
               [92, 100], [95, 100], [100, 100]]
# kvjax.attention.tiled.PrefillTiles' defaults (tests/accounting/test_prefill.py keeps them equal; that
# module imports JAX, which kvjax plan does not), and bf16 queries and outputs.
Q_TILE = 128
KV_TOKENS = 256
ACTIVATION_BYTES = 2


class FormulaError(KvjaxError):
    """An input the arithmetic cannot take; the message names it."""


def human_bytes(n):
    """1024-based units, exact where the value is a whole number of the unit."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            v = n / size
            return f"{v:,.0f} {unit}" if v == int(v) else f"{v:,.6g} {unit}"
    return f"{n:,} B"


def gib_bytes(num, den):
    """num/den GiB as whole bytes, a fractional byte rounded up (num, den: an exact decimal)."""
    return cdiv(num * GiB, den)


def weight_bytes(params, num, den):
    """params × num/den bytes per parameter, a fractional byte rounded up."""
    return cdiv(params * num, den)


def vector_bytes(dim, bits, group, group_scale_bytes, vector_scale_bytes):
    """Exact bytes of one cached vector of dim elements in a KV format (kvjax.quant.kv_formats):
    its elements, one scale per `group` of them, one scale per vector."""
    if (dim * bits) % 8 != 0:
        raise FormulaError(f"head dim {dim} × {bits} bits is not a whole number of bytes")
    scales = cdiv(dim, group) * group_scale_bytes if group > 0 else 0
    return dim * bits // 8 + scales + vector_scale_bytes


def kv_budget(per_token, per_block, context, block_size, total_bytes, util_num, util_den, weights, activations,
              cudagraph, kv_cache_memory_bytes):
    """Budget → blocks → concurrency for one device whose layout costs per_token and per_block
    bytes (weights: this device's share; total_bytes None: no budget). → a dict of the figures and
    their warnings (kvjax.accounting.budget.Plan's fields)."""
    per_request = per_token * context
    blocks_per_request = cdiv(context, block_size)
    out = {"bytes_per_token": per_token, "bytes_per_block": per_block, "kv_bytes_per_request": per_request,
           "blocks_per_request": blocks_per_request, "tail_waste_tokens": blocks_per_request * block_size - context,
           "requested_bytes": None, "budget_bytes": None, "num_blocks": None, "usable_blocks": None,
           "token_slots": None, "concurrency": None, "concurrency_exact": None, "concurrency_blocks": None}
    warnings = []
    budget = None
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes  # vLLM: overrides utilization and profiling entirely
    elif total_bytes is not None:
        requested = cdiv(total_bytes * util_num, util_den)
        out["requested_bytes"] = requested
        budget = requested - weights - activations - cudagraph
    else:
        warnings.append("no GPU memory given (--device-memory-gib or --kv-cache-memory-bytes): budget not computed")
    if budget is not None:
        if budget <= 0:
            warnings.append(f"non-KV memory exceeds the requested memory by {-budget} bytes: no KV budget")
        num_blocks = max(0, budget // per_block)
        usable = max(0, num_blocks - 1)
        conc = max(0, budget // per_request)
        conc_blocks = usable // blocks_per_request
        out["budget_bytes"] = budget
        out["num_blocks"] = num_blocks
        out["usable_blocks"] = usable
        out["token_slots"] = usable * block_size
        out["concurrency"] = conc
        out["concurrency_exact"] = max(0.0, budget / per_request)
        out["concurrency_blocks"] = conc_blocks
        if budget > 0 and conc == 0:
            warnings.append(f"budget {human_bytes(budget)} cannot hold one request of {context} tokens "
                            f"({human_bytes(per_request)}): concurrency 0")
        elif conc_blocks == 0 and budget > 0:
            warnings.append(f"the block pool ({usable} usable blocks) cannot hold one request of "
                            f"{blocks_per_request} blocks")
    out["warnings"] = warnings
    return out


def host_tier(host_offload_bytes, tp, pooled, per_block, block_size, token_slots):
    """vLLM's kv_offloading_size split over the ranks, in blocks of the device's layout (no null
    block on the host). → (the figures, a warning or None)."""
    host_bytes = host_offload_bytes if pooled else host_offload_bytes // tp
    num_host = host_bytes // per_block
    warning = None
    if num_host == 0:
        warning = (f"host tier of {host_bytes} bytes per device is smaller than one block of {per_block} bytes: "
                   "no host blocks")
    total = None if token_slots is None else token_slots + num_host * block_size
    return {"host_offload_bytes": host_offload_bytes, "host_bytes": host_bytes, "num_host_blocks": num_host,
            "host_tokens": num_host * block_size, "total_tokens": total}, warning


def prefill(tokens, context, block_size, heads, kv_heads, key_dim, value_dim, activation_bytes, q_tile, kv_tokens):
    """One layer's prefill attention temporaries on one rank (kvjax.accounting.prefill's docstring):
    the untiled reference's f32 score array and the tiled form's working set, in bytes."""
    width = cdiv(context, block_size)  # the block table's entries
    positions = width * block_size
    tq = min(q_tile, tokens)
    tk = max(1, min(kv_tokens // block_size, width)) * block_size  # tiled.PrefillTiles.pages_per_tile × Z
    tiled = ((tokens + tq) * heads * (key_dim + value_dim) * activation_bytes  # q and the output, padded by a tile
             + 2 * heads * tq * tk * 4  # f32 scores and their exponentials
             + heads * tq * (key_dim + value_dim) * 4  # the f32 q tile and accumulator
             + tk * kv_heads * (key_dim + value_dim) * 4)  # the f32 K and V tiles
    scores = tokens * heads * positions * 4
    return {"tokens": tokens, "positions": positions, "heads": heads, "reference_scores_bytes": scores,
            "reference_bytes": 2 * scores, "tiled_bytes": tiled}


def page_plan(p):
    """What `kvjax plan --json` prints for the calculator's inputs `p` (a dict: the model's shape
    kind, num_layers, num_heads, num_kv_heads, head_dim, kv_lora_rank; fmt, the KV format's bits,
    group, group_scale_bytes and vector_scale_bytes; context, block_size, tp, batched_tokens;
    exact decimals as [num, den] pairs: total_gib (None: no budget), util (None: 0.92), weights_gib
    (None: params × weight_bytes; params None too: 0), activations_gib, cudagraph_gib). The static
    page's whole computation; tests hold it equal to `kvjax plan --json` on a table of configs."""
    tp = p["tp"]
    mla = p["kind"] == "mla"
    kv = p["num_kv_heads"]
    if not mla and p["num_heads"] % kv != 0:  # the rules of kvjax.core.kv_cache_interface.KVSpec, in its words
        raise FormulaError(f"num_kv_heads {kv} does not divide num_heads {p['num_heads']}")
    if tp < 1 or p["num_heads"] % tp != 0:
        raise FormulaError(f"tp {tp} does not divide the {p['num_heads']} query heads")
    if not mla and kv % tp != 0 and tp % kv != 0:
        raise FormulaError(f"tp {tp} and {kv} kv heads: one must divide the other")
    rank_kv = 1 if mla else max(1, kv // tp)
    rank_heads = p["num_heads"] if mla else p["num_heads"] // tp
    f = 1 if mla else 2
    fmt = p["fmt"]
    per_token = f * p["num_layers"] * rank_kv * vector_bytes(p["head_dim"], fmt["bits"], fmt["group"],
                                                            fmt["group_scale_bytes"], fmt["vector_scale_bytes"])
    util = DEFAULT_UTIL if p["util"] is None else p["util"]
    if util[0] <= 0 or util[0] > util[1]:
        raise FormulaError(f"--gpu-memory-utilization must be in (0, 1], got {util[0] / util[1]}")
    warnings = []
    if p["weights_gib"] is not None:
        weights = gib_bytes(p["weights_gib"][0], p["weights_gib"][1])
    elif p["params"] is not None:
        weights = weight_bytes(p["params"], p["weight_bytes"][0], p["weight_bytes"][1])
    else:
        weights = 0
        warnings.append("no --weights-gib or --params-b: weights counted as 0")
    total = None if p["total_gib"] is None else gib_bytes(p["total_gib"][0], p["total_gib"][1])
    activations = gib_bytes(p["activations_gib"][0], p["activations_gib"][1])
    cudagraph = gib_bytes(p["cudagraph_gib"][0], p["cudagraph_gib"][1])
    out = kv_budget(per_token, p["block_size"] * per_token, p["context"], p["block_size"], total, util[0], util[1],
                    cdiv(weights, tp), activations, cudagraph, None)
    out["warnings"] = warnings + out["warnings"]
    out["tp"] = tp
    out["context"] = p["context"]
    out["block_size"] = p["block_size"]
    out["total_bytes"] = total
    out["weights_bytes"] = cdiv(weights, tp)
    out["activations_bytes"] = activations
    out["cudagraph_bytes"] = cudagraph
    out["util"] = util[0] / util[1]
    out["tail_waste_bytes"] = out["tail_waste_tokens"] * per_token
    out["budget_per_request"] = out["concurrency_exact"]
    value_dim = p["kv_lora_rank"] if mla else p["head_dim"]
    out["prefill_attention"] = prefill(p["batched_tokens"], p["context"], p["block_size"], p["num_heads"] // tp,
                                       rank_kv, p["head_dim"], value_dim, ACTIVATION_BYTES, Q_TILE, KV_TOKENS)
    out["spec"] = {"kind": p["kind"], "num_layers": p["num_layers"], "num_heads": rank_heads, "num_kv_heads": rank_kv,
                   "head_dim": p["head_dim"], "kv_lora_rank": p["kv_lora_rank"]}
    return out
