"""Which first blocks the pool may have cached: lets the scheduler skip a prefix search that cannot hit.

A prefix hit starts at a request's first block, and a cached block's hash is the hash of its
request's tokens (chained from the first block, whose hash is a function of its Z tokens and the
cache salt alone). So a waiting request can hit only if an earlier request had the same first Z
tokens and salt, unless two different blocks hash alike (a 2^-64 chance, the equality the prefix
cache itself trusts). `FirstBlocks` records each request's first block once it is full: at
admission, or, for a prompt shorter than a block, in the step its output fills it. The scheduler
asks `get_computed_blocks` (a pass over every pool block: ~0.6 ms for 194,455 blocks on a CPU)
only for a request whose first block was recorded before. The record is a bitmap of 2^22 bits
indexed by a hash of (salt, tokens): a bit two first blocks share costs a needless search, never a
missed hit (after millions of distinct first blocks most bits are set, and nearly every request
is searched, as without the record).
"""
from __future__ import annotations

from kvjax.core.sched.request import Request

BITS = 1 << 22


class FirstBlocks:
    """The first blocks of the requests the scheduler has put in its pool (module docstring)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.bits = bytearray(BITS // 8)
        self.pending: set[Request] = set()  # requests whose first block is not full yet

    def _bit(self, req: Request) -> tuple[int, int]:
        return self._bit_of(req.salt, req.token_range(0, self.block_size))

    def _bit_of(self, salt, first_block) -> tuple[int, int]:
        k = hash((salt, *first_block)) & (BITS - 1)
        return k >> 3, 1 << (k & 7)

    def may_hold(self, prompt, salt: str | None = None) -> bool:
        """Whether a prompt's first block may be in this pool (an earlier request had it): the data-parallel
        router's question to each replica (kvjax.engine.data_parallel); False for a prompt shorter than a block.
        A plain read of the record, safe from another thread (a stale answer routes worse, never wrongly)."""
        if len(prompt) < self.block_size:
            return False
        byte, bit = self._bit_of(salt, tuple(int(t) for t in prompt[:self.block_size]))
        return bool(self.bits[byte] & bit)

    def may_hit(self, req: Request) -> bool:
        """False when req cannot hit the prefix cache: no earlier request had its first block, or it
        has no block that may be a hit (the last token is always computed). Ask before `add(req)`."""
        if req.num_tokens <= self.block_size:
            return False
        byte, bit = self._bit(req)
        return bool(self.bits[byte] & bit)

    def add(self, req: Request) -> None:
        """Record req's first block (once it is full; until then req is pending: see `grown`)."""
        if req.num_tokens < self.block_size:
            self.pending.add(req)
            return
        byte, bit = self._bit(req)
        self.bits[byte] |= bit

    def grown(self) -> None:
        """After outputs were appended: record the pending requests whose first block filled, and
        drop those that finished short of a block (never cached)."""
        for req in [r for r in self.pending if r.num_tokens >= self.block_size or r.status == "finished"]:
            self.pending.discard(req)
            if req.num_tokens >= self.block_size:
                self.add(req)
