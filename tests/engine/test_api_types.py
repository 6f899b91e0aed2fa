"""Every public LLM call given a value of the wrong type or shape refuses it with one LLMError (a
ValueError) naming the argument, before anything runs, and the LLM stays usable (round three's
"API types" class: raw TypeError / KeyError / ValueError before)."""
from __future__ import annotations

import numpy as np
import pytest

from kvjax import LLM, BeamSearchParams, SamplingParams
from kvjax.engine.arg_utils import LLMError

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
HI = [{"role": "user", "content": "hi"}]
SP = SamplingParams(max_tokens=2, temperature=0.0)

# (call on an LLM, words the one-line error must contain: the argument it names and what it got)
CASES = {
    "chat of one message dict": (lambda llm: llm.chat(HI[0], chat_template=TEMPLATE), ["messages", "dict"]),
    "chat of an int": (lambda llm: llm.chat(5, chat_template=TEMPLATE), ["messages", "int"]),
    "chat of strings": (lambda llm: llm.chat(["hi"], chat_template=TEMPLATE), ["conversation 0", "str"]),
    "chat_template_kwargs setting messages": (
        lambda llm: llm.chat(HI, chat_template=TEMPLATE, chat_template_kwargs={"messages": []}), ["'messages'"]),
    "chat_template_kwargs an int": (
        lambda llm: llm.chat(HI, chat_template=TEMPLATE, chat_template_kwargs=5), ["chat_template_kwargs", "int"]),
    "progress not callable": (lambda llm: llm.generate(["a"], SP, progress=5), ["progress", "int"]),
    "sampling_params a dict": (lambda llm: llm.generate(["a"], {"max_tokens": 2}), ["sampling_params", "dict"]),
    "sampling_params of ints": (lambda llm: llm.generate(["a"], [5]), ["SamplingParams", "int"]),
    "prompts a generator": (lambda llm: llm.generate(p for p in ["a"]), ["prompts", "generator"]),
    "a prompt None": (lambda llm: llm.generate([None]), ["prompt", "None"]),
    "use_tqdm an int": (lambda llm: llm.generate(["a"], SP, use_tqdm=5), ["use_tqdm", "5"]),
    "priority a string": (lambda llm: llm.generate(["a"], SP, priority="x"), ["priority", "str"]),
    "beam_search params an int": (lambda llm: llm.beam_search(["a"], 5), ["BeamSearchParams", "int"]),
    "score_windows 1-d": (lambda llm: llm.score_windows([1, 2, 3]), ["token_windows", "(3,)"]),
    "score_windows batch_size 0": (lambda llm: llm.score_windows([[1, 2]], batch_size=0), ["batch_size", "0"]),
    "reset_prefix_cache of a string": (lambda llm: llm.reset_prefix_cache("yes"), ["reset_running_requests", "yes"]),
    "reset_connector a list": (lambda llm: llm.reset_prefix_cache(reset_connector=[1]), ["reset_connector", "[1]"]),
    "a missing chat template file": (lambda llm: llm.chat(HI, chat_template="/missing/file.jinja"),
                                     ["/missing/file.jinja"]),
}


@pytest.fixture(scope="module")
def llm():
    return LLM("small-gqa", num_gpu_blocks_override=32, use_tqdm_on_load=False)


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_type_is_one_clear_error(llm, case):
    call, words = CASES[case]
    with pytest.raises(ValueError) as e:
        call(llm)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert not llm.llm_engine.has_unfinished_requests()


def test_empty_inputs_are_empty_results(llm):
    assert len(llm.generate([], SP)) == 0 and len(llm.chat([], SP, chat_template=TEMPLATE)) == 0
    scores = llm.score_windows(np.zeros((0, 8), np.int32))
    assert scores.shape == (0, 8, llm.config.vocab_size) and scores.dtype == np.float32
    # and the LLM still generates what a prompt alone would
    out, = llm.generate([[1, 2, 3]], SP, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_sampling_params_from_a_generator(llm):
    # any iterable of SamplingParams, one per prompt, as vLLM's Sequence
    outs = llm.generate(["a", "b"], (SamplingParams(max_tokens=n, temperature=0.0) for n in (1, 3)), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3]


def test_chat_template_read_as_vllm_reads_it(llm, tmp_path):
    # vLLM's _load_chat_template: an existing file first (even with braces in its path), else text with
    # "{", "}" or a newline is the template, else a missing file
    path = tmp_path / "t{1}.jinja"
    path.write_text("F:{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out, = llm.chat(HI, SP, chat_template=str(path), use_tqdm=False)
    assert out.prompt == "F:hi"
    out, = llm.chat(HI, SP, chat_template="literal }\nno variables", use_tqdm=False)
    assert out.prompt == "literal }\nno variables"
