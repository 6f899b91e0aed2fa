"""A `kvjax serve` app on a free loopback port in a thread, for the tests that talk HTTP to it
(tests/entrypoints/, tests/benchmarks/), and what those tests ask of it: plain HTTP, raw sockets a
test can close mid-reply, and whether the engine is idle again (every block free)."""
from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request

from kvjax.testing.pages_demo import post_raw, read_events  # noqa: F401 (raw sockets a test can close mid-reply)


@contextlib.contextmanager
def served_app(app):
    """The base URL of `app` served by uvicorn on a free loopback port in a thread; shut down after."""
    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    end = time.time() + 60
    while not srv.started:
        assert time.time() < end and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def serving(api_key=None, enable_prompt_tokens_details=False, enable_request_id_headers=False,
            enable_per_request_metrics=False, **engine_args):
    """(the AsyncLLM, the base URL) of a server built from these AsyncEngineArgs (api_key: the keys its
    /v1 routes require, as `kvjax serve --api-key`; enable_*: as its flags); shut down after."""
    from kvjax import AsyncEngineArgs, AsyncLLM
    from kvjax.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    app = build_app(engine, api_key=api_key, enable_prompt_tokens_details=enable_prompt_tokens_details,
                    enable_request_id_headers=enable_request_id_headers,
                    enable_per_request_metrics=enable_per_request_metrics)
    try:
        with served_app(app) as url:
            yield engine, url
    finally:
        engine.shutdown()


class RemoteOpenAIServer:
    """vLLM's tests.utils.RemoteOpenAIServer for the ported vLLM tests: `kvjax serve MODEL *cli_args`, the
    arguments read by kvjax's own serve parser, run in-process by serving(); url_for and the clients."""

    def __init__(self, model: str, cli_args: list[str]):
        import argparse
        import dataclasses

        from kvjax import AsyncEngineArgs
        from kvjax.commands import serve

        parser = argparse.ArgumentParser()
        serve.add_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["serve", model, *cli_args])
        serve.resolve_model(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        self._serving = serving(api_key=args.api_key, enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                                enable_request_id_headers=args.enable_request_id_headers,
                                enable_per_request_metrics=args.enable_per_request_metrics,
                                **{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)
                                   if f.init})

    def __enter__(self):
        self.engine, self.url = self._serving.__enter__()
        return self

    def __exit__(self, *exc):
        return self._serving.__exit__(*exc)

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url, *(p.strip("/") for p in parts)])

    def get_client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url_for("v1"), api_key="unused", max_retries=0, **{"timeout": 600, **kwargs})

    def get_async_client(self, **kwargs):
        """An AsyncOpenAI client that keeps no connection open (`Connection: close`): vLLM's tests leave
        some unclosed, and one collected later in another test's event loop would fail that test."""
        import openai

        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key="unused", max_retries=0,
                                  **{"timeout": 600, "default_headers": {"Connection": "close"}, **kwargs})


def http(url: str, body: dict | None = None) -> tuple[int, dict[str, str], str]:
    """(status, headers, text) of a GET (body None) or a JSON POST, any status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def wait_idle(engine, timeout: float = 10.0) -> None:
    """Within timeout: no request left in the engine, every usable block free."""
    core, end = engine.llm_engine.engine, time.time() + timeout
    while True:
        idle = (not engine.llm_engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
                and core.scheduler.num_free_blocks() == core.usable_blocks)
        if idle:
            return
        assert time.time() < end, (f"a request is still running or holds blocks: "
                                   f"{core.scheduler.num_free_blocks()} of {core.usable_blocks} blocks free")
        time.sleep(0.02)


def metric(engine, name: str) -> float:
    """An unlabelled metric's value (readable from any thread while the engine steps in its own)."""
    return next(m.value for m in engine.get_metrics() if m.name == name)


def finished_count(engine, reason: str) -> int:
    """How many sequences the engine has finished for this reason (vllm:request_success{finished_reason})."""
    return sum(m.value for m in engine.get_metrics()
               if m.name == "vllm:request_success" and m.labels.get("finished_reason") == reason)
