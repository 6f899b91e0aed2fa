"""Memory budget → number of KV blocks → concurrency, the way vLLM V1 sizes its cache at start.

Reproduces SPEC "Budget → blocks" (vLLM `vllm/v1/worker/gpu_worker.py: determine_available_memory`
and `vllm/v1/core/kv_cache_utils.py: get_num_blocks`):

    requested  = ceil(total × gpu_memory_utilization)      (default 0.92; extensible KV cache
                                                             with util unset → 1.0)
    available  = requested − non-KV (weights + activations) − CUDA-graph estimate
                 (an explicit kv_cache_memory_bytes replaces all of this)
    num_blocks = available // bytes_per_block               (block 0 is the null block)
    usable     = num_blocks − 1

A host tier (vLLM's native CPU offloading, `--kv-offloading-size`, `vllm/config/kv_offloading.py`
and `vllm/v1/kv_offload/cpu.py`) keeps blocks of the same layout in host memory; the size is summed
over the TP ranks and each rank offloads its own shard into its 1/tp:

    host_blocks = (host_bytes // tp) // bytes_per_block    (no null block on the host)

and the simulator of SPEC "The simulator": concurrency = floor(budget / KV per request), shown
beside the unrounded value and beside what the block pool really admits,
floor(usable / cdiv(context, block_size)), which also pays for the tail block's waste.

The arithmetic is kvjax.accounting.formulas's (the calculator page compiles the same file to JavaScript);
this module reads and checks the inputs. Everything is exact integer/rational arithmetic: GiB inputs such as 65.2 are read as exact
decimals (Fraction), never as binary floats, and a fractional byte count is rounded UP
(a partially used byte is used). Pure Python, no JAX.
"""
from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any

from kvjax.accounting import formulas
from kvjax.core.kv_cache_interface import KVSpec, SpecError
from kvjax.math_utils import cdiv
from kvjax.utils.checks import MAX_GIB, check_int

KiB, MiB, GiB = 1024, 1024**2, 1024**3
DEFAULT_UTIL = Fraction("0.92")
DEFAULT_BLOCK_SIZE = 64
MAX_EXACT = 10**18  # bound on exact() inputs: parameters, GiB, utilization
# A decimal's text is bounded before Fraction builds it: Fraction("1e999999999") is exact and would
# take a billion digits (minutes of work), while no kvjax quantity needs more than these.
MAX_NUMBER_CHARS = 100
MAX_DECIMAL_EXPONENT = 400
_EXPONENT = re.compile(r"[eE]([+-]?\d+)\s*$")

WEIGHT_DTYPE_BYTES = {"fp32": Fraction(4), "bf16": Fraction(2), "fp16": Fraction(2), "fp8": Fraction(1),
                      "int8": Fraction(1), "int4": Fraction(1, 2)}


class BudgetError(SpecError):
    """A budget input that breaks a rule; the message names the value."""


def exact(value: Any, name: str = "value", limit: int | None = MAX_EXACT) -> Fraction:
    """An exact rational from an int, a decimal string, a float (read as its shortest decimal) or a Fraction."""
    if isinstance(value, bool):
        raise BudgetError(f"{name} must be a number, got {value!r}")
    if isinstance(value, Fraction):
        return value
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, str):
        found = _EXPONENT.search(value)
        if len(value) > MAX_NUMBER_CHARS or (found and abs(int(found.group(1)[:8])) > MAX_DECIMAL_EXPONENT):
            raise BudgetError(f"{name} must be a number of at most {MAX_NUMBER_CHARS} characters with an exponent "
                              f"of at most {MAX_DECIMAL_EXPONENT}, got {value[:40]!r}")
    try:
        result = Fraction(str(value)) if isinstance(value, (float, str)) else Fraction(value)
    except (ValueError, TypeError, ZeroDivisionError):
        raise BudgetError(f"{name} must be a number, got {value!r}") from None
    if limit is not None and abs(result) > limit:  # "1e400" is an exact Fraction, but no kvjax quantity is near it
        raise BudgetError(f"{name} must be at most {limit:.0e} in magnitude, got {str(value)[:40]!r}")
    return result


def gib(value: Any, name: str = "size") -> int:
    """GiB (1024³ bytes) in [0, MAX_GIB] → whole bytes, rounding a fractional byte up."""
    x = exact(value, name, limit=None)
    if not 0 <= x <= MAX_GIB:
        raise BudgetError(f"{name} must be in [0, {MAX_GIB:,}] GiB, got {str(value)[:40]!r}")
    return formulas.gib_bytes(x.numerator, x.denominator)


