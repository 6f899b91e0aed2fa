"""kvjax.LLM, the Python API: the README's quickstart and docs/python_api.md's AsyncLLM example, EOS and
stop tokens against transformers, scoring against transformers' logits, the contiguous layout against the
paged one, priorities.

The reference models are tests/hf_fixtures.py's random-init transformers checkpoints; their
greedy output is compared only up to the first near-tie (two top logits closer than MARGIN),
where a 1e-6 difference in logits may legitimately pick the other token.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re

import chex
import numpy as np
import pytest
import torch
from hf_fixtures import hf_logits, make_hf_model, save_hf_model

import kvjax
from kvjax.engine.arg_utils import LLMError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARGIN = 1e-4
NEW = 12


def test_docs_async_example_streams_what_generate_returns():
    """docs/python_api.md's AsyncLLM example as written: the DELTA texts it prints, joined, are the
    text LLM.generate returns for the same greedy request."""
    doc = open(os.path.join(ROOT, "docs", "python_api.md")).read()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", doc, re.S) if "AsyncLLM" in block]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/python_api.md", "exec"), {})
    llm = kvjax.LLM("small-gqa", num_gpu_blocks_override=64, use_tqdm_on_load=False)
    want = llm.generate("def fibonacci(n):", kvjax.SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert out.getvalue() == want[0].outputs[0].text and len(want[0].outputs[0].token_ids) == 16


@pytest.mark.slow
def test_readme_python_example_runs_as_written():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out, names = io.StringIO(), {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), names)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 and lines[0].startswith("'def fibonacci(n):' -> ")
    assert "(length, log-prob -" in lines[0]
    assert lines[3] == "192 tokens, 0 preemptions"  # 3 prompts × n=2 × 32 tokens
    # The second call finds the first prompt's full blocks that the first call cached (vLLM's hit
    # leaves at least the last prompt token to compute).
    llm = names["llm"]
    hit = (len(llm.get_tokenizer().encode("def fibonacci(n):")) - 1) // llm.block_size * llm.block_size
    assert hit > 0 and lines[4] == f"second call: {hit} prompt tokens from the prefix cache"


def hf_greedy(hf, prompt, eos=None):
    """(transformers' greedy continuation, index of its first near-tie)."""
    hf.generation_config.eos_token_id = eos
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)
    margins = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in out.scores]
    near = [i for i, m in enumerate(margins) if m < MARGIN]
    return out.sequences[0, len(prompt):].tolist(), (near[0] if near else NEW)


@pytest.fixture(scope="module")
def eos_case(tmp_path_factory):
    """A llama checkpoint whose EOS is a token its greedy path reaches part-way for some prompts."""
    hf = make_hf_model("llama-gqa")
    rng = np.random.RandomState(3)
    prompts = [[int(t) for t in rng.randint(0, 128, n)] for n in (4, 7, 10, 5)]
    free = [hf_greedy(hf, p) for p in prompts]
    counts = {}
    for tokens, near in free:
        for t in set(tokens[1:min(near, NEW - 1)]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (counts[t], -t))  # reached before the end by the most prompts
    hf.config.eos_token_id = eos
    folder = save_hf_model(hf, str(tmp_path_factory.getbasetemp() / "llm" / "llama-eos"))
    with open(os.path.join(folder, "config.json")) as fh:
        assert json.load(fh)["eos_token_id"] == eos
    return folder, hf, prompts, free, eos


