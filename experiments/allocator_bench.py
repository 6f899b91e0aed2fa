"""Allocator benchmark: the jitted batched decode-step allocation vs the plain-Python oracle.

One "op" = one request getting the slot for its next decode token: append the sampled
token (hashing the block it completes) and allocate_slots(1) (a new block every Z tokens,
cached when full). At N concurrent requests, one decode step is N ops. Three ways:

* oracle    kvjax/testing/pool_oracle.py, plain Python lists/dicts, one request at a time
            (vLLM's own allocator is plain Python objects like these);
* jax-call  pool.append_token_step + pool.allocate_step jitted together, one call per
            step, driven by a host loop (kvjax.scheduler makes calls like these);
* jax-scan  the same two calls for all D steps inside one jitted lax.scan (no host round
            trip; what a fused decode loop does).

Compile time is excluded (each path is warmed up once); each measurement reruns the D
steps from the same start state until it has taken MIN_TIME_S. A ratio, not a pass/fail. Writes
experiments/results/allocator_bench.{json,md}. Run: python -m experiments.allocator_bench
"""

from __future__ import annotations

import copy
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import pool
from kvjax.testing.pool_oracle import OraclePool

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "experiments" / "results"
Z, PROMPT, STEPS = 16, 8, 64  # block size, prompt tokens per request, decode steps timed
CONCURRENCY = (1, 64, 512)
MIN_TIME_S = 0.3  # each measurement repeats from the same start state at least this long


def prompts(n: int) -> np.ndarray:
    """i32[n, PROMPT] distinct prompts (no prefix hits: this measures allocation)."""
    return (np.arange(n * PROMPT, dtype=np.int32).reshape(n, PROMPT) + 1) % 30000


def bench_oracle(n: int) -> float:
    m = -(-(PROMPT + 2 * STEPS) // Z)
    o = OraclePool(n * m + 1, Z, max_blocks_per_request=m)
    for r, p in enumerate(prompts(n)):
        assert o.add(str(r), p.tolist())["ok"]
    spent, ops = 0.0, 0
    while spent < MIN_TIME_S:  # repeat from the same start (a fresh copy) until measurable
        oc = copy.deepcopy(o)
        reqs = [oc.requests[str(r)] for r in range(n)]
        t0 = time.perf_counter()
        for step in range(STEPS):
            for req in reqs:  # what OraclePool.append does, minus building its output view
                req.tokens.append(step)
                oc._rehash(req)
                assert oc.allocate_slots(req, 1) is not None
        spent += time.perf_counter() - t0
        ops += n * STEPS
    return ops / spent


def setup_jax(n: int):
    m = -(-(PROMPT + 2 * STEPS) // Z)  # room for warm-up + timed steps
    s = pool.init(n * m + 1, Z, n, m)
    toks = np.zeros((n, m * Z), np.int32)
    toks[:, :PROMPT] = prompts(n)
    for r in range(n):
        s, ok = pool.add_request(s, r, jnp.asarray(toks[r]), PROMPT)
    reqs = jnp.arange(n, dtype=jnp.int32)
    s, ok = pool.allocate_step(s, reqs, jnp.full(n, PROMPT, jnp.int32))  # the prefills
    assert bool(ok.all())
    return s, reqs


@jax.jit
def decode_step(s, t, reqs):
    """One decode step's bookkeeping for requests reqs (i32[N]), as one jitted call."""
    n = reqs.shape[0]
    s, ok_a = pool.append_token_step(s, jnp.full(n, 1, jnp.int32) * t, jnp.ones(n, bool))
    s, ok = pool.allocate_step(s, reqs, jnp.ones(n, jnp.int32))
    return s, ok & ok_a


def bench_jax_call(n: int) -> float:
    s, reqs = setup_jax(n)
    jax.block_until_ready(decode_step(s, jnp.int32(0), reqs))  # warm-up: compile
    s0, spent, ops = s, 0.0, 0
    while spent < MIN_TIME_S:  # the pool is functional: rerun from s0 until measurable
        s = s0
        t0 = time.perf_counter()
        for step in range(STEPS):
            s, ok = decode_step(s, jnp.int32(step), reqs)
        jax.block_until_ready(s)
        spent += time.perf_counter() - t0
        ops += n * STEPS
        assert bool(ok.all())
    pool.check_invariants(s)
    return ops / spent


def bench_jax_scan(n: int) -> float:
    s, reqs = setup_jax(n)
    run = jax.jit(lambda s, ts: jax.lax.scan(lambda c, t: decode_step(c, t, reqs), s, ts))
    ts = jnp.arange(STEPS, dtype=jnp.int32)
    jax.block_until_ready(run(s, ts))  # warm-up: compile
    spent, ops = 0.0, 0
    while spent < MIN_TIME_S:
        t0 = time.perf_counter()
        s2, ok = run(s, ts)
        jax.block_until_ready(s2)
        spent += time.perf_counter() - t0
        ops += n * STEPS
    assert bool(ok.all())
    return ops / spent


def main() -> dict:
    rows = []
    for n in CONCURRENCY:
        t0 = time.perf_counter()
        row = {"concurrency": n, "oracle_ops_s": bench_oracle(n),
               "jax_call_ops_s": bench_jax_call(n), "jax_scan_ops_s": bench_jax_scan(n)}
        row["call_vs_oracle"] = row["jax_call_ops_s"] / row["oracle_ops_s"]
        row["scan_vs_oracle"] = row["jax_scan_ops_s"] / row["oracle_ops_s"]
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
    result = {
        "what": "decode-step slot allocation (append token + allocate_slots(1)), ops = request-steps",
        "block_size": Z, "prompt_tokens": PROMPT, "decode_steps": STEPS,
        "backend": jax.default_backend(), "device": str(jax.devices()[0]),
        "jax": jax.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "rows": rows,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "allocator_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Allocator benchmark ({result['backend']}, {result['device']}, jax {result['jax']})", "",
             f"{result['what']}; block size {Z}, {PROMPT}-token prompts, {STEPS} decode steps timed, "
             f"compile excluded, each figure >= {MIN_TIME_S} s of repeats.", "",
             "| concurrent requests | oracle ops/s | jax per-call ops/s | jax scan ops/s | call / oracle | scan / oracle |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['oracle_ops_s']:,.0f} | {r['jax_call_ops_s']:,.0f} | "
                     f"{r['jax_scan_ops_s']:,.0f} | {r['call_vs_oracle']:.2f}x | {r['scan_vs_oracle']:.2f}x |")
    text = "\n".join(lines) + "\n"
    (OUT / "allocator_bench.md").write_text(text)
    print(text, end="")
    return result


if __name__ == "__main__":
    main()
