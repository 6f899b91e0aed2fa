"""The scheduler's configuration (vLLM's `vllm/config/scheduler.py`): pool size, rows, token budget,
policy, chunked prefill and the host tier, checked once where they are given.

Plain Python (kvjax plan imports kvjax.config without JAX). The bytes of the tables a scheduler
allocates for a config are kvjax.core.sched.tables's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv

POLICIES = ("fcfs", "priority")


def check_policy(policy, error: type = KvjaxError, name: str = "policy") -> None:
    """vLLM's scheduling policies: "fcfs", or "priority" (lower value first, then arrival)."""
    if policy not in POLICIES:
        raise error(f"{name} must be 'fcfs' or 'priority', got {policy!r}")


def check_host_tier(num_host_blocks: int, prefix_caching: bool, error: type = KvjaxError,
                    name: str = "num_host_blocks") -> None:
    """A host offload tier needs prefix caching: its blocks are found by their hashes."""
    if num_host_blocks and not prefix_caching:
        raise error(f"{name}={num_host_blocks}: a host offload tier needs prefix caching (its blocks are found "
                    "by their hashes)")


def request_blocks(windows: tuple, block_size: int, max_num_batched_tokens: int, num_tokens: int) -> int:
    """The most blocks a request of num_tokens holds at once, summed over the KV cache groups:
    cdiv(num_tokens, Z) in a full group; in a sliding one at most its window's blocks plus one
    step's chunk (freed at the next step)."""
    full = cdiv(num_tokens, block_size)
    return sum(full if w is None else 1 if w == "mamba" else min(full, cdiv(w - 1 + max_num_batched_tokens,
                                                                            block_size) + 1)
               for w in windows)  # a Mamba group ("mamba"): one state block


def pool_limits(windows: tuple, block_size: int, max_num_batched_tokens: int, usable_blocks: int,
                max_model_len: int):
    """(n -> `request_blocks` of n tokens, the longest request usable_blocks can hold, at most
    max_model_len and at least 1), by bisection: request_blocks grows with n."""
    blocks_for = functools.partial(request_blocks, windows, block_size, max_num_batched_tokens)
    lo, hi = 1, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if blocks_for(mid) <= usable_blocks else (lo, mid - 1)
    return blocks_for, lo


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # pool size P, including the null block
    block_size: int  # Z tokens per block
    max_num_seqs: int = 8  # most requests running at once
    max_num_batched_tokens: int = 256  # token budget per step (prefill chunks + decodes)
    max_model_len: int = 256  # prompt + generated tokens per request
    prefix_caching: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority"
    max_requests: int | None = None  # R pool request slots; default 2 * max_num_seqs
    chunked_prefill: bool = True  # False: a waiting request is admitted only if all its tokens fit the budget
    num_host_blocks: int = 0  # E host offload tier slots (kvjax.kv_offload.manager); 0 = no tier
    host_policy: str = "lru"  # the tier's eviction policy: "lru" or "arc"
    windows: tuple = (None,)  # each KV cache group's sliding window (None: full attention; "mamba"), one table each

    def __post_init__(self):
        check_policy(self.policy)
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise KvjaxError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.blocks_per_request > self.num_blocks - 1:
            # Otherwise a lone request could preempt itself forever.
            raise KvjaxError(f"a max_model_len={self.max_model_len} request needs "
                             f"{self.blocks_per_request} blocks but the pool "
                             f"has only {self.num_blocks - 1} usable")
        if len(self.windows) > 1 and self.num_host_blocks:
            raise KvjaxError("a host offload tier serves one KV cache group (full attention) only")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM's rule too: otherwise a long prompt could never be admitted whole.
            raise KvjaxError(f"without chunked prefill, max_num_batched_tokens={self.max_num_batched_tokens} "
                             f"must be >= max_model_len={self.max_model_len}")
        if self.num_host_blocks < 0:
            raise KvjaxError(f"num_host_blocks={self.num_host_blocks}: a host tier needs >= 0 blocks")
        check_host_tier(self.num_host_blocks, self.prefix_caching)
        if "mamba" in self.windows and self.prefix_caching:  # kvjax.core.single_type_kv_cache_manager's rule
            raise KvjaxError("prefix caching with Mamba groups needs vLLM's mamba_cache_mode='align', which kvjax does "
                             "not implement; vLLM's 'none' mode, kvjax's, runs without prefix caching "
                             "(enable_prefix_caching=False, --no-enable-prefix-caching)")
        if self.max_requests is not None and self.max_requests < self.max_num_seqs:
            raise KvjaxError(f"max_requests={self.max_requests} < max_num_seqs={self.max_num_seqs}")

    @property
    def blocks_per_request(self) -> int:
        """`request_blocks` of a max_model_len request."""
        return request_blocks(self.windows, self.block_size, self.max_num_batched_tokens, self.max_model_len)

    @property
    def num_slots(self) -> int:
        """The pool's request slots: max_requests, default 2 × max_num_seqs."""
        return self.max_requests or 2 * self.max_num_seqs

    def describe(self) -> str:
        """The sizes the tables follow from, for messages."""
        return (f"num_blocks={self.num_blocks:,}, max_num_seqs={self.max_num_seqs:,} ({self.num_slots:,} request "
                f"slots), max_model_len={self.max_model_len:,}, block_size={self.block_size}"
                + (f", num_host_blocks={self.num_host_blocks:,}" if self.num_host_blocks else ""))

