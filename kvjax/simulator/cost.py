"""Cost models of one engine step: its features, a roofline with device presets, a fitted profile.

A step's time depends on what the scheduler put in it (`StepFeatures`, read from the StepPlan):

    tokens            T = prefill tokens + decode tokens, the rows every linear layer multiplies
    prefill_tokens    prompt tokens, chunks of them and recomputation after a preemption
    decode_tokens     one per request that decodes
    context_tokens    Σ seq_lens: positions the step's attention reads from the KV cache (each
                      request's K/V once per layer, as paged attention reads it)
    attention_pairs   Σ query-key pairs, n·L − n(n − 1)/2 for n new tokens ending at position L
                      (causal): the attention's multiply-adds per head and dimension
    windowed          per sliding window W of the model: the keys a layer of that window reads,
                      Σ min(L, W + n − 1), and its pairs, Σ over the new tokens of min(p + 1, W)
    loaded_tokens     host tier hits copied in before the step
    shape             the engine's compiled step: (decode form, rows or padded tokens, table width)

`Roofline` (a device and a model): step time = max(bytes / bandwidth, FLOPs / peak) + the
all-reduces of tensor parallelism + a fixed overhead per step, with

    bytes  = the weights one rank holds (read once per step; a MoE model's routed experts only as
             far as the step's T tokens touch them: E × (1 − (1 − k/E)^T) of E experts per layer,
             routing taken as uniform) + context_tokens × KV bytes per token per rank (its
             format's: fp8 half of bf16, MLA's latent; a sliding-window layer's share reads only
             its window, `windowed`) + T × the same (written)
    FLOPs  = 2 × active parameters per rank × T (a MoE model's routed experts count top_k of
             num_experts) at the weights' tensor-core peak (fp8 weights: the fp8 peak), plus
             2 × layers × heads per rank × (key dim + value dim) × attention_pairs at the bf16 peak
             (a sliding layer's pairs within its window)
    comm   = 2 all-reduces per layer of T × hidden × 2 bytes, ring: 2 (tp − 1) / tp of it over
             the link bandwidth
    loads  = the host tier's hits copied in before the step (loaded_tokens × KV bytes per token per
             rank) over the host link (PCIe Gen5 x16, 64 GB/s each way), not overlapped with it

Device presets cite their vendors' datasheets (dense throughput, half of the with-sparsity
figures); this CPU's numbers are measured (`measure_cpu`: a copy for bandwidth, a matmul for the
peak). `FittedProfile` is a least-squares fit of recorded step times (`kvjax bench serve`'s step
log) over [1, prefill_tokens, decode_tokens, context_tokens, attention_pairs], or over the
engine's compiled shapes (`shape`, kvjax.engine.steps.step_shape: [1, decode form, rows or padded
tokens, those × table width]; a CPU step pays for its padding): what this machine really does per
step. Both print their numbers (`describe`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from kvjax.errors import KvjaxError

FEATURES = ("1", "prefill_tokens", "decode_tokens", "context_tokens", "attention_pairs")  # the plan's work
# The engine's compiled step (`shape`): which program, the rows or padded tokens it computes, and
# those times its table width (what a reference attention reads): what a CPU step really costs.
SHAPE_FEATURES = ("1", "decode_form", "padded_tokens", "attention_slots")


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    """What one step computes (module docstring)."""

    num_requests: int
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    attention_pairs: int
    # per sliding window W of the model: (W, the context a layer of that window reads, its query-key pairs)
    windowed: tuple[tuple[int, int, int], ...] = ()
    loaded_tokens: int = 0  # host tier hits copied in before the step (plan.loads × block size)
    shape: tuple[bool, int, int] = (False, 0, 0)  # the engine's compiled step (kvjax.engine.steps.step_shape)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def from_plan(cls, plan, windows: Sequence[int] = (), config=None) -> "StepFeatures":
        """The features of a kvjax.core.sched.output.StepPlan (one model step); windows: the
        model's sliding windows; config: its SchedulerConfig (for the host tier's loads and the
        engine's compiled shape)."""
        from kvjax.engine.stats import causal_pairs
        from kvjax.engine.steps import step_shape

        n = np.asarray(plan.num_scheduled, np.int64)
        prefill = np.asarray(plan.prefill, bool)
        return cls(plan.num_requests, int(n[prefill].sum()), int((~prefill).sum()),
                   int(np.sum(plan.seq_lens, dtype=np.int64)), causal_pairs(n, plan.seq_lens),
                   _windowed(n, plan.seq_lens, windows), len(plan.loads) * config.block_size if config else 0,
                   step_shape(plan, config) if config else (False, 0, 0))

    @classmethod
    def decoding(cls, seq_lens, windows: Sequence[int] = (), config=None) -> "StepFeatures":
        """A step in which each request decodes one token, ending at seq_lens (config: as from_plan's)."""
        from kvjax.engine.steps import decode_shape

        ends = np.asarray(seq_lens, np.int64)
        n, context = len(ends), int(ends.sum())
        shape = (False, 0, 0) if config is None else decode_shape(int(ends.max()), config)
        return cls(n, 0, n, context, context, _windowed(np.ones_like(ends), ends, windows), 0, shape)

    def vector(self, names: Sequence[str] = None) -> np.ndarray:
        """f64 values of the named features (default FEATURES): a fitted profile's regressors."""
        decode_form, padded, width = self.shape
        values = {"1": 1.0, "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                  "context_tokens": self.context_tokens, "attention_pairs": self.attention_pairs,
                  "decode_form": float(decode_form), "padded_tokens": padded, "attention_slots": padded * width}
        return np.array([values[k] for k in (FEATURES if names is None else names)], np.float64)


