"""Engine overhead: this checkout's LLM.generate against an earlier commit's, on the same load, in one run.

`LLM.generate` became a loop over `LLMEngine.step` (requests checked and queued, one engine step
at a time, RequestOutputs built per output kind) where it was one call into the engine's own
loop. This measures what that costs on the decode path: the same greedy workload on the built-in
small-gqa model (B prompts of P tokens, N new tokens each, no preemption, prefix caching off so
that every run computes the same tokens), through each checkout's `kvjax.LLM`, at
steps_per_call 1 (a host step per token) and 8 (the device loop).

Each checkout runs in processes of its own (both are the `kvjax` package): the baseline is
checked out with `git worktree` into a temporary folder; runs alternate baseline / current so
that a noisy neighbour slows both alike; each process compiles with one unmeasured run, then
times R runs. Reported per variant: median decode tokens/s of decode-only steps
(Summary.decode_tokens_per_s, compile excluded), median wall seconds of a whole generate call,
and whether both produced the same tokens.

    python -m kvjax.experiments.engine_overhead [--baseline ce16183] [--rounds 3]

Writes engine_overhead.json, .md and .png to --out (default $OUT, else experiments/results).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

from kvjax.experiments import results_dir
from kvjax.markdown import markdown_table
from kvjax.utils.output_files import save_figure, write_json, write_text
from kvjax.utils.plotting import pyplot

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASELINE = "ce16183"  # the last commit before the engine surface (EngineArgs, LLMEngine, AsyncLLM)

WORKER = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from kvjax import LLM, SamplingParams
batch, prompt, new, k, repeats = (int(x) for x in sys.argv[2:7])
prompts = np.random.default_rng(0).integers(1, 256, (batch, prompt)).tolist()
llm = LLM("small-gqa", block_size=16, num_gpu_blocks_override=1 + batch * -(-(prompt + new) // 16),
          max_num_seqs=batch, max_model_len=prompt + new, enable_prefix_caching=False, steps_per_call=k,
          use_tqdm_on_load=False)
params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
llm.generate(prompts, params, use_tqdm=False)  # compiles every step shape
runs = []
for _ in range(repeats):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    runs.append(dict(wall_s=time.perf_counter() - t0, decode_tok_s=outs.summary.decode_tokens_per_s,
                     untimed_calls=outs.summary.untimed_calls))
print(json.dumps(dict(runs=runs, tokens=[o.outputs[0].token_ids for o in outs])))
"""


def run_worker(checkout: str, batch: int, prompt: int, new: int, k: int, repeats: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    out = subprocess.run([sys.executable, "-c", WORKER, checkout, str(batch), str(prompt), str(new), str(k),
                          str(repeats)], capture_output=True, text=True, env=env, cwd=checkout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the worker in {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(baseline: str, current: str, *, batch: int, prompt: int, new: int, rounds: int, repeats: int) -> list:
    rows = []
    for k in (1, 8):
        got = {"baseline": [], "current": []}
        tokens = {}
        for _ in range(rounds):
            for name, checkout in (("baseline", baseline), ("current", current)):
                r = run_worker(checkout, batch, prompt, new, k, repeats)
                got[name] += r["runs"]
                tokens[name] = r["tokens"]
        med = {name: {key: statistics.median(x[key] for x in runs) for key in ("wall_s", "decode_tok_s")}
               for name, runs in got.items()}
        rows.append(dict(steps_per_call=k, batch=batch, prompt=prompt, new=new,
                         baseline_tok_s=med["baseline"]["decode_tok_s"], current_tok_s=med["current"]["decode_tok_s"],
                         ratio=med["current"]["decode_tok_s"] / med["baseline"]["decode_tok_s"],
                         baseline_wall_s=med["baseline"]["wall_s"], current_wall_s=med["current"]["wall_s"],
                         wall_ratio=med["current"]["wall_s"] / med["baseline"]["wall_s"],
                         same_tokens=tokens["baseline"] == tokens["current"], runs=got))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=BASELINE, help=f"the commit to compare against ({BASELINE})")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="alternating process pairs per variant (3)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per process (3)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    out = results_dir(args.out)
    with tempfile.TemporaryDirectory(prefix="kvjax-baseline-") as tmp:
        base = os.path.join(tmp, "checkout")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", base, args.baseline], check=True,
                       capture_output=True)
        try:
            commit = subprocess.run(["git", "-C", base, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
            current = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, check=True).stdout.strip()
            rows = measure(base, str(ROOT), batch=args.batch, prompt=args.prompt, new=args.new, rounds=args.rounds,
                           repeats=args.repeats)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", base], capture_output=True)
    result = dict(baseline=commit, current=current, machine=platform.processor() or platform.machine(),
                  cpus=os.cpu_count(), rows=rows)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "engine_overhead.json", result, "--out", indent=1)
    table = "\n".join(markdown_table(
        ["steps/call", "baseline tok/s", "current tok/s", "ratio", "baseline wall s", "current wall s", "wall ratio",
         "same tokens"],
        [[r["steps_per_call"], f"{r['baseline_tok_s']:,.0f}", f"{r['current_tok_s']:,.0f}", f"{r['ratio']:.3f}",
          f"{r['baseline_wall_s']:.3f}", f"{r['current_wall_s']:.3f}", f"{r['wall_ratio']:.3f}", r["same_tokens"]]
         for r in rows]))
    text = (f"# Engine overhead: {current} against {commit}\n\nsmall-gqa, batch {args.batch}, {args.prompt}-token "
            f"prompts, {args.new} new tokens, greedy; medians of {args.rounds} alternating process pairs × "
            f"{args.repeats} runs, compile excluded ({result['cpus']} CPUs).\n\n{table}\n")
    write_text(out / "engine_overhead.md", text, "--out")
    _plot(rows, out / "engine_overhead.png", commit, current)
    print(text)
    return 0


def _plot(rows: list, path: pathlib.Path, commit: str, current: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["baseline_tok_s"] for r in rows], 0.4, label=commit)
    ax.bar([x + 0.2 for x in xs], [r["current_tok_s"] for r in rows], 0.4, label=current)
    ax.set_xticks(list(xs), [f"steps_per_call {r['steps_per_call']}" for r in rows])
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, "--out")
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
