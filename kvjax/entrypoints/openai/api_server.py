"""An OpenAI-compatible HTTP server over AsyncLLM (vLLM's `vllm serve`, `entrypoints/openai/api_server.py`).

    kvjax serve small-gqa --port 8000 --chat-template template.jinja
    curl localhost:8000/v1/completions -d '{"model": "small-gqa", "prompt": "def f(x):", "max_tokens": 8}'

Endpoints: GET /health, GET /v1/models, GET /metrics (vLLM's metric names, Prometheus text),
POST /v1/completions and POST /v1/chat/completions. Each HTTP request is one or more engine requests
(one per prompt, "cmpl-<hex>-<i>"), run concurrently and batched by the engine with every other
client's; a prompt's n samples are choices prompt * n + sample, as vLLM numbers them. With "stream":
true the reply is server-sent events, one choice's news per `data: {...}` chunk (RequestOutputKind.DELTA),
then `data: [DONE]`; stream_options adds usage to it (serving_completion, serving_chat). A client that
disconnects aborts its engine requests, their blocks free before the engine's next step: mid-stream,
the stream's generators close; before a reply that does not stream, `with_cancellation` (vLLM's)
cancels the handler.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a request the
engine refuses (a KvjaxError or ValueError: SamplingParams' and the engine's checks, vLLM's request
rules in protocol.py with the field as `param`, a malformed body), 404 for a model this server does
not serve, 500 for anything else. An error after a stream started is sent as one
`data: {"error": ...}` chunk before [DONE], as vLLM does.
"""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvjax.engine.async_llm import AsyncLLM
from kvjax.engine.metrics import CONTENT_TYPE
from kvjax.engine.outputs import RequestOutput
from kvjax.entrypoints.openai.api_utils import final_outputs, with_cancellation
from kvjax.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvjax.entrypoints.openai.serving_chat import chat_chunks, chat_response, render_prompt
from kvjax.entrypoints.openai.serving_completion import completion_chunks, completion_response
from kvjax.errors import dumps


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def _error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES[status], "param": param, "code": status}}


def _error_of(e: BaseException) -> tuple[int, str, str | None]:
    if isinstance(e, _HTTPError):
        return e.status, str(e), e.param
    if isinstance(e, ValueError):  # KvjaxError is one: SamplingParams', the engine's and protocol.py's checks
        return 400, str(e), getattr(e, "param", None)
    return 500, f"{type(e).__name__}: {e}", None


def build_app(engine: AsyncLLM, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under the model id served_model_name (default the engine's model)."""
    model_id = served_model_name or engine.vllm_config.model
    app = FastAPI(title="kvjax OpenAI-compatible server")

    # ValueError and _HTTPError are answered by Starlette's ExceptionMiddleware; Exception (a bug: 500)
    # by its ServerErrorMiddleware, which then re-raises it for the server's log.
    @app.exception_handler(_HTTPError)
    @app.exception_handler(ValueError)
    @app.exception_handler(Exception)
    async def any_error(_: Request, e: Exception):
        status, message, param = _error_of(e)
        return JSONResponse(_error_body(status, message, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def malformed(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return JSONResponse(_error_body(400, f"{param}: {first.get('msg', 'invalid request')}", param), status_code=400)

    @app.get("/health")
    async def health():
        await engine.check_health()
        return PlainTextResponse("")

    @app.get("/v1/models")
    async def models():
        card = {"id": model_id, "object": "model", "created": _now(), "owned_by": "kvjax", "root": model_id,
                "max_model_len": engine.vllm_config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        text = engine.llm_engine.engine.metrics.render_prometheus()
        return PlainTextResponse(text, headers={"Content-Type": CONTENT_TYPE})

    def check_model(name: str | None) -> None:
        if name is not None and name != model_id:
            raise _HTTPError(404, f"The model `{name}` does not exist.", "model")

    def check_top_logprobs(top: int | None) -> None:
        """The engine's max_logprobs rule, said of the chat field that asks (SamplingParams.logprobs)."""
        limit, k = engine.vllm_config.max_logprobs, top or 0
        k = engine.vllm_config.model_config.vocab_size if k == -1 else k
        if limit != -1 and k > limit:
            raise _HTTPError(400, f"top_logprobs={top} asks for {k} tokens, more than this server's "
                                  f"max_logprobs={limit}", "top_logprobs")

    async def open_requests(base_id: str, prompts: list, params) -> list[AsyncIterator[RequestOutput]]:
        """One generator per prompt, each request checked first (a bad one: 400 before anything runs)."""
        llm_engine = engine.llm_engine
        checked = []
        for prompt in prompts:
            text, ids = llm_engine.process_prompt(prompt)
            llm_engine.check_request(ids, params)
            checked.append({"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text})
        return [engine.generate(p, params, request_id=f"{base_id}-{i}") for i, p in enumerate(checked)]

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(body: CompletionRequest, raw_request: Request):
        check_model(body.model)
        body.check()
        if body.echo:
            raise _HTTPError(400, "echo=true is not supported by kvjax", "echo")
        params = body.to_sampling_params(await engine.get_default_sampling_params())
        rid, created = f"cmpl-{uuid.uuid4().hex}", _now()
        gens = await open_requests(rid, body.prompts(), params)
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_id}
        if body.stream:
            return _sse(completion_chunks(head, gens, params.n, *body.usage_flags()))
        return completion_response(head, await final_outputs(gens), params.n)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        check_model(body.model)
        body.check()
        check_top_logprobs(body.top_logprobs)
        prompt = render_prompt(engine, body)
        params = body.to_sampling_params(await engine.get_default_sampling_params())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", _now()
        gens = await open_requests(rid, [prompt], params)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model_id}
        tokenizer = engine.get_tokenizer()
        if body.stream:
            return _sse(chat_chunks({**head, "object": "chat.completion.chunk"}, body, gens[0], tokenizer))
        (out,) = await final_outputs(gens)
        return chat_response(head, body, out, tokenizer)

    return app


# ----------------------------------------------------------------------------------- helpers
def _now() -> int:
    return int(time.time())


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {dumps(chunk)}\n\n"
        except Exception as e:  # noqa: BLE001 (the status is sent already: the error goes in the stream)
            status, message, param = _error_of(e)
            yield f"data: {dumps(_error_body(status, message, param))}\n\n"
        finally:
            await chunks.aclose()  # a client that left: its generators close, AsyncLLM aborts their requests
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def run_server(args) -> None:
    """`kvjax serve`: build the engine from the parsed flags and serve it until interrupted."""
    import uvicorn

    from kvjax.engine.arg_utils import AsyncEngineArgs

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args))
    try:
        app = build_app(engine, args.served_model_name or args.model)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.shutdown()
