"""An OpenAI-compatible HTTP server over AsyncLLM (vLLM's `vllm serve`, `entrypoints/openai/api_server.py`).

    kvjax serve small-gqa --port 8000 --chat-template template.jinja
    curl localhost:8000/v1/completions -d '{"model": "small-gqa", "prompt": "def f(x):", "max_tokens": 8}'

Endpoints: GET /health, GET /v1/models, GET /metrics (vLLM's metric names, Prometheus text),
POST /v1/completions and POST /v1/chat/completions. Each HTTP request is one or more engine requests
(one per prompt, "cmpl-<hex>-<i>"), run concurrently and batched by the engine with every other
client's; a prompt's n samples are choices prompt * n + sample, as vLLM numbers them. With "stream":
true the reply is server-sent events, one choice's news per `data: {...}` chunk (RequestOutputKind.DELTA),
then `data: [DONE]`. A client that disconnects mid-stream stops its generators, and AsyncLLM aborts
their requests (their blocks are free before the engine's next step).

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a request the
engine refuses (a KvjaxError or ValueError: SamplingParams' and the engine's checks, a malformed
body), 404 for a model this server does not serve, 500 for anything else. An error after a stream
started is sent as one `data: {"error": ...}` chunk before [DONE], as vLLM does.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvjax.engine.async_llm import AsyncLLM
from kvjax.engine.metrics import CONTENT_TYPE
from kvjax.engine.outputs import RequestOutput
from kvjax.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
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
    if isinstance(e, ValueError):  # KvjaxError is one: SamplingParams' and the engine's checks
        return 400, str(e), None
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
    async def completions(body: CompletionRequest):
        check_model(body.model)
        if body.echo:
            raise _HTTPError(400, "echo=true is not supported by kvjax", "echo")
        params = body.to_sampling_params(await engine.get_default_sampling_params())
        rid, created = f"cmpl-{uuid.uuid4().hex}", _now()
        gens = await open_requests(rid, body.prompts(), params)
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_id}
        if body.stream:
            return _sse(_completion_chunks(head, gens, params.n))
        outs = await _final_outputs(gens)
        choices = [_completion_choice(i * params.n + c.index, c.text, c, _Offsets())
                   for i, out in enumerate(outs) for c in out.outputs]
        return {**head, "choices": choices, "usage": _usage(outs)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body.model)
        prompt = _render_chat(engine, body.messages)
        params = body.to_sampling_params(await engine.get_default_sampling_params())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", _now()
        gens = await open_requests(rid, [prompt], params)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model_id}
        if body.stream:
            return _sse(_chat_chunks({**head, "object": "chat.completion.chunk"}, gens[0], params.n))
        (out,) = await _final_outputs(gens)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return {**head, "choices": choices, "usage": _usage([out])}

    return app


# ----------------------------------------------------------------------------------- helpers
def _now() -> int:
    return int(time.time())


def _render_chat(engine: AsyncLLM, messages: list[dict]) -> str:
    """The conversation as LLM.chat renders it (LLMEngine.render_chat: the engine's chat template)."""
    if not engine.llm_engine.chat_template:
        raise _HTTPError(400, f"model {engine.vllm_config.model!r} has no chat template: serve it with "
                              "--chat-template", "messages")
    return engine.llm_engine.render_chat(messages, add_generation_prompt=True)


async def _final_outputs(gens) -> list[RequestOutput]:
    """Each generator's one (FINAL_ONLY) output, the prompts run concurrently."""
    async def last(gen):
        out = None
        async for out in gen:
            pass
        return out

    return list(await asyncio.gather(*(last(g) for g in gens)))


async def _merge(gens) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every generator as they come; leaving early cancels them all,
    which aborts their requests."""
    if len(gens) == 1:  # the usual case: no tasks needed
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, which raises it)
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class _Offsets:
    """A choice's running text offset for its logprobs' text_offset (kept across stream chunks)."""

    def __init__(self):
        self.at = 0


def _completion_choice(index: int, text: str, c, offsets: _Offsets) -> dict:
    logprobs = None
    if c.logprobs is not None:
        lp = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token, step in zip(c.token_ids, c.logprobs):
            chosen = step[token]
            piece = chosen.decoded_token or ""
            lp["tokens"].append(piece)
            lp["token_logprobs"].append(max(chosen.logprob, -9999.0))  # JSON has no -inf (vLLM clamps the same)
            lp["top_logprobs"].append({(x.decoded_token or ""): max(x.logprob, -9999.0) for x in step.values()})
            lp["text_offset"].append(offsets.at)
            offsets.at += len(piece)
        logprobs = lp
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def _usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _completion_chunks(head: dict, gens, n: int) -> AsyncIterator[dict]:
    offsets: dict[int, _Offsets] = {}
    async for i, out in _merge(gens):
        for c in out.outputs:
            index = i * n + c.index
            choice = _completion_choice(index, c.text, c, offsets.setdefault(index, _Offsets()))
            yield {**head, "choices": [choice]}


async def _chat_chunks(head: dict, gen, n: int) -> AsyncIterator[dict]:
    for index in range(n):  # vLLM's first chunk of each choice: its role
        yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]}
    async for _, out in _merge([gen]):
        for c in out.outputs:
            yield {**head, "choices": [{"index": c.index, "delta": {"content": c.text}, "logprobs": None,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}


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
