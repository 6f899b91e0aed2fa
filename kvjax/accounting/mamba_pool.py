"""The pool of an attention + Mamba hybrid (Bamba, Granite-4.0-H, Nemotron-H) as kvjax.accounting.sizing profiles
it and kvjax.accounting.reconcile allocates it: vLLM's groups and block count, kvjax's arrays.

vLLM 0.33 sizes such a pool as one block pool whose blocks are one page size (`MambaSpec`, the attention block
size grown until an attention page holds one layer's state: kvjax.core.mamba_spec.hybrid_block_size); every
group's j-th layer shares the j-th of `group size` tensors of num_blocks pages, so vLLM holds

    num_blocks × bytes per block        (bytes per block: the largest group's pages, each Mamba page padded)

and num_blocks = KV budget // bytes per block (kvjax.accounting.hybrid.plan_groups, the engine's numbers).

kvjax takes the same blocks, tables and concurrency but keeps its own arrays (kvjax.worker.mamba_state): the
attention layers' page tensors, and per Mamba layer an unpadded conv state [P, k − 1, conv_dim] and SSM state
[P, heads, head_dim, state] indexed by the same block ids. It therefore holds

    num_blocks × (attention tensors' pages + Mamba layers × (conv + SSM state bytes))

which is more than vLLM's whenever there are more Mamba layers than a group holds (every Mamba layer has a state
for every block of the pool, not only for the blocks its group was handed). `held_bytes` gives both.
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
    def attention_tensors(self) -> int:
        """Page tensors the attention layers hold (kvjax.worker.mamba_state.create_hybrid_cache)."""
        return len(set(self.groups.layer_slots))

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
        """Bytes on one rank for plan's num_blocks: what kvjax holds (attention pages, conv, SSM states) and vLLM."""
        p = plan.num_blocks
        attention = max(g.block_bytes for g in plan.groups if g.window != MAMBA)  # its tensors' pages per block
        conv, ssm = self.state.tensor_bytes()
        return {"attention pages": p * attention, "mamba conv state": p * self.num_mamba_layers * conv,
                "mamba ssm state": p * self.num_mamba_layers * ssm, "vllm": p * plan.bytes_per_block}

    def row_notes(self, plan: hybrid.GroupPlan) -> dict[str, str]:
        """What each cache row of the reconciliation holds, by group, beside vLLM's padded shared tensors."""
        held, p = self.held_bytes(plan), plan.num_blocks
        names = {g: i for i, g in enumerate(plan.groups)}
        attention = [g for g in plan.groups if g.window != MAMBA]
        mamba = [g for g in plan.groups if g.window == MAMBA]
        tensors = max(len(g.layers) for g in plan.groups)  # vLLM's: one per layer of the largest group
        page = plan.bytes_per_block // tensors
        (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = self.state.shapes, self.state.dtypes
        conv, ssm = self.state.tensor_bytes()

        def which(gs):
            n = sum(len(g.layers) for g in gs)
            return f"group{'s' * (len(gs) > 1)} {','.join(str(names[g]) for g in gs)} ({n} layer{'s' * (n > 1)})"

        return {
            "kv pages": f"attention {which(attention)}: {p:,} blocks × {held['attention pages'] // p:,} B; vLLM "
                        f"holds {tensors} shared tensor{'s' * (tensors > 1)} × {p:,} × {page:,} B page = "
                        f"{held['vllm']:,} B for all {len(plan.groups)} groups, states padded in",
            "mamba conv state": f"Mamba {which(mamba)}: {self.num_mamba_layers} layers × {p:,} × "
                                f"{'×'.join(map(str, conv_shape))} {conv_dtype} ({conv:,} B), kvjax's own array",
            "mamba ssm state": f"{self.num_mamba_layers} layers × {p:,} × {'×'.join(map(str, ssm_shape))} "
                               f"{ssm_dtype} ({ssm:,} B); a state {conv + ssm:,} B, padded by vLLM to its {page:,} B "
                               "page"}
