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

The Mosaic GPU kernels (kvjax.attention.mgpu_decode, mgpu_mla, mgpu_ragged) have their own tile
dataclasses below (MosaicDecodeTiles, MosaicRaggedTiles): wgmma fixes their query rows at 64 and
their tokens per step at 64-256, and SMEM, not registers, bounds their pipelines.

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


# ------------------------------------------------------------------------------- Mosaic GPU

_SMEM_BYTES = 227 * 1024  # an H100/H200 block's shared memory (opt-in maximum)


@dataclasses.dataclass(frozen=True)
class MosaicDecodeTiles:
    """Static tile sizes of one Mosaic GPU decode launch (kvjax.attention.mgpu_decode, mgpu_mla).

    A program is one warpgroup that owns 64 query rows (wgmma's M; GQA: one kv head's group,
    MLA: a tile of 64 heads), one sequence and one split. Each step it waits for
    block_kv = pages_per_block × Z tokens of K and V that the TMA copied into one of `stages`
    SMEM slots, runs Q·Kᵀ and P·V on the tensor cores (wgmma) and refills the slot with the step
    `stages` ahead. Hence, unlike DecodeTiles (Triton: powers of two >= 16):
    - block_kv is 64, 128 or 256 tokens: the P·V product contracts over it and P's SMEM tile is
      swizzled in rows of 64 bf16 (128 bytes); wgmma's N for Q·Kᵀ allows up to 256;
    - stages × block_kv × (K + V bytes per token) is the HBM data in flight per program, the
      lever of a memory-bound kernel (Little's law: ~5 MB in flight across 132 SMs feed 4.8
      TB/s); it is bounded by the block's 227 KiB of SMEM (`smem_bytes` checks the sum).
    """

    pages_per_block: int  # pages per step; block_kv = pages_per_block × Z tokens
    num_splits: int  # split-K programs per (sequence, row block); 1 = no split
    stages: int = 3  # SMEM slots of K/V in flight (>= 2: one computing, one arriving)

    def check(self, *, block_size: int) -> None:
        """Raise ValueError if these tiles can't run pages of `block_size` tokens."""
        _check_mosaic(self, ("pages_per_block", "num_splits", "stages"), block_size)


def _check_mosaic(tiles, fields, block_size: int) -> None:
    """The rules every Mosaic GPU tile dataclass shares (MosaicDecodeTiles' docstring)."""
    name = type(tiles).__name__
    for field in fields:
        value = getattr(tiles, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")
    if tiles.stages < 2:
        raise ValueError(f"{name}.stages must be >= 2 (one slot computing, one arriving), got {tiles.stages}")
    block_kv = tiles.pages_per_block * block_size
    if block_kv not in (64, 128, 256):
        raise ValueError(f"{name}: pages_per_block × block_size = {tiles.pages_per_block} × {block_size}"
                         f" = {block_kv} tokens per step; the wgmma tiles need 64, 128 or 256")


def default_mosaic_tiles(*, batch: int, row_blocks: int, block_size: int, max_blocks: int,
                         bytes_per_token: int) -> MosaicDecodeTiles:
    """Mosaic GPU decode tiles: 128 tokens a step (64 when a token's K and V take over 512 bytes,
    as MLA's 576-lane latent does), as many stages as fit 160 KiB of SMEM (at most 4), splits as
    the Triton tiles choose them. bytes_per_token: K + V bytes of one token of one row block."""
    block_kv = 128 if bytes_per_token <= 512 else 64
    ppb = max(1, block_kv // block_size)
    block_kv = ppb * block_size
    stages = max(2, min(4, (160 * 1024) // (block_kv * bytes_per_token)))
    steps = cdiv(max_blocks, ppb)
    return MosaicDecodeTiles(pages_per_block=ppb, num_splits=_num_splits(batch * row_blocks, steps), stages=stages)


def fit_smem(tiles: MosaicDecodeTiles, *, block_size: int, max_blocks: int, smem_of) -> MosaicDecodeTiles:
    """Default tiles cut down until smem_of(tiles) (bytes) fits a block: fewer stages first (down
    to 2), then fewer tokens a step (down to 64), then more splits (each split's slice of the
    block table, which sits in SMEM, gets shorter). Tiles a caller gives are checked, never cut."""
    while smem_of(tiles) > _SMEM_BYTES:
        if tiles.stages > 2:
            tiles = dataclasses.replace(tiles, stages=tiles.stages - 1)
        elif tiles.pages_per_block > 1 and tiles.pages_per_block * block_size > 64:
            tiles = dataclasses.replace(tiles, pages_per_block=tiles.pages_per_block // 2)
        elif tiles.num_splits * tiles.pages_per_block < max_blocks:
            tiles = dataclasses.replace(tiles, num_splits=tiles.num_splits * 2)
        else:
            break
    return tiles


@dataclasses.dataclass(frozen=True)
class MosaicRaggedTiles:
    """Static tile sizes of one Mosaic GPU ragged-kernel launch (kvjax.attention.mgpu_ragged).

    The query rows of a program are fixed at 64 (wgmma's M: 64 / G' tokens × G' heads); what is
    chosen is the kv step, block_kv = pages_per_block × Z positions (64, 128 or 256: P·V
    contracts over it), and `stages`, the K/V steps in flight. The default, 64 positions and 2
    stages, keeps a block under half of an SM's SMEM for bf16 heads of 128 (about 100 KiB), so
    two blocks share an SM and overlap each other's softmax with their matmuls.
    """

    pages_per_block: int  # pages per kv step
    stages: int = 2  # K/V steps in flight

    @staticmethod
    def default(block_size: int) -> "MosaicRaggedTiles":
        return MosaicRaggedTiles(pages_per_block=max(1, 64 // block_size))

    def check(self, *, block_size: int) -> None:
        """Raise ValueError if these tiles can't run pages of `block_size` tokens."""
        _check_mosaic(self, ("pages_per_block", "stages"), block_size)
