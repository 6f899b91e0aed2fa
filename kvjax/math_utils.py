"""Integer helpers shared by the allocator, the scheduler, the accounting and the kernels.

vLLM keeps the same few in `vllm/utils/math_utils.py` (`cdiv`, `next_power_of_2`). Pure Python,
no JAX: `kvjax plan` imports this module without starting JAX, and `cdiv` is written so that it
works unchanged on integer NumPy and JAX arrays.
"""
from __future__ import annotations


def cdiv(a, b):
    """Ceiling division (ints or integer arrays): blocks needed for a tokens in blocks of b."""
    return -(-a // b)


def pow2_bucket(n: int, lo: int = 1, hi: int | None = None) -> int:
    """The smallest power of two >= max(n, lo), capped at hi (callers guarantee n <= hi): the
    padded sizes that let a jitted call compile once per bucket rather than once per size."""
    b = 1 << (max(n, lo) - 1).bit_length()
    return b if hi is None else min(hi, b)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
