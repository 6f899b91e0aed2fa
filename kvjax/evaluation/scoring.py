"""Teacher-forced scoring through the paged cache: a batch of windows prefilled at once, or one
long window chunk by chunk, each through `kvjax.worker.model_runner.forward`.

`prefill` gives both halves of one pass, the logits and the caches it wrote; `sequence_logits`
and `prefill_caches` (what calibration reads) are its two halves. Each sequence of a [B, S]
batch is one prefill step over its own fresh cache (block table 1..S/Z, block 0 null), vmapped
over B (mapped one row after another for a mixture-of-experts model). Every query therefore attends to keys and values read back from the cache, stored in
the cache's dtype, exactly as a served prefill does (vLLM V1 writes K/V with
`reshape_and_cache_flash` first and attention then reads the cache), so fp8 KV changes these
logits the same way it changes a served model's. The metadata and the block tables are the
same for every row, only tokens (and so the pages) differ.

`ChunkedScorer` scores one long window the way vLLM's chunked prefill serves it: chunk after
chunk, each chunk's K/V written into the paged cache (in the variant's dtype and scales) and
its queries attending to every position cached so far, read back from the pages (an attention + Mamba
hybrid's state carried from chunk to chunk in its state block). A one-step
prefill of 8,192 tokens would make the reference attention hold B × Q × N × S f32 scores per
layer (9 heads × 8192² × 4 B = 2.4 GB for SmolLM2, and several such temporaries); a chunk of T
queries holds T / S of that. Chunk c's block table covers only the (c + 1) × T positions it
can see, so the chunks together do about half the attention work of a full-width table
(causal), at the price of one compilation per chunk shape.
"""
from __future__ import annotations

import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention.metadata import build_metadata
from kvjax.core.kv_cache_groups import MAMBA
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.core.mamba_spec import hybrid_block_size
from kvjax.errors import KvjaxError
from kvjax.math_utils import cdiv
from kvjax.worker.model_runner import forward
from kvjax.worker.mamba_state import create_hybrid_cache
from kvjax.worker.paged_cache import PagedCache


def windows(tokens, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows i32[W, seq_len] from the start of a token stream."""
    n = min(max_windows, len(tokens) // seq_len)
    if n < 1:
        raise KvjaxError(f"the data holds {len(tokens)} tokens, fewer than one window of {seq_len}")
    return np.asarray(tokens[: n * seq_len]).reshape(n, seq_len)


def prefill_layout(seq_len: int, block_size: int, start: int = 0, layer_types: tuple = (),
                   state_block: int | None = None):
    """(metadata, num_blocks) for prefilling positions start..seq_len-1 of one sequence in blocks
    1..cdiv(seq_len, Z), positions before start already cached (a chunk of a chunked prefill).

    layer_types: an attention + Mamba hybrid's (ModelConfig.layer_types): its Mamba layers form a second KV cache
    group whose one block, state_block (default: the one after the attention blocks, the layout's last), holds
    every Mamba layer's state (kvjax.worker.mamba_state: in its slot's page tensor), the same block for every chunk
    of a sequence."""
    blocks = cdiv(seq_len, block_size)
    tables, groups = [list(range(1, blocks + 1))], {}
    if "mamba" in layer_types:
        state_block = blocks + 1 if state_block is None else state_block
        tables = [[tables[0], [state_block]]]
        groups = dict(windows=(None, MAMBA), layer_groups=tuple(int(t == "mamba") for t in layer_types))
    md = build_metadata([start], [seq_len - start], tables, block_size=block_size,
                        max_tokens=seq_len - start, max_seqs=1, max_blocks_per_seq=blocks, **groups)
    return md, (blocks if state_block is None else max(blocks, state_block)) + 1


def empty_cache(config, kv_spec: KVSpec, num_blocks: int, block_size: int, scales=None) -> PagedCache:
    """A zeroed cache of kv_spec for `config`'s model: its pages (a hybrid's Mamba layers' states inside them,
    kvjax.worker.mamba_state.create_hybrid_cache)."""
    if config.mamba is None:
        return PagedCache.create(kv_spec, num_blocks, block_size, scales)
    return create_hybrid_cache(kv_spec, config.mamba.state_spec(config.dtype), config.layer_types, num_blocks,
                               block_size, scales=scales)


def prefill(model, params, tokens: jax.Array, kv_spec: KVSpec | None, block_size: int = 16,
            cache: PagedCache | None = None):
    """tokens i32[B, S] → (logits f32[B, S, V], caches), each row prefilled alone into its own
    paged cache; the caches come back stacked (every page array gains a leading B axis).

    cache: the empty cache every row starts from, of `prefill_layout`'s blocks (a KV format's
    dtype and scales: `LLM.score_windows` passes its own); default `PagedCache.create(kv_spec, ...)`.
    """
    if cache is None and model.config.mamba is not None:  # a page must hold a state: vLLM's grown block size
        block_size = hybrid_block_size(kv_spec.layer_bytes_per_token(0),
                                       model.config.mamba.state_spec(model.config.dtype).page_bytes, block_size)
    md, num_blocks = prefill_layout(tokens.shape[1], block_size, layer_types=model.config.layer_types)
    if cache is None:
        cache = empty_cache(model.config, kv_spec, num_blocks, block_size)
    elif (cache.num_blocks, cache.block_size) != (num_blocks, block_size):
        raise KvjaxError(f"a prefill of {tokens.shape[1]} tokens in blocks of {block_size} needs a cache of "
                         f"{num_blocks} blocks of {block_size}, got {cache.num_blocks} of {cache.block_size}")

    def one(row):  # i32[S] → (f32[S, V], the row's cache)
        return forward(model, params, row, md, cache)

    if model.config.moe is not None:
        # jax.lax.ragged_dot (the MoE experts' grouped product, models.moe) has no batching rule
        # for vmap yet ("vmap over any dim but 0 - NYI" in JAX 0.11): the rows run one after another.
        return jax.lax.map(one, tokens)
    return jax.vmap(one)(tokens)


def sequence_logits(model, params, tokens: jax.Array, kv_spec: KVSpec | None, block_size: int = 16,
                    cache: PagedCache | None = None) -> jax.Array:
    """tokens i32[B, S] → logits f32[B, S, V]: `prefill`'s logits."""
    return prefill(model, params, tokens, kv_spec, block_size, cache)[0]