@pytest.mark.slow
def test_eos_stops_as_transformers_does(eos_case):
    folder, hf, prompts, free, eos = eos_case
    want = [hf_greedy(hf, p, eos=eos)[0] for p in prompts]
    assert any(len(w) < NEW and w[-1] == eos for w in want), "no prompt reaches the EOS id"
    for k in (1, 8):
        llm = kvjax.LLM(folder, block_size=4, max_num_seqs=2, num_gpu_blocks_override=12, max_model_len=32,
                        steps_per_call=k)
        assert llm.engine.eos_token_ids == (eos,)
        outs = llm.generate(prompts, kvjax.SamplingParams(max_tokens=NEW, temperature=0), use_tqdm=False)
        for out, w, (_, near) in zip(outs, want, free):
            n = min(near, len(w))
            got = out.outputs[0]
            assert got.token_ids[:n] == w[:n]
            if len(w) < NEW and len(w) <= near:  # transformers stopped at EOS before any near-tie
                assert got.token_ids == w and got.finish_reason == "stop"
        ignoring = llm.generate(prompts, kvjax.SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
                                use_tqdm=False)
        for out, (tokens, near) in zip(ignoring, free):
            assert out.outputs[0].token_ids[:near] == tokens[:near] and out.outputs[0].finish_reason == "length"
        state = llm.engine.scheduler.state
        assert int(state.pool.num_free) == llm.num_blocks - 1, "a stopped request's blocks did not return"


@pytest.mark.slow
def test_stop_token_ids_stop_and_are_kept(eos_case):
    folder, hf, prompts, free, eos = eos_case
    llm = kvjax.LLM(folder, block_size=4, max_num_seqs=4, max_model_len=32, steps_per_call=8)
    tokens, near = free[0]
    stop = next(t for t in tokens[2:near] if t != eos)
    params = kvjax.SamplingParams(max_tokens=NEW, temperature=0, stop_token_ids=[stop], ignore_eos=True)
    out = llm.generate(prompts[0], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(stop) + 1] and out.finish_reason == "stop"


