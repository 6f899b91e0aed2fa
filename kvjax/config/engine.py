"""The engine's configuration: pool size, rows, token budget, steps per device call, layout, host tier
and tensor parallelism, each bounded where it is given (vLLM's `vllm/config/` engine args as kvjax's
Engine takes them; kvjax.engine.arg_utils maps LLM(...)'s names onto it). No JAX at import.
"""
from __future__ import annotations

import dataclasses

from kvjax.config.scheduler import check_host_tier, check_policy
from kvjax.errors import INT32_MAX, MAX_SEED, KvjaxError, _show, check_int, is_int

MAX_STEPS_PER_CALL = 1024  # the CLI's cap too
MAX_NUM_SEQS = 2**16  # rows of every step
DEFAULT_BUDGET = 2048  # tokens per step when max_num_batched_tokens is not given (vLLM's long-time default)
KV_LAYOUTS = ("paged", "contiguous")


def step_budget(max_num_batched_tokens: int | None, max_num_seqs: int, chunked_prefill: bool, max_len: int) -> int:
    """A step's token budget: max_num_batched_tokens, else vLLM's default (DEFAULT_BUDGET), at
    least one token per row, and without chunked prefill never below max_len (the longest
    request), or a long prompt could never be admitted."""
    return max_num_batched_tokens or max(max_num_seqs, DEFAULT_BUDGET, 0 if chunked_prefill else max_len)


class EngineError(KvjaxError):
    """An engine built or called with values that break a rule; the message names the value."""


def model_len(max_model_len, max_position_embeddings: int, error: type = EngineError) -> int:
    """The longest request (prompt + generated tokens): max_model_len, an integer in [1, the model's
    max_position_embeddings], or the model's own length when None."""
    if max_model_len is None:
        return max_position_embeddings
    if not is_int(max_model_len) or not 1 <= max_model_len <= max_position_embeddings:
        raise error(f"max_model_len={_show(max_model_len)} must be in [1, {max_position_embeddings}] "
                    "(an integer; the model's max_position_embeddings)")
    return int(max_model_len)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_blocks: int  # P, including the null block 0
    block_size: int = 16  # Z
    max_num_seqs: int = 8  # B: requests running at once (rows of every step)
    max_model_len: int | None = None  # prompt + generated tokens; None: the model's max_position_embeddings
    max_num_batched_tokens: int | None = None  # step token budget; None: 2048 (unchunked: ≥ max_model_len)
    chunked_prefill: bool = True  # False: a prompt is prefilled in one step (vLLM enable_chunked_prefill)
    prefix_caching: bool = True
    steps_per_call: int = 1  # decode steps per device call
    seed: int = 0  # the random stream of requests without a seed of their own
    policy: str = "fcfs"  # or "priority": generate(..., priorities=...) orders admission and preemption
    kv_layout: str = "paged"  # or "contiguous": the baseline without paging (no prefix caching)
    kv_offload_blocks: int = 0  # host offload tier: blocks kept in host memory (kvjax.kv_offload.host_pages); 0 = none
    kv_offload_policy: str = "lru"  # its eviction policy, "lru" or "arc" (vLLM's kv_offloading policies)
    max_logprobs: int = 20  # most log-probabilities a request may ask for per token (vLLM's; -1 = no limit)
    tensor_parallel_size: int = 1  # devices the model and the KV pages are split over (kvjax.worker.sharding)
    hybrid_kv_cache: bool = True  # a model with sliding windows: one block table per KV cache group, a window's
    # blocks freed as it moves (vLLM's hybrid KV cache manager); False: every layer kept as full attention

    def __post_init__(self):
        # Every value bounded where it is given: beyond these, XLA would be asked for the impossible
        # (steps_per_call=10**9 aborts the process inside the compiler) or int32 indices would wrap.
        for name, low, high in (("num_blocks", 1, INT32_MAX), ("block_size", 1, INT32_MAX),
                                ("max_num_seqs", 1, MAX_NUM_SEQS), ("steps_per_call", 1, MAX_STEPS_PER_CALL),
                                ("seed", 0, MAX_SEED), ("max_logprobs", -1, INT32_MAX),
                                ("tensor_parallel_size", 1, 256), ("kv_offload_blocks", 0, INT32_MAX)):
            check_int(getattr(self, name), name, low, high, EngineError)
        for name in ("max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, 1, INT32_MAX, EngineError)
        for name in ("chunked_prefill", "prefix_caching", "hybrid_kv_cache"):
            if not isinstance(getattr(self, name), bool):
                raise EngineError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.num_blocks < 2:
            raise EngineError(f"num_blocks={self.num_blocks} leaves no usable block (block 0 is the null block)")
        if self.num_blocks * self.block_size > INT32_MAX:
            raise EngineError(f"num_blocks {self.num_blocks:,} × block_size {self.block_size:,} = "
                              f"{self.num_blocks * self.block_size:,} token slots; slots are int32 indices "
                              f"(at most {INT32_MAX:,})")
        check_policy(self.policy, EngineError)
        if self.kv_layout not in KV_LAYOUTS:
            raise EngineError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.kv_layout == "contiguous" and self.prefix_caching:
            raise EngineError("the contiguous KV layout cannot share prefixes (a row belongs to one request): "
                              "turn prefix caching off")
        value = self.kv_offload_blocks
        from kvjax.kv_offload import host_pages as offload  # JAX: only when an engine is configured

        offload.check_policy(self.kv_offload_policy)
        check_host_tier(value, self.prefix_caching, EngineError, "kv_offload_blocks")
        tp = self.tensor_parallel_size
        check_int(tp, "tensor_parallel_size", 1, None, EngineError)
        if tp > 1 and (value or self.kv_layout != "paged"):
            raise EngineError(f"tensor_parallel_size={tp} needs the paged layout and no host tier (the host "
                              "tier copies whole pages of one device)")


def kv_cache_groups(model_config, kv_spec, config: EngineConfig) -> tuple[tuple, tuple, tuple]:
    """(each KV cache group's window, each layer's group, each layer's page tensor): vLLM's
    grouping (kvjax.accounting.hybrid) for a model with sliding windows on the paged layout, the
    j-th layer of every group sharing page tensor j; else one full-attention group and () twice
    (the window, if any, is then the attention mask alone)."""
    windows = tuple(getattr(model_config, "layer_windows", ()) or ())
    if not any(w is not None for w in windows) or not config.hybrid_kv_cache or config.kv_layout != "paged":
        return (None,), (), ()
    for what, value in (("a host offload tier", config.kv_offload_blocks),
                        ("tensor parallelism", config.tensor_parallel_size > 1)):
        if value:
            raise EngineError(f"{what} with KV cache groups is not implemented: this model has sliding windows; "
                              "pass hybrid_kv_cache=False (vLLM's disable_hybrid_kv_cache_manager) to keep one group")
    from kvjax.accounting import hybrid

    groups = hybrid.kv_cache_groups(kv_spec, windows, config.block_size)
    layer_groups, layer_slots = [0] * len(windows), [0] * len(windows)
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            layer_groups[layer], layer_slots[layer] = g, j
    return tuple(g.window for g in groups), tuple(layer_groups), tuple(layer_slots)
