"""The chained block hash used by the prefix cache, and the request block hasher that applies it as a
request's tokens arrive (vLLM V1 `core/kv_cache_utils.py`).

vLLM gives every FULL block of a request a hash of (parent block hash, the block's token
ids, extra keys such as the cache salt on the first block), so a hash names a whole
prefix, not just one block's tokens. vLLM hashes with Python's `hash`/sha256 on the host;
kvjax must compute the same thing inside `jax.jit` (the decode-step allocator caches a
block the moment its last token is scheduled, possibly inside `lax.scan`), so the hash
here is plain uint32 arithmetic that runs identically on NumPy arrays and on JAX arrays.

The definition (one lane; the hash is two lanes with different seeds = 64 bits, because
JAX runs with x64 off and has no native uint64):

    h = seed[lane]
    for t in block_tokens:             # Z tokens, each as uint32
        h = mix(h, t)                  # MurmurHash3_x86_32 body step
    for w in (parent_lo, parent_hi, has_extra, extra_lo, extra_hi):
        h = mix(h, w)
    h = fmix(h ^ Z)                    # MurmurHash3 finalizer

The first block has parent (0, 0); only the first block may carry an extra key (vLLM
puts the cache salt on the first block only, so a salted request shares no block with an
unsalted one or with another salt). Tokens are mixed before the parent so the token part
of every block can be computed in parallel and only a 5-word mix is sequential along the
chain.

Collisions. With a 64-bit hash and P cached blocks, one lookup of a fresh prefix falsely
matches some cached block with probability about P / 2**64 (P = 1e6 blocks: 5e-14), and
over n lookups about n * P / 2**64. That is the odds for non-adversarial input only:
MurmurHash3 is not a cryptographic hash, seed-independent collisions for it are known, and
two seeds of one weak function are not an independent 64-bit hash. A collision is NOT
detected: a lookup would return a block holding another prefix's KV and the model would
attend to the wrong keys and values, silently producing wrong output. (vLLM offers sha256
block hashing for multi-tenant serving for this reason.) Use this hash for experiments,
not for serving untrusted users.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

# The two lanes' seeds; any two distinct constants work, these are arbitrary odd words.
SEEDS = (0x9747B28C, 0x2F1B3C4D)
# Constants are typed uint32 scalars: JAX refuses Python ints above int32's range, and
# typed scalars keep NumPy and JAX arithmetic wrapping identically modulo 2**32.
_U = np.uint32
_C1, _C2, _N = _U(0xCC9E2D51), _U(0x1B873593), _U(0xE6546B64)
_F1, _F2 = _U(0x85EBCA6B), _U(0xC2B2AE35)


def _rotl(x, r: int):
    return (x << r) | (x >> (32 - r))


def _mix(h, k):
    """One MurmurHash3_x86_32 body step: fold the 32-bit word k into the state h.

    Works on NumPy or JAX uint32 arrays (wrapping multiply, nothing is promoted)."""
    k = k * _C1
    k = _rotl(k, 15)
    k = k * _C2
    h = h ^ k
    h = _rotl(h, 13)
    return h * _U(5) + _N


def _fmix(h):
    """MurmurHash3's finalizer: avalanche the last mixed bits over the whole word."""
    h = h ^ (h >> 16)
    h = h * _F1
    h = h ^ (h >> 13)
    h = h * _F2
    return h ^ (h >> 16)


def _chain_words(parent, has_extra, extra):
    """The five chain words mixed after the tokens (see module docstring)."""
    return (parent[..., 0], parent[..., 1], has_extra, extra[..., 0], extra[..., 1])


def block_hash_np(parent, block_tokens, has_extra=False, extra=(0, 0)) -> np.ndarray:
    """The block hash on the host. parent: u32[2] (zeros for the first block);
    block_tokens: ints[Z]; extra: u32[2], mixed in only when has_extra. Returns u32[2]."""
    parent = np.asarray(parent, dtype=np.uint32).reshape(2)
    extra = np.asarray(extra, dtype=np.uint32).reshape(2)
    toks = np.asarray(block_tokens, dtype=np.int64).astype(np.uint32)  # ids < 2**31
    h = np.array(SEEDS, dtype=np.uint32)  # u32[2], one entry per lane
    for t in toks:  # the definition is sequential over a block's tokens
        h = _mix(h, np.full(2, t, dtype=np.uint32))
    for w in _chain_words(parent, np.uint32(bool(has_extra)), extra):
        h = _mix(h, np.full(2, w, dtype=np.uint32))
    return _fmix(h ^ np.uint32(len(toks)))


