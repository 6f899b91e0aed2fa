# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ported from vLLM 0.33's tests/entrypoints/serve/middleware/test_authentication_middleware.py (its
sdist), against kvjax's AuthenticationMiddleware and `kvjax serve`'s routes. Changed: the routes come
from kvjax's app (build_app over a small-gqa AsyncLLM) instead of vLLM's register_api_routers, once for
the one task kvjax serves ("generate", vLLM's SupportedTask for text generation) instead of each of
vLLM's tasks, so MockModelConfig and VLLM_SERVER_DEV_MODE (vLLM's dev-only routes; kvjax has none) are
left out. Everything else is vLLM's text.
"""

import pytest
import regex as re
from fastapi import FastAPI
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvjax import AsyncEngineArgs, AsyncLLM
from kvjax.entrypoints.openai.api_server import (
    GUARDED_PREFIX,
    AuthenticationMiddleware,
    build_app,
)

SUPPORTED_TASKS = ("generate",)  # kvjax serves text generation only

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def get_all_http_routes(app: FastAPI) -> list[tuple[str, list[str]]]:
    """Extract all HTTP routes (path, methods) from the FastAPI app."""
    routes = []
    for route in app.routes:
        if not isinstance(route, Route):
            continue
        path = route.path
        methods = list(route.methods or {"GET"})
        routes.append((path, methods))
    return routes


def generate_test_path(path_template: str) -> str:
    """Replace path parameters (e.g. {response_id}) with 'test'."""
    return re.sub(r"\{[^}]+\}", "test", path_template)


def _create_app_with_mock_routes(routes: list[tuple[str, list[str]]]) -> FastAPI:
    """Create a FastAPI app with AuthenticationMiddleware and mock endpoints."""
    app = FastAPI()
    app.add_middleware(AuthenticationMiddleware, tokens=["valid-token"])

    async def mock_endpoint():
        return JSONResponse({"status": "ok"})

    for path_template, methods in routes:
        allowed_methods = list(set(methods + ["OPTIONS"]))
        app.add_api_route(
            path_template,
            mock_endpoint,
            methods=allowed_methods,
            include_in_schema=False,
        )
    return app


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="small-gqa", max_model_len=256, max_num_seqs=2,
                                                       num_gpu_blocks_override=16, use_tqdm_on_load=False))
    yield engine
    engine.shutdown()


@pytest.fixture(params=SUPPORTED_TASKS)
def task_routes(request, engine) -> tuple[str, list[tuple[str, list[str]]]]:
    """For each supported task, build an app with only that task's routers,
    extract all routes, and return the task name and routes."""
    task = request.param
    app = build_app(engine)  # kvjax registers every route of its one task here

    routes = get_all_http_routes(app)
    assert any(path.startswith(GUARDED_PREFIX) for path, _ in routes)  # kvjax's: not a vacuous walk
    return task, routes


# ---------------------------------------------------------------------------
# Tests for auto-discovered routes
# ---------------------------------------------------------------------------


def test_auto_discovered_protected_routes_require_auth(task_routes):
    """For every auto-discovered route that starts with a guarded prefix,
    verify that authentication is enforced."""
    task, routes = task_routes
    app = _create_app_with_mock_routes(routes)
    client = TestClient(app)

    for path_template, methods in routes:
        if not path_template.startswith(GUARDED_PREFIX):
            continue

        test_path = generate_test_path(path_template)
        test_method = methods[0] if methods else "GET"

        resp = client.request(test_method, test_path)
        assert resp.status_code == 401, (
            f"[{task}] {test_method} {test_path} should reject missing token"
        )

        resp = client.request(
            test_method, test_path, headers={"Authorization": "Bearer wrong"}
        )
        assert resp.status_code == 401, (
            f"[{task}] {test_method} {test_path} should reject invalid token"
        )

        resp = client.request(
            test_method, test_path, headers={"Authorization": "Bearer valid-token"}
        )
        assert resp.status_code == 200, (
            f"[{task}] {test_method} {test_path} should accept valid token"
        )


def test_auto_discovered_unprotected_routes_no_auth(task_routes):
    """For every auto-discovered route that does NOT start with a guarded
    prefix, verify that no authentication is required."""
    task, routes = task_routes
    app = _create_app_with_mock_routes(routes)
    client = TestClient(app)

    for path_template, methods in routes:
        if path_template.startswith(GUARDED_PREFIX):
            continue

        test_path = generate_test_path(path_template)
        test_method = methods[0] if methods else "GET"

        resp = client.request(test_method, test_path)
        assert resp.status_code == 200, (
            f"[{task}] {test_method} {test_path} should be accessible without token"
        )