def _windowed(n, ends, windows: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """Per window W: (W, Σ min(end, W + n − 1) keys read, Σ over the new tokens at positions p of
    min(p + 1, W) query-key pairs), for n new tokens per request ending at `ends`."""
    n, ends = np.asarray(n, np.int64), np.asarray(ends, np.int64)
    out = []
    for w in windows:
        lo, hi = ends - n + 1, np.minimum(ends, w)  # keys per token: x = p + 1 from lo to ends, capped at w
        below = np.where(hi >= lo, (lo + hi) * (hi - lo + 1) // 2, 0)
        above = w * np.maximum(ends - np.maximum(lo, w + 1) + 1, 0)
        out.append((int(w), int(np.minimum(ends, w + n - 1).sum()), int((below + above).sum())))
    return tuple(out)


# ------------------------------------------------------------------------------------- devices

@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator's roofline numbers (per device)."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float  # dense tensor-core peak
    fp8_flops: float  # dense; a device without fp8 tensor cores: its bf16 peak
    link_bytes_per_s: float  # one direction, to the other devices of a tensor-parallel group
    memory_gib: float
    source: str
    host_bytes_per_s: float = 64e9  # one direction, host memory to the device (PCIe Gen5 x16)


# Dense peaks: NVIDIA publishes "with sparsity" tensor-core figures; dense is half of them.
DEVICES = {
    "h100": Device("H100 SXM", 3.35e12, 989e12, 1979e12, 450e9, 80,
                   "NVIDIA H100 datasheet: 3.35 TB/s HBM3, BF16 1,979 / FP8 3,958 TFLOPS with sparsity, "
                   "NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions)"),
    "h200": Device("H200 SXM", 4.8e12, 989e12, 1979e12, 450e9, 141,
                   "NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s, BF16 1,979 / FP8 3,958 TFLOPS with "
                   "sparsity, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions)"),
    "b200": Device("B200", 8.0e12, 2250e12, 4500e12, 900e9, 180,
                   "NVIDIA DGX B200 datasheet: 1,440 GB HBM3e and 64 TB/s for 8 GPUs (8 TB/s each), "
                   "72 PFLOPS FP8 training with sparsity for 8 (4.5 PF dense each; BF16 half of it), "
                   "NVLink 1.8 TB/s (both directions); PCIe Gen5 x16 to the host"),
}


def measure_cpu(seconds: float = 0.5) -> Device:
    """This machine's CPU: bandwidth from copying a 256 MiB array (read + write), the peak from
    a 1,024² f32 matmul through JAX (what the engine runs on); the best of a few repeats."""
    import jax
    import jax.numpy as jnp

    src = np.ones(1 << 25, np.float64)  # 256 MiB
    dst = np.empty_like(src)
    best_copy = _best(lambda: np.copyto(dst, src), seconds)
    a = jnp.ones((1024, 1024), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    best_mm = _best(lambda: mm(a).block_until_ready(), seconds)
    bw, flops = 2 * src.nbytes / best_copy, 2 * 1024 ** 3 / best_mm
    return Device("this CPU", bw, flops, flops, bw, 0, f"measured: a 256 MiB copy at {bw / 1e9:.1f} GB/s, a 1,024² "
                                                       f"f32 matmul at {flops / 1e9:.1f} GFLOP/s", host_bytes_per_s=bw)


def _best(fn, seconds: float) -> float:
    best, end = float("inf"), time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > end:
            return best


# ------------------------------------------------------------------------------------- models

@dataclasses.dataclass(frozen=True)
class ModelCost:
    """What a step of one model costs on one tensor-parallel rank, from its shapes."""

    name: str
    layers: int
    heads: int  # query heads per rank
    key_dim: int  # per head: head_dim (MLA absorbed: kv_lora_rank + qk_rope_head_dim)
    value_dim: int  # head_dim (MLA: kv_lora_rank)
    hidden_size: int
    kv_bytes_per_token: int  # one rank's KV bytes per token (the format's, every layer)
    weight_bytes: int  # one rank's weights
    active_params: int  # per rank, per token (MoE: top_k of the routed experts)
    fp8_weights: bool
    tp: int
    expert_weight_bytes: int = 0  # within weight_bytes: every routed expert of every MoE layer, per rank
    num_experts: int = 0  # E (0: a dense model)
    top_k: int = 0  # k
    sliding: tuple[tuple[int, int], ...] = ()  # (window W, layers with it); the other layers are full attention

    def attention_reads(self, f: StepFeatures) -> tuple[float, float]:
        """(KV tokens the step's layers read, summed over layers; query-key pairs, summed over
        layers): a full layer reads the context, a sliding one its window's part (the features'
        `windowed`; the whole context where they lack its window). Layers' KV taken as equal."""
        seen = {w: (ctx, pairs) for w, ctx, pairs in f.windowed}
        full = self.layers - sum(n for _, n in self.sliding)
        reads, pairs = full * f.context_tokens, full * f.attention_pairs
        for w, n in self.sliding:
            ctx, p = seen.get(w, (f.context_tokens, f.attention_pairs))
            reads, pairs = reads + n * ctx, pairs + n * p
        return reads, pairs

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` tokens reads (module docstring: experts as far as touched)."""
        if not self.num_experts:
            return float(self.weight_bytes)
        touched = 1.0 - (1.0 - self.top_k / self.num_experts) ** tokens
        return self.weight_bytes - self.expert_weight_bytes * (1.0 - touched)

    @classmethod
    def from_config(cls, config, spec, *, weight_bytes: int, weight_dtype: str = "bf16", tp: int = 1,
                    dcp: int = 1) -> "ModelCost":
        """config: a kvjax ModelConfig; spec: its KVSpec in the KV format asked for (whole model);
        weight_bytes: the whole model's (kvjax plan's weights). dcp > 1 (MLA, kvjax.attention.dcp): a rank reads
        1/dcp of every context for dcp times the heads, so its KV bytes per token are divided by dcp and its
        attention work is unchanged (the merge's all-gathers are left out of the cost)."""
        heads = config.num_heads // tp
        if config.is_mla:
            key, value = config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank
        else:
            key = value = config.head_dim
        moe, experts = config.moe, 0
        if moe is not None:  # every routed expert's bytes, at the model's bytes per parameter
            d, i = config.hidden_size, moe.intermediate_size
            params = len(config.moe_layers) * moe.num_experts * (3 * d * i + moe.expert_bias * (2 * i + d))
            experts = int(params * weight_bytes / config.num_params)
        windows = [w for w in config.layer_windows if w is not None]
        return cls(config.name or config.model_type, config.num_layers, heads, key, value, config.hidden_size,
                   spec.per_rank(tp).bytes_per_token // dcp, weight_bytes // tp, active_params(config) // tp,
                   weight_dtype.startswith("fp8"), tp, experts // tp, moe.num_experts if moe else 0,
                   moe.top_k if moe else 0, tuple((w, windows.count(w)) for w in sorted(set(windows))))


def active_params(config) -> int:
    """Parameters one token multiplies: all of a dense model's; a MoE model's without the routed
    experts it does not visit (num_experts − top_k of them in each MoE layer)."""
    total = config.num_params
    moe = config.moe
    if moe is None:
        return total
    d, i = config.hidden_size, moe.intermediate_size
    unused = (moe.num_experts - moe.top_k) * (3 * d * i + moe.expert_bias * (2 * i + d))
    return total - len(config.moe_layers) * unused


# ------------------------------------------------------------------------------------- cost models

@dataclasses.dataclass(frozen=True)
class Roofline:
    """Step time of `model` on `device` (module docstring); overhead_s: a fixed cost per step
    (scheduling, launches), an assumption, not measured."""

    device: Device
    model: ModelCost
    overhead_s: float = 1e-3

    def step_seconds(self, f: StepFeatures) -> float:
        m, d = self.model, self.device
        reads, pairs = m.attention_reads(f)
        moved = m.weight_bytes_read(f.tokens) + (reads / m.layers + f.tokens) * m.kv_bytes_per_token
        linear = 2 * m.active_params * f.tokens / (d.fp8_flops if m.fp8_weights else d.bf16_flops)
        attention = 2 * m.heads * (m.key_dim + m.value_dim) * pairs / d.bf16_flops
        comm = 0.0
        if m.tp > 1:
            comm = m.layers * 2 * (2 * (m.tp - 1) / m.tp) * f.tokens * m.hidden_size * 2 / d.link_bytes_per_s
        loads = f.loaded_tokens * m.kv_bytes_per_token / d.host_bytes_per_s  # before the step, not overlapped
        return max(moved / d.hbm_bytes_per_s, linear + attention) + comm + loads + self.overhead_s

    def describe(self) -> str:
        d, m = self.device, self.model
        return (f"roofline on {d.name} ({d.source}): {d.hbm_bytes_per_s / 1e12:.2f} TB/s, bf16 "
                f"{d.bf16_flops / 1e12:,.0f} / fp8 {d.fp8_flops / 1e12:,.0f} TFLOP/s dense; {m.name} per rank of "
                f"{m.tp}: {m.weight_bytes / 2**30:.2f} GiB of weights, {m.active_params / 1e9:.2f}B active "
                f"parameters, {m.kv_bytes_per_token:,} KV bytes per token"
                + "".join(f", {n} layers sliding over {w:,} tokens" for w, n in m.sliding)
                + f"; overhead {self.overhead_s * 1e3:g} ms per step (assumed)")


@dataclasses.dataclass(frozen=True)
class FittedProfile:
    """step seconds = coefficients · the step's `features` (FEATURES: the plan's work, or
    SHAPE_FEATURES: the engine's compiled shapes), least squares over recorded steps (`fit`), every
    coefficient kept >= 0: a feature whose free fit comes out negative (it explains noise, not
    cost: a workload of other proportions would extrapolate it into negative time) is dropped and
    the rest refitted, until none is."""

    coefficients: tuple[float, ...]
    steps: int  # how many steps it was fitted on
    rms_error_s: float  # its residual on them
    features: tuple[str, ...] = FEATURES

    def step_seconds(self, f: StepFeatures) -> float:
        return max(0.0, float(np.dot(self.coefficients, f.vector(self.features))))

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepFeatures, float]], features: Sequence[str] = FEATURES) -> "FittedProfile":
        """samples: (features, seconds) of recorded steps; at least as many as there are features."""
        names = tuple(features)
        if len(samples) < len(names):
            raise KvjaxError(f"fitting a step profile needs at least {len(names)} recorded steps, got {len(samples)}")
        x = np.stack([f.vector(names) for f, _ in samples])
        y = np.array([s for _, s in samples], np.float64)
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # columns of very different sizes
        keep = np.ones(len(names), bool)
        while True:
            coef = np.zeros(len(names))
            sol, *_ = np.linalg.lstsq(x[:, keep] / scale[keep], y, rcond=None)
            coef[keep] = sol / scale[keep]
            if (coef >= 0).all():
                break
            keep &= coef >= 0  # drop the negative ones (class docstring), refit the rest
        return cls(tuple(float(c) for c in coef), len(samples), float(np.sqrt(np.mean((x @ coef - y) ** 2))), names)

    def describe(self) -> str:
        terms = ", ".join(f"{name} {c:.3g}" for name, c in zip(self.features, self.coefficients))
        return (f"profile fitted on {self.steps} recorded steps (seconds per unit: {terms}; "
                f"rms error {self.rms_error_s * 1e3:.2f} ms)")

    def to_json(self) -> dict:
        return {"features": list(self.features), "coefficients": list(self.coefficients), "steps": self.steps,
                "rms_error_s": self.rms_error_s}

    @classmethod
    def from_json(cls, d: dict) -> "FittedProfile":
        names = tuple(d.get("features", ()))
        if names not in (FEATURES, SHAPE_FEATURES) or len(d.get("coefficients", [])) != len(names):
            raise KvjaxError(f"a fitted profile has features {list(FEATURES)} or {list(SHAPE_FEATURES)} and one "
                             f"coefficient each; got {d.get('features')!r}")
        return cls(tuple(float(c) for c in d["coefficients"]), int(d["steps"]), float(d["rms_error_s"]), names)
