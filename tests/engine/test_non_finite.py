"""A model whose logits stop being finite (NaN weights, a degenerate config) ends the request with
vLLM's finish reason "error" and reports no token drawn from them (round three: NaN weights printed
every token id 0 and exit 0). Other requests in the same steps are untouched: their tokens equal a
clean model's."""
from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from kvjax import LLM, SamplingParams

T = 7  # a token id none of the prompts holds


@pytest.fixture(scope="module")
def clean():
    return LLM("small-gqa", num_gpu_blocks_override=48, max_num_seqs=4, steps_per_call=8, use_tqdm_on_load=False)


def _with_params(clean, change):
    llm = LLM("small-gqa", num_gpu_blocks_override=48, max_num_seqs=4, steps_per_call=8, use_tqdm_on_load=False)
    llm.engine.params = change(llm.engine.params)
    return llm


def test_nan_weights_end_every_request_with_error_and_no_token(clean, caplog):
    llm = _with_params(clean, lambda p: jax.tree.map(lambda x: x * np.nan, p))
    with caplog.at_level(logging.WARNING, logger="kvjax"):
        outs = llm.generate([[65, 66, 67], [68] * 20], SamplingParams(max_tokens=5, temperature=0.0, logprobs=2),
                            use_tqdm=False)
    for o in outs:
        c, = o.outputs
        assert c.finish_reason == "error" and list(c.token_ids) == [] and c.logprobs in ([], None)
    assert sum("not finite" in r.message for r in caplog.records) == 2
    assert llm.engine.scheduler.num_free_blocks() == llm.engine.usable_blocks


@pytest.mark.slow  # 20 s; the default run has non-finite logits from the first token on (NaN weights)
def test_logits_turning_non_finite_mid_decode(clean):
    # token T's embedding row is NaN: a request that samples T (pushed by a logit bias) ends in the
    # device decode loop at the step that reads T back, keeping T; its neighbour decodes on
    def poison(p):
        table = p["embed_tokens"]["embedding"]
        return {**p, "embed_tokens": {"embedding": table.at[T].set(np.nan)}}

    llm = _with_params(clean, poison)
    prompts = [[65, 66, 67, 68], [69, 70, 71]]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logit_bias={T: 100.0}, logprobs=1),
              SamplingParams(max_tokens=12, temperature=0.0)]
    poisoned, healthy = llm.generate(prompts, params, use_tqdm=False)
    c, = poisoned.outputs
    assert list(c.token_ids) == [T] and c.finish_reason == "error" and len(c.logprobs) == 1
    want, = clean.generate([prompts[1]], params[1], use_tqdm=False)
    assert healthy.outputs[0].token_ids == want.outputs[0].token_ids
    assert healthy.outputs[0].finish_reason == "length"
    assert llm.engine.scheduler.num_free_blocks() == llm.engine.usable_blocks
    again, = llm.generate([prompts[1]], params[1], use_tqdm=False)  # the LLM goes on as before
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
