# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ported from vLLM 0.33's tests/entrypoints/openai/chat_completion/test_chat_echo.py (its sdist), against
`kvjax serve smollm2-135m`. Changed: the model (smollm2-135m, SmolLM2-135M-Instruct, for
Qwen/Qwen2-1.5B-Instruct) and the number that follows from it (--max-logprobs: its vocabulary, 49152,
for Qwen2's 151936); its vocabulary size read from kvjax's config instead of vLLM's ModelConfig;
--generation-config gives the server SmolLM2's recommended sampling (its model card's temperature 0.2,
top_p 0.9, as tests/entrypoints/data/smollm2_generation_config) where Qwen2-1.5B-Instruct's checkpoint
brings its own (vLLM applies a checkpoint's generation_config.json): SmolLM2's GGUF carries none, and at
vLLM's default temperature 1.0 its reply to the apple saying runs to the context's end instead of stopping;
a pool of 256 blocks on this CPU (--num-gpu-blocks-override: a kvjax decode step here takes time
and memory in proportion to the pool); RemoteOpenAIServer is tests/serving.py's
(the same arguments through kvjax's serve parser, the server in-process); pytest-asyncio's markers and
fixtures as anyio's. Marked slow (SmolLM2-135M on this CPU). Everything else is vLLM's text.
"""
import os
from typing import NamedTuple

import openai  # use the official client for correctness check
import pytest
from serving import RemoteOpenAIServer

from kvjax.models.hub import load_model_config

pytestmark = pytest.mark.slow

GENERATION_CONFIG = os.path.join(os.path.dirname(__file__), "data", "smollm2_generation_config")

# # any model with a chat template should work here
MODEL_NAME = "smollm2-135m"


def get_vocab_size(model_name):
    return load_model_config(model_name).vocab_size


@pytest.fixture(scope="module")
def server():
    args = [
        # use half precision for speed and memory savings in CI environment
        "--dtype",
        "float16",
        "--enforce-eager",
        "--max-model-len",
        "4080",
        "--max-logprobs",  # test prompt_logprobs equal to -1
        "49152",
        "--generation-config",
        GENERATION_CONFIG,
        "--num-gpu-blocks-override",  # this CPU: a 4,096-token pool (its 255 usable blocks hold 4,080 tokens)
        "256",
    ]

    with RemoteOpenAIServer(MODEL_NAME, args) as remote_server:
        yield remote_server


@pytest.fixture
async def client(server):
    async with server.get_async_client() as async_client:
        yield async_client


class TestCase(NamedTuple):
    model_name: str
    echo: bool


@pytest.mark.anyio
@pytest.mark.parametrize(
    "test_case",
    [
        TestCase(model_name=MODEL_NAME, echo=True),
        TestCase(model_name=MODEL_NAME, echo=False),
    ],
)
async def test_chat_session_with_echo_and_continue_final_message(
    client: openai.AsyncOpenAI, test_case: TestCase
):
    saying: str = "Here is a common saying about apple. An apple a day, keeps"
    # test echo with continue_final_message parameter
    chat_completion = await client.chat.completions.create(
        model=test_case.model_name,
        messages=[
            {"role": "user", "content": "tell me a common saying"},
            {"role": "assistant", "content": saying},
        ],
        extra_body={
            "echo": test_case.echo,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert chat_completion.id is not None
    assert len(chat_completion.choices) == 1

    choice = chat_completion.choices[0]
    assert choice.finish_reason == "stop"

    message = choice.message
    if test_case.echo:
        assert message.content is not None and saying in message.content
    else:
        assert message.content is not None and saying not in message.content
    assert message.role == "assistant"


@pytest.mark.anyio
async def test_prompt_logprobs(client: openai.AsyncOpenAI):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Beijing is the capital of which country?"},
    ]

    completion = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        extra_body={"prompt_logprobs": -1},
    )

    assert completion.prompt_logprobs is not None
    assert len(completion.prompt_logprobs) > 0


@pytest.mark.anyio
async def test_top_logprobs(client: openai.AsyncOpenAI):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Beijing is the capital of which country?"},
    ]

    completion = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=1,
        extra_body={
            "top_logprobs": -1,
            "logprobs": True,
        },
    )
    assert completion.choices[0].logprobs is not None
    assert completion.choices[0].logprobs.content is not None
    assert len(completion.choices[0].logprobs.content) > 0
    assert len(
        completion.choices[0].logprobs.content[0].top_logprobs
    ) == get_vocab_size(MODEL_NAME)
