"""The pool of an attention + Mamba hybrid (Bamba, Granite-4.0-H, Nemotron-H) as kvjax.accounting.sizing profiles
it and kvjax.accounting.reconcile allocates it: vLLM's groups, block count and bytes.

vLLM 0.33 sizes such a pool as one block pool whose blocks are one page size (`MambaSpec`, the attention block
size grown until an attention page holds one layer's state: kvjax.core.mamba_spec.hybrid_block_size); every
group's j-th layer shares the j-th of `group size` tensors of num_blocks pages, so vLLM holds

    num_blocks × bytes per block        (bytes per block: the largest group's pages, each Mamba page padded)

and num_blocks = KV budget // bytes per block (kvjax.accounting.hybrid.plan_groups, the engine's numbers).

kvjax holds the same (kvjax.worker.mamba_state): one page tensor per slot (j below the largest group's layer
count) of num_blocks attention pages, which the j-th layer of every group uses through its own blocks, a Mamba
layer's conv and SSM states in the first bytes of its state block's page. `held_bytes` gives kvjax's bytes from
its tensors and vLLM's from the groups: equal.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.accounting import hybrid
from kvjax.core.kv_cache_groups import MAMBA


@dataclasses.dataclass(frozen=True)
class MambaPool:
    """What sizing and reconciliation need of a hybrid beyond its attention KVSpec: the engine's resolved groups
    (kvjax.config.engine.resolve_kv_cache_groups, with the Mamba state) and the model's layers."""

    groups: Any  # kvjax.config.engine.KVCacheGroups with .state (kvjax.core.mamba_spec.MambaSpec)
    layer_types: tuple[str, ...]  # ModelConfig.layer_types
    windows: tuple  # each cached layer's window, MAMBA for a Mamba layer (kvjax.config.mamba.cache_layers)
    layer_ids: tuple[int, ...]  # each cached layer's decoder layer

    @classmethod
    def from_config(cls, config, groups) -> "MambaPool":
        from kvjax.config.mamba import cache_layers

        return cls(groups, tuple(config.layer_types), *cache_layers(config))

    @property
    def state(self):
        return self.groups.state

    @property
    def num_mamba_layers(self) -> int:
        return sum(t == "mamba" for t in self.layer_types)

    @property
    def mamba_groups(self) -> int:
        return sum(w == MAMBA for w in self.groups.windows)

    @property
    def tensors(self) -> int:
        """Page tensors the cache holds, one per slot: the largest group's layer count (vLLM's)."""
        return max(self.groups.layer_slots) + 1

    def plan(self, rank_spec, budget_bytes: int, *, block_size: int, max_model_len: int,
             max_num_batched_tokens: int) -> hybrid.GroupPlan:
        """vLLM's groups and num_blocks for the budget; block_size already grown (resolve_block_size)."""
        return hybrid.plan_groups(rank_spec, self.windows, budget_bytes, block_size=block_size,
                                  max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                  layer_ids=self.layer_ids, state=self.state)

    def cache_maker(self, rank_spec, num_blocks: int, block_size: int):
        """A thunk creating the engine's hybrid cache (kvjax.engine.core: create_hybrid_cache) of num_blocks."""
        from kvjax.worker.mamba_state import create_hybrid_cache

        return lambda: create_hybrid_cache(rank_spec, self.state, self.layer_types, num_blocks, block_size,
                                           self.groups.layer_slots)

    def profile_tables(self, table: list[int], first_free: int) -> list[list[int]]:
        """One profiled sequence's table in each group: `table` in an attention group, one state block of its own
        (first_free, first_free + 1, ...) in each Mamba group."""
        out, nxt = [], first_free
        for w in self.groups.windows:
            if w == MAMBA:
                out.append([nxt])
                nxt += 1
            else:
                out.append(table)
        return out

    def held_bytes(self, plan: hybrid.GroupPlan) -> dict[str, int]:
        """Bytes on one rank for plan's num_blocks: kvjax's (its slot tensors of attention pages, every state inside
        one) and vLLM's (num_blocks × the groups' bytes per block)."""
        attention = next(g for g in plan.groups if g.window != MAMBA)
        page = attention.block_bytes // len(attention.layers)  # one attention layer's page: a slot tensor's block
        return {"kvjax": plan.num_blocks * self.tensors * page, "vllm": plan.num_blocks * plan.bytes_per_block}

    def row_notes(self, plan: hybrid.GroupPlan) -> dict[str, str]:
        """What the reconciliation's pages row holds: each slot tensor's groups and the state inside a page."""
        p = plan.num_blocks
        page = plan.bytes_per_block // self.tensors
        names = {g: i for i, g in enumerate(plan.groups)}
        (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = self.state.shapes, self.state.dtypes
        conv, ssm = self.state.tensor_bytes()
        attention = [str(names[g]) for g in plan.groups if g.window != MAMBA]
        mamba = [str(names[g]) for g in plan.groups if g.window == MAMBA]
        return {"kv pages": f"{self.tensors} slot tensor{'s' * (self.tensors > 1)} × {p:,} blocks × {page:,} B page, "
                           f"as vLLM's, shared by attention group{'s' * (len(attention) > 1)} {','.join(attention)} "
                           f"and Mamba group{'s' * (len(mamba) > 1)} {','.join(mamba)}; a Mamba page holds "
                           f"{'×'.join(map(str, conv_shape))} {conv_dtype} ({conv:,} B) then "
                           f"{'×'.join(map(str, ssm_shape))} {ssm_dtype} ({ssm:,} B), padded to the page"}