def block_token_state(block_tokens: jax.Array) -> jax.Array:
    """The token part of the hash, in JAX, for any leading batch shape.

    block_tokens: i32[..., Z] -> u32[..., 2] (state after mixing the Z tokens)."""
    toks = block_tokens.astype(jnp.uint32)  # i32 ids are >= 0, so this is a plain reinterpretation
    z = toks.shape[-1]
    h = jnp.broadcast_to(jnp.array(SEEDS, jnp.uint32), toks.shape[:-1] + (2,))
    for i in range(z):  # Z is static: straight-line code, no loop on the device
        h = _mix(h, toks[..., i:i + 1])
    return h


def block_hash_finish(token_state, parent, has_extra, extra, block_size: int) -> jax.Array:
    """The chain part of the hash, in JAX. token_state: u32[..., 2] from
    `block_token_state`; parent, extra: u32[..., 2]; has_extra: bool[...]. -> u32[..., 2]."""
    h = token_state
    for w in _chain_words(parent, has_extra.astype(jnp.uint32), extra):  # 5 static words
        h = _mix(h, w[..., None])
    return _fmix(h ^ jnp.uint32(block_size))


def block_hash_jnp(parent, block_tokens, has_extra, extra) -> jax.Array:
    """The block hash in JAX: u32[..., 2] from parent u32[..., 2], tokens i32[..., Z],
    has_extra bool[...], extra u32[..., 2]. Equals `block_hash_np` element for element."""
    z = block_tokens.shape[-1]
    return block_hash_finish(block_token_state(block_tokens), parent, has_extra, extra, z)


def extend_request_hashes(t, rows, filled, max_new: int | None = None):
    """The request block hasher (vLLM's `get_request_block_hasher`) over the KV cache manager's
    request table t (kvjax.core.request_table.Requests): hash the blocks of request slots
    rows (i32[B], distinct) that became full since the last call, chained on each row's
    previous hash. A row's blocks are hashed as soon as they fill, so its k-th new block holds
    the tokens filled[b, k*Z:(k+1)*Z] (its old tail, then the tokens handed to the call).
    max_new: a static bound on new full blocks per row (1 for a one-token append: no loop);
    None loops over the most any row has. → t."""
    z, m = t.block_size, t.max_blocks_per_request

    def one(k, t):
        j = t.num_hashed[rows]  # i32[B] the next block to hash
        do = j < t.num_tokens[rows] // z
        toks = filled[:, k * z:(k + 1) * z] if isinstance(k, int) else \
            jax.lax.dynamic_slice_in_dim(filled, k * z, z, axis=1)
        first = j == 0
        parent = jnp.where(first[:, None], jnp.uint32(0), t.req_hash[rows, jnp.maximum(j - 1, 0)])
        salt = jnp.where(first[:, None], t.salt[rows], jnp.uint32(0))
        h = block_hash_jnp(parent, toks, first & t.has_salt[rows], salt)
        return t.replace(req_hash=t.req_hash.at[rows, jnp.where(do, j, m)].set(h, mode="drop"),
                         num_hashed=t.num_hashed.at[rows].add(do.astype(jnp.int32)))

    if max_new is not None:
        for k in range(max_new):
            t = one(k, t)
        return t
    most = (t.num_tokens[rows] // z - t.num_hashed[rows]).max()
    return jax.lax.fori_loop(0, most, one, t)


def salt_key(salt: str | None) -> tuple[bool, tuple[int, int]]:
    """A cache salt (vLLM's `cache_salt`, a string) as (has_extra, two uint32 words).

    Host side only: sha256 of the UTF-8 bytes, first 8 bytes little-endian."""
    if salt is None:
        return False, (0, 0)
    if not isinstance(salt, str):
        raise TypeError(f"cache salt must be a string or None, got {type(salt).__name__} {salt!r}")
    d = hashlib.sha256(salt.encode("utf-8")).digest()
    return True, (int.from_bytes(d[0:4], "little"), int.from_bytes(d[4:8], "little"))


def request_block_hashes_np(tokens, block_size: int, salt: str | None = None) -> list[tuple[int, int]]:
    """Chained hashes of every full block of a token list, on the host (for the oracle
    and for tests). Returns one (lo, hi) tuple per full block."""
    has_extra, extra = salt_key(salt)
    out: list[tuple[int, int]] = []
    parent = (0, 0)
    for j in range(len(tokens) // block_size):
        h = block_hash_np(parent, tokens[j * block_size:(j + 1) * block_size],
                          has_extra and j == 0, extra if j == 0 else (0, 0))
        parent = (int(h[0]), int(h[1]))
        out.append(parent)
    return out


def max_cached_blocks(num_tokens, block_size: int):
    """The most leading blocks of a request that a cache (the device prefix cache, the host
    tier) may serve: (num_tokens - 1) // Z, so that the last token is computed and gives the
    logits to sample from (vLLM's rule). Python ints or jnp arrays."""
    return (num_tokens - 1) // block_size
