"""Host offload tier benchmark: multi-turn chat with and without a host KV tier, over host sizes.

The workload is `conversations` × `turns` prompts. A conversation's first prompt is `first` tokens;
each later prompt is the previous one plus `new` tokens (the assistant's recorded reply and
the user's next message; fixed text, so the whole workload is known up front). Prompts are
interleaved turn by turn (turn 1 of every conversation, then turn 2, ...) and submitted in
one `LLM.generate` call, FCFS, `max_num_seqs` at a time: by the time a conversation's next
turn is admitted, the other conversations have filled the device pool, which holds about
half of the workload's distinct blocks, so its earlier turns were evicted from the device.

Every variant is a `kvjax.LLM` with the same pool and only `kv_offloading_size` and the host
tier's eviction policy (`kv_transfer_config={"kv_connector_extra_config": {"eviction_policy":
...}}`, vLLM's OffloadingConnector) changing: off, then host tiers of a quarter, half, all and
twice the workload's distinct blocks, LRU and ARC. Per variant: prompt tokens prefilled, host
hit rate (host hit tokens / prompt tokens looked up), time to first token p50 / p99 (from the
start of the run, queueing included, as every request arrives at once), total time. Compile
excluded: each variant's LLM runs the workload once unmeasured, then the median of `--repeats`
runs. The LLM's engine keeps its device prefix cache and its host tier from one generate call
to the next, so every run starts from an empty pool and an empty host tier
(`reset_prefix_cache(reset_connector=True)`): each measures the workload's own host hits, not
the blocks an earlier run left behind.

With a tier that holds the whole workload, the prefill must fall to the unshared remainder:
the first turn of each conversation plus the new text of each later turn (`first` and `new`
are multiples of the block size, so every earlier turn is whole blocks); the table says if it
did, and the greedy tokens of every variant must equal those without the tier.

Writes offload_bench.{json,md,png} to --out (default $OUT, else experiments/results), and
offload_bench_<model>.* for a model other than small-gqa.
Run: python -m kvjax.experiments.offload_bench [--model smollm2-135m] [--quick]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import numpy as np

from kvjax import LLM, SamplingParams
from kvjax.experiments import results_dir
from kvjax.experiments.decode_bench import _meta, _write
from kvjax.markdown import markdown_table
from kvjax.math_utils import cdiv
from kvjax.models.hub import load_model
from kvjax.utils.output_files import save_figure
from kvjax.utils.plotting import pyplot

FRACTIONS = (0.25, 0.5, 1.0, 2.0)  # host tier sizes, as fractions of the workload's distinct blocks


def chat_workload(conversations: int, turns: int, first: int, new: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts turn by turn: each conversation's previous prompt plus `new` random tokens."""
    rng = np.random.default_rng(seed)
    convs, prompts = [[] for _ in range(conversations)], []
    for t in range(turns):
        for c in range(conversations):
            convs[c] = convs[c] + rng.integers(0, vocab, new if t else first).tolist()
            prompts.append(list(convs[c]))
    return prompts


