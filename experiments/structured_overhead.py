"""Structured-output overhead: an unconstrained greedy batch alone, and the same batch beside one
constrained request or one logit-biased request, side by side in one process.

Issue 57 put a grammar mask and logit_bias into the jitted sampler. A step with neither traces the
program it traced before, so unconstrained requests should decode as fast as ever; a constrained
request makes the batch it is in run one decode step per device call while it runs (its matcher
advances on the host between tokens: kvjax.engine.structured_output), which costs what
steps_per_call 1 costs. This measures both on the built-in small-gqa model: B random prompts of P
tokens, N new greedy tokens each (ignore_eos, prefix caching off, so every run computes the same
tokens), through `kvjax.LLM`, in these variants:

    alone           the batch by itself (steps_per_call K: the device loop)
    + plain         the batch and one more plain greedy request, K: the control for a batch one row
                    longer (the step's batch is padded to a power of two: 8 rows become 16)
    + constrained   the batch and one request held to a regex of exactly N letters (it runs as long
                    as the batch), K
    + logit_bias    the batch and one request with a logit_bias of +5 on 16 ids, K
    alone, k=1      the batch by itself at steps_per_call 1: what the constrained fallback costs

Every variant compiles in one unmeasured run; then rounds alternate the variants so that a noisy
neighbour slows each alike. Reported per variant, as medians over the rounds: the unconstrained
requests' decode tokens/s (their generated tokens after the first, over the window from the first
of their first tokens to the last of their last tokens: RequestOutput.metrics) and the wall seconds
of the generate call; and whether the B unconstrained outputs were the same tokens as alone.

    python -m kvjax.experiments.structured_overhead [--batch 8] [--new 256] [--steps-per-call 8] [--rounds 5]

Writes structured_overhead.json and .md to --out (default $OUT, else experiments/results).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from kvjax.experiments import results_dir
from kvjax.markdown import markdown_table
from kvjax.utils.output_files import write_json, write_text

VARIANTS = ("alone", "+ plain", "+ constrained", "+ logit_bias", "alone, k=1")


def make_llm(batch: int, prompt: int, new: int, steps_per_call: int):
    from kvjax import LLM

    blocks = 1 + (batch + 1) * -(-(prompt + new) // 16)  # the batch and its companion, no preemption
    return LLM("small-gqa", block_size=16, num_gpu_blocks_override=blocks, max_num_seqs=batch + 1,
               max_model_len=prompt + new, enable_prefix_caching=False, steps_per_call=steps_per_call,
               use_tqdm_on_load=False)


def companion(variant: str, prompt: list[int], new: int):
    """The request beside the batch in a variant (None: the batch alone), and its SamplingParams."""
    from kvjax import SamplingParams
    from kvjax.engine.sampling_params import StructuredOutputsParams

    if variant == "+ constrained":
        return prompt, SamplingParams(max_tokens=new, temperature=0, structured_outputs=StructuredOutputsParams(
            regex=f"[a-z]{{{new}}}"))
    if variant == "+ plain":
        return prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    if variant == "+ logit_bias":
        return prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True,
                                      logit_bias={t: 5.0 for t in range(97, 113)})
    return None


def run_once(llm, prompts: list[list[int]], new: int, extra) -> dict:
    """One generate call: the batch (and the companion last); the batch's decode rate and tokens."""
    from kvjax import SamplingParams

    params = [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)] * len(prompts)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    if extra is not None:
        inputs.append({"prompt_token_ids": extra[0]})
        params = params + [extra[1]]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    mine = outs[:len(prompts)]
    first = min(o.metrics.first_token_latency for o in mine)
    last = max(o.metrics.last_token_ts for o in mine)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in mine)
    companion_tokens = len(outs[-1].outputs[0].token_ids) if extra is not None else 0
    return dict(decode_tok_s=tokens / (last - first), wall_s=wall, tokens=[list(o.outputs[0].token_ids) for o in mine],
                companion_tokens=companion_tokens)


