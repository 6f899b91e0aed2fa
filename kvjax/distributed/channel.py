"""Rank 0's word to every rank of a multi-process job, and the ranks' agreement, carried by JAX's collectives.

kvjax writes no transport: a message from rank 0 (`send` / `receive`) is pickled and broadcast with
`jax.experimental.multihost_utils.broadcast_one_to_all` (an all-reduce in which only rank 0's buffer is
non-zero), first its length (i32[1]; 0 for None), then its bytes in a buffer padded to a power of two (u8[2^k], at least
256), so that a long run compiles a handful of broadcast programs, not one per message size. `agree` gathers one
64-bit fingerprint from every rank (`process_allgather`, u32[ranks, 2]) and ends the job when they differ:
kvjax.engine.lockstep fingerprints each step's plan before the step runs, so ranks whose schedulers diverged
stop there, each with the same one error, instead of entering mismatched collectives (a hang) or sampling
different tokens.

Every collective that fails (a rank died: the connection closed) ends this process through
kvjax.distributed.runtime.lost_peers. The ranks trust one another as vLLM's processes do (its engine core and
workers exchange pickled and msgpack'd objects over ZMQ): a message is a Python object pickled by rank 0.
"""
from __future__ import annotations

import pickle

import numpy as np

from kvjax.distributed import runtime

MIN_BUFFER = 256  # bytes: the smallest broadcast buffer


def _collective(what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (JAX raises its runtime error, or ValueError, when gloo loses a peer)
        runtime.lost_peers(what, e)


def _broadcast(array: np.ndarray, what: str) -> np.ndarray:
    from jax.experimental import multihost_utils

    return _collective(what, multihost_utils.broadcast_one_to_all, array)


def send(message, what: str = "rank 0's message") -> None:
    """Rank 0: broadcast `message` (any picklable object) to every rank; each other rank must call `receive`.
    None costs the length alone (0: a pickle is never empty), the usual message of a step without news."""
    if message is None:
        _broadcast(np.zeros(1, np.int32), what)
        return
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    _broadcast(np.array([len(data)], np.int32), what)
    buffer = np.zeros(_bucket(len(data)), np.uint8)
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    _broadcast(buffer, what)


def receive(what: str = "rank 0's message"):
    """Any rank but 0: the object rank 0 `send`s next (blocks until it does)."""
    (length,) = _broadcast(np.zeros(1, np.int32), what)
    if length == 0:
        return None
    data = _broadcast(np.zeros(_bucket(int(length)), np.uint8), what)
    return pickle.loads(data[:int(length)].tobytes())


def _bucket(length: int) -> int:
    return max(MIN_BUFFER, 1 << max(0, length - 1).bit_length())


def agree(fingerprint: int, what: str) -> None:
    """Every rank passes its 64-bit fingerprint of the same thing; if any differs from rank 0's, every rank ends
    with one error naming `what` and the ranks that differ (kvjax.distributed.runtime.abort)."""
    from jax.experimental import multihost_utils

    mine = np.array([fingerprint & 0xFFFFFFFF, fingerprint >> 32], np.uint32)
    every = np.asarray(_collective(what, multihost_utils.process_allgather, mine)).reshape(-1, 2)  # u32[ranks, 2]
    differ = [r for r in range(len(every)) if (every[r] != every[0]).any()]
    if differ:
        runtime.abort(f"rank {runtime.rank()} of {runtime.world()}: {what} differs between ranks (rank"
                      f"{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} against rank 0): the ranks' "
                      "schedulers diverged, so every rank ends before running mismatched steps")


__all__ = ["agree", "receive", "send"]
