"""`kvjax report`: the end-to-end report on the built-in small models, on CPU, in minutes.

Sections, each computed in this run (nothing is copied from a stored result):
1. SPEC Tables 1 and 2 and simulator groups A–C from the formulas (kvjax.accounting.spec_tables, kvjax.accounting.budget),
   with a plot of max concurrency against context length.
2. A decode run through scheduler, block pool, paged cache and model, with prefix caching on
   and a pool small enough to force preemption; a plot of blocks in use per step.
3. The fp8 / int8 KV accuracy table for both small models (kvjax.evaluation.accuracy), and the
   same for small-gqa with inflated K channels.
4. The memory reconciliation: analytic vs measured bytes (kvjax memory).
5. A real pretrained LLM, SmolLM2-135M-Instruct (GGUF, fetched and cached on first use): chat
   requests sharing its system prompt (prefix hits), a cut-down fp8 accuracy table, and the
   memory reconciliation. The full accuracy suite is `kvjax accuracy --model smollm2-135m`.

Writes `results/REPORT.md` beside its PNG plots and a `report.json` with every number; prints
a line per section (with --json: report.json's content and the files written, as one object).
The sections show on a progress bar on stderr when it is a terminal (--no-progress: never).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from kvjax.commands.common import add_progress_flag, progress_enabled
from kvjax.errors import UsageError
from kvjax.markdown import markdown_table
from kvjax.progress import Phases
from kvjax.utils.output_files import save_figure, write_json, write_text
from kvjax.utils.output_folders import check_output_dir, output_folder
from kvjax.utils.plotting import pyplot
from kvjax.utils.strict_json import dumps

DEFAULT_OUT = "results"
SECTIONS = ("decode", "accuracy", "memory", "smollm")  # after section 1, the tables, which always runs


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="the end-to-end report on the built-in small models",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: results/)")
    p.add_argument("--quick", action="store_true", help="fewer windows and requests (a smoke run)")
    p.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {','.join(SECTIONS)}")
    p.add_argument("--json", action="store_true", help="print report.json's content and the files written")
    add_progress_flag(p)


def _section_tables(out: str) -> tuple[str, dict]:
    from kvjax.accounting import budget as bud
    from kvjax.accounting import spec_tables as tables
    from kvjax.commands.plan import format_plan
    from kvjax.commands.tables import table1_markdown, table2_markdown

    t1, t2 = tables.table1(), tables.table2()
    md = ["## 1. KV bytes, budget and concurrency (SPEC Tables 1–2, simulator groups A–C)", "",
          "### Table 1 — KV bytes per token", "", table1_markdown(t1), "",
          "### Table 2 — concurrency (budget = ceil(GPU × util) − weights; floor everywhere)", "",
          table2_markdown(t2), ""]
    groups = {}
    for name, group in bud.GROUPS.items():
        pl = tables.scenario_plan(group)
        groups[name] = pl.to_json()
        md += [f"### Simulator group {name}: {group['title']}", "", "```",
               format_plan(pl, group["title"], pl.warnings), "```", ""]
    _plot_concurrency(os.path.join(out, "concurrency_vs_context.png"))
    md += ["![max concurrency vs context](concurrency_vs_context.png)", ""]
    return "\n".join(md), {"table1": t1, "table2": t2, "groups": groups}


def _plot_concurrency(path: str) -> None:
    from kvjax.accounting import budget as bud
    from kvjax.accounting import spec_tables as tables

    plt = pyplot()
    contexts = [2**k for k in range(10, 18)]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in ("A", "B"):
        group = bud.GROUPS[name]
        for dtype, style in (("bf16", "-o"), ("fp8", "--s")):
            ys = [tables.scenario_plan({**group, "kv_dtype": dtype, "context": c}).concurrency for c in contexts]
            ax.plot(contexts, ys, style, label=f"group {name} ({group['preset']}), {dtype} KV")
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=1)  # log above 1, linear down to 0 (group A at 64K+ holds none)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("max concurrent requests")
    ax.set_title("Max concurrency vs context (simulator groups A and B)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, "--out", dpi=110)
    plt.close(fig)


def _section_accuracy(out: str, quick: bool) -> tuple[str, dict]:
    from kvjax.commands.accuracy import markdown, write_outputs
    from kvjax.data import CALIB, HELDOUT
    from kvjax.evaluation.accuracy import evaluate

    # --quick, a smoke run: vLLM's default fp8 and nvfp4, and on the outliers fp8 unit against calibrated
    kw = dict(max_windows=8, prompts=4, decode_tokens=16) if quick else {}
    md = ["## 3. Quantized KV accuracy against bf16 (held-out stdlib text)", ""]
    data = {}
    for model, outliers in (("small-gqa", False), ("small-mla", False), ("small-gqa", True)):
        only = (("fp8_e4m3 unit", "fp8_e4m3 per_tensor") if outliers else ("fp8_e4m3 unit", "nvfp4")) if quick else None
        res = evaluate(model, HELDOUT, CALIB, outlier_channels=outliers, only=only, **kw)
        paths = write_outputs(res, out)
        key = model + ("_outliers" if outliers else "")
        data[key] = res
        md += [markdown(res), f"![accuracy {key}]({os.path.basename(paths['png'])})", ""]
    return "\n".join(md), data


def run(args) -> int:
    out = check_output_dir(args.out, "--out")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(SECTIONS)
    if unknown:
        raise UsageError(f"--skip: unknown section(s) {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(SECTIONS)}")
    start = time.time()
    sections: list[str] = []
    data: dict[str, Any] = {}
    todo = [(name, fn) for name, fn in (("decode", _section_decode), ("accuracy", _section_accuracy),
                                        ("memory", _section_memory), ("smollm", _section_smollm)) if name not in skip]
    # every file into a staging folder, moved into --out together at the end: a run that fails
    # midway leaves the previous report whole, never new plots beside an old REPORT.md
    with output_folder(out) as stage, Phases("report", 1 + len(todo), progress_enabled(args)) as phases:
        phases.start("tables")
        text, data["tables"] = _section_tables(stage)
        sections.append(text)
        for name, fn in todo:
            phases.start(name)
            t0 = time.time()
            text, data[name] = fn(stage, args.quick)
            sections.append(text)
            if not args.json:
                print(f"kvjax report: {name} done in {time.time() - t0:.0f} s", flush=True)
        import jax

        head = ["# kvjax report", "",
                f"Generated by `kvjax report{' --quick' if args.quick else ''}` on {jax.devices()[0].platform} "
                f"(jax {jax.__version__}) in {time.time() - start:.0f} s. Every number below was computed in this run.",
                ""]
        write_text(os.path.join(stage, "REPORT.md"), "\n".join(head + sections), "--out")
        write_json(os.path.join(stage, "report.json"), data, "--out", default=str)
    if args.json:
        files = dict(report_md=os.path.join(out, "REPORT.md"), report_json=os.path.join(out, "report.json"))
        print(dumps(dict(data, outputs=files, seconds=round(time.time() - start, 1)), indent=1, default=str))
    else:
        print(f"wrote {os.path.join(out, 'REPORT.md')} in {time.time() - start:.0f} s")
    return 0


def _section_decode(out: str, quick: bool) -> tuple[str, dict]:
    """small-gqa serving held-out prompts that share a system prefix, from a pool too small
    for all of them at once: prefix hits, preemption by recompute, blocks in use per step."""
    from kvjax.data import HELDOUT
    from kvjax.engine.llm import LLM
    from kvjax.engine.sampling import SamplingParams

    text = open(HELDOUT, "rb").read()
    system = list(text[:96])  # a shared 96-byte "system prompt": 6 full blocks of 16
    n = 8 if quick else 24
    prompts = [system + list(text[4096 + 200 * i: 4096 + 200 * i + 24 + 8 * (i % 5)]) for i in range(n)]
    max_tokens = 48
    block_size, num_blocks, max_seqs = 16, 1 + 48, 8  # 8 running requests would need up to 96 blocks
    llm = LLM("small-gqa", kv_cache_dtype="bf16", num_gpu_blocks_override=num_blocks, block_size=block_size,
              max_num_seqs=max_seqs, enable_prefix_caching=True, steps_per_call=8, use_tqdm_on_load=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts, params, use_tqdm=False)  # compile every step shape once
    llm.reset_prefix_cache()  # so that the timed run starts cold: its hits are the shared prefix's alone
    run = llm.generate(prompts, params, use_tqdm=False)  # the timed run
    s = run.summary
    _plot_blocks(s, os.path.join(out, "blocks_in_use.png"))
    sample = run[0]
    rows = [("requests", f"{s.requests} ({s.failed} refused)"),
            ("prompt tokens", f"{s.prompt_tokens:,}"),
            ("prefix-cache hits", f"{s.prefix_hit_tokens:,} of {s.prefix_queried_tokens:,} looked-up tokens "
                                  f"({100 * s.prefix_hit_rate:.1f}%)"),
            ("generated tokens", f"{s.generated_tokens:,}"),
            ("prefill tokens computed", f"{s.prefill_tokens:,} (prompts minus hits, plus recomputation)"),
            ("prefill / decode tokens/s", f"{s.prefill_tokens_per_s:,.0f} / {s.decode_tokens_per_s:,.0f}"),
            ("step latency p50 / p99", f"{s.step_latency_p50_ms:.2f} / {s.step_latency_p99_ms:.2f} ms"),
            ("peak blocks used", f"{s.peak_blocks_used} of {s.usable_blocks} usable"),
            ("preemptions", f"{s.preemptions}")]
    md = ["## 2. Decoding through scheduler, block pool and paged cache", "",
          f"`small-gqa`, {n} prompts of held-out text sharing a 96-byte prefix, {max_tokens} new tokens each, "
          f"greedy, bf16 KV, block size {block_size}, a pool of {num_blocks} blocks ({num_blocks - 1} usable) "
          f"for up to {max_seqs} running requests, 8 decode steps per device call (second of two identical runs, "
          "the prefix cache reset between them: no step compiles and the timed run starts cold):", ""]
    md += markdown_table(["quantity", "value"], rows)
    md += ["", f"First request's continuation: `{sample.outputs[0].text!r}`", "",
           "![blocks in use per step](blocks_in_use.png)", ""]
    return "\n".join(md), {"summary": s.to_json(), "num_cached_tokens": [o.num_cached_tokens for o in run],
                           "config": dict(num_gpu_blocks_override=num_blocks, block_size=block_size,
                                          max_num_seqs=max_seqs, requests=n, max_tokens=max_tokens)}


def _plot_blocks(summary, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(range(len(summary.blocks_in_use)), summary.blocks_in_use, lw=1.5, label="blocks in use")
    ax.axhline(summary.usable_blocks, color="tab:red", ls="--", lw=1, label="usable blocks")
    ax.set_xlabel("engine step")
    ax.set_ylabel("blocks")
    ax.set_title(f"Blocks in use per step ({summary.preemptions} preemptions)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, "--out", dpi=110)
    plt.close(fig)


def _memory_json(args: list[str]) -> dict:
    """`kvjax memory ARGS --json` in a fresh process, so that only its own arrays are live."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvjax.commands.main", "memory", *args, "--json", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def _section_memory(out: str, quick: bool) -> tuple[str, dict]:
    """`kvjax memory` in a fresh process per model."""
    from kvjax.commands.memory import render

    md = ["## 4. Analytic KV bytes against what the device holds (`kvjax memory`)", "",
          "A 48 MiB \"device\" (`--device-memory-gib 0.046875`, util 0.92): the budget is profiled the way vLLM does "
          "(weights, then one forward over max_num_batched_tokens, then divide what is left by the block size), "
          "the cache is allocated, and every row is measured on the device (CPU: live arrays and XLA's memory "
          "analysis).", ""]
    data = {}
    for model, extra in (("small-gqa", []), ("small-mla", []),
                         ("small-gqa", ["--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2"])):
        r = _memory_json(["--model", model, "--device-memory-gib", "0.046875", "--max-num-batched-tokens", "512",
                          "--max-num-seqs", "16", *extra])
        key = " ".join([model, *extra])
        data[key] = r
        md += [f"### `kvjax memory --model {key} --device-memory-gib 0.046875 --max-num-batched-tokens 512`", "", "```",
               render(r), "```", ""]
    return "\n".join(md), data


