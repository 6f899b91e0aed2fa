# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ported from vLLM 0.33's tests/entrypoints/openai/completion/test_prompt_validation.py (its sdist),
against `kvjax serve small-gqa`. Changed: the model (small-gqa for openai-community/gpt2) and, for this
CPU, a small pool beside `--enforce-eager` (SERVER_ARGS); RemoteOpenAIServer is tests/serving.py's (the
same arguments through kvjax's serve parser, the server in-process); pytest-asyncio's markers as anyio's.
Not ported: test_load_prompt_embeds and test_disable_prompt_embeds (unit tests of vLLM's
safe_load_prompt_embeds on torch tensors: kvjax refuses `prompt_embeds` with a 400 naming it,
docs/server_fields.md). Everything else is vLLM's text.
"""

import openai
import pytest
import regex as re
from serving import RemoteOpenAIServer

SERVER_ARGS = ["--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "2", "--num-gpu-blocks-override", "16"]


@pytest.mark.anyio
async def test_empty_prompt():
    model_name = "small-gqa"
    server_args = SERVER_ARGS
    with RemoteOpenAIServer(model_name, server_args) as remote_server:
        client = remote_server.get_async_client()

        with pytest.raises(
            openai.BadRequestError,
            match="Either prompt or prompt_embeds must be provided and non-empty.",
        ):
            await client.completions.create(
                model=model_name,
                prompt=None,
                max_tokens=5,
                temperature=0.0,
                extra_body={"prompt_embeds": []},
            )


@pytest.mark.anyio
async def test_out_of_vocab_token_ids():
    model_name = "small-gqa"
    server_args = SERVER_ARGS
    with RemoteOpenAIServer(model_name, server_args) as remote_server:
        client = remote_server.get_async_client()

        with pytest.raises(
            openai.BadRequestError, match=re.compile(".*out of vocabulary.*").pattern
        ):
            await client.completions.create(
                model=model_name, prompt=[999999], max_tokens=5, temperature=0.0
            )
