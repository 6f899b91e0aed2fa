# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for middleware that's off by default and can be toggled through
server arguments, mainly --api-key and --enable-request-id-headers.

Ported from vLLM 0.33's tests/entrypoints/serve/middleware/test_optional_middleware.py (its sdist),
against `kvjax serve small-gqa`. Changed: the model (small-gqa for the embeddings model
intfloat/multilingual-e5-small, so "--runner pooling" is left out of the arguments: kvjax serves text
generation); RemoteOpenAIServer is tests/serving.py's (the same arguments through kvjax's serve parser,
the server in-process), with a small pool for this CPU; pytest-asyncio's markers as anyio's. Not
ported: test_v2_endpoint_rejects_missing_api_token and test_v2_endpoint_accepts_valid_api_token
(/v2/embed is a pooling endpoint; kvjax has no pooling runner and serves no /v2 route).
Everything else is vLLM's text.
"""

from http import HTTPStatus

import pytest
import requests
from serving import RemoteOpenAIServer

MODEL_NAME = "small-gqa"


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest):
    passed_params = []
    if hasattr(request, "param"):
        passed_params = request.param
    if isinstance(passed_params, str):
        passed_params = [passed_params]

    args = [
        # use half precision for speed and memory savings in CI environment
        "--dtype",
        "float16",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--max-num-seqs",
        "2",
        "--num-gpu-blocks-override",
        "16",
        *passed_params,
    ]

    with RemoteOpenAIServer(MODEL_NAME, args) as remote_server:
        yield remote_server


@pytest.mark.anyio
async def test_no_api_token(server: RemoteOpenAIServer):
    response = requests.get(server.url_for("v1/models"))
    assert response.status_code == HTTPStatus.OK


@pytest.mark.anyio
async def test_no_request_id_header(server: RemoteOpenAIServer):
    response = requests.get(server.url_for("health"))
    assert "X-Request-Id" not in response.headers


@pytest.mark.parametrize(
    "server",
    [["--api-key", "test"]],
    indirect=True,
)
@pytest.mark.anyio
async def test_missing_api_token(server: RemoteOpenAIServer):
    response = requests.get(server.url_for("v1/models"))
    assert response.status_code == HTTPStatus.UNAUTHORIZED


@pytest.mark.parametrize(
    "server",
    [["--api-key", "test"]],
    indirect=True,
)
@pytest.mark.anyio
async def test_passed_api_token(server: RemoteOpenAIServer):
    response = requests.get(
        server.url_for("v1/models"), headers={"Authorization": "Bearer test"}
    )
    assert response.status_code == HTTPStatus.OK


@pytest.mark.parametrize(
    "server",
    [["--api-key", "test"]],
    indirect=True,
)
@pytest.mark.anyio
async def test_not_v1_or_v2_path_skips_auth(server: RemoteOpenAIServer):
    # Authorization check is skipped for paths that
    # don't start with /v1 or /v2 (e.g. /health, /metrics).
    response = requests.get(server.url_for("health"))
    assert response.status_code == HTTPStatus.OK


@pytest.mark.parametrize(
    "server",
    ["--enable-request-id-headers"],
    indirect=True,
)
@pytest.mark.anyio
async def test_enable_request_id_header(server: RemoteOpenAIServer):
    response = requests.get(server.url_for("health"))
    assert "X-Request-Id" in response.headers
    assert len(response.headers.get("X-Request-Id", "")) == 32


@pytest.mark.parametrize(
    "server",
    ["--enable-request-id-headers"],
    indirect=True,
)
@pytest.mark.anyio
async def test_custom_request_id_header(server: RemoteOpenAIServer):
    response = requests.get(
        server.url_for("health"), headers={"X-Request-Id": "Custom"}
    )
    assert "X-Request-Id" in response.headers
    assert response.headers.get("X-Request-Id") == "Custom"
