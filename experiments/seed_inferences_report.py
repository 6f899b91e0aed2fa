"""experiments/seed_inferences.py's markdown and figures: each section's table, then the seed's
sentence and what the measured numbers say, by a rule stated beside it (the rule reads the
numbers; the words are chosen by it, not written in after looking)."""
from __future__ import annotations

import pathlib

from kvjax.markdown import markdown_table
from kvjax.utils.output_files import save_figure
from kvjax.utils.plotting import pyplot

SEED = {  # the seed's own sentences (../shared/seed/, its lines 100, 95, 99, 79-81 and 101, 102), then in English
    "preemption": "容量规划不足时，它表现为延迟尖刺和吞吐下降，而不是平滑降级推断 — when capacity planning falls short, "
                  "preemption by recompute shows up as latency spikes and a throughput drop, not a smooth degradation.",
    "block_size": "「把 block size 调大」不会提高并发：它改的是碎片和 kernel 效率，不改 per_token推断 — a larger block "
                  "size does not raise concurrency: it changes fragmentation and kernel efficiency, not bytes per token.",
    "prefix_caching": "完全唯一的 prompt 只会多付哈希计算和元数据，不会多出可用 block推断 — fully unique prompts only "
                      "pay extra hashing and metadata, and gain no usable block.",
    "host_offload": "它扩大的是「可保留的 KV 总量」，不是「GPU 上可同时计算的并发」推断 … 每次搬运都要走 CPU↔GPU 链路 — "
                    "CPU offload raises the KV that can be kept, not the requests computed at once on the GPU; every "
                    "transfer pays the CPU↔GPU link.",
    "planned_vs_observed": "真实容量以引擎 profiling 后填入的 num_gpu_blocks、kv_cache_size_tokens、kv_cache_max_concurrency "
                           "字段为准 — the real capacity is what the engine fills in after profiling: num_gpu_blocks, "
                           "kv_cache_size_tokens, kv_cache_max_concurrency.",
}


def _f(x, fmt=",.1f"):
    return "—" if x is None else format(x, fmt)


def _pct(x):
    return "—" if x is None else f"{100 * x:.1f}%"


def preemption_md(r: dict) -> list[str]:
    rows = r["rows"]
    lines = [f"Poisson arrivals at {r['rate_req_s']:.2f} req/s (70% of the roomy pool's throughput with every request "
             f"at once), {r['requests']} requests of {r['input_len']}±25% prompt and {r['output_len']}±25% output "
             f"tokens, max_num_seqs {r['max_num_seqs']}, block {r['block_size']}, prefix caching on (vLLM's default).",
             "", *markdown_table(
                 ["pool blocks", "longest requests held", "preemptions", "recompute tax", "TTFT p50 / p99 ms",
                  "TPOT p50 / p99 ms", "ITL p50 / p99 ms", "output tok/s", "preempted req's longest gap p50 ms",
                  "recompute step p50 ms", "decode step p50 ms"],
                 [[x["num_blocks"], x["longest_requests_held"], x["preemptions"], _pct(x["recompute_tax"]),
                   f"{_f(x['ttft_p50_ms'])} / {_f(x['ttft_p99_ms'])}", f"{_f(x['tpot_p50_ms'])} / {_f(x['tpot_p99_ms'])}",
                   f"{_f(x['itl_p50_ms'])} / {_f(x['itl_p99_ms'])}", _f(x["output_throughput"]),
                   _f(x["preempted_max_gap_p50_ms"]), _f(x["recompute_step_p50_ms"]), _f(x["decode_step_p50_ms"])]
                  for x in rows], "r" * 11), ""]
    roomy, tight = rows[0], max(rows, key=lambda x: (x["recompute_tax"], x["preemptions"]))
    if not tight["preemptions"]:
        return lines + ["Verdict: no pool in this run was tight enough to preempt; nothing to judge."]
    spike = tight["preempted_max_gap_p50_ms"] is not None and tight["preempted_max_gap_p50_ms"] > 5 * tight["itl_p50_ms"]
    smooth_median = tight["itl_p50_ms"] <= 1.5 * roomy["itl_p50_ms"]
    drop = 1 - tight["output_throughput"] / roomy["output_throughput"]
    lines.append(f"Rule: a spike when a preempted request's longest gap is > 5× the ITL median while the median "
                 f"itself stays within 1.5× of the roomy pool's. The pool that recomputed most ({tight['num_blocks']} blocks): preempted requests' longest gap "
                 f"{_f(tight['preempted_max_gap_p50_ms'])} ms vs ITL median {_f(tight['itl_p50_ms'])} ms "
                 f"(roomy {_f(roomy['itl_p50_ms'])} ms); recompute tax {_pct(tight['recompute_tax'])}; output "
                 f"throughput {_pct(drop)} lower than the roomy pool's.")
    verdict = ("**spikes**: the preempted requests stall for many steps while everyone else's token gaps barely move"
               if spike and smooth_median else
               "**not only spikes**: the typical token gap grows too" if spike else
               "**no clear spike**: a preempted request's longest gap is close to the usual ITL")
    return lines + ["", f"Verdict: {verdict}; throughput {'drops' if drop > 0.05 else 'holds'} "
                        f"({_pct(drop)}) at {_pct(tight['recompute_tax'])} of the work redone."]


