"""An OpenAI-compatible HTTP server over AsyncLLM (vLLM's `vllm serve`, `entrypoints/openai/api_server.py`).

    kvjax serve small-gqa --port 8000 --chat-template template.jinja --api-key KEY
    curl localhost:8000/v1/completions -H "Authorization: Bearer KEY" \\
        -d '{"model": "small-gqa", "prompt": "def f(x):", "max_tokens": 8}'

Endpoints: GET / (the KV cache calculator) and GET /pool (the live block pool), with their JSON
(kvjax.entrypoints.page_routes), GET /health, GET /v1/models, GET /v1/models/{id}, GET /metrics (vLLM's metric names,
Prometheus text), POST /v1/completions, POST /v1/chat/completions and POST /v1/chat/completions/batch
(vLLM's: a list of conversations, one choice each), and SageMaker's GET/POST /ping and POST
/invocations (a chat or completions body, routed by its shape, as vLLM). Each HTTP request is one or
more engine requests (one per prompt, "<id>-<i>"), run concurrently and batched by the engine with
every other client's; a prompt's n samples are choices prompt * n + sample, as vLLM numbers them.
With "stream": true the reply is server-sent events, one choice's news per `data: {...}` chunk
(RequestOutputKind.DELTA), then `data: [DONE]`; stream_options adds usage to it. A client that
disconnects aborts its engine requests, their blocks free before the engine's next step: mid-stream,
the stream's generators close; before a reply that does not stream, `with_cancellation` (vLLM's)
cancels the handler. use_beam_search runs vLLM's online beam search (entrypoints/openai/beam_search).

A prompt is read as vLLM's renderer reads it: tokenized with add_special_tokens, cut to
truncate_prompt_tokens (-1: max_model_len - 1) — "left" keeps its last tokens, "right" (the
default, the tokenizers' truncation side) its first —, then held to the context length in
vLLM's words: a prompt longer than max_model_len is refused ("This model's maximum context length
is ... tokens. However, your prompt contains ... input tokens, ..."), one exactly as long too
(no room for a token), max_tokens above max_model_len too; a prompt that fits gets
min(max_tokens, max_model_len - prompt) new tokens (vLLM 0.33's get_max_tokens clamps, it does not
refuse).

--api-key KEY (or KVJAX_API_KEY, else vLLM's VLLM_API_KEY): every /v1 route answers 401 unless the
request carries `Authorization: Bearer KEY` (compared in constant time, as vLLM's
AuthenticationMiddleware: SHA-256 digests through secrets.compare_digest); /health and /metrics
stay open, as in vLLM.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a request the
engine refuses (a KvjaxError or ValueError: SamplingParams' and the engine's checks, vLLM's request
rules in protocol.py with the field as `param`, a malformed body), 401 without the key, 404 for a
model this server does not serve or a route it does not have, 500 for anything else. An error after
a stream started is sent as one `data: {"error": ...}` chunk before [DONE], as vLLM does.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
import uuid
from typing import AsyncIterator

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvjax.engine.async_llm import AsyncLLM
from kvjax.engine.metrics import CONTENT_TYPE
from kvjax.entrypoints.openai.api_utils import final_outputs, timing_metrics, usage, with_cancellation
from kvjax.entrypoints.openai.beam_search import beam_search
from kvjax.entrypoints.openai.protocol import (BatchChatCompletionRequest, ChatCompletionRequest, CompletionRequest,
                                              InvalidRequest)
from kvjax.entrypoints.openai.serving_chat import chat_chunks, chat_response, render_prompt
from kvjax.entrypoints.openai.serving_completion import completion_chunks, completion_response
from kvjax.entrypoints.page_routes import add_page_routes
from kvjax.errors import KvjaxError
from kvjax.utils.strict_json import dumps

API_KEY_ENVS = ("KVJAX_API_KEY", "VLLM_API_KEY")  # kvjax's name first, then the one vLLM reads
GUARDED_PREFIX = "/v1"  # vLLM guards /v1, /v2, /inference, /cohere: kvjax serves only /v1


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 500: "InternalServerError"}


def _error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def _error_of(e: BaseException) -> tuple[int, str, str | None]:
    if isinstance(e, _HTTPError):
        return e.status, str(e), e.param
    if isinstance(e, ValueError):  # KvjaxError is one: SamplingParams', the engine's and protocol.py's checks
        return 400, str(e), getattr(e, "param", None)
    return 500, f"{type(e).__name__}: {e}", None


def api_keys(given=None) -> list[str]:
    """The keys a server requires: --api-key's, else the environment's (KVJAX_API_KEY, VLLM_API_KEY); [] for none."""
    if given:
        return [given] if isinstance(given, str) else [k for k in given if k]
    return [v for v in (os.environ.get(name) for name in API_KEY_ENVS) if v][:1]


class AuthenticationMiddleware:
    """vLLM's: an ASGI middleware that answers 401 to a /v1 request without `Authorization: Bearer
    <one of the keys>`; the keys' SHA-256 digests are compared in constant time, every key tried."""

    def __init__(self, app, tokens: list[str]):
        self.app = app
        self.digests = [hashlib.sha256(t.encode("utf-8")).digest() for t in tokens]

    def verify(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        match = False
        for d in self.digests:
            match |= secrets.compare_digest(digest, d)
        return match

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith(GUARDED_PREFIX) and not self.verify(dict(scope.get("headers", []))):
            response = JSONResponse(_error_body(401, "Unauthorized"), status_code=401)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class XRequestIdMiddleware:
    """vLLM's (--enable-request-id-headers): every response carries an X-Request-Id header, the request's
    own when it sent one, else a random uuid4 in hex."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", [])).get(b"x-request-id")

        async def send_with_request_id(message):
            if message["type"] == "http.response.start":
                request_id = given if given is not None else uuid.uuid4().hex.encode()
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        return await self.app(scope, receive, send_with_request_id)


def build_app(engine: AsyncLLM, served_model_name: str | None = None, api_key=None, *,
              enable_prompt_tokens_details: bool = False, enable_request_id_headers: bool = False,
              enable_per_request_metrics: bool = False) -> FastAPI:
    """The FastAPI app serving `engine` under the model id served_model_name (default the engine's
    model); api_key: a key or list of keys every /v1 request must carry (default: api_keys(), from
    the environment; none: open); enable_prompt_tokens_details: a reply's usage says how many prompt
    tokens the prefix cache held (vLLM's --enable-prompt-tokens-details; replies that do not stream);
    enable_request_id_headers: every response carries X-Request-Id (vLLM's flag);
    enable_per_request_metrics: a reply for one prompt and one choice carries its timings in `metrics`
    (vLLM's --enable-per-request-metrics: in the reply, or in a stream's usage chunk)."""
    model_id = served_model_name or engine.vllm_config.model
    app = FastAPI(title="kvjax OpenAI-compatible server")
    keys = api_keys(api_key)
    if keys:
        app.add_middleware(AuthenticationMiddleware, tokens=keys)
    if enable_request_id_headers:  # added after authentication, so it wraps it: a 401 gets the header too (vLLM)
        app.add_middleware(XRequestIdMiddleware)
    config = engine.vllm_config

    # ValueError and _HTTPError are answered by Starlette's ExceptionMiddleware; Exception (a bug: 500)
    # by its ServerErrorMiddleware, which then re-raises it for the server's log.
    @app.exception_handler(_HTTPError)
    @app.exception_handler(ValueError)
    @app.exception_handler(Exception)
    async def any_error(_: Request, e: Exception):
        status, message, param = _error_of(e)
        return JSONResponse(_error_body(status, message, param), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):  # an unknown route: OpenAI's shape too
        return JSONResponse(_error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def malformed(_: Request, e: RequestValidationError):
        message, param = validation_message(e.errors())
        return JSONResponse(_error_body(400, message, param), status_code=400)

    @app.get("/health")
    async def health():
        await engine.check_health()
        return PlainTextResponse("")

    def card() -> dict:
        """vLLM's ModelCard of the served model."""
        return {"id": model_id, "object": "model", "created": _now(), "owned_by": "kvjax", "root": config.model,
                "parent": None, "max_model_len": config.max_model_len, "permission": []}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_name:path}")
    async def model(model_name: str):
        if model_name != model_id:
            raise _HTTPError(404, f"The model `{model_name}` does not exist.", "model")
        return card()

    @app.get("/metrics")
    async def metrics():
        text = engine.render_metrics()  # with data parallelism: every replica's series and their sum
        return PlainTextResponse(text, headers={"Content-Type": CONTENT_TYPE})

    def check_model(name: str | None) -> None:
        if name is not None and name != model_id:
            raise _HTTPError(404, f"The model `{name}` does not exist.", "model")

    def check_top_logprobs(top: int | None) -> None:
        """The engine's max_logprobs rule, said of the chat field that asks (SamplingParams.logprobs)."""
        limit, k = config.max_logprobs, top or 0
        k = config.model_config.vocab_size if k == -1 else k
        if limit != -1 and k > limit:
            raise _HTTPError(400, f"top_logprobs={top} asks for {k} tokens, more than this server's "
                                  f"max_logprobs={limit}", "top_logprobs")

    def tokenize(prompt, body) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt, truncated and held to the context length as vLLM's renderer does."""
        m, trunc = config.max_model_len, body.truncate_prompt_tokens
        requested = body._max_tokens()
        if requested is not None and requested > m:
            name = body.max_tokens_param() if isinstance(body, ChatCompletionRequest) else "max_tokens"
            raise InvalidRequest(f"{name}={requested} cannot be greater than max_model_len={m}. Please request "
                                 "fewer output tokens.", name)
        if trunc is not None and trunc > m:
            raise InvalidRequest(f"truncate_prompt_tokens={trunc} cannot be greater than max_model_len = {m}. Please "
                                 "request a smaller truncation size.", "truncate_prompt_tokens")
        if isinstance(prompt, str):
            text, ids = prompt, engine.get_tokenizer().encode(prompt, add_special_tokens=body.add_special_tokens)
        else:
            text, ids = None, [int(t) for t in prompt]
        keep = m - 1 if trunc == -1 else trunc
        if keep is not None and keep < len(ids):
            ids = ids[len(ids) - keep:] if body.truncation_side == "left" else ids[:keep]
            text = None if text is None else engine.get_tokenizer().decode(ids, skip_special_tokens=False)
        if len(ids) > m:
            raise InvalidRequest(f"This model's maximum context length is {m} tokens. However, your prompt contains "
                                 f"{len(ids)} input tokens, which exceeds this limit even without any output tokens. "
                                 "Please reduce the length of the input prompt.", "input_tokens")
        if len(ids) == m:
            raise InvalidRequest(f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens "
                                 f"(at least 1) is longer than the maximum model length of {m}. Make sure that "
                                 "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
                                 "output tokens).", "input_tokens")
        return text, ids

    async def run(body, prompts: list, default, base_id: str):
        """One engine request (or beam search) per prompt, each checked before any runs (a bad one: 400).
        → (generators of RequestOutputs, the SamplingParams, each prompt's (text, ids))."""
        llm_engine, m = engine.llm_engine, config.max_model_len
        inputs, plans = [], []
        for prompt in prompts:
            text, ids = tokenize(prompt, body)
            requested = body._max_tokens()
            if requested is None:  # vLLM's get_max_tokens: the generation config's, else up to the context's end
                requested = llm_engine.get_diff_sampling_param().get("max_tokens")
            echo_only = isinstance(body, CompletionRequest) and body.echo and body.max_tokens == 0
            new = 1 if echo_only else min(m - len(ids), requested if requested is not None else m)
            if body.use_beam_search:
                params = body.to_beam_search_params(new, default)
            else:
                params = body.to_sampling_params(new, default)
                llm_engine.check_request(ids, params)
            inputs.append((text, ids))
            plans.append(params)
        gens = []
        for i, ((text, ids), params) in enumerate(zip(inputs, plans)):
            rid = f"{base_id}-{i}"
            if body.use_beam_search:
                gens.append(_once(beam_search(engine, ids, text, params, rid, allowed_token_ids=body.allowed_token_ids,
                                              priority=body.priority, eos_token_ids=llm_engine.model.eos_token_ids)))
            else:
                gens.append(engine.generate({"prompt_token_ids": ids}, params, request_id=rid, priority=body.priority,
                                            prompt_text=text))
        return gens, plans[0], inputs

    def response_id(prefix: str, body, raw: Request) -> str:
        """vLLM's: the X-Request-Id header, else the body's request_id, else a random id, after the prefix."""
        return f"{prefix}-{raw.headers.get('X-Request-Id') or body.request_id or uuid.uuid4().hex}"

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(body: CompletionRequest, raw_request: Request):
        check_model(body.model)
        body.check()
        default = await engine.get_default_sampling_params()
        rid, created = response_id("cmpl", body, raw_request), _now()
        gens, params, inputs = await run(body, body.prompts(), default, rid)
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_id}
        n = body.n or 1
        if body.stream:
            return _sse(completion_chunks(head, body, gens, n, engine.get_tokenizer(), enable_per_request_metrics))
        outs = await final_outputs(gens)
        return details(completion_response(head, body, outs, n, engine.get_tokenizer()), outs, n)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        check_model(body.model)
        body.check()
        check_top_logprobs(body.top_logprobs)
        prompt = render_prompt(engine, body)
        default = await engine.get_default_sampling_params()
        rid, created = response_id("chatcmpl", body, raw_request), _now()
        gens, params, inputs = await run(body, [prompt], default, rid)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model_id}
        tokenizer = engine.get_tokenizer()
        if body.stream:
            return _sse(chat_chunks({**head, "object": "chat.completion.chunk"}, body, gens[0], tokenizer, prompt,
                                    enable_per_request_metrics))
        (out,) = await final_outputs(gens)
        return details(chat_response(head, body, out, tokenizer, prompt), [out], body.n or 1)

    @app.post("/v1/chat/completions/batch")
    @with_cancellation
    async def batch_chat_completions(body: BatchChatCompletionRequest, raw_request: Request):
        """vLLM's batch chat completions: every conversation rendered and run at once with the request's
        other fields, one choice per conversation (index i), the usage summed over them."""
        check_model(body.model)
        body.check()
        check_top_logprobs(body.top_logprobs)
        singles = body.conversations()
        prompts = [render_prompt(engine, single) for single in singles]
        default = await engine.get_default_sampling_params()
        rid, created = response_id("chatcmpl", body, raw_request), _now()
        gens, _, _ = await run(singles[0], prompts, default, rid)  # the same sampling fields for each
        outs = await final_outputs(gens)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model_id}
        tokenizer = engine.get_tokenizer()
        choices = []
        for i, (single, out, prompt) in enumerate(zip(singles, outs, prompts)):
            (choice,) = chat_response(head, single, out, tokenizer, prompt)["choices"]
            choices.append({**choice, "index": i, "finish_reason": choice["finish_reason"] or "stop"})
        return {**head, "choices": choices, "usage": usage(outs), "prompt_logprobs": None, "prompt_token_ids": None,
                "prompt_text": None}

    @app.get("/ping")
    @app.post("/ping")
    async def ping():
        """SageMaker's health check (vLLM's /ping): /health's answer."""
        return await health()

    @app.post("/invocations")
    async def invocations(raw_request: Request):
        """SageMaker's inference route (vLLM's): the body goes to the first endpoint whose request it is,
        chat completions before completions; one that is neither is a 400 naming both."""
        try:
            body = await raw_request.json()
        except json.JSONDecodeError as e:
            raise _HTTPError(400, f"JSON decode error: {e}") from None
        for request_type, endpoint in ((ChatCompletionRequest, chat_completions), (CompletionRequest, completions)):
            try:
                request = request_type.model_validate(body)
            except pydantic.ValidationError:
                continue
            return await endpoint(body=request, raw_request=raw_request)
        raise _HTTPError(400, "Cannot find suitable handler for request. Expected one of: "
                              "['ChatCompletionRequest', 'CompletionRequest']")

    def details(reply: dict, outs, n: int) -> dict:
        """vLLM's prompt_tokens_details (the last prompt's tokens found in the prefix cache) and, for one
        prompt's one choice, its per-request metrics (vLLM leaves them out for more: not one stream's)."""
        if enable_prompt_tokens_details and outs and outs[-1].num_cached_tokens is not None:
            reply["usage"]["prompt_tokens_details"] = {"cached_tokens": outs[-1].num_cached_tokens}
        if enable_per_request_metrics and len(outs) == 1 and n == 1:
            reply["metrics"] = timing_metrics(outs[0].metrics, reply["usage"]["completion_tokens"])
        return reply

    add_page_routes(app, engine)  # the calculator at /, the live block pool at /pool (kvjax.entrypoints.page_routes)
    return app


# ----------------------------------------------------------------------------------- helpers
# pydantic-core's wrapper and union-branch markers in an error's loc (vLLM's _INTERNAL_LOC_MARKERS)
_LOC_MARKERS = frozenset(("function-wrap function-after function-before function-plain json-or-python lax-or-strict "
                          "chain default nullable tagged-union union call arguments is-instance is-subclass callable "
                          "str int float bool bytes bytearray list tuple dict set frozenset complex none "
                          "nonetype").split())
_MAX_REPORTED_ERRORS, _MAX_ERROR_INPUT_CHARS, _MAX_ERROR_CHARS = 10, 200, 1000  # vLLM's bounds


def _clean_loc(loc) -> str:
    """vLLM's clean_loc_for_param: the loc dotted ("body.seed"), pydantic's internal segments dropped."""
    parts = [str(p) for p in loc if not (re.search(r"[\[\]{}()]", str(p)) or str(p).lower() in _LOC_MARKERS)]
    return ".".join(parts or [str(p) for p in loc])


def _summary(value):
    """vLLM's _summarize_error_input: a long string cut, a container described, not echoed."""
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """vLLM's validation_exception_handler: ("N validation error(s):" then each error's dict, its input
    summarized and its loc dotted, the first 10; the first error's loc as param)."""
    if not errors:
        return "Validation error", None
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:"]
    for err in errors[:_MAX_REPORTED_ERRORS]:
        err = dict(err)
        if "input" in err:
            err["input"] = _summary(err["input"])
        if isinstance(err.get("loc"), (tuple, list)):
            err["loc"] = _clean_loc(err["loc"])
        text = str(err)
        lines.append("  " + (text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text))
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}")
    loc = errors[0].get("loc")
    return "\n".join(lines), _clean_loc(loc) if loc else None


async def _once(coro):
    """An async generator of one item: a beam search's one RequestOutput."""
    yield await coro


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
    from kvjax.engine.data_parallel import serving_engine

    engine = serving_engine(AsyncEngineArgs.from_cli_args(args), getattr(args, "data_parallel_routing", "prefix"))
    try:
        app = build_app(engine, args.served_model_name or args.model, getattr(args, "api_key", None),
                        enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
                        enable_request_id_headers=getattr(args, "enable_request_id_headers", False),
                        enable_per_request_metrics=getattr(args, "enable_per_request_metrics", False))
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.shutdown()


__all__ = ["build_app", "run_server", "api_keys", "AuthenticationMiddleware", "XRequestIdMiddleware", "KvjaxError"]
