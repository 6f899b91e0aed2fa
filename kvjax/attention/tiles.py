"""Tile sizes for the Pallas paged-decode kernels, and the per-shape defaults.

A decode kernel program owns one sequence, one block of query rows (GQA: every query head of
one kv head; MLA: a tile of heads) and one split of the context. It walks its split's pages
`pages_per_block` at a time (block_k = pages_per_block × Z tokens per step, gathered through
the block table), keeping an online softmax, and writes a partial (out, logsumexp) that
`merge_splits` combines — flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context
inference"), which vLLM calls split-KV.

Every size here is a power of two because the Triton lowering of Pallas only loads, stores and
multiplies arrays whose sizes are powers of two, and its matrix multiplies need at least 16
rows, 16 contraction lanes and 16 columns: hence block_h >= 16 (a group of 7 is padded to 16
rows) and block_k >= 16 tokens. The same rules are enforced in interpret mode, so a test that
passes on CPU runs unchanged on a GPU.

The defaults are educated guesses, not tuned on a GPU: block_k of 128 tokens for GQA (JAX's
shipped kernel: 8 pages of 16) and 32 for MLA (a 32 × 576 latent tile is already 36 KiB in
bf16), and enough splits that batch × head blocks × splits fills two waves of an H200's 132
SMs, with at least two steps per split.
"""
from __future__ import annotations

import dataclasses

from kvjax.math_utils import cdiv, is_power_of_two, pow2_bucket

_SMS = 132  # streaming multiprocessors on an H100/H200; the split heuristic fills 2 waves
_MIN_STEPS_PER_SPLIT = 2  # fewer makes the merge cost more than the split parallelism wins


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """Static tile sizes of one decode-kernel launch (hashable: a jit static argument)."""

    pages_per_block: int  # pages gathered per inner-loop step; block_k = pages_per_block × Z
    num_splits: int  # split-K programs per (sequence, row block); 1 = no split
    block_h: int  # query rows per program (GQA: group padded up; MLA: heads per tile)
    num_warps: int = 4  # Triton launch parameter; ignored in interpret mode
    num_stages: int = 2  # Triton software-pipelining depth; ignored in interpret mode

    def check(self, *, block_size: int, rows: int | None = None) -> None:
        """Raise ValueError if these tiles can't run pages of `block_size` tokens.

        `rows`: the GQA group size, which must fit one row block so that each K/V page is read
        once per kv head. MLA may tile its heads, so it passes None.
        """
        for name in ("pages_per_block", "num_splits", "block_h", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeTiles.{name} must be a positive int, got {value!r}")
        if not is_power_of_two(self.pages_per_block):
            raise ValueError(f"DecodeTiles.pages_per_block must be a power of two, got {self.pages_per_block}")
        if not is_power_of_two(self.block_h) or self.block_h < 16:
            raise ValueError(f"DecodeTiles.block_h must be a power of two >= 16 (Triton dot rows), got {self.block_h}")
        if self.pages_per_block * block_size < 16:
            raise ValueError(f"DecodeTiles: pages_per_block × block_size = {self.pages_per_block} × {block_size}"
                             f" = {self.pages_per_block * block_size} tokens per step; Triton dots need >= 16")
        if rows is not None and rows > self.block_h:
            raise ValueError(f"DecodeTiles.block_h = {self.block_h} is smaller than the query group of {rows} heads;"
                             " one program must hold the whole group so each K/V page is read once")


def _pages_per_block(block_size: int, max_blocks: int, target_tokens: int) -> int:
    ppb = pow2_bucket(max(1, target_tokens // block_size))
    ppb = min(ppb, pow2_bucket(max_blocks))  # don't gather pages no sequence can have
    return max(ppb, pow2_bucket(cdiv(16, block_size)))  # Triton dots need block_k >= 16


def _num_splits(programs: int, steps: int) -> int:
    want = cdiv(2 * _SMS, programs)
    return max(1, min(want, steps // _MIN_STEPS_PER_SPLIT))


def default_tiles(*, batch: int, num_kv_heads: int, group: int, head_dim: int, block_size: int,
                  max_blocks: int) -> DecodeTiles:
    """GQA tiles: one program per (sequence, kv head, split), the whole group in its rows."""
    ppb = _pages_per_block(block_size, max_blocks, 128 if head_dim <= 128 else 64)
    steps = cdiv(max_blocks, ppb)
    return DecodeTiles(pages_per_block=ppb, num_splits=_num_splits(batch * num_kv_heads, steps),
                       block_h=max(16, pow2_bucket(group)), num_warps=8, num_stages=2)


def default_mla_tiles(*, batch: int, num_heads: int, kv_lora_rank: int, block_size: int,
                      max_blocks: int) -> DecodeTiles:
    """MLA tiles: one program per (sequence, head tile, split). Up to 64 heads share a latent read."""
    block_h = min(64, max(16, pow2_bucket(num_heads)))
    ppb = _pages_per_block(block_size, max_blocks, 32 if kv_lora_rank >= 256 else 64)
    steps = cdiv(max_blocks, ppb)
    return DecodeTiles(pages_per_block=ppb, num_splits=_num_splits(batch * cdiv(num_heads, block_h), steps),
                       block_h=block_h, num_warps=4, num_stages=2)