def block_size_md(r: dict) -> list[str]:
    rows = r["rows"]
    lines = [f"One KV budget of {r['budget_tokens']:,} tokens (num_blocks = budget // block size, the null block among "
             f"them), {r['requests']} requests at once, {r['input_len']}±25% + {r['output_len']}±25% tokens, no prefix "
             "caching, max_num_seqs not binding.", "",
             *markdown_table(["block size", "blocks", "usable tokens", "peak running", "mean running", "preemptions",
                              "tail waste tok/request", "waste share of blocks in use", "decode step p50 ms",
                              "output tok/s"],
                             [[x["block_size"], x["num_blocks"], x["usable_tokens"], x["peak_running"],
                               _f(x["mean_running"]), x["preemptions"], _f(x["tail_waste_tokens_per_request"]),
                               _pct(x["tail_waste_share"]), _f(x["decode_step_ms"], ".2f"),
                               _f(x["output_throughput"])] for x in rows], "r" * 10), ""]
    peak = [x["peak_running"] for x in rows]
    mean = [x["mean_running"] for x in rows]
    changed = max(mean) > 1.1 * min(mean) or max(peak) != min(peak)
    lines.append(f"Rule: concurrency changed if the peak of running requests differs or the mean differs by > 10%. "
                 f"Peak {min(peak)}–{max(peak)}, mean {min(mean):.1f}–{max(mean):.1f}; tail waste per request "
                 f"{_f(rows[0]['tail_waste_tokens_per_request'])} → {_f(rows[-1]['tail_waste_tokens_per_request'])} tokens.")
    return lines + ["", "Verdict: " + ("**concurrency changes with the block size** at a fixed budget: the tail "
                                       "waste (about half a block per request) and the null block come out of the "
                                       "same tokens" if changed else
                                       "**concurrency holds**; only the waste and the step time move")]


def prefix_caching_md(r: dict) -> list[str]:
    lines = [f"{r['requests']} requests at once, {r['input_len']} + {r['output_len']} tokens, caching on and off "
             f"alternated, medians of {r['repeats']} runs each.", ""]
    table = []
    for name in ("unique", "shared_prefix"):
        w = r[name]
        for tag in ("on", "off"):
            x = w[tag]
            table.append([f"{name.replace('_', ' ')} (prefix {w['prefix_len']})", tag, _f(x["output_throughput"]),
                          _f(x["mean_step_ms"], ".2f"), _f(x["ttft_p50_ms"]), f"{x['prefill_tokens']:,.0f}"])
    lines += markdown_table(["workload", "prefix caching", "output tok/s", "mean step ms", "TTFT p50 ms",
                             "prefill tokens"], table, "llrrrr")
    u, s = r["unique"], r["shared_prefix"]
    cost = u["on"]["mean_step_ms"] / u["off"]["mean_step_ms"] - 1
    gain = s["on"]["output_throughput"] / s["off"]["output_throughput"] - 1
    lines += ["", f"Rule: 'only a cost' if on unique prompts caching computes the same tokens and its step time is "
                  f"within noise (≤ 5%) or above. Unique: prefill tokens {u['on']['prefill_tokens']:,.0f} vs "
                  f"{u['off']['prefill_tokens']:,.0f}, mean step {cost:+.1%}; shared prefix: throughput {gain:+.1%}, "
                  f"prefill tokens {s['on']['prefill_tokens']:,.0f} vs {s['off']['prefill_tokens']:,.0f}.", "",
              "Verdict: " + ("**a cost too small to see**" if abs(cost) <= 0.05 else
                             f"**a measurable cost** ({cost:+.1%} per step)" if cost > 0 else
                             f"**no cost** (caching's steps {cost:+.1%})")
              + f" on unique prompts; on a shared system prompt the gain is {gain:+.1%} throughput."]
    return lines


