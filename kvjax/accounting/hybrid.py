"""What a KV budget buys for a hybrid model's KV cache groups (vLLM 0.33's `vllm/v1/core/kv_cache_planning.py`,
`vllm/v1/core/kv_cache_utils.py`). No JAX. The groups themselves, which layers share a block table and
how many blocks a request holds in each, are kvjax.core.kv_cache_groups's.

A block is one page for every layer slot of a group, so bytes per block are the largest group's
pages (`_get_kv_cache_bytes_per_block`), and num_blocks = budget // bytes per block
(`get_kv_cache_config_from_groups`), block 0 among them as the null block.

A request of max_model_len tokens holds `KVGroup.blocks_per_request` blocks in each group, the tokens
in flight being max_concurrent_batches × max_num_batched_tokens (`VllmConfig.max_in_flight_tokens`;
1 batch without async scheduling or pipeline parallelism). Max concurrency is num_blocks over their sum
(`get_max_concurrency_for_kv_cache_config`), the KV cache size in tokens int(max concurrency ×
max_model_len) (`get_kv_cache_capacity`).

With Mamba layers (`plan_model`: Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1, Jamba) the attention
block size is first grown until an attention page holds one layer's state (kvjax.core.mamba_spec's
`hybrid_block_size`, on one rank's pages: tensor parallelism splits both the kv heads and the state),
every Mamba page is padded to the attention page, and each Mamba group holds one block per request.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from kvjax.config.mamba import cache_layers
from kvjax.core.kv_cache_groups import HybridError, KVGroup, kv_cache_groups
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.core.mamba_spec import MambaSpec, hybrid_block_size
from kvjax.utils.checks import check_int


@dataclass(frozen=True)
class GroupPlan:
    """The pool a budget buys for a grouping, and what it holds (vLLM's figures)."""

    groups: tuple[KVGroup, ...]
    block_size: int
    bytes_per_block: int
    num_blocks: int  # block 0, the null block, among them
    blocks_per_request: tuple[int, ...]  # per group
    max_model_len: int
    in_flight_tokens: int  # max_concurrent_batches × max_num_batched_tokens
    state: MambaSpec | None = None  # a Mamba layer's state on one rank (None: no Mamba layers)
    requested_block_size: int | None = None  # the block size asked for, before a Mamba state grew it

    @property
    def max_concurrency(self) -> float:
        """vLLM's: num_blocks / the blocks one max_model_len request holds over all groups."""
        return self.num_blocks / sum(self.blocks_per_request)

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's "KV cache size: N tokens": int(max concurrency × max_model_len)."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def admitted(self) -> int:
        """Requests of max_model_len the pool admits at once: its usable blocks (the null block
        aside) over the blocks each holds."""
        return (self.num_blocks - 1) // sum(self.blocks_per_request)


def plan_groups(spec: KVSpec, windows: Sequence, budget_bytes: int, *, block_size: int,
                max_model_len: int, max_num_batched_tokens: int, max_concurrent_batches: int = 1,
                layer_ids: Sequence[int] | None = None, state: MambaSpec | None = None) -> GroupPlan:
    """The pool budget_bytes buy for these layers, and its concurrency at max_model_len (with Mamba
    layers among the windows: their state, and block_size already grown to hold it)."""
    for name, value in (("budget_bytes", budget_bytes), ("block_size", block_size), ("max_model_len", max_model_len),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_concurrent_batches", max_concurrent_batches)):
        check_int(value, name, 0 if name == "budget_bytes" else 1, None, HybridError)
    groups = kv_cache_groups(spec, windows, block_size, layer_ids=layer_ids,
                             mamba_page=None if state is None else state.page_bytes)
    per_block = max(g.block_bytes for g in groups)
    in_flight = max_concurrent_batches * max_num_batched_tokens
    return GroupPlan(groups, block_size, per_block, budget_bytes // per_block,
                     tuple(g.blocks_per_request(block_size, max_model_len, in_flight) for g in groups), max_model_len,
                     in_flight, state)


def plan_model(config, budget_bytes: int, *, kv_dtype: str | None = None, block_size: int, max_model_len: int,
               max_num_batched_tokens: int, max_concurrent_batches: int = 1, tp: int = 1,
               mamba_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto") -> GroupPlan:
    """`plan_groups` for a kvjax.config.model.ModelConfig on one of tp ranks: its layers' windows, and
    with Mamba layers their state (in the mamba_* dtypes, vLLM's flags) and the block size grown to
    hold it. kv_dtype: the attention layers' KV format (None: the model dtype)."""
    spec = config.kv_spec(kv_dtype).per_rank(tp)
    windows, layer_ids = cache_layers(config)
    state, requested = None, block_size
    if config.mamba is not None:
        state = config.mamba.state_spec(config.dtype, tp, mamba_cache_dtype, mamba_ssm_cache_dtype)
        block_size = hybrid_block_size(spec.layer_bytes_per_token(0), state.page_bytes, block_size)
    plan = plan_groups(spec, windows, budget_bytes, block_size=block_size, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens, max_concurrent_batches=max_concurrent_batches,
                       layer_ids=layer_ids, state=state)
    return dataclasses.replace(plan, requested_block_size=requested)
