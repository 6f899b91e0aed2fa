"""kvjax's grouped allocator against vLLM 0.33's own `KVCacheManager`, op by op.

Random traces (`kvjax replay`'s ops: add, append, free, reset_prefix_cache) on a pool with KV
cache groups (a full-attention and a sliding-window group, in either order, sometimes more
groups or a lone sliding group, prefix caching on and off, small pools that refuse; with --mamba,
Mamba groups beside them, vLLM's MambaSpec in mamba_cache_mode "none" whose block size is
max_model_len, prefix caching off as that mode requires) are run through vLLM's KVCacheManager,
built from vLLM's own KVCacheConfig / FullAttentionSpec / SlidingWindowSpec / MambaSpec, and through
`kvjax replay` (kvjax.core.replay.iter_trace). After every op the
two states are compared: ok, each group's hit blocks, new blocks and whole table (null block 0),
the free queue head to tail, ref counts, cached blocks, num_free and usage. The block hashes
themselves differ (vLLM hashes with sha256, kvjax with its own jittable hash); what is compared
is every block id they lead to.

vLLM is read from its unzipped wheel, as the other reference scripts read it:

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm && unzip -q /tmp/vllm/vllm-0.33.0-*.whl -d /tmp/vllm/src
    pip install --target /tmp/vdeps <what its imports need: torch, pydantic, msgspec, cbor2, ...>
    python experiments/vllm_replay_reference.py --vllm-src /tmp/vllm/src --deps /tmp/vdeps

Writes experiments/results/vllm_replay_reference.{md,json}; exits 1 on the first difference,
printing the trace and both states.
"""
from __future__ import annotations

import argparse
import importlib
import os
import random
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"


def _vllm(src: str, deps: str | None):
    for p in ([deps] if deps else []) + [src]:
        sys.path.insert(0, p)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # Imported by name from the wheel's folder on sys.path: vLLM is a reference here, not a dependency.
    mod = importlib.import_module
    utils, interface = mod("vllm.v1.core.kv_cache_utils"), mod("vllm.v1.kv_cache_interface")
    sha256 = mod("vllm.utils.hashing").sha256
    utils.init_none_hash(sha256)
    return dict(torch=mod("torch"), SamplingParams=mod("vllm.sampling_params").SamplingParams, sha256=sha256,
                KVCacheManager=mod("vllm.v1.core.kv_cache_manager").KVCacheManager,
                hasher=utils.get_request_block_hasher, Full=interface.FullAttentionSpec,
                Config=interface.KVCacheConfig, Group=interface.KVCacheGroupSpec, Mamba=interface.MambaSpec,
                Sliding=interface.SlidingWindowSpec, Request=mod("vllm.v1.request").Request)


