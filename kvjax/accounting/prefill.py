"""The prefill attention's temporaries, estimated from shapes: what `kvjax plan` prints beside its budget.

A prefill step's attention keeps temporaries that grow with the chunk T and, untiled, with the
context S too. The jnp reference (kvjax.attention.reference) scores every query of the chunk
against every cached position at once: one f32 array of B·Q·N·S scores (B sequences, Q queries
each, N query heads, S = the block table's width × Z positions), and its softmax beside it, two
such arrays at its peak (XLA's memory_analysis: 64 GiB for one Llama-3-8B layer prefilling 8,192
tokens over 32K; kvjax.attention.tiled's docstring). The tiled form (kvjax.attention.tiled,
flash attention over the block table) never holds S; one layer's working set is

    output and a padded copy of q         (T + Tq) × N × (Hk + Hv) × activation bytes
    one kv step: scores and their exps    2 × N × Tq × Tk × 4      (f32)
                 the q tile and the acc   N × Tq × (Hk + Hv) × 4
                 the K and V tiles        Tk × K × (Hk + Hv) × 4   (dequantized to f32)

with Tq = min(q_tile, T) and Tk = pages_per_tile × Z. Within about 10% of XLA's memory_analysis of
`paged_attention_tiled` on CPU, less the one copy of the page pool the CPU backend adds there
(`tiled.as_bits`; tests/accounting/test_prefill.py compares the two). Layers run one after
another, so this is one layer's, not the model's.

vLLM's profile_run measures activations with max_num_batched_tokens tokens at position 0;
`kvjax memory` profiles the chunk at the end of a max_model_len context instead
(kvjax.accounting.sizing), so its measured peak holds these temporaries. `kvjax plan` is analytic:
its budget takes --activations-gib as given (SPEC's worked examples keep 0) and prints this
estimate as a row of its own. The arithmetic is kvjax.accounting.formulas.prefill (the calculator page
runs it too). Pure Python, no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.accounting import formulas
from kvjax.accounting.formulas import KV_TOKENS, Q_TILE  # kvjax.attention.tiled.PrefillTiles' defaults
from kvjax.core.kv_cache_interface import KVSpec, SpecError
from kvjax.utils.checks import check_int


@dataclasses.dataclass(frozen=True)
class PrefillTemporaries:
    """One layer's prefill attention temporaries on one rank, in bytes (module docstring)."""

    tokens: int  # T: the chunk's new tokens (max_num_batched_tokens)
    positions: int  # S: the positions its block table covers, cdiv(max_model_len, Z) × Z
    heads: int  # N: query heads on one rank
    reference_scores_bytes: int  # one f32 [B·Q·N·S] score array of the untiled reference (B = 1, Q = T)
    tiled_bytes: int  # the tiled form's working set

    @property
    def reference_bytes(self) -> int:
        """The reference's peak: the scores and their softmax, two arrays of f32 scores."""
        return 2 * self.reference_scores_bytes

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "positions": self.positions, "heads": self.heads,
                "reference_scores_bytes": self.reference_scores_bytes, "reference_bytes": self.reference_bytes,
                "tiled_bytes": self.tiled_bytes}


def prefill_temporaries(spec: KVSpec, tokens: int, max_model_len: int, block_size: int, *, tp: int = 1,
                        activation_bytes: int = 2, q_tile: int = Q_TILE,
                        kv_tokens: int = KV_TOKENS) -> PrefillTemporaries:
    """The temporaries of one layer on one of tp ranks prefilling a chunk of `tokens` new tokens at
    the end of a max_model_len context, for the model's layout `spec`, with queries and outputs of
    activation_bytes each (2: bf16). A rank holds 1/tp of the query heads and
    `spec.kv_heads_per_rank(tp)` kv heads. MHA/GQA/MQA: kv heads of head_dim for keys and values;
    MLA (absorbed): one kv head, keys the whole latent (kv_lora_rank + qk_rope_head_dim), values
    its kv_lora_rank lanes."""
    for name, value in (("tokens", tokens), ("max_model_len", max_model_len), ("block_size", block_size),
                        ("tp", tp), ("activation_bytes", activation_bytes), ("q_tile", q_tile),
                        ("kv_tokens", kv_tokens)):
        check_int(value, name, 1, None, SpecError)
    if spec.num_heads % tp:
        raise SpecError(f"tp {tp} does not divide the {spec.num_heads} query heads")
    value_dim = spec.kv_lora_rank if spec.kind == "mla" else spec.head_dim
    t = formulas.prefill(tokens, max_model_len, block_size, spec.num_heads // tp, spec.kv_heads_per_rank(tp),
                         spec.head_dim, value_dim, activation_bytes, q_tile, kv_tokens)
    return PrefillTemporaries(tokens, t["positions"], t["heads"], t["reference_scores_bytes"], t["tiled_bytes"])
