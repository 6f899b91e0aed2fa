"""A `kvjax serve` app on a free loopback port in a thread, for the tests that talk HTTP to it
(tests/entrypoints/, tests/benchmarks/)."""
from __future__ import annotations

import contextlib
import threading
import time


@contextlib.contextmanager
def serving(**engine_args):
    """(the AsyncLLM, the base URL) of a server built from these AsyncEngineArgs; shut down after."""
    import uvicorn

    from kvjax import AsyncEngineArgs, AsyncLLM
    from kvjax.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    srv = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    end = time.time() + 60
    while not srv.started:
        assert time.time() < end and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield engine, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(30)
        engine.shutdown()
