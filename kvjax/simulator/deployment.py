"""A deployment's scheduler, from `kvjax plan`'s sizing: what `kvjax simulate` runs.

`scheduler_config(plan, layer_windows, ...)` gives the pool kvjax plan's budget buys per rank, with
the rules the engine's own sizing uses (kvjax.config.engine):

- full attention everywhere: plan's blocks (block 0 the null block), one block table;
- sliding-window layers: vLLM's hybrid KV cache groups on plan's budget
  (kvjax.accounting.hybrid.plan_groups: bytes per block the largest group's pages), one block table
  per group, and max_model_len capped at the longest request the pool can hold over the groups
  (kvjax.config.scheduler.pool_limits);
- a host tier (plan's --kv-offloading-size): its blocks (one KV cache group only, as the engine);
- decode context parallelism (dcp > 1, an MLA model): plan's blocks, each a page on each of dcp ranks, so the
  scheduler's block is block_size × dcp tokens (vLLM's resolve_dcp_kv_block_size; kvjax.accounting.dcp);
- Mamba layers (`mamba_scheduler_config`): vLLM's attention + Mamba groups on plan's budget (kvjax plan's hybrid
  section, kvjax.accounting.hybrid.plan_model: the block size grown to hold a state), one state block per request
  in each Mamba group, no prefix caching (mamba_cache_mode "none", as the engine).
"""
from __future__ import annotations

from typing import Sequence

from kvjax.accounting import hybrid
from kvjax.accounting.budget import Plan
from kvjax.config.scheduler import SchedulerConfig, pool_limits
from kvjax.errors import KvjaxError


def scheduler_config(pl: Plan, layer_windows: Sequence[int | None], *, max_num_seqs: int,
                     max_num_batched_tokens: int, prefix_caching: bool = True, dcp: int = 1) -> SchedulerConfig:
    """The scheduler of the deployment plan `pl` sized (module docstring); layer_windows: each
    layer's sliding window (None: full attention), () for none."""
    if pl.num_blocks is None or pl.num_blocks < 2 or not pl.budget_bytes:
        raise KvjaxError(f"the budget leaves {pl.num_blocks} KV blocks: nothing to schedule (kvjax plan shows why)")
    z, windows = pl.block_size * dcp, (None,)
    num_blocks, max_len = pl.num_blocks, min(pl.context, (pl.num_blocks - 1) * z)
    if any(w is not None for w in layer_windows) and dcp > 1:
        raise KvjaxError("decode context parallelism splits MLA's latent cache; this model has sliding-window layers")
    if any(w is not None for w in layer_windows):
        gp = hybrid.plan_groups(pl.spec, layer_windows, pl.budget_bytes, block_size=z, max_model_len=pl.context,
                                max_num_batched_tokens=max_num_batched_tokens)
        windows, num_blocks = tuple(g.window for g in gp.groups), gp.num_blocks
        _, max_len = pool_limits(windows, z, max_num_batched_tokens, num_blocks - 1, pl.context)
    return SchedulerConfig(num_blocks=num_blocks, block_size=z, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                           prefix_caching=prefix_caching, num_host_blocks=pl.num_host_blocks or 0, windows=windows)


def mamba_scheduler_config(gp: hybrid.GroupPlan, *, max_num_seqs: int, max_num_batched_tokens: int) -> SchedulerConfig:
    """The scheduler of a model with Mamba layers on the pool `gp` (kvjax.commands.plan_mamba.mamba_plan's)."""
    if gp is None or gp.num_blocks < 2:
        raise KvjaxError("the budget leaves no KV blocks beside the Mamba states: nothing to schedule (kvjax plan "
                         "shows why)")
    windows = tuple(g.window for g in gp.groups)
    _, max_len = pool_limits(windows, gp.block_size, max_num_batched_tokens, gp.num_blocks - 1, gp.max_model_len)
    return SchedulerConfig(num_blocks=gp.num_blocks, block_size=gp.block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len, prefix_caching=False,
                           windows=windows)