@functools.partial(jax.jit, static_argnames="model")
def window_logprobs(model, params, tokens: jax.Array, cache: PagedCache) -> jax.Array:
    """tokens i32[B, S] → log-probabilities f32[B, S, V], each row prefilled alone into `cache`
    (`prefill`). The cache is an argument, not a constant, so the KV formats that share a dtype
    (unit, dynamic and calibrated e4m3 scales) share one compiled program."""
    return jax.nn.log_softmax(sequence_logits(model, params, tokens, None, cache.block_size, cache), axis=-1)


def prefill_caches(model, params, tokens: jax.Array, kv_spec: KVSpec, block_size: int = 16):
    """`prefill`'s stacked caches of tokens i32[B, S], one fresh cache of kv_spec per row: the K/V
    the model writes, which calibration (kvjax.quant.calibration) and the outlier map observe."""
    return prefill(model, params, tokens, kv_spec, block_size)[1]


def next_token_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Per-position negative log-likelihood of tokens[:, 1:] under logits[:, :-1]: f32[B, S-1]."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)  # [B, S-1, V]
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def chunk_layouts(seq_len: int, chunk: int, block_size: int, layer_types: tuple = ()) -> tuple[list, int]:
    """([(start, metadata)] per chunk, num_blocks) for prefilling one sequence of seq_len tokens
    chunk tokens at a time into blocks 1..cdiv(seq_len, Z) (block 0 null). Chunk c's block table
    covers positions < its own end only: what it may attend to. A hybrid's (layer_types) Mamba state lives in
    the block after them, which every chunk continues."""
    if chunk <= 0 or seq_len <= 0:
        raise KvjaxError(f"seq_len {seq_len} and chunk {chunk} must be positive")
    hybrid = "mamba" in layer_types
    state = cdiv(seq_len, block_size) + 1 if hybrid else None
    layouts = [(start, prefill_layout(min(start + chunk, seq_len), block_size, start, layer_types, state)[0])
               for start in range(0, seq_len, chunk)]
    return layouts, cdiv(seq_len, block_size) + 1 + hybrid


class ChunkedScorer:
    """Teacher-forced log-probs of one long window through an LLM's KV format (its dtype, scales,
    skipped layers, block size), prefilled chunk by chunk into one paged cache (module docstring).

        scorer = ChunkedScorer(llm, seq_len=8192, chunk=2048)
        for start, logp in scorer.chunks(window):   # logp f32[T, V]: log p(next | tokens ≤ start + j)
            ...
    """

    def __init__(self, llm, seq_len: int, chunk: int):
        if seq_len > llm.config.max_position_embeddings:
            raise KvjaxError(f"windows of {seq_len} tokens exceed the model's max_position_embeddings "
                             f"{llm.config.max_position_embeddings}")
        self.llm, self.seq_len = llm, seq_len
        self.layouts, self.num_blocks = chunk_layouts(seq_len, chunk, llm.block_size, llm.config.layer_types)

    def chunks(self, window) -> Iterator[tuple[int, jax.Array]]:
        """(start, log-probs f32[T, V], T = the chunk) of window i32[S] (S = seq_len), chunk after chunk."""
        window = np.asarray(window)
        if window.shape != (self.seq_len,):
            raise ValueError(f"a window must be i32[{self.seq_len}], got {window.shape}")
        llm = self.llm
        cache = empty_cache(llm.config, llm.kv_spec, self.num_blocks, llm.block_size, llm.scales)
        for start, md in self.layouts:
            n = md.num_tokens
            logp, cache = _chunk_logprobs(llm.model.module, llm.model.params,
                                          jnp.asarray(window[start:start + n], jnp.int32), md, cache)
            yield start, logp


# The log-softmax runs inside the same jit as the step, as in `window_logprobs`; one jit for every
# scorer, so scorers whose caches share a dtype (not only their scales) share its programs.
@functools.partial(jax.jit, static_argnames="model", donate_argnames="cache")
def _chunk_logprobs(model, params, tokens, md, cache):  # i32[T] → (f32[T, V], cache)
    logits, cache = forward(model, params, tokens, md, cache)
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), cache
