"""The device's two ceilings, measured in JAX: memory bandwidth and the bf16 matmul rate.

Every roofline in kvjax's GPU results divides by these, not by a datasheet (an H200's datasheet
says 4.8 TB/s and about 990 dense bf16 TFLOP/s; this workplace measured a torch copy at 4.3 TB/s
and an 8192³ bf16 product at 790 TFLOP/s). Three measurements, each on random data (zeros run
faster: a bf16 product 13% faster on one H200), each program run `iters` times back to back
after a warm-up call and timed as a whole (dispatch is asynchronous; only the last call is
waited on), repeated `repeats` times, the median kept:

* read: the sum of a bf16 array of `gib` GiB (bytes = the array: a decode step mostly reads);
* copy: y = x * 2 over the same array, counting the bytes read and the bytes written;
* matmul: an n × n × n bf16 product with f32 accumulation, 2 n³ FLOPs.

The array is several times the H200's 60 MB L2, so no pass is served from the cache.

    python -m kvjax.experiments.device_peaks [--gib 4] [--out DIR]     # writes device_peaks.json
    python -m kvjax.experiments.device_peaks --tiny                    # the same code on tiny sizes (CPU)
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from kvjax.experiments import results_dir
from kvjax.utils.output_files import write_json


def _timed(fn, arg, iters: int, repeats: int) -> float:
    """Median seconds per call of fn(arg) over `repeats` timings of `iters` back-to-back calls."""
    jax.block_until_ready(fn(arg))  # compile + warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(arg)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def measure(gib: float = 4.0, matmul_n: int = 8192, iters: int = 20, repeats: int = 3) -> dict:
    """{read_gb_s, copy_gb_s, matmul_tflop_s, ...} of the default device (GB = 1e9 bytes)."""
    n = int(gib * 2**30) // 2  # bf16 elements
    x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), jnp.bfloat16)
    nbytes = x.size * x.dtype.itemsize
    read_s = _timed(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x, iters, repeats)
    copy_s = _timed(jax.jit(lambda a: a * 2), x, iters, repeats)
    del x
    k1, k2 = jax.random.split(jax.random.key(1))
    a = jax.random.normal(k1, (matmul_n, matmul_n), jnp.bfloat16)
    b = jax.random.normal(k2, (matmul_n, matmul_n), jnp.bfloat16)
    mm = jax.jit(lambda ab: jnp.dot(ab[0], ab[1], preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    mm_s = _timed(mm, (a, b), iters, repeats)
    d = jax.devices()[0]
    return {"device": d.device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
            "array_bytes": nbytes, "iters": iters, "repeats": repeats,
            "read_s": read_s, "read_gb_s": nbytes / read_s / 1e9,
            "copy_s": copy_s, "copy_gb_s": 2 * nbytes / copy_s / 1e9,
            "matmul_n": matmul_n, "matmul_s": mm_s, "matmul_tflop_s": 2 * matmul_n**3 / mm_s / 1e12}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="size of the array read and copied (GiB)")
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="16 MiB and a 256³ product: the code path on a CPU")
    parser.add_argument("--out", default=None, help="folder for device_peaks.json (default $OUT, else experiments/results)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.gib, args.matmul_n, args.iters = 1 / 64, 256, 2
    r = measure(args.gib, args.matmul_n, args.iters)
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "device_peaks.json", r, "--out", indent=1)
    print(f"{r['device']}: read {r['read_gb_s']:,.0f} GB/s, copy (read + write) {r['copy_gb_s']:,.0f} GB/s "
          f"over {r['array_bytes'] / 2**30:.2f} GiB; bf16 matmul {r['matmul_n']}³ {r['matmul_tflop_s']:,.0f} TFLOP/s")
    return r


if __name__ == "__main__":
    main()