def run_variant(model, prompts, max_tokens: int, repeats: int, policy: str | None = None, **settings) -> dict:
    """One LLM's greedy runs of the workload: the first compiles, the next `repeats` are measured.
    policy: the host tier's eviction policy (with settings' kv_offloading_size)."""
    if policy is not None:
        settings["kv_transfer_config"] = {"kv_connector_extra_config": {"eviction_policy": policy}}
    llm = LLM(model, **settings)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)

    def run():
        if not llm.reset_prefix_cache(reset_connector=True):  # an empty pool and host tier, as a fresh LLM's
            raise RuntimeError("the prefix cache was not reset: a request is still running")
        return llm.generate(prompts, sp, use_tqdm=False)

    run()  # compiles
    runs = [run() for _ in range(repeats)]
    s = [r.summary for r in runs]
    med = lambda f: statistics.median(getattr(x, f) for x in s)  # noqa: E731
    last = s[-1]
    return {"settings": settings, "policy": policy, "host_blocks": last.host_blocks,
            "prefill_tokens": last.prefill_tokens, "prompt_tokens": last.prompt_tokens,
            "prefix_hit_tokens": last.prefix_hit_tokens, "host_hit_tokens": last.host_hit_tokens,
            "host_hit_rate": last.host_hit_tokens / last.prefix_queried_tokens,
            "host_bytes_stored": last.host_bytes_stored, "host_bytes_loaded": last.host_bytes_loaded,
            "host_memory_kind": last.host_memory_kind, "preemptions": last.preemptions,
            "ttft_p50_ms": med("ttft_p50_ms"), "ttft_p99_ms": med("ttft_p99_ms"), "wall_s": med("wall_s"),
            "outputs": [o.outputs[0].token_ids for o in runs[-1]]}


