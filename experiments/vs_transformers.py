"""kvjax against transformers on the same weights, side by side in one run (issue 13, point 4).

Both decode greedily from the same prompts with the same fp32 weights: kvjax through
`kvjax.LLM` (the engine, its paged cache, `steps_per_call` 1 and 8), transformers with its own
KV cache (`LlamaForCausalLM.generate`, eager attention, torch on the same CPU threads). The
transformers model is built from kvjax's parameters (written as a Hugging Face folder by
models.loader.save_checkpoint, the inverse of the loader), so the weights are identical by
construction; the greedy tokens are compared too.

Measured per batch size (1 and 8; 128-token prompts, 128 new tokens):
- prefill tokens/s: kvjax's Summary (the prefill step of each warm run; the ratio takes the
  median over the warm runs of both step counts, whose prefill is the same step);
  transformers: one forward over the batch of prompts;
- decode tokens/s: kvjax's Summary (decode-only steps of a warm run); transformers: (generate
  time − that prefill time) per generated token after the first; medians of `repeats` runs;
- compile: kvjax's first run of each shape compiles its steps (reported separately), and the
  time to the first token of a fresh `LLM` (its prefill compile included when the process has
  not compiled that shape yet: the first kvjax row of each batch size).

Every kvjax run starts from an empty prefix cache (`reset_prefix_cache`, as vLLM's benchmarks
do; the LLM's engine would otherwise keep the blocks of the run before), so each one prefills
its whole prompts as transformers does.

    python -m kvjax.experiments.decode_bench --vs-transformers [--model smollm2-135m]
"""
from __future__ import annotations

import statistics
import tempfile
import time

import jax
import numpy as np

from kvjax import LLM, SamplingParams
from kvjax.markdown import markdown_table
from kvjax.models.hub import LoadedModel
from kvjax.models.loader import save_checkpoint


def hf_llama_config(config) -> dict:
    """A transformers LlamaConfig dict for a kvjax llama ModelConfig (default RoPE only)."""
    if config.model_type != "llama" or config.rope.rope_type != "default":
        raise ValueError(f"the transformers baseline builds Llama models with default RoPE, got "
                         f"{config.model_type} / {config.rope.rope_type}")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.rms_norm_eps,
            "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.qkv_bias,
            "mlp_bias": config.mlp_bias, "hidden_act": "silu", "dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope.theta},
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def transformers_model(model: LoadedModel):
    """transformers' LlamaForCausalLM holding the kvjax model's weights, fp32, eager attention."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder, hf_llama_config(model.config), jax.tree_util.tree_map(np.asarray, model.params))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                               attn_implementation="eager")
    return hf.eval()


def transformers_run(hf, prompts: np.ndarray, new_tokens: int) -> dict:
    """Prefill and decode rates of transformers' greedy generate, and its tokens."""
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)  # explicit: a prompt holding the pad id must not be masked
    with torch.no_grad():
        t0 = time.perf_counter()
        hf(ids, attention_mask=mask, use_cache=True)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0)
        total_s = time.perf_counter() - t0
    b = ids.shape[0]
    return {"prefill_tok_s": ids.numel() / prefill_s,
            "decode_tok_s": b * (new_tokens - 1) / max(total_s - prefill_s, 1e-9),
            "tokens": out[:, ids.shape[1]:].tolist()}