def test_score_equals_transformers_log_softmax(eos_case):
    folder, hf, *_ = eos_case
    tokens = np.random.RandomState(0).randint(0, 128, (2, 24))
    got = kvjax.LLM(folder, block_size=4, num_gpu_blocks_override=8).score_windows(tokens)
    chex.assert_shape(got, (2, 24, 128))
    for row, lp in zip(tokens, got):
        logits = hf_logits(hf, row)
        want = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
            logits.max(-1, keepdims=True)
        np.testing.assert_allclose(lp, want, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny-mla"])
def test_contiguous_layout_generates_what_the_paged_layout_generates(name):
    prompts = [[int(t) for t in np.random.RandomState(i).randint(0, 128, 3 + 5 * i)] for i in range(5)]
    common = dict(block_size=4, max_num_seqs=3, max_model_len=48, enable_prefix_caching=False, steps_per_call=8)
    params = kvjax.SamplingParams(max_tokens=10, temperature=0)
    paged = kvjax.LLM(f"preset:{name}", num_gpu_blocks_override=12, **common)  # tight: requests get preempted
    contiguous = kvjax.LLM(f"preset:{name}", num_gpu_blocks_override=12, kv_layout="contiguous", **common)
    a, b = paged.generate(prompts, params, use_tqdm=False), contiguous.generate(prompts, params, use_tqdm=False)
    assert a.summary.preemptions > 0 and b.summary.preemptions == a.summary.preemptions
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    rows = contiguous.engine.cache.layers[0]  # a row per max_num_seqs, as long as the pool's 11 blocks of 4
    chex.assert_shape(rows.latent if name == "tiny-mla" else rows.k, (3, 44, *(
        (24,) if name == "tiny-mla" else (2, 16))))


@pytest.mark.slow
def test_priority_reaches_the_scheduler():
    """One row at a time with prefix caching: whichever of two prompts sharing a prefix runs
    second finds the first one's cached blocks. FCFS runs 0, 1, 2; priorities [2, 0, 1] run 1, 2, 0."""
    rng = np.random.RandomState(1)
    shared = [int(t) for t in rng.randint(0, 128, 8)]
    prompts = [shared + [1, 2], [int(t) for t in rng.randint(0, 128, 9)], shared + [3, 4, 5]]
    common = dict(block_size=4, max_num_seqs=1, max_model_len=32, num_gpu_blocks_override=20)
    params = kvjax.SamplingParams(max_tokens=3, temperature=0)
    fcfs = kvjax.LLM("preset:tiny", **common).generate(prompts, params, use_tqdm=False)
    prio = kvjax.LLM("preset:tiny", scheduling_policy="priority", **common).generate(prompts, params,
                                                                                      priority=[2, 0, 1],
                                                                                      use_tqdm=False)
    assert [o.num_cached_tokens for o in fcfs] == [0, 0, 8]
    assert [o.num_cached_tokens for o in prio] == [8, 0, 0]
    fcfs_llm = kvjax.LLM("preset:tiny", **common)
    # vLLM accepts priorities under fcfs and ignores them: the order stays 0, 1, 2
    assert [o.num_cached_tokens for o in fcfs_llm.generate(prompts, params, priority=[2, 0, 1], use_tqdm=False)] == \
        [0, 0, 8]


@pytest.mark.slow
def test_api_errors_name_the_value():
    with pytest.raises(LLMError, match="give one of num_gpu_blocks_override or gpu_memory_utilization"):
        kvjax.LLM("preset:tiny", num_gpu_blocks_override=8, gpu_memory_utilization=0.5)
    with pytest.raises(LLMError, match="LLM\\(\\) has no argument 'kv_dtype'"):  # the old names are gone
        kvjax.LLM("preset:tiny", kv_dtype="fp8")
    with pytest.raises(ValueError, match="contiguous KV layout cannot share prefixes"):
        kvjax.LLM("preset:tiny", num_gpu_blocks_override=8, kv_layout="contiguous")
    with pytest.raises(ValueError, match="the contiguous cache stores unquantized KV only"):
        kvjax.LLM("preset:tiny", num_gpu_blocks_override=8, kv_layout="contiguous", enable_prefix_caching=False,
                  kv_cache_dtype="fp8")
    llm = kvjax.LLM("preset:tiny", num_gpu_blocks_override=8, max_model_len=16, block_size=4)
    with pytest.raises(LLMError, match="prompt token ids must be a list of integers"):
        llm.generate([[1.5, 2]], use_tqdm=False)
    one = llm.generate("ab", kvjax.SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # one prompt
    assert len(one) == 1 and one[0].prompt == "ab" and one[0].prompt_token_ids == [97, 98]
    assert len(llm.generate([1, 2, 3], use_tqdm=False)) == 1  # token ids of one prompt
    with pytest.raises(LLMError, match="token_windows must be integer ids"):
        llm.score_windows(np.zeros((2, 3), np.float32))


def test_hybrid_kv_cache_sizes_by_the_groups(tmp_path_factory):
    """A Gemma 3 checkpoint (sliding layers): kv_cache_memory_bytes buys blocks of one group's
    pages (vLLM's hybrid KV cache, its page tensors shared by the groups),
    disable_hybrid_kv_cache_manager blocks of every layer's. (Both give the same tokens:
    tests/engine/test_engine_sliding.py.)"""
    folder = save_hf_model(make_hf_model("gemma3"), str(tmp_path_factory.mktemp("llm-gemma3")))
    common = dict(block_size=4, max_num_seqs=2, max_model_len=48, kv_cache_memory_bytes=2**20)
    hybrid = kvjax.LLM(folder, **common)
    full = kvjax.LLM(folder, disable_hybrid_kv_cache_manager=True, **common)
    cfg = hybrid.config
    page = 2 * 4 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V × 4 slots × heads × dims × fp32: one layer
    from kvjax.core.kv_cache_groups import kv_cache_groups

    layers_per_group = max(len(g.layers) for g in kv_cache_groups(cfg.kv_spec(), cfg.layer_windows, 4))
    assert hybrid.num_blocks == 1 + 2**20 // (layers_per_group * page)
    assert full.num_blocks == 1 + 2**20 // (cfg.num_layers * page)
    assert hybrid.vllm_config.cache_config.groups.hybrid and not full.vllm_config.cache_config.groups.hybrid
    assert len(hybrid.engine.cache.layers) == layers_per_group and len(full.engine.cache.layers) == cfg.num_layers
    with pytest.raises(kvjax.engine.arg_utils.LLMError, match="disable_hybrid_kv_cache_manager must be True or False"):
        kvjax.LLM(folder, disable_hybrid_kv_cache_manager="yes", **common)