def bench(model_name: str, conversations: int, turns: int, first: int, new: int, max_tokens: int,
          block_size: int, max_num_seqs: int, repeats: int, policies=("lru", "arc"), fractions=FRACTIONS) -> dict:
    model = load_model(model_name)
    prompts = chat_workload(conversations, turns, first, new, model.config.vocab_size)
    z = block_size
    longest = first + (turns - 1) * new + max_tokens
    distinct = conversations * cdiv(longest, z)  # blocks of every conversation's last turn
    # The pool holds max_num_seqs requests of the longest length (nothing is preempted) and
    # about half of the workload's distinct blocks.
    num_blocks = 1 + max(max_num_seqs * cdiv(longest, z), distinct // 2)
    base = dict(num_gpu_blocks_override=num_blocks, block_size=z, max_num_seqs=max_num_seqs, max_model_len=longest,
                steps_per_call=8)
    bytes_per_block = model.config.kv_spec().bytes_per_block(z)
    rows = [run_variant(model, prompts, max_tokens, repeats, **base)]
    for frac in fractions:
        gib = max(1, round(frac * distinct)) * bytes_per_block / 2**30
        for policy in policies:
            rows.append(run_variant(model, prompts, max_tokens, repeats, policy, kv_offloading_size=gib, **base))
            rows[-1]["fraction"] = frac
    unshared = conversations * (first + (turns - 1) * new)
    want = rows[0]["outputs"]
    for r in rows:
        r["same_tokens"] = r.pop("outputs") == want
        r["ttft_ratio_off_over_on"] = rows[0]["ttft_p50_ms"] / r["ttft_p50_ms"]
    return {"model": model_name, "conversations": conversations, "turns": turns, "first": first, "new": new,
            "max_tokens": max_tokens, "block_size": z, "max_num_seqs": max_num_seqs, "num_blocks": num_blocks,
            "distinct_blocks": distinct, "bytes_per_block": bytes_per_block, "repeats": repeats,
            "unshared_prefill_tokens": unshared, "rows": rows}


def markdown(r: dict) -> str:
    m = r["meta"]
    lines = [f"# Host offload tier: multi-turn chat ({r['model']}, {m['backend']}, {m['cpus']} CPUs)", "",
             f"{r['conversations']} conversations × {r['turns']} turns, interleaved turn by turn in one generate call; "
             f"first prompt {r['first']} tokens, +{r['new']} per turn, {r['max_tokens']} generated per turn (greedy). "
             f"Device pool {r['num_blocks'] - 1} usable blocks of {r['block_size']} tokens, {r['max_num_seqs']} requests "
             f"at once, 8 decode steps per call; the workload has {r['distinct_blocks']} distinct blocks of "
             f"{r['bytes_per_block']:,} bytes. Medians of {r['repeats']} runs after a compiling one. "
             f"`python -m kvjax.experiments.offload_bench{'' if r['model'] == 'small-gqa' else ' --model ' + r['model']}"
             f"{' --quick' if r.get('quick') else ''}`", "",
             *markdown_table(
                 ["host tier", "policy", "host blocks", "prefill tokens", "host hit tokens", "host hit rate",
                  "TTFT p50 ms", "TTFT p99 ms", "total s", "TTFT p50 off / on", "same tokens"],
                 [[f"{row['fraction']:g} × workload" if "fraction" in row else "off", _policy(row) or "-",
                   f"{row['host_blocks']:,}", f"{row['prefill_tokens']:,}", f"{row['host_hit_tokens']:,}",
                   f"{100 * row['host_hit_rate']:.1f}%", f"{row['ttft_p50_ms']:,.1f}", f"{row['ttft_p99_ms']:,.1f}",
                   f"{row['wall_s']:.2f}", f"{row['ttft_ratio_off_over_on']:.2f}×", row["same_tokens"]]
                  for row in r["rows"]], "llrrrrrrrrl")]
    full = [row for row in r["rows"] if row.get("fraction", 0) >= 1]
    u = r["unshared_prefill_tokens"]
    got = ", ".join(f"{row['prefill_tokens']:,}" for row in full)
    lines += ["", f"Unshared remainder (first turns + new text of later turns): {u:,} tokens; with a tier holding the "
              f"whole workload the prefill was {got} "
              f"({'equal' if all(row['prefill_tokens'] == u for row in full) else '**not equal**'}), "
              f"against {r['rows'][0]['prefill_tokens']:,} without the tier. Host pages: "
              f"{full[0]['host_memory_kind'] if full else 'n/a'}."]
    return "\n".join(lines) + "\n"


def _policy(row: dict) -> str | None:
    """A row's host tier eviction policy (None: no tier). Results written before the vLLM-named
    API kept it in their settings as kv_offload_policy."""
    return row.get("policy", row["settings"].get("kv_offload_policy"))


def plot(r: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    off = r["rows"][0]
    for policy, marker in (("lru", "o"), ("arc", "s")):
        rows = [row for row in r["rows"] if _policy(row) == policy]
        gib = [row["host_blocks"] * r["bytes_per_block"] / 2**20 for row in rows]
        ax1.plot(gib, [100 * row["host_hit_rate"] for row in rows], marker=marker, label=policy.upper())
        ax2.plot(gib, [row["ttft_p50_ms"] for row in rows], marker=marker, label=f"{policy.upper()} p50")
    ax2.axhline(off["ttft_p50_ms"], color="tab:red", ls="--", lw=1, label="no host tier p50")
    ax1.set(xlabel="host tier (MiB)", ylabel="host hit rate (% of prompt tokens)", title="Host hit rate")
    ax2.set(xlabel="host tier (MiB)", ylabel="time to first token (ms)", title="TTFT")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{r['model']}: {r['conversations']} conversations × {r['turns']} turns")
    fig.tight_layout()
    save_figure(fig, path, "--out", dpi=110)
    plt.close(fig)


def bandwidth(block_sizes=(1, 4, 16, 64), blocks: int = 32, repeats: int = 5) -> dict:
    """Host -> device bandwidth of block loads (HostPages.load: the page transfers and the
    scatter into the cache) and device -> host of stores, for Llama-3-8B-shaped blocks (32
    layers, 8 kv heads of 128, bf16: 128 KiB per token) of each block size: GB/s = bytes moved /
    the median wall time of moving `blocks` blocks, waited for."""
    import jax

    from kvjax.core.kv_cache_interface import KVSpec
    from kvjax.kv_offload import host_pages as offload
    from kvjax.worker.paged_cache import PagedCache

    spec = KVSpec("gqa", 32, 32, 8, 128, kv_dtype="bf16")
    rows = []
    for z in block_sizes:
        cache = jax.device_put(PagedCache.create(spec, blocks + 1, z), jax.devices()[0])
        pages = offload.HostPages(blocks, cache)
        ids, slots = list(range(1, blocks + 1)), list(range(blocks))
        times = {"store": [], "load": []}
        for i in range(repeats + 1):  # the first round compiles
            t = time.perf_counter()
            pages.store(cache, ids, slots)
            jax.block_until_ready([p for p in pages.pages if p is not None])
            t1 = time.perf_counter()
            cache = pages.load(cache, slots, ids[::-1])
            jax.block_until_ready(cache)
            t2 = time.perf_counter()
            if i:
                times["store"].append(t1 - t)
                times["load"].append(t2 - t1)
        nbytes = blocks * pages.bytes_per_block
        rows.append({"block_size": z, "bytes_per_block": pages.bytes_per_block, "blocks": blocks,
                     "memory_kind": pages.memory_kind,
                     **{f"{k}_gb_s": nbytes / statistics.median(v) / 1e9 for k, v in times.items()}})
        print(f"block {z:3d} tokens = {pages.bytes_per_block / 2**20:7.2f} MiB: host->device "
              f"{rows[-1]['load_gb_s']:7.2f} GB/s, device->host {rows[-1]['store_gb_s']:7.2f} GB/s "
              f"({pages.memory_kind}, {blocks} blocks)", flush=True)
    return {"meta": _meta(), "spec": "llama-3-8b-shaped: 32 layers, 8 kv heads x 128, bf16", "rows": rows}


def bandwidth_markdown(r: dict) -> str:
    lines = [f"# Host tier transfers ({r['meta']['device']}, {r['meta']['backend']})", "", f"Blocks of {r['spec']}; "
             "`python -m kvjax.experiments.offload_bench --bandwidth`", "",
             *markdown_table(["block size (tokens)", "bytes per block", "blocks per call", "host pages",
                              "host → device GB/s", "device → host GB/s"],
                             [[x["block_size"], f"{x['bytes_per_block']:,}", x["blocks"], x["memory_kind"],
                               f"{x['load_gb_s']:.2f}", f"{x['store_gb_s']:.2f}"] for x in r["rows"]], "rrrlrr")]
    return "\n".join(lines) + "\n"


SIZES = {  # model -> (conversations, turns, first, new, max_tokens, block size, max_num_seqs)
    "small-gqa": (8, 4, 256, 128, 8, 16, 4),
    "smollm2-135m": (6, 3, 128, 64, 8, 16, 3),
}
QUICK = (3, 3, 16, 8, 4, 8, 2)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small-gqa", help="small-gqa | smollm2-135m | a checkpoint folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small workload, one repeat, LRU only (a smoke run)")
    parser.add_argument("--bandwidth", action="store_true",
                        help="host <-> device GB/s of block loads and stores vs block size (the GPU check)")
    parser.add_argument("--out", default=None, help="output dir (default $OUT, else ./experiments/results)")
    args = parser.parse_args(argv)
    out_dir = results_dir(args.out)
    if args.bandwidth:
        result = bandwidth(block_sizes=(1, 4) if args.quick else (1, 4, 16, 64), blocks=4 if args.quick else 32)
        _write(out_dir, "offload_bandwidth", result, bandwidth_markdown(result))
        return result
    c, t, first, new, gen, z, seqs = QUICK if args.quick else SIZES.get(args.model, SIZES["small-gqa"])
    t0 = time.perf_counter()
    result = {"meta": _meta(), "quick": args.quick, **bench(
        args.model, c, t, first, new, gen, z, seqs, 1 if args.quick else args.repeats,
        policies=("lru",) if args.quick else ("lru", "arc"), fractions=(0.5, 1.0) if args.quick else FRACTIONS)}
    result["seconds"] = time.perf_counter() - t0
    stem = "offload_bench" if args.model == "small-gqa" else f"offload_bench_{pathlib.Path(args.model).name}"
    _write(out_dir, stem, result, markdown(result))
    plot(result, out_dir / f"{stem}.png")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
