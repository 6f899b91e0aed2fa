"""The bytes of the scheduler's device tables, from their shapes, before any is allocated: the block
pool's state (kvjax.core.kv_cache_manager) and the host tier's index (kvjax.kv_offload.manager).

The scheduler checks that its own tables fit (kvjax.core.sched.scheduler) and the engine that its
KV cache, these tables and a step's logits fit together (kvjax.engine.core): both ask here, once per
config. jax.eval_shape allocates nothing.
"""
from __future__ import annotations

import functools

import jax

from kvjax.accounting.memory import tree_bytes
from kvjax.config.scheduler import SchedulerConfig
from kvjax.core import kv_cache_manager as manager
from kvjax.kv_offload import manager as host_cache
from kvjax.math_utils import cdiv


@functools.lru_cache(maxsize=16)
def state_bytes(config: SchedulerConfig) -> int:
    """The bytes of the pool state and host index a Scheduler of `config` allocates."""
    z = config.block_size
    shapes = jax.eval_shape(lambda: manager.init(config.num_blocks, z, config.num_slots,
                                                 cdiv(config.max_model_len, z), config.prefix_caching,
                                                 config.windows))
    host = jax.eval_shape(lambda: host_cache.init(config.num_host_blocks, config.host_policy)) \
        if config.num_host_blocks else ()
    return tree_bytes((shapes, host))
