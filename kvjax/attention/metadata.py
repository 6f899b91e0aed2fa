"""Batch metadata for one model step over the paged cache: vLLM V1's flat ragged batch.

vLLM V1 runs prefill and decode requests in one forward pass (`gpu_model_runner._prepare_inputs`):
the scheduled tokens of every request are concatenated into one flat token axis, and per-token
positions and slot mappings plus per-request block tables and sequence lengths tell attention
where each token lives. kvjax does the same with static shapes, so one compiled step serves
every batch that fits its buckets:

    T  max tokens per step (flat; padded)     B  max sequences per step (padded)
    M  max blocks per sequence (block table width)

Per token t: `positions[t]` (its position in its sequence), `slot_mapping[t]` (where its K/V is
written: block_table[p // Z] × Z + p % Z), `seq_ids[t]` (its row in `block_tables`; kvjax keeps
a per-token sequence index rather than vLLM's query_start_loc because a gather by it is the
plainest way to give each token its own sequence's keys), `valid[t]`. Per sequence b:
`block_tables[b]`, `context_lens[b]` (tokens in the cache after this step's writes),
`logits_indices[b]` (its last token's index in T, the only logits a generator needs) and
`query_start[b]` (its first token's index in T). `max_query_len` (static, Q) bounds the new
tokens of any one sequence: the reference attention lays each sequence's queries out in a
[B, Q] grid so that a token scores only its own sequence's positions (vLLM's
`query_start_loc` and `max_query_len` of FlashAttention's varlen call).

Padding tokens have valid False, position 0, and slots in the null block 0; padding sequences
have context length 0 and an all-zero block table, so nothing of theirs is ever read.

`decode` is a static flag: True promises one token per sequence, token b belonging to
sequence b (T == B), which lets attention use the decode-only form that the Pallas kernel
implements. A step compiles once per (T, B, M, decode).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.core.block_pool import NULL_BLOCK
from kvjax.core.kv_cache_groups import MAMBA
from kvjax.math_utils import cdiv


class MetadataError(ValueError):
    """A batch that does not fit its static sizes or the cache; the message names the value."""


@struct.dataclass
class BatchMetadata:
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]
    seq_ids: jax.Array  # i32[T]
    valid: jax.Array  # bool[T]
    block_tables: jax.Array  # i32[B, M]
    context_lens: jax.Array  # i32[B]
    logits_indices: jax.Array  # i32[B]
    query_start: jax.Array  # i32[B]
    max_query_len: int = struct.field(pytree_node=False, default=1)  # Q
    decode: bool = struct.field(pytree_node=False, default=False)
    # KV cache groups (kvjax.core.single_type_kv_cache_manager): every group's block tables and
    # slots, and each layer's group; () = one group, whose tables are block_tables / slot_mapping.
    group_tables: jax.Array | None = None  # i32[G, B, M]; a sliding group's skipped entries are null
    group_slots: jax.Array | None = None  # i32[G, T]
    layer_groups: tuple = struct.field(pytree_node=False, default=())

    def for_layer(self, layer: int) -> "BatchMetadata":
        """The step as layer `layer` sees it: its KV cache group's block tables and slots."""
        if not self.layer_groups:
            return self
        g = self.layer_groups[layer]
        return self.replace(block_tables=self.group_tables[g], slot_mapping=self.group_slots[g])

    @property
    def num_tokens(self) -> int:  # T (static)
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:  # B (static)
        return self.block_tables.shape[0]


def slot_of(block, position, block_size: int):
    """Slot of `position` in its block `block`: block × Z + position % Z.

    Plain arithmetic on NumPy or jnp arrays alike, so the host builder and the jitted decode
    metadata share it; each looks the block up in its own library (a host loop over NumPy rows
    would pay a device dispatch per sequence for jnp, and jit cannot trace NumPy)."""
    return block * block_size + position % block_size