def utilization(value: Any, name: str = "util") -> Fraction:
    """gpu_memory_utilization as an exact rational in (0, 1]."""
    util = exact(value, name)
    if not 0 < util <= 1:
        raise BudgetError(f"{name} must be in (0, 1], got {float(util):g}")
    return util


def weight_bytes(params: Any, dtype: str = "bf16") -> int:
    """Weights = parameter count × bytes per parameter (params may be fractional billions × 1e9)."""
    if dtype not in WEIGHT_DTYPE_BYTES:
        raise BudgetError(f"unknown weight dtype {dtype!r}; choose one of {', '.join(WEIGHT_DTYPE_BYTES)}")
    n = exact(params, "params") * WEIGHT_DTYPE_BYTES[dtype]
    if n < 0:
        raise BudgetError(f"params must be ≥ 0, got {params!r}")
    return formulas.weight_bytes(n.numerator, 1, n.denominator)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything `kvjax plan` prints. Byte counts are ints; `*_exact` values are unrounded."""

    spec: KVSpec  # the layout ONE rank holds (or the whole model when pooled)
    tp: int
    pooled: bool
    context: int
    block_size: int
    util: Fraction | None
    total_bytes: int | None  # per device (× tp when pooled)
    requested_bytes: int | None
    weights_bytes: int  # per device (whole model when pooled)
    activations_bytes: int
    cudagraph_bytes: int
    kv_cache_memory_bytes: int | None
    budget_bytes: int | None  # available for KV
    bytes_per_token: int
    bytes_per_block: int
    kv_bytes_per_request: int
    num_blocks: int | None
    usable_blocks: int | None
    token_slots: int | None
    blocks_per_request: int
    tail_waste_tokens: int
    concurrency: int | None
    concurrency_exact: float | None
    concurrency_blocks: int | None
    warnings: tuple[str, ...]
    host_offload_bytes: int | None = None  # the host tier as given: all ranks together; None = no tier
    host_bytes: int | None = None  # per device (all of it when pooled)
    num_host_blocks: int | None = None
    host_tokens: int | None = None
    total_tokens: int | None = None  # device token slots + host tokens

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("spec", "util")}
        out["util"] = None if self.util is None else float(self.util)
        out["warnings"] = list(self.warnings)
        out["tail_waste_bytes"] = self.tail_waste_tokens * self.bytes_per_token
        out["budget_per_request"] = self.concurrency_exact
        out["spec"] = self.spec.to_dict()
        return out


def plan(spec: KVSpec, *, context: int, block_size: int = DEFAULT_BLOCK_SIZE,
         total_bytes: int | None = None, util: Any = None, extensible: bool = False,
         weights_bytes: int = 0, activations_bytes: int = 0, cudagraph_bytes: int = 0,
         kv_cache_memory_bytes: int | None = None, tp: int = 1, pooled: bool = False,
         host_offload_bytes: int | None = None) -> Plan:
    """Size the KV cache of one device and say how many requests of `context` tokens fit.

    weights_bytes is the whole model; with tp > 1 each rank holds weights / tp and the KV of
    `spec.per_rank(tp)`. `pooled=True` instead reproduces the seed's pooled arithmetic: one
    imaginary device of tp × total holding all weights and one full copy of the KV — not a
    concurrency any deployment reaches (MLA's latent is replicated on every rank).
    host_offload_bytes sizes a host tier the way vLLM's kv_offloading_size does (all ranks together).
    """
    for name, value in (("context", context), ("block_size", block_size), ("tp", tp)):
        check_int(value, name, 1, None, BudgetError)
    for name, value in (("weights", weights_bytes), ("activations", activations_bytes),
                        ("cudagraph", cudagraph_bytes)):
        if value < 0:
            raise BudgetError(f"{name} bytes must be ≥ 0, got {value}")
    if total_bytes is not None and total_bytes <= 0:
        raise BudgetError(f"total GPU memory must be positive, got {total_bytes} bytes")
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes <= 0:
        raise BudgetError(f"kv_cache_memory_bytes must be positive, got {kv_cache_memory_bytes}")
    if host_offload_bytes is not None and host_offload_bytes <= 0:
        raise BudgetError(f"host_offload_bytes must be positive (None for no host tier), got {host_offload_bytes}")
    if util is not None:
        util = utilization(util)
    elif not extensible:
        util = DEFAULT_UTIL
    else:
        util = Fraction(1)  # vLLM: extensible KV cache with util unset resolves to 1.0

    warnings: list[str] = []
    rank_spec = spec if pooled else spec.per_rank(tp)
    if pooled:
        spec.kv_heads_per_rank(tp)  # still validate tp against the heads
        if total_bytes is not None:
            total_bytes *= tp
        warnings.append(f"pooled arithmetic over {tp} devices: not a deployable concurrency"
                        + (" (MLA KV is replicated on every rank)" if spec.kind == "mla" else ""))
        rank_weights = weights_bytes
    else:
        rank_weights = cdiv(weights_bytes, tp)

    # The arithmetic itself is kvjax.accounting.formulas's, which the calculator page runs too.
    s = formulas.kv_budget(rank_spec.bytes_per_token, rank_spec.bytes_per_block(block_size), context, block_size,
                           total_bytes, util.numerator, util.denominator, rank_weights, activations_bytes,
                           cudagraph_bytes, kv_cache_memory_bytes)
    warnings += s["warnings"]
    host = {}
    if host_offload_bytes is not None:
        # vLLM divides kv_offloading_size by the ranks; each rank's CPU blocks mirror its device blocks
        host, warning = formulas.host_tier(host_offload_bytes, tp, pooled, s["bytes_per_block"], block_size,
                                           s["token_slots"])
        warnings += [warning] if warning else []
    return Plan(rank_spec, tp, pooled, context, block_size, util if kv_cache_memory_bytes is None else None,
                total_bytes, s["requested_bytes"], rank_weights, activations_bytes, cudagraph_bytes,
                kv_cache_memory_bytes, s["budget_bytes"], s["bytes_per_token"], s["bytes_per_block"],
                s["kv_bytes_per_request"], s["num_blocks"], s["usable_blocks"], s["token_slots"],
                s["blocks_per_request"], s["tail_waste_tokens"], s["concurrency"], s["concurrency_exact"],
                s["concurrency_blocks"], tuple(warnings), **host)


human_bytes = formulas.human_bytes  # 1024-based units, exact where the value is a whole number of the unit


# --------------------------------------------------------------------------------------------
# SPEC's simulator groups and Table 2 scenarios: inputs only; every output is computed.
# --------------------------------------------------------------------------------------------
GROUPS: dict[str, dict[str, Any]] = {
    "A": dict(preset="llama-3-70b", kv_dtype="bf16", context=8192, gpu_gib="160", util="0.92",
              weights_gib="130", tp=1, title="Llama-3-70B, bf16, 8K, 160 GiB"),
    # One card of DeepSeek-V3 at TP=8: weights 625/8 = 78.125 GiB per card, MLA KV replicated.
    "B": dict(preset="deepseek-v3", kv_dtype="bf16", context=32768, gpu_gib="141", util="0.92",
              weights_gib="625", tp=8, title="DeepSeek-V3, bf16, 32K, one 141 GiB card of TP=8"),
    "C": dict(preset="llama-3-70b", kv_dtype="bf16", context=131072, gpu_gib="160", util="0.92",
              weights_gib="130", tp=1, title="Llama-3-70B, bf16, 128K, 160 GiB"),
}

TABLE2: list[dict[str, Any]] = [
    dict(scenario="Llama-3-8B, bf16 KV", preset="llama-3-8b", kv_dtype="bf16", gpu_gib="80",
         weights_gib="15", context=8192),
    dict(scenario="Llama-3-70B, bf16 KV", preset="llama-3-70b", kv_dtype="bf16", gpu_gib="160",
         weights_gib="130", context=8192),
    dict(scenario="Llama-3-70B, fp8 KV, bf16 weights", preset="llama-3-70b", kv_dtype="fp8", gpu_gib="160",
         weights_gib="130", context=8192),
    dict(scenario="Llama-3-70B, fp8 KV + fp8 weights", preset="llama-3-70b", kv_dtype="fp8", gpu_gib="160",
         weights_gib="65.2", context=8192),
    dict(scenario="DeepSeek-V3, bf16 KV, 8×141 GiB TP=8 pooled", preset="deepseek-v3", kv_dtype="bf16",
         gpu_gib="141", weights_gib="625", context=32768, tp=8, pooled=True),
    dict(scenario="DeepSeek-V3, bf16 KV, one card of TP=8", preset="deepseek-v3", kv_dtype="bf16",
         gpu_gib="141", weights_gib="625", context=32768, tp=8),
]
