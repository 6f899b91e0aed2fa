"""Multi-process tensor parallelism on JAX's distributed runtime, on this machine: 2 (and, marked slow, 4)
processes joined over gloo (tests/distributed/mp_job.py on every rank), each with one or two CPU devices.

- Greedy tokens of the job's TP 2 / 4 are those of one process at TP 1 (`kvjax.LLM` in this process, the
  same requests), for a dense (tiny: GQA), an MLA (tiny-mla) and a MoE (tiny-moe) model, with a roomy pool and
  with one so small that requests are preempted (counted: more than none on both sides). A fourth request is
  sampled with a seed: the same tokens too, so seeds reach every rank. After the MLA run, rank 0 aborts one of
  two requests after a step: the other's tokens are still one process's, and every later plan agrees.
- Decode context parallelism across the processes (tiny-mla at DCP = TP, a scheduler block of 4 tokens as at
  DCP 1): DCP 1's tokens, and each rank's latent pages hold num_blocks × 4 / D tokens of 24 f32 lanes, the
  hand-computed bytes (kv_lora_rank 16 + rope 8 lanes), D times fewer than at DCP 1.
- A rank whose scheduler diverges (mp_job.py's "perturb": it admits one request fewer in its first step) ends
  every process with the one error naming the step's plan, before mismatched collectives could hang.
- A rank that dies (SIGKILL) inside a step, or one that never joins: every other process ends with one error,
  within the timeout; none is left running (mp_launch.launch fails the test if one is).
"""
from __future__ import annotations

import pytest
from mp_launch import PROMPTS, launch, sampling_params

from kvjax import LLM

LATENT_LANES = 16 + 8  # tiny-mla: kv_lora_rank + qk_rope_head_dim, float32
BLOCKS = 48  # the pools with room for every request (PROMPTS: 28 tokens + 4 × 8 generated, in blocks of 4)
TIGHT = 7  # blocks (6 usable) of 4 tokens: the 13-token prompt's 21 tokens need 6; the four together need 17
RUNS = {  # name → (model, engine arguments besides the job's tensor_parallel_size)
    "dense": ("preset:tiny", dict(block_size=4, num_gpu_blocks_override=BLOCKS)),
    "dense-preempting": ("preset:tiny", dict(block_size=4, num_gpu_blocks_override=TIGHT)),
    "mla": ("preset:tiny-mla", dict(block_size=4, num_gpu_blocks_override=BLOCKS)),
    "mla-preempting": ("preset:tiny-mla", dict(block_size=4, num_gpu_blocks_override=TIGHT)),
    "moe": ("preset:tiny-moe", dict(block_size=4, num_gpu_blocks_override=BLOCKS)),
    "moe-preempting": ("preset:tiny-moe", dict(block_size=4, num_gpu_blocks_override=TIGHT)),
}
_references: dict[str, dict] = {}


def reference(name: str) -> dict:
    """One process at TP 1, the same requests: tokens and preemptions (computed once per run name)."""
    if name not in _references:
        model, args = RUNS[name]
        llm = LLM(model, use_tqdm_on_load=False, **args)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling_params(), use_tqdm=False)
        metrics = llm.llm_engine.engine.metrics.snapshot()
        _references[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                             "preemptions": sum(m.value for m in metrics if m.name == "vllm:num_preemptions")}
    return _references[name]


def _job(names, nnodes: int, devices: int, dcp: int, limit_s: float):
    """Every run of `names` in one job of nnodes processes, then tiny-mla at DCP dcp with the "mla" run's scheduler
    block (4 tokens, a rank's page 4 / dcp of them) and blocks; → rank 0's results (the last one DCP's)."""
    tp = nnodes * devices
    runs = [{"model": RUNS[n][0], "args": {**RUNS[n][1], "tensor_parallel_size": tp}, "abort": n == "mla"}
            for n in names]
    runs.append({"model": "preset:tiny-mla", "args": dict(block_size=4 // dcp, num_gpu_blocks_override=BLOCKS,
                                                          decode_context_parallel_size=dcp, tensor_parallel_size=tp)})
    ranks = launch(nnodes, {"runs": runs, "devices": devices, "timeout": 60}, limit_s=limit_s)
    for r, rank in enumerate(ranks):
        assert rank.returncode == 0 and not rank.errors(), f"rank {r}: {rank.returncode}\n{rank.stderr[-3000:]}"
    results = ranks[0].results()
    assert len(results) == len(runs), ranks[0].stdout
    return dict(zip(names + ["mla-dcp"], results))


def _check(results: dict, dcp: int, devices: int):
    for name, got in results.items():
        want = reference(name if name != "mla-dcp" else "mla")
        assert got["tokens"] == want["tokens"], name
        if name.endswith("preempting"):
            assert got["preemptions"] > 0 and want["preemptions"] > 0, name
        else:
            assert got["preemptions"] == want["preemptions"] == 0, name
    # an abort reaches every rank: the request beside the aborted one ends as it does alone, and no plan differs
    assert results["mla"]["after_abort"] == [reference("mla")["tokens"][0]]
    one, split = results["mla"], results["mla-dcp"]  # DCP 1 and DCP dcp: the same blocks of 4 tokens
    assert one["num_blocks"] == split["num_blocks"] == BLOCKS
    # a rank's latent pages: blocks × its tokens of a block × lanes × 4 B (f32), on each of this process's devices
    assert one["page_bytes"] == [BLOCKS * 4 * LATENT_LANES * 4] * devices
    assert split["page_bytes"] == [BLOCKS * (4 // dcp) * LATENT_LANES * 4] * devices


def test_two_processes_agree_with_one():
    """TP 2 over 2 processes (one CPU device each): dense preempting, MLA roomy (DCP 1) and DCP 2; the MoE runs are
    in the slow job below (CI's budget)."""
    _check(_job(["dense-preempting", "mla"], 2, 1, 2, limit_s=240), 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("nnodes,devices", [(4, 1), (2, 2)])
def test_four_ranks_agree_with_one(nnodes, devices):
    """TP 4 over 4 processes of one device, or over 2 of two devices; every run, and DCP 4 (DCP 2 on 2 × 2)."""
    dcp = 4 if nnodes == 4 else 2
    _check(_job(list(RUNS), nnodes, devices, dcp, limit_s=540), dcp, devices)