def measure(*, batch: int, prompt: int, new: int, steps_per_call: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 256, (batch + 1, prompt)).tolist()
    batch_prompts, extra_prompt = prompts[:batch], prompts[batch]
    llms = {steps_per_call: make_llm(batch, prompt, new, steps_per_call), 1: make_llm(batch, prompt, new, 1)}
    plan = {v: (llms[1 if v == "alone, k=1" else steps_per_call], companion(v, extra_prompt, new)) for v in VARIANTS}
    for llm, extra in plan.values():  # compile every step shape, unmeasured
        run_once(llm, batch_prompts, new, extra)
    runs = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v, (llm, extra) in plan.items():
            runs[v].append(run_once(llm, batch_prompts, new, extra))
    reference = runs["alone"][0]["tokens"]
    rows = []
    for v in VARIANTS:
        tok_s = statistics.median(r["decode_tok_s"] for r in runs[v])
        rows.append(dict(variant=v, decode_tok_s=tok_s, wall_s=statistics.median(r["wall_s"] for r in runs[v]),
                         vs_alone=None, same_tokens=all(r["tokens"] == reference for r in runs[v]),
                         companion_tokens=runs[v][-1]["companion_tokens"],
                         decode_tok_s_runs=[r["decode_tok_s"] for r in runs[v]]))
    alone = rows[0]["decode_tok_s"]
    for row in rows:
        row["vs_alone"] = row["decode_tok_s"] / alone
    return dict(batch=batch, prompt=prompt, new=new, steps_per_call=steps_per_call, rounds=rounds, rows=rows)


def render(result: dict) -> str:
    table = markdown_table(
        ["variant", "unconstrained decode tok/s", "vs alone", "wall s", "same tokens as alone", "companion tokens"],
        [[r["variant"], f"{r['decode_tok_s']:.0f}", f"{r['vs_alone']:.3f}", f"{r['wall_s']:.2f}",
          "yes" if r["same_tokens"] else "NO", r["companion_tokens"] or "-"] for r in result["rows"]])
    return "\n".join([
        "# Structured-output overhead on unconstrained decode", "",
        f"small-gqa, {result['batch']} greedy prompts of {result['prompt']} tokens, {result['new']} new tokens each, "
        f"steps_per_call {result['steps_per_call']} unless said; medians of {result['rounds']} alternating rounds "
        f"on {result['machine']} ({result['cpus']} CPUs, load average {result['load_before']:.2f} before, "
        f"{result['load_after']:.2f} after; JAX {result['backend']}).", "",
        *table, "",
        "The unconstrained requests' decode tokens/s: their tokens after the first over the window from the "
        "first of their first tokens to the last of their last tokens. A constrained request runs its batch one "
        "decode step per device call while it runs (here as long as the batch): compare it with `alone, k=1`; "
        "a companion makes the batch one row longer: compare the companions with `+ plain`.", ""])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="unconstrained prompts (8)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens each (16)")
    ap.add_argument("--new", type=int, default=256, help="new tokens each (256)")
    ap.add_argument("--steps-per-call", type=int, default=8, help="decode steps per device call (8)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, variants alternating (5)")
    ap.add_argument("--out", default=None, help="output dir (default $OUT, else ./experiments/results)")
    args = ap.parse_args(argv)
    import jax

    load_before = os.getloadavg()[0]
    result = measure(batch=args.batch, prompt=args.prompt, new=args.new, steps_per_call=args.steps_per_call,
                     rounds=args.rounds)
    result.update(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                  backend=jax.default_backend(), load_before=load_before, load_after=os.getloadavg()[0])
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "structured_overhead.json", result, "--out", indent=1)
    text = render(result)
    write_text(out / "structured_overhead.md", text, "--out")
    print(text)
    return result


if __name__ == "__main__":
    main()