def host_offload_md(r: dict) -> list[str]:
    rows = r["rows"]
    lines = [f"{r['conversations']} conversations × {r['turns']} turns (first {r['first']} tokens, then the reply "
             f"({r['output_len']}) and {r['new']} new tokens each turn), arriving over time; a device pool of "
             f"{rows[0]['num_blocks']} blocks, about half the workload's {r['distinct_blocks']} distinct blocks.", "",
             *markdown_table(["host tier", "returning TTFT p50 / p99 ms", "first-turn TTFT p50 ms", "prefill tokens",
                              "peak running", "mean running", "preemptions", "bytes stored / loaded"],
                             [["yes" if x["host_tier"] else "no",
                               f"{_f(x['returning_ttft_p50_ms'])} / {_f(x['returning_ttft_p99_ms'])}",
                               _f(x["first_turn_ttft_p50_ms"]), f"{x['prefill_tokens']:,}", x["peak_running"],
                               _f(x["mean_running"]), x["preemptions"],
                               f"{x.get('host_bytes_stored', 0):,} / {x.get('host_bytes_loaded', 0):,}"]
                              for x in rows], "lrrrrrrr"), ""]
    off, on = rows
    faster = 1 - on["returning_ttft_p50_ms"] / off["returning_ttft_p50_ms"]
    same_conc = on["peak_running"] <= off["peak_running"]
    lines.append(f"Rule: offload 'does not raise concurrency' if the peak of running requests with the tier is not "
                 f"above the peak without it. Peak {off['peak_running']} → {on['peak_running']}; returning TTFT "
                 f"{faster:+.0%} faster; prefill tokens {off['prefill_tokens']:,} → {on['prefill_tokens']:,}.")
    return lines + ["", "Verdict: " + ("**confirmed**: the host tier keeps the evicted KV" if same_conc else
                                       "**refuted**: more requests ran at once with the tier")
                    + f" (returning TTFT {faster:+.0%}), the running requests are bounded by the device pool, and "
                    f"the transfer is {on.get('host_bytes_stored', 0) + on.get('host_bytes_loaded', 0):,} bytes."]


def planned_md(r: dict) -> list[str]:
    rows = r["rows"]
    lines = markdown_table(["pool blocks", "request tokens", "kvjax plan concurrency", "vLLM reported (max_model_len)",
                            "observed peak running", "observed mean running", "preemptions", "recompute tax"],
                           [[x["num_blocks"], x["request_len"], x["planned_concurrency"],
                             f"{x['vllm_reported_concurrency']:.2f} ({x['max_model_len']})", x["observed_peak_running"],
                             _f(x["observed_mean_running"]), x["preemptions"], _pct(x["recompute_tax"])]
                            for x in rows], "r" * 8)
    over = all(x["observed_peak_running"] > x["planned_concurrency"] for x in rows)
    return ["Fixed-length requests, three times as many as the plan holds, all at once; max_num_seqs far above.", "",
            *lines, "",
            "max_model_len is set to the request length, so vLLM's reported figure (num_blocks / blocks per "
            "max_model_len request, its log line 'Maximum concurrency for N tokens per request') is for these "
            "requests.", "",
            "Rule: the plan is the capacity if the observed peak equals it. " + (
                "Verdict: **the peak exceeds both figures**: the scheduler admits a request when its prompt "
                "fits, not its whole length, so more requests run at once than either number, and the excess is "
                "paid back by preemption as they grow; the planned figure is the concurrency that can finish "
                "without preempting, vLLM's reported one a bound for requests of max_model_len tokens."
                if over else "Verdict: **the plan holds**: the observed peak does not exceed kvjax plan's figure.")]


