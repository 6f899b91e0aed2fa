"""The step plan the scheduler hands a model runner (vLLM V1's `vllm/v1/core/sched/output.py`).

Axes: the kvjax package docstring's legend; B are the scheduled requests, T their scheduled tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvjax.core.sched.request import Request


@dataclass(frozen=True)
class StepPlan:
    """One engine step for a model runner. B scheduled requests, T scheduled tokens."""

    req_ids: tuple[str, ...]  # B, in scheduling order
    slots: np.ndarray  # i32[B] pool request slots
    rows: np.ndarray  # i32[B] batch rows: a running request keeps its row (of max_num_seqs) until it stops
    num_scheduled: np.ndarray  # i32[B] tokens computed this step
    token_ids: np.ndarray  # i32[T] tokens whose KV is computed this step, request after request
    block_tables: np.ndarray  # i32[B, M] each request's block table (0 = null)
    seq_lens: np.ndarray  # i32[B] tokens in the KV cache after this step
    sample: np.ndarray  # bool[B] a token is sampled (the request's last token is computed)
    preempted: tuple[str, ...]  # requests preempted while planning this step
    remaining: np.ndarray  # i32[B] tokens each request may still generate
    stop_ids: np.ndarray  # i32[B, X] tokens that finish each request "stop" (-1 padding; X a power of two)
    admitted: np.ndarray  # bool[B] admitted from waiting by this step (its prefix lookup just ran)
    prefill: np.ndarray  # bool[B] computes a prompt, a chunk of one, or a preempted request's recompute
    num_tokens: np.ndarray  # i32[B] each request's tokens (prompt + output so far)
    num_preemptions: np.ndarray  # i32[B] times each request was preempted before
    loads: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))  # i32[loads, 2] (host slot,
    # device block): host tier hits to copy in before the step runs, then `Scheduler.loads_done`
    group_tables: np.ndarray | None = None  # i32[B, G, M] with sliding windows: every group's tables (group 0's
    # are block_tables; a sliding group's skipped entries are null); None with one full-attention group

    @property
    def num_requests(self) -> int:
        return len(self.req_ids)

    @property
    def is_decode(self) -> bool:
        """Every request computes one token and samples: the step a device loop may repeat."""
        return bool(self.sample.all() and (self.num_scheduled == 1).all())


@dataclass
class StepDraft:
    """What one `Scheduler.schedule()` call has planned so far (its `_plan` makes the StepPlan)."""

    budget: int  # tokens left in this step
    # req_id -> (request, tokens this step, tokens computed before); in scheduling order, admissions last
    scheduled: dict[str, tuple[Request, int, int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)

    def take(self, reqs: list[Request], nums: list[int], starts: list[int]) -> None:
        self.scheduled.update(zip((r.req_id for r in reqs), zip(reqs, nums, starts)))
        self.budget -= sum(nums)