def build_metadata(num_computed: Sequence[int], num_new: Sequence[int], block_tables, *, block_size: int,
                   max_tokens: int, max_seqs: int, max_blocks_per_seq: int, decode: bool = False,
                   rows: Sequence[int] | None = None, max_query_len: int | None = None,
                   windows: Sequence[int | None] | None = None, layer_groups: tuple = ()) -> BatchMetadata:
    """Host-side metadata for one step (numpy, validated); see `_build`. With KV cache groups
    (windows: each group's sliding window, None = full attention, "mamba" = a Mamba group, whose table holds one
    state block and whose slots stay null; layer_groups: each layer's group),
    block_tables[i] is sequence i's table in every group, and a sliding group's table may hold the
    null block where its window no longer reaches (before the first query's window)."""
    if windows is None:
        return _build(num_computed, num_new, block_tables, None, block_size=block_size, max_tokens=max_tokens,
                      max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq, decode=decode, rows=rows,
                      max_query_len=max_query_len)
    if len(block_tables) != len(num_new) or any(len(t) != len(windows) for t in block_tables):
        raise MetadataError(f"block_tables must give each of the {len(num_new)} sequences one table per group "
                            f"({len(windows)} groups)")
    mds = [_build(num_computed, num_new, [t[g] for t in block_tables], w, block_size=block_size,
                  max_tokens=max_tokens, max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq, decode=decode,
                  rows=rows, max_query_len=max_query_len) for g, w in enumerate(windows)]
    return mds[0].replace(group_tables=jnp.stack([m.block_tables for m in mds]),
                          group_slots=jnp.stack([m.slot_mapping for m in mds]), layer_groups=tuple(layer_groups))


