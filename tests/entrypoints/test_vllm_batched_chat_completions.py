# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ported from vLLM 0.33's tests/entrypoints/openai/chat_completion/test_batched_chat_completions.py (its
sdist): its tests of POST /v1/chat/completions/batch through a server, against `kvjax serve smollm2-135m`.
Changed: the model (smollm2-135m, SmolLM2-135M-Instruct, for Qwen/Qwen2.5-1.5B-Instruct; a model that
writes JSON by itself: a random one pads a schema's whitespace to the context's end), with SmolLM2's
recommended sampling where Qwen2.5's checkpoint brings its own (--generation-config: its model card's
temperature 0.2, top_p 0.9, as tests/entrypoints/data/smollm2_generation_config) and a pool of 256
blocks and 600-second request timeouts (vLLM's: 60) on this CPU; RemoteOpenAIServer is tests/serving.py's (the same arguments through
kvjax's serve parser, the server in-process); pytest-asyncio's markers as anyio's; httpx as httpx2
(the HTTP library the openai client installs here). Not ported:
test_batched_chat_completions_logprob_token_ids (kvjax refuses `logprob_token_ids` with a 400,
docs/server_fields.md), test_batch_rejects_kv_transfer_prompt_token_ids (`kv_transfer_params`: refused
the same way), and the tests of vLLM's serving objects on mocks (OpenAIServingChatBatch,
OnlineRenderer, reasoning parsers, Harmony), which kvjax does not have. Marked slow (SmolLM2-135M on
this CPU); tests/entrypoints/test_openai_serving.py checks the endpoint on small-gqa in the default set.
Everything else is vLLM's text.
"""

import json
import os

import httpx2 as httpx  # the openai client's HTTP library here (httpx's fork); vLLM's tests use httpx
import pytest
from serving import RemoteOpenAIServer

pytestmark = pytest.mark.slow
GENERATION_CONFIG = os.path.join(os.path.dirname(__file__), "data", "smollm2_generation_config")

# any model with a chat template defined in tokenizer_config should work here
MODEL_NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def default_server_args():
    return [
        # use half precision for speed and memory savings in CI environment
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "128",
        "--enforce-eager",
        "--generation-config",
        GENERATION_CONFIG,
        "--num-gpu-blocks-override",
        "256",
    ]


@pytest.fixture(scope="module")
def server(default_server_args):
    with RemoteOpenAIServer(MODEL_NAME, default_server_args) as remote_server:
        yield remote_server


@pytest.mark.anyio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_batched_chat_completions(
    server: RemoteOpenAIServer, model_name: str
) -> None:
    conversations = [
        [{"role": "user", "content": "Reply with exactly the word: alpha"}],
        [{"role": "user", "content": "Reply with exactly the word: beta"}],
    ]

    async with httpx.AsyncClient() as http_client:
        response = await http_client.post(
            f"{server.url_for('v1/chat/completions/batch')}",
            json={
                "model": model_name,
                "messages": conversations,
            },
            timeout=600,  # this CPU: 60 in vLLM
        )

    assert response.status_code == 200, response.text
    data = response.json()

    choices = data["choices"]
    assert len(choices) == 2

    indices = {choice["index"] for choice in choices}
    assert indices == {0, 1}

    # Each conversation should produce a non-empty text response.
    for choice in choices:
        assert choice["message"]["content"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_batched_chat_completions_with_json_schema(
    server: RemoteOpenAIServer, model_name: str
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
        },
        "required": ["answer"],
    }
    conversations = [
        [{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        [{"role": "user", "content": "Is fire cold? Answer in JSON."}],
    ]

    async with httpx.AsyncClient() as http_client:
        response = await http_client.post(
            f"{server.url_for('v1/chat/completions/batch')}",
            json={
                "model": model_name,
                "messages": conversations,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": schema, "strict": True},
                },
            },
            timeout=600,  # this CPU: 60 in vLLM
        )

    assert response.status_code == 200, response.text
    data = response.json()

    choices = data["choices"]
    assert len(choices) == 2

    for choice in choices:
        parsed = json.loads(choice["message"]["content"])
        assert "answer" in parsed
        assert parsed["answer"] in ("yes", "no")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_batched_chat_completions_logprobs_not_token_id_placeholders(
    server: RemoteOpenAIServer, model_name: str
) -> None:
    # Regression test: requesting `return_token_ids` alongside logprobs must not
    # corrupt the logprob `token` fields into "token_id:{id}" placeholders. That
    # placeholder rendering is controlled by `return_tokens_as_token_ids`, which
    # this request leaves unset.
    conversations = [
        [{"role": "user", "content": "Reply with exactly the word: alpha"}],
    ]

    async with httpx.AsyncClient() as http_client:
        response = await http_client.post(
            f"{server.url_for('v1/chat/completions/batch')}",
            json={
                "model": model_name,
                "messages": conversations,
                "logprobs": True,
                "top_logprobs": 1,
                "return_token_ids": True,
            },
            timeout=600,  # this CPU: 60 in vLLM
        )

    assert response.status_code == 200, response.text
    data = response.json()

    content = data["choices"][0]["logprobs"]["content"]
    assert content
    for entry in content:
        assert not entry["token"].startswith("token_id:")
        for top in entry["top_logprobs"]:
            assert not top["token"].startswith("token_id:")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_batched_chat_completions_return_tokens_as_token_ids(
    server: RemoteOpenAIServer, model_name: str
) -> None:
    # Complementary check: when `return_tokens_as_token_ids` is explicitly set,
    # the logprob tokens *should* be rendered as "token_id:{id}" placeholders,
    # proving the new field is actually wired through.
    conversations = [
        [{"role": "user", "content": "Reply with exactly the word: alpha"}],
    ]

    async with httpx.AsyncClient() as http_client:
        response = await http_client.post(
            f"{server.url_for('v1/chat/completions/batch')}",
            json={
                "model": model_name,
                "messages": conversations,
                "logprobs": True,
                "top_logprobs": 1,
                "return_tokens_as_token_ids": True,
            },
            timeout=600,  # this CPU: 60 in vLLM
        )

    assert response.status_code == 200, response.text
    data = response.json()

    content = data["choices"][0]["logprobs"]["content"]
    assert content
    assert all(entry["token"].startswith("token_id:") for entry in content)
