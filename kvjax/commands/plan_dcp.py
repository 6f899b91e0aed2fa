"""`kvjax plan`'s section for decode context parallelism: an MLA model under tensor parallelism, its KV bytes and
concurrency per rank at D = 1, 2, 4, 8 and at --decode-context-parallel-size (kvjax.accounting.dcp), rendered.
Shown for an MLA model with -tp > 1 or a D given; a D that breaks vLLM's rule, or any D > 1 on a model that is not
MLA, is refused by name. No JAX.
"""
from __future__ import annotations

from kvjax.accounting import budget as bud
from kvjax.accounting.dcp import DCPError, DCPRow, dcp_rows
from kvjax.errors import UsageError


def dcp_section(pl: bud.Plan, dcp: int | None) -> list[DCPRow] | None:
    """The rows to show for the parsed --decode-context-parallel-size (None: not given), or None."""
    if dcp is None and (pl.spec.kind != "mla" or pl.tp == 1 or pl.pooled):
        return None
    try:
        return dcp_rows(pl, 1 if dcp is None else dcp)
    except DCPError as e:
        raise UsageError(str(e).replace("decode_context_parallel_size", "--decode-context-parallel-size")) from None


def format_dcp(rows: list[DCPRow], chosen: int | None) -> str:
    """One line per D: per-rank KV per token and per request, the scheduler's block, token slots, concurrency."""
    h = bud.human_bytes
    lines = ["decode context parallelism (MLA's latent split by token over D of the tp ranks; per rank):",
             f"  {'D':>2}  {'KV / token':>12}  {'block':>12}  {'KV / request':>13}  {'token slots':>13}  "
             f"{'concurrency':>11}"]
    for r in rows:
        slots = "-" if r.token_slots is None else f"{r.token_slots:,}"
        conc = "-" if r.concurrency is None else f"{r.concurrency:,}"
        mark = "  ← --decode-context-parallel-size" if chosen is not None and r.dcp == chosen else ""
        lines.append(f"  {r.dcp:>2}  {h(r.kv_bytes_per_token):>12}  {f'{r.block_tokens:,} tokens':>12}  "
                     f"{h(r.kv_bytes_per_request):>13}  {slots:>13}  {conc:>11}{mark}")
    lines.append("  a rank's page stays one block's Z tokens; the scheduler's block is Z·D tokens, so the same "
                 "blocks hold D× the tokens")
    return "\n".join(lines)


__all__ = ["dcp_section", "format_dcp"]
