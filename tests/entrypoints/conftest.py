"""The fixtures both server test modules use, each built from the requesting module's COMMON
(AsyncEngineArgs / LLM arguments) and PROMPTS: one `kvjax serve` per module, an OpenAI client to it,
the offline LLM on the same arguments, and its greedy texts of PROMPTS (the reference); and vLLM
0.33's sample_structured_outputs_choices (its tests/entrypoints/conftest.py), for the ported tests."""
from __future__ import annotations

import openai
import pytest
from serving import serving

from kvjax import LLM, SamplingParams


@pytest.fixture(scope="module")
def server(request):
    with serving(**request.module.COMMON) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(request):
    return LLM(**request.module.COMMON)


@pytest.fixture(scope="module")
def greedy(llm, request):
    outs = llm.generate(request.module.PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


# ---- from vLLM 0.33's tests/entrypoints/conftest.py (its sdist), unchanged ---------------------
@pytest.fixture
def sample_structured_outputs_choices():
    return [
        "Python",
        "Java",
        "JavaScript",
        "C++",
        "C#",
        "PHP",
        "TypeScript",
        "Ruby",
        "Swift",
        "Kotlin",
    ]