def kvjax_run(model: LoadedModel, prompts: np.ndarray, new_tokens: int, steps_per_call: int,
              repeats: int = 3) -> dict:
    """A fresh LLM: time to its first token (compiling the prefill), then the median rates of
    `repeats` warm runs (and every warm run's prefill rate: a batch's prefill is one step)."""
    b, p = prompts.shape
    settings = dict(max_num_seqs=b, max_model_len=p + new_tokens, block_size=16, steps_per_call=steps_per_call,
                    enable_prefix_caching=False)
    llm = LLM(model, **settings)

    def run(max_tokens: int):
        """(outputs, seconds) of one greedy run from an empty prefix cache (the reset not timed)."""
        if not llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache was not reset: a request is still running")
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts.tolist(), params, use_tqdm=False)
        return outs, time.perf_counter() - t0

    first, ttft = run(1)
    cold, _ = run(new_tokens)  # compiles the decode steps
    warm = [run(new_tokens)[0] for _ in range(repeats)]
    prefill = [w.summary.prefill_tokens_per_s for w in warm]
    median = lambda key: statistics.median(getattr(w.summary, key) for w in warm)  # noqa: E731
    return {"steps_per_call": steps_per_call, "prefill_tok_s": statistics.median(prefill), "prefill_samples": prefill,
            "decode_tok_s": median("decode_tokens_per_s"), "step_p50_ms": median("step_latency_p50_ms"),
            "first_token_s": ttft, "compile_s": first.summary.compile_s + cold.summary.compile_s,
            "tokens": [o.outputs[0].token_ids for o in warm[0]]}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each sequence's tokens before its first difference."""
    fractions = []
    for x, y in zip(a, b):
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fractions.append(same / max(len(x), 1))
    return float(np.mean(fractions))


def compare(model: LoadedModel, batches=(1, 8), prompt_len: int = 128, new_tokens: int = 128,
            repeats: int = 3, seed: int = 0) -> dict:
    """Every measurement of the module docstring, for each batch size; medians of `repeats`."""
    import torch

    hf = transformers_model(model)
    rng = np.random.default_rng(seed)
    rows = []
    for b in batches:
        prompts = rng.integers(3, model.config.vocab_size, (b, prompt_len))
        kv = {k: kvjax_run(model, prompts, new_tokens, k, repeats) for k in (1, 8)}
        transformers_run(hf, prompts, min(new_tokens, 4))  # warm-up: torch's first calls allocate
        tf_runs = [transformers_run(hf, prompts, new_tokens) for _ in range(repeats)]
        tf = {key: statistics.median(r[key] for r in tf_runs) for key in ("prefill_tok_s", "decode_tok_s")}
        rows.append({
            "batch": b, "prompt": prompt_len, "new_tokens": new_tokens, "torch_threads": torch.get_num_threads(),
            "transformers": tf, "kvjax": {k: {key: v for key, v in r.items() if key != "tokens"} for k, r in kv.items()},
            "token_agreement": {k: agreement(r["tokens"], tf_runs[0]["tokens"]) for k, r in kv.items()},
            "ratios": {f"decode_K{k}": r["decode_tok_s"] / tf["decode_tok_s"] for k, r in kv.items()}
            | {"prefill": statistics.median(kv[1]["prefill_samples"] + kv[8]["prefill_samples"])
               / tf["prefill_tok_s"]}})
    return {"model": model.name, "rows": rows}


def markdown(r: dict) -> str:
    cells = []
    for row in r["rows"]:
        b, tf, ratios = row["batch"], row["transformers"], row["ratios"]
        cells.append([b, "transformers (eager, own KV cache)", f"{tf['prefill_tok_s']:,.0f}",
                      f"{tf['decode_tok_s']:,.1f}", "", "", "", ""])
        cells += [[b, f"kvjax, {k} step(s) per call", f"{kv['prefill_tok_s']:,.0f}", f"{kv['decode_tok_s']:,.1f}",
                   f"{kv['step_p50_ms']:.1f}", f"{kv['first_token_s']:.1f}", f"{kv['compile_s']:.1f}",
                   f"{100 * row['token_agreement'][k]:.0f}%"] for k, kv in row["kvjax"].items()]
        cells.append([b, "kvjax / transformers", f"{ratios['prefill']:.2f}×",
                      f"{ratios['decode_K1']:.2f}× (K=1), {ratios['decode_K8']:.2f}× (K=8)", "", "", "", ""])
    lines = [f"## kvjax vs transformers — {r['model']}, fp32 weights, greedy, same prompts", "",
             *markdown_table(["batch", "", "prefill tok/s", "decode tok/s", "step p50 ms", "first token s", "compile s",
                              "same tokens"], cells, "rlrrrrrr")]
    return "\n".join(lines) + "\n"
