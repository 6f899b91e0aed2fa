"""What decode context parallelism buys an MLA model: KV bytes per rank and concurrency at D = 1, 2, 4, 8 (vLLM's
`--decode-context-parallel-size`; `vllm/v1/kv_cache_interface.py: max_memory_usage_bytes`,
`vllm/v1/core/kv_cache_utils.py: resolve_dcp_kv_block_size`).

Under tensor parallelism MLA's latent is replicated: every rank of TP holds every token (SPEC "Budget → blocks").
DCP splits it by token over D of those ranks (kvjax.worker.dcp_pages), so with the same per-rank budget:

    a rank's page           Z tokens, bytes_per_block bytes (unchanged: the page is still Z of that rank's tokens)
    a scheduler block       Z·D tokens (vLLM's resolve_dcp_kv_block_size), one page on each of the D ranks
    KV bytes / token / rank bytes_per_token / D
    blocks                  budget // bytes_per_block (unchanged); token slots (blocks − 1) · Z · D
    blocks / request        cdiv(context, Z·D); concurrency = usable blocks // blocks per request

so token capacity and concurrency grow D-fold (less the rounding of the last block). Plain arithmetic on a
kvjax.accounting.budget.Plan at D = 1; no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from kvjax.accounting.budget import Plan
from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv

SIZES = (1, 2, 4, 8)  # the D the readout lists (those dividing tp)


class DCPError(KvjaxError):
    """A decode context parallel size the plan cannot take; the message names it."""


@dataclasses.dataclass(frozen=True)
class DCPRow:
    """One D's per-rank numbers (module docstring). Budget-dependent fields are None without a budget."""

    dcp: int
    kv_bytes_per_token: float  # per rank: bytes_per_token / D
    page_bytes: int  # one rank's page of Z tokens
    block_tokens: int  # Z · D: the scheduler's block
    kv_bytes_per_request: int  # per rank: blocks per request × page bytes
    blocks_per_request: int
    usable_blocks: int | None
    token_slots: int | None
    concurrency: int | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_dcp_size(plan: Plan, dcp: int) -> None:
    """vLLM's rule (D divides tp) and kvjax's (an MLA model), each refused by name."""
    if not isinstance(dcp, int) or isinstance(dcp, bool) or dcp < 1:
        raise DCPError(f"decode_context_parallel_size must be a positive integer, got {dcp!r}")
    if plan.pooled and dcp > 1:
        raise DCPError("--decode-context-parallel-size with --pooled: the pooled arithmetic holds one copy of the KV "
                       "already; DCP is per rank")
    if plan.tp % dcp:
        raise DCPError(f"tp_size={plan.tp} must be divisible by dcp_size={dcp}.")
    if dcp > 1 and plan.spec.kind != "mla":
        raise DCPError(f"decode_context_parallel_size={dcp}: kvjax splits MLA's latent cache only; this model's KV "
                       f"cache is {plan.spec.kind.upper()} per rank, not MLA")


def dcp_row(plan: Plan, dcp: int) -> DCPRow:
    """The numbers of `plan` (made at D = 1) with its latent split over dcp ranks."""
    check_dcp_size(plan, dcp)
    tokens = plan.block_size * dcp
    blocks = cdiv(plan.context, tokens)
    usable = plan.usable_blocks
    return DCPRow(dcp, plan.bytes_per_token / dcp, plan.bytes_per_block, tokens, blocks * plan.bytes_per_block, blocks,
                  usable, None if usable is None else usable * tokens,
                  None if usable is None else usable // blocks)


def dcp_rows(plan: Plan, chosen: int = 1, sizes: Sequence[int] = SIZES) -> list[DCPRow]:
    """The rows of every D in `sizes` that divides plan.tp, and `chosen`, in increasing D."""
    check_dcp_size(plan, chosen)
    return [dcp_row(plan, d) for d in sorted({d for d in sizes if plan.tp % d == 0} | {chosen})]


__all__ = ["DCPError", "DCPRow", "SIZES", "check_dcp_size", "dcp_row", "dcp_rows"]
