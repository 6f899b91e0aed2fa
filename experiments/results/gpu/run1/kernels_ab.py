"""Run 1 probe: Mosaic GPU decode kernel vs the Triton one, GQA 32/8/128, pages of 16, random, permuted tables."""
import json, os, sys, time, statistics
import jax, jax.numpy as jnp, numpy as np
from kvjax.attention import pallas_decode, mgpu_decode
from kvjax.attention.reference import paged_decode_reference
peaks = json.load(open(sys.argv[1])) if os.path.exists(sys.argv[1]) else {}
bw = peaks.get("read_gb_s", 4000.0)
rows = []
def timed(f, *a, iters=30):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters): o = f(*a)
        jax.block_until_ready(o); ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)
for B, S, dt in [(32, 8192, "bf16"), (32, 8192, "fp8"), (128, 8192, "bf16"), (8, 32768, "bf16"), (1, 32768, "bf16")]:
    Z, N, K, H = 16, 32, 8, 128
    M = S // Z; P = B * M + 1
    rng = np.random.default_rng(0)
    tables = jnp.asarray((rng.permutation(P - 1)[:B * M] + 1).reshape(B, M).astype(np.int32))
    lens = jnp.full((B,), S, jnp.int32)
    k = jax.random.normal(jax.random.key(1), (P, Z, K, H), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), (P, Z, K, H), jnp.bfloat16)
    if dt == "fp8": k, v = k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)
    q = jax.random.normal(jax.random.key(3), (B, N, H), jnp.bfloat16)
    kvb = 2 * B * S * K * H * k.dtype.itemsize
    row = {"B": B, "S": S, "kv": dt, "kv_bytes": kvb}
    ref = None
    for name, mod in (("triton", pallas_decode), ("mosaic", mgpu_decode)):
        try:
            f = jax.jit(lambda q, k, v, t, l, mod=mod: mod.paged_decode(q, k, v, t, l, scale=H ** -0.5, interpret=False))
            out = f(q, k, v, tables, lens)
            if ref is None:
                ref = np.asarray(jax.jit(lambda q, k, v, t, l: pallas_decode.paged_decode(q, k, v, t, l, scale=H ** -0.5, interpret=False))(q, k, v, tables, lens), np.float32)
            err = float(np.max(np.abs(np.asarray(out, np.float32) - ref)))
            s = timed(f, q, k, v, tables, lens)
            row[name] = {"ms": s * 1e3, "gb_s": kvb / s / 1e9, "frac_bw": kvb / s / 1e9 / bw, "maxdiff_vs_triton": err}
        except Exception as e:
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    rows.append(row); print(json.dumps(row), flush=True)
    del k, v
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "kernels_ab.json"), "w"), indent=1)