SECTIONS = (("1. Preemption by recompute", "preemption", preemption_md),
            ("2. Block size at a fixed KV budget", "block_size", block_size_md),
            ("3. Prefix caching on unique prompts", "prefix_caching", prefix_caching_md),
            ("4. Host offload on returning conversations", "host_offload", host_offload_md),
            ("5. Planned vs observed concurrency", "planned_vs_observed", planned_md))


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# The seed's inferences, measured ({m['backend']}, {m['cpus']} CPUs{', --quick' if result['quick'] else ''})",
             "", "Run: `python -m kvjax.experiments.seed_inferences" + (" --quick" if result["quick"] else "") + "` "
             f"({result['wall_s'] / 60:.0f} min). Every engine runs its workload once to compile, then the measured run; "
             "latencies are vLLM bench serve's (kvjax.benchmarks.serve), the step counts the scheduler's "
             "(kvjax.engine.stats.StepLog). Greedy, ignore_eos, one engine step per token.", ""]
    for title, key, fn in SECTIONS:
        lines += [f"## {title}", "", f"> {SEED[key]}", ""]
        for model, r in result["models"].items():
            lines += [f"### {model}", "", *fn(r[key]), ""]
    return "\n".join(lines)


def plot(model: str, r: dict, path: pathlib.Path) -> None:
    """Four panels: the tightest pool's ITLs over time with its preemptions; recompute tax and ITL p99
    by pool; running requests by block size; returning-turn TTFT with and without the host tier."""
    plt = pyplot()
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    tl, pre = r["preemption"]["timeline"], r["preemption"]["rows"]
    a = ax[0, 0]
    a.scatter(tl["token_time_s"], tl["itl_ms"], s=3, alpha=0.5, label="each output's gap (ITL)")
    for t in tl["preempt_s"]:
        a.axvline(t, color="red", alpha=0.3, lw=0.8)
    a.set(title=f"{r['preemption']['timeline_blocks']} blocks: ITL over time; red: preemptions",
          xlabel="s", ylabel="ms", yscale="log")
    a = ax[0, 1]
    x = [p["num_blocks"] for p in pre]
    a.plot(x, [100 * p["recompute_tax"] for p in pre], "o-", label="recompute tax %")
    a2 = a.twinx()
    a2.plot(x, [p["itl_p99_ms"] for p in pre], "s--", color="C1", label="ITL p99 ms")
    a2.plot(x, [p["itl_p50_ms"] for p in pre], "^--", color="C2", label="ITL p50 ms")
    a.set(title="by pool size", xlabel="pool blocks", ylabel="recompute tax %", xscale="log")
    a2.set_ylabel("ms")
    a.legend(loc="upper left"), a2.legend(loc="upper right")
    a = ax[1, 0]
    bs = r["block_size"]["rows"]
    a.bar([str(b["block_size"]) for b in bs], [b["mean_running"] for b in bs], label="mean running")
    a.plot([str(b["block_size"]) for b in bs], [b["peak_running"] for b in bs], "ko", label="peak running")
    a.set(title=f"block size at {r['block_size']['budget_tokens']:,} KV tokens", xlabel="block size",
          ylabel="requests")
    a.legend()
    a = ax[1, 1]
    ho = r["host_offload"]["rows"]
    a.bar(["recompute", "host tier"], [h["returning_ttft_p50_ms"] for h in ho], label="p50")
    a.plot(["recompute", "host tier"], [h["returning_ttft_p99_ms"] for h in ho], "ko", label="p99")
    a.set(title="returning turns' TTFT", ylabel="ms")
    a.legend()
    fig.suptitle(f"The seed's inferences on {model}")
    fig.tight_layout()
    save_figure(fig, path, "--out", dpi=90)
    plt.close(fig)
