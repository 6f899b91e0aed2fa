"""Streaming accuracy metrics: compare a variant's next-token distributions with the baseline's
one batch (or one chunk of `kvjax.evaluation.scoring.ChunkedScorer`) at a time.

A real LLM's distributions are too big to keep: SmolLM2's vocabulary is 49,152, so the
log-probs of 16K scored tokens are 3.2 GB per variant, and one 8,192-token window's are 1.6
GB. kvjax.evaluation.accuracy therefore loops windows outer and variants inner: each batch of windows is
scored by the baseline and then by every variant, and `compare` reduces each pair to three
numbers per position (KL, top-1 agreement, NLL) that a `Tally` adds up, overall and per
position bucket. Nothing holds more than two batches' distributions at a time.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# Position bucket edges, each 4× the last: [0, 128), [128, 512), [512, 2K), [2K, 8K), [8K, 32K), [32K, 128K).
# Only buckets that hold positions are reported (`Tally.buckets`): windows of 8K or less never show the last two.
BUCKETS = (0, 128, 512, 2048, 8192, 32768, 131072)


@jax.jit
def compare(base: jax.Array, logp: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-position metrics of log-probs logp f32[..., V] against the baseline's base f32[..., V],
    predicting targets i32[...]: (KL(base ‖ logp) f32[...], top-1 agreement bool[...], NLL f32[...])."""
    kl = jnp.sum(jnp.exp(base) * (base - logp), axis=-1)
    top1 = jnp.argmax(logp, axis=-1) == jnp.argmax(base, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return kl, top1, nll


@dataclasses.dataclass
class Tally:
    """Running sums of one variant's per-position metrics, overall and per position bucket
    (bucket b holds positions edges[b] <= p < edges[b + 1]; a position is the query's, which
    predicts token p + 1). Sums are float64 so millions of small KLs add up exactly enough."""

    edges: tuple[int, ...] = BUCKETS
    count: np.ndarray = dataclasses.field(init=False)  # i64[nb] positions added per bucket
    kl: np.ndarray = dataclasses.field(init=False)  # f64[nb] sums
    top1: np.ndarray = dataclasses.field(init=False)  # f64[nb]
    nll: np.ndarray = dataclasses.field(init=False)  # f64[nb]

    def __post_init__(self):
        nb = len(self.edges) - 1
        if nb < 1 or list(self.edges) != sorted(set(self.edges)):
            raise ValueError(f"bucket edges must be at least two increasing positions, got {self.edges}")
        self.count = np.zeros(nb, np.int64)
        self.kl, self.top1, self.nll = (np.zeros(nb) for _ in range(3))

    def add(self, positions, kl, top1, nll) -> None:
        """positions i32[S]; kl, top1, nll [..., S] (any leading batch axes share the positions)."""
        positions = np.asarray(positions)
        if positions.min() < self.edges[0] or positions.max() >= self.edges[-1]:
            raise ValueError(f"positions {positions.min()}..{positions.max()} fall outside the buckets {self.edges}")
        bucket = np.searchsorted(self.edges, positions, side="right") - 1  # i64[S]
        flat = lambda x: np.asarray(x, np.float64).reshape(-1, positions.shape[0]).sum(axis=0)  # noqa: E731
        rows = np.asarray(kl).size // positions.shape[0]
        self.count += np.bincount(bucket, minlength=len(self.count)) * rows
        for name, x in (("kl", kl), ("top1", top1), ("nll", nll)):
            getattr(self, name)[:] += np.bincount(bucket, weights=flat(x), minlength=len(self.count))

    def overall(self) -> dict:
        n = int(self.count.sum())
        nll = float(self.nll.sum() / n)
        return dict(tokens=n, nll=nll, perplexity=math.exp(nll), kl_vs_bf16=max(float(self.kl.sum() / n), 0.0),
                    top1_agreement=float(self.top1.sum() / n))

    def buckets(self) -> list[dict]:
        """One dict per non-empty bucket: its range, tokens, mean KL, top-1 agreement, perplexity."""
        return [dict(start=self.edges[b], end=self.edges[b + 1], tokens=int(self.count[b]),
                     kl_vs_bf16=max(float(self.kl[b] / self.count[b]), 0.0),
                     top1_agreement=float(self.top1[b] / self.count[b]),
                     perplexity=math.exp(self.nll[b] / self.count[b]))
                for b in range(len(self.count)) if self.count[b]]