class VllmReplay:
    """vLLM's KVCacheManager driven by kvjax replay's ops, with replay's conventions: `add`
    schedules the whole prompt after its hits, `append` schedules the new tokens after every
    earlier one, a refused op takes back its tokens (the window's freed blocks stay freed), a
    request longer than the pool fails without reaching the manager."""

    def __init__(self, v: dict, num_blocks: int, block_size: int, windows, prefix_caching: bool):
        self.v, self.z, self.windows, self.capacity = v, block_size, windows, (num_blocks - 1) * block_size
        spec = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype=v["torch"].bfloat16)
        # a Mamba layer's state, one page a request: its block size is max_model_len (mamba_cache_mode "none")
        mamba = v["Mamba"](shapes=((2, 8),), dtypes=(v["torch"].bfloat16,), block_size=self.capacity,
                           mamba_cache_mode="none")
        groups = [v["Group"]([f"layer{g}"], mamba if w == "mamba" else v["Full"](**spec) if w is None
                             else v["Sliding"](**spec, sliding_window=w)) for g, w in enumerate(windows)]
        config = v["Config"](num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        # resolve_kv_cache_block_sizes: the scheduler's block is the lcm of the groups' (a Mamba group's is
        # max_model_len), and without prefix caching the hashes are taken at it too
        sched = self.capacity if "mamba" in windows else block_size
        self.mgr = v["KVCacheManager"](config, max_model_len=self.capacity, scheduler_block_size=sched,
                                       hash_block_size=sched, enable_caching=prefix_caching)
        self.reqs: dict = {}
        self.hasher = v["hasher"](block_size, v["sha256"])

    def _ids(self, blocks) -> list[list[int]]:
        return [list(g) for g in blocks.get_block_ids(allow_none=False)] if blocks is not None else \
            [[] for _ in self.windows]

    def view(self, op, name, ok, hits=None, hit_tokens=0, new=None) -> dict:
        pool, none = self.mgr.block_pool, [[] for _ in self.windows]
        req = self.reqs.get(name)
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        n = len(pool.blocks)
        return {"op": op, "req": name, "ok": ok, "hit_blocks": hits or none, "hit_tokens": hit_tokens,
                "new_blocks": new or none,
                "blocks": [list(g) for g in self.mgr.get_block_ids(req.request_id)] if req else none,
                "free_queue": free, "num_free": pool.get_num_free_blocks(),
                "ref_cnt": {str(b.block_id): b.ref_cnt for b in pool.blocks if b.ref_cnt and not b.is_null},
                "cached": [b.block_id for b in pool.blocks if b.block_hash is not None],
                "usage": round(1.0 - pool.get_num_free_blocks() / (n - 1), 6)}

    def add(self, name, tokens):
        if len(tokens) > self.capacity:
            return self.view("add", name, False)
        req = self.v["Request"](name, list(tokens), self.v["SamplingParams"](max_tokens=1), None,
                                block_hasher=self.hasher)
        hits, n_hit, _ = self.mgr.get_computed_blocks(req)
        new = self.mgr.allocate_slots(req, len(tokens) - n_hit, n_hit, hits)
        if new is None:
            self.mgr.free(req)  # drops the manager's empty bookkeeping for it
            return self.view("add", name, False)
        req.num_computed_tokens = len(tokens)
        self.reqs[name] = req
        return self.view("add", name, True, self._ids(hits), n_hit, self._ids(new))

    def append(self, name, tokens):
        req = self.reqs[name]
        if req.num_tokens + len(tokens) > self.capacity:
            return self.view("append", name, False)
        req.append_output_token_ids(list(tokens))
        new = self.mgr.allocate_slots(req, len(tokens))
        if new is None:
            del req._all_token_ids[-len(tokens):], req._output_token_ids[-len(tokens):]
            del req.block_hashes[req.num_tokens // self.z:]
            return self.view("append", name, False)
        req.num_computed_tokens += len(tokens)
        return self.view("append", name, True, None, 0, self._ids(new))

    def free(self, name):
        self.mgr.free(self.reqs[name])
        view = self.view("free", name, True)
        del self.reqs[name]
        return view

    def reset_prefix_cache(self):
        return self.view("reset_prefix_cache", None, bool(self.mgr.reset_prefix_cache()))


LAYOUTS = (["full", "sliding"], ["sliding", "full"], ["full", "sliding", "sliding"], ["sliding", "full", "full"],
           ["sliding"], ["full"])
# Granite-4.0-H's and Jamba's order (Mamba groups first), Falcon-H1's (attention first), more Mamba groups
# than attention ones, and a sliding window beside a Mamba group
MAMBA_LAYOUTS = (["mamba", "full"], ["full", "mamba"], ["mamba", "mamba", "full"], ["mamba", "full", "mamba"],
                 ["sliding", "mamba"], ["mamba", "sliding", "full"])


def random_trace(rng: random.Random, v: dict, hybrid_only: bool, mamba: bool = False) -> tuple[list[dict], list[dict]]:
    """A random trace and vLLM's state after each op (the names it adds are the ones vLLM took)."""
    z = rng.choice([1, 2, 4, 16])
    layout = rng.choice(MAMBA_LAYOUTS if mamba else LAYOUTS[:4] if hybrid_only else LAYOUTS)
    w = rng.randint(1, 6 * z)
    windows = [None if k == "full" else "mamba" if k == "mamba" else w for k in layout]
    num_blocks, pc = rng.randint(4, 40), rng.random() < 0.75 and not mamba
    groups = [{"type": "full_attention"} if x is None else {"type": "mamba"} if x == "mamba" else
              {"type": "sliding_window", "sliding_window": x} for x in windows]
    ops = [{"op": "init", "num_blocks": num_blocks, "block_size": z, "prefix_caching": pc, "groups": groups}]
    ref = VllmReplay(v, num_blocks, z, windows, pc)
    states = [None]
    base = [rng.randrange(4) for _ in range(12 * z)]
    live, n = [], 0
    for _ in range(rng.randint(8, 40)):
        r = rng.random()
        if r < 0.35 or not live:
            name, n = f"r{n}", n + 1
            k = rng.randint(1, 10 * z)
            toks = base[:k] if rng.random() < 0.6 else [rng.randrange(4) for _ in range(k)]
            op, out = {"op": "add", "req": name, "tokens": toks}, ref.add(name, toks)
            if out["ok"]:
                live.append(name)
        elif r < 0.8:
            name, toks = rng.choice(live), [rng.randrange(4) for _ in range(rng.randint(1, 3 * z))]
            op, out = {"op": "append", "req": name, "tokens": toks}, ref.append(name, toks)
        elif r < 0.97:
            name = rng.choice(live)
            live.remove(name)
            op, out = {"op": "free", "req": name}, ref.free(name)
        else:
            op, out = {"op": "reset_prefix_cache"}, ref.reset_prefix_cache()
        ops.append(op)
        states.append(out)
    return ops, states


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-src", required=True, help="vLLM 0.33's unzipped wheel (the folder holding vllm/)")
    ap.add_argument("--deps", help="a folder with vLLM's pure-Python imports (pip install --target)")
    ap.add_argument("--traces", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hybrid-only", action="store_true", help="only layouts with a full and a sliding group")
    ap.add_argument("--mamba", action="store_true", help="layouts with Mamba groups (written to "
                                                         "vllm_replay_reference_mamba.{md,json})")
    args = ap.parse_args(argv)
    v = _vllm(args.vllm_src, args.deps)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from kvjax.core.replay import iter_trace
    from kvjax.utils.output_files import write_json, write_text
    from kvjax.utils.strict_json import dumps

    rng, t0 = random.Random(args.seed), time.time()
    ops_run, layouts = 0, {}
    for i in range(args.traces):
        ops, want = random_trace(rng, v, args.hybrid_only, args.mamba)
        got = [out for out, _ in iter_trace(dumps(op) for op in ops)]
        for k in range(1, len(ops)):
            if got[k] != want[k]:
                print(f"trace {i}, op {k}: {dumps(ops[k])}\ninit: {dumps(ops[0])}")
                for key in want[k]:
                    if want[k][key] != got[k].get(key):
                        print(f"  {key}: vLLM {want[k][key]}  kvjax {got[k].get(key)}")
                return 1
        ops_run += len(ops) - 1
        kinds = "+".join({"full_attention": "full", "sliding_window": "sliding"}.get(g["type"], g["type"])
                         for g in ops[0]["groups"])
        layouts[kinds] = layouts.get(kinds, 0) + 1
    result = {"vllm": "0.33.0", "traces": args.traces, "ops": ops_run, "seed": args.seed, "identical": True,
              "layouts": layouts, "seconds": round(time.time() - t0, 1)}
    OUT.mkdir(exist_ok=True)
    stem = "vllm_replay_reference" + ("_mamba" if args.mamba else "")
    write_json(OUT / f"{stem}.json", result, "--out")
    rows = "\n".join(f"| {k} | {n} |" for k, n in sorted(layouts.items()))
    write_text(OUT / f"{stem}.md",
        "# kvjax replay against vLLM 0.33's KVCacheManager\n\n"
        f"`python experiments/vllm_replay_reference.py --vllm-src ... --deps ... --traces {args.traces} "
        f"--seed {args.seed}{' --mamba' if args.mamba else ''}`: {args.traces} random traces, {ops_run} ops, the state after every op identical "
        "(each group's hit, new and whole block table, free queue, ref counts, cached blocks, num_free, usage).\n\n"
        f"| groups | traces |\n|---|---:|\n{rows}\n", "--out")
    print(dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