def _section_smollm(out: str, quick: bool) -> tuple[str, dict]:
    """SmolLM2-135M-Instruct: chat decoding with prefix hits, a cut-down accuracy table, memory."""
    from kvjax.commands.accuracy import markdown, write_outputs
    from kvjax.commands.memory import render
    from kvjax.data import CALIB, CHAT_PROMPTS, HELDOUT, PROSE
    from kvjax.engine.llm import LLM
    from kvjax.engine.sampling import SamplingParams
    from kvjax.evaluation.accuracy import evaluate
    from kvjax.models.hub import load_model

    model = "smollm2-135m"
    loaded = load_model(model)  # fetched and verified on first use ($KVJAX_CACHE)
    questions = [q for q in open(CHAT_PROMPTS).read().splitlines() if q][:4 if quick else 8]
    max_tokens = 24 if quick else 48
    # max_model_len bounds each sequence's block table, which decode attention reads in full
    llm = LLM(loaded, kv_cache_dtype="bf16", block_size=16, num_gpu_blocks_override=1 + 8 * 512 // 16,
              max_num_seqs=8, max_model_len=512, enable_prefix_caching=True, steps_per_call=8)
    run = llm.chat([[{"role": "user", "content": q}] for q in questions],
                   SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    s = run.summary
    answers = [o.outputs[0] for o in run]
    stops = sum(a.finish_reason == "stop" for a in answers)
    rows = [("requests", f"{s.requests} chat requests ({stops} ended at EOS, the rest at {max_tokens} tokens)"),
            ("prompt tokens", f"{s.prompt_tokens:,}"),
            ("prefix-cache hits", f"{s.prefix_hit_tokens:,} of {s.prefix_queried_tokens:,} looked-up tokens "
                                  f"({100 * s.prefix_hit_rate:.1f}%): the chat template's system prompt"),
            ("generated tokens", f"{s.generated_tokens:,}"),
            ("decode tokens/s (compiled steps only)", f"{s.decode_tokens_per_s:,.1f}"),
            ("compile time", f"{s.compile_s:.1f} s"),
            ("peak blocks used", f"{s.peak_blocks_used} of {s.usable_blocks} usable")]
    md = ["## 5. A real pretrained LLM: SmolLM2-135M-Instruct (GGUF)", "",
          f"`{model}`: 30 layers, 9 query / 3 kv heads × 64, vocabulary 49,152; the Q4_1/Q8_0 GGUF dequantized "
          "to fp32 weights, bf16 KV, block size 16, max_model_len 512, greedy, one run (rates leave out the "
          "device calls that compiled).", "", "### Chat decoding with prefix caching", ""]
    md += markdown_table(["quantity", "value"], rows)
    # a backquote in an answer would open a code span across the table's cells
    md += [""] + markdown_table(["question", "answer"],
                                [(q, a.text.replace("`", "'")) for q, a in zip(questions, answers)])
    del llm

    acc = None
    if quick:  # every variant compiles its own scoring and decode steps: minutes on a 30-layer model
        md += ["", "(`--quick`: the cut-down accuracy table is left out.)", ""]
    else:
        # One format of each kind, since every kv dtype compiles its own 30-layer steps (as many as the
        # table had before nvfp4 came): vLLM's default fp8, a calibrated scale, a scale per token and head, nvfp4.
        acc = evaluate(loaded, (HELDOUT, PROSE), CALIB, calib_windows=2, max_windows=4, prompts=2, decode_tokens=16,
                       seq_len=256, only=("fp8_e4m3 unit", "fp8_e4m3 per_tensor", "int8_per_token_head", "nvfp4"))
        paths = write_outputs(acc, out)
        md += ["", "### Quantized KV accuracy against bf16 (cut down)", "",
               "A few windows of code and prose, one format of each kind; the full suite (every KV format, KL by "
               "position up to 8K, passkey retrieval, outlier map, layer sensitivity, the trade-off table) is "
               "`kvjax accuracy --model smollm2-135m` (docs/accuracy.md).", "", markdown(acc),
               f"![accuracy {model}]({os.path.basename(paths['png'])})", ""]

    memory_args = ["--model", model, "--device-memory-gib", "2", "--max-num-batched-tokens", "512"]
    mem = _memory_json(memory_args)
    md += ["### Analytic KV bytes against what the device holds", "",
           f"`kvjax memory {' '.join(memory_args)}`:", "", "```", render(mem), "```", ""]
    return "\n".join(md), {"decode": dict(summary=s.to_json(), questions=questions,
                                           answers=[a.text for a in answers]), "accuracy": acc, "memory": mem}
