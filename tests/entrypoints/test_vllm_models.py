# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ported from vLLM 0.33's tests/entrypoints/openai/models/test_models.py (its sdist), against `kvjax serve
small-gqa`. Changed: the model (small-gqa, whose root is its name as it was given); the server
(tests/serving.py's in-process `kvjax serve`, max_num_seqs 4 on this CPU); pytest-asyncio's markers and
fixtures as anyio's. Left out: the LoRA adapters the original serves beside the model (LoRA is not
implemented in kvjax: `--enable-lora` is refused), so its lora_models assertions have nothing to list;
test_retrieve_model is kvjax's, for GET /v1/models/{id}, which the original's file does not exercise.
"""

import openai  # use the official client for correctness check
import pytest
from serving import serving

MODEL_NAME = "small-gqa"


@pytest.fixture(scope="module")
def server():
    args = dict(model=MODEL_NAME, dtype="bfloat16", max_model_len=2048, max_num_seqs=4, num_gpu_blocks_override=64,
                use_tqdm_on_load=False)

    with serving(**args) as remote_server:
        yield remote_server


@pytest.fixture
async def client(server):
    async with openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0) as async_client:
        yield async_client


@pytest.mark.anyio
async def test_check_models(client: openai.AsyncOpenAI):
    models = await client.models.list()
    models = models.data
    served_model = models[0]
    lora_models = models[1:]
    assert served_model.id == MODEL_NAME
    assert served_model.root == MODEL_NAME
    assert lora_models == []


@pytest.mark.anyio
async def test_retrieve_model(client: openai.AsyncOpenAI):
    model = await client.models.retrieve(MODEL_NAME)
    assert (model.id, model.object, model.owned_by) == (MODEL_NAME, "model", "kvjax")
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("qwen3-lora")