def _build(num_computed: Sequence[int], num_new: Sequence[int], block_tables: Sequence[Sequence[int]],
           window: int | None, *, block_size: int, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
           decode: bool = False, rows: Sequence[int] | None = None,
           max_query_len: int | None = None) -> BatchMetadata:
    """One group's host-side metadata (window: its sliding window, None = full attention).

    Sequence i already has num_computed[i] tokens in the cache and schedules num_new[i] more,
    at positions num_computed[i] .. num_computed[i] + num_new[i] - 1; block_tables[i] lists its
    physical blocks in logical order and must cover every position up to that end. The step's
    tokens are laid out sequence after sequence; the caller passes token ids in that order,
    padded to max_tokens. decode=True requires one new token per sequence and
    max_tokens == max_seqs. rows: the row of the step's per-sequence arrays each sequence
    takes (distinct, < max_seqs; default 0, 1, 2, ...): the engine keeps a request in one row
    while it runs, as vLLM's persistent batch does, and the contiguous cache needs that.
    max_query_len: at least the largest num_new (default max_tokens, 1 for decode); a bucket
    keeps compiles few.
    """
    n = len(num_new)
    if not len(num_computed) == n == len(block_tables):
        raise MetadataError(f"num_computed ({len(num_computed)}), num_new ({n}) and block_tables "
                            f"({len(block_tables)}) must have one entry per sequence")
    if n > max_seqs:
        raise MetadataError(f"{n} sequences exceed max_seqs {max_seqs}")
    rows = list(range(n)) if rows is None else [int(r) for r in rows]
    if len(rows) != n or len(set(rows)) != n or not all(0 <= r < max_seqs for r in rows):
        raise MetadataError(f"rows {rows} must be {n} distinct rows in [0, {max_seqs})")
    if decode and rows != list(range(n)):
        raise MetadataError("a decode step's sequence b is token b: rows must be 0, 1, 2, ...")
    total = sum(num_new)
    if total > max_tokens:
        raise MetadataError(f"{total} scheduled tokens exceed max_tokens {max_tokens}")
    if decode and (max_tokens != max_seqs or any(k != 1 for k in num_new)):
        raise MetadataError(f"a decode step needs one new token per sequence and max_tokens == max_seqs; "
                            f"got num_new {list(num_new)}, max_tokens {max_tokens}, max_seqs {max_seqs}")
    if max_query_len is None:
        max_query_len = 1 if decode else max_tokens
    if max(num_new, default=0) > max_query_len:
        raise MetadataError(f"a sequence schedules {max(num_new)} tokens, more than max_query_len {max_query_len}")
    positions = np.zeros(max_tokens, np.int32)
    slots = np.full(max_tokens, NULL_BLOCK * block_size, np.int32)
    seq_ids = np.zeros(max_tokens, np.int32)
    valid = np.zeros(max_tokens, bool)
    tables = np.full((max_seqs, max_blocks_per_seq), NULL_BLOCK, np.int32)
    context_lens = np.zeros(max_seqs, np.int32)
    logits_indices = np.zeros(max_seqs, np.int32)
    query_start = np.zeros(max_seqs, np.int32)
    t = 0
    for i, (row, done, new, table) in enumerate(zip(rows, num_computed, num_new, block_tables)):
        if done < 0 or new < 0:
            raise MetadataError(f"sequence {i}: num_computed {done} and num_new {new} must be >= 0")
        end = done + new
        needed = min(end, 1) if window == MAMBA else cdiv(end, block_size)  # a Mamba group: one state block
        if needed > max_blocks_per_seq:
            raise MetadataError(f"sequence {i}: {end} tokens need {needed} blocks of {block_size}, "
                                f"more than max_blocks_per_seq {max_blocks_per_seq}")
        if len(table) < needed:
            raise MetadataError(f"sequence {i}: {end} tokens need {needed} blocks of {block_size}, "
                                f"its block table has {len(table)}")
        seen = 0 if window is None or window == MAMBA else max(0, done - window + 1) // block_size  # window's first
        if NULL_BLOCK in table[seen:needed]:
            raise MetadataError(f"sequence {i}: block table {list(table[:needed])} uses the null block "
                                f"{NULL_BLOCK}, which never holds KV" + (f", at or after block {seen}, "
                                f"which its window of {window} still sees" if seen else ""))
        width = min(len(table), max_blocks_per_seq)
        tables[row, :width] = table[:width]
        pos = np.arange(done, end, dtype=np.int32)
        positions[t:t + new] = pos
        if window != MAMBA:  # a Mamba layer writes its state block, not token slots: its slots stay null
            slots[t:t + new] = slot_of(tables[row, pos // block_size], pos, block_size)
        seq_ids[t:t + new] = row
        valid[t:t + new] = True
        context_lens[row] = end
        logits_indices[row] = t + new - 1 if new else 0
        query_start[row] = t
        t += new
    return BatchMetadata(jnp.asarray(positions), jnp.asarray(slots), jnp.asarray(seq_ids),
                         jnp.asarray(valid), jnp.asarray(tables), jnp.asarray(context_lens),
                         jnp.asarray(logits_indices), jnp.asarray(query_start), max_query_len, decode=decode)


def decode_metadata(block_tables: jax.Array, num_computed: jax.Array, active: jax.Array,
                    block_size: int, layer_groups: tuple = ()) -> BatchMetadata:
    """Jittable metadata for a decode step: sequence b's one new token is token b.

    block_tables: i32[B, M] (must already hold the block for position num_computed[b]), or
    i32[B, G, M] with KV cache groups (layer_groups: each layer's group); num_computed: i32[B]
    tokens already cached; active: bool[B]. Inactive rows become padding. Built from device
    arrays so a generator can run decode steps inside `lax.scan`.
    """
    if block_tables.ndim == 3:
        mds = [decode_metadata(block_tables[:, g], num_computed, active, block_size)
               for g in range(block_tables.shape[1])]
        return mds[0].replace(group_tables=jnp.stack([m.block_tables for m in mds]),
                              group_slots=jnp.stack([m.slot_mapping for m in mds]), layer_groups=tuple(layer_groups))
    batch = block_tables.shape[0]
    rows = jnp.arange(batch, dtype=jnp.int32)
    positions = jnp.where(active, num_computed, 0).astype(jnp.int32)  # i32[B]
    block = jnp.take_along_axis(block_tables, (positions // block_size)[:, None], axis=1)[:, 0]
    slots = jnp.where(active, slot_of(block, positions, block_size), NULL_BLOCK * block_size)
    return BatchMetadata(positions=positions, slot_mapping=slots.astype(jnp.int32), seq_ids=rows,
                         valid=active, block_tables=block_tables,
                         context_lens=jnp.where(active, num_computed + 1, 0).astype(jnp.int32),
                         logits_indices=rows, query_start=rows, max_query_len=1, decode=True)
