"""`kvjax serve`: an OpenAI-compatible HTTP server over AsyncLLM (vLLM's `vllm serve`).

    kvjax serve small-gqa --port 8000 --num-gpu-blocks-override 64 --max-num-seqs 4
    kvjax serve --model PATH --chat-template template.jinja --served-model-name my-model
    KVJAX_API_KEY=secret kvjax serve small-gqa --host 0.0.0.0   # clients send Authorization: Bearer secret

MODEL (or --model) is what EngineArgs' `model` takes; the engine flags are the one table's
(kvjax.engine.cli_args), read back with AsyncEngineArgs.from_cli_args and resolved before the
server listens, so a bad flag exits with status 2 and one line. The endpoints and their
behaviour: kvjax.entrypoints.openai.api_server.
"""
from __future__ import annotations

from kvjax.engine.arg_utils import AsyncEngineArgs
from kvjax.engine.cli_args import FLAGS, add_engine_flags, as_flags
from kvjax.errors import KvjaxError, UsageError
from kvjax.utils.checks import int_arg


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (vLLM's `vllm serve`)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model to serve (as --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int_arg(0, 65535), default=8000, help="port to listen on (8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients ask for (default: MODEL)")
    p.add_argument("--chat-template", dest="chat_template", metavar="TEMPLATE",
                   help="the chat template (a file or its text) instead of the checkpoint's")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in replies (vLLM's flag)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="an X-Request-Id header on every response (the request's own, else a random one; vLLM's flag)")
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="each reply's timings (time to first token, queue, generation, tokens/s) in its `metrics` "
                        "field (vLLM's flag)")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` (one of these keys) on every /v1 route, as vLLM's "
                        "--api-key (default: $KVJAX_API_KEY, else $VLLM_API_KEY; none: open)")
    add_engine_flags(p, tuple(FLAGS), "engine arguments (vLLM's EngineArgs: kvjax.engine.cli_args)",
                     defaults={"model": None}, helps={"model": "the model, when MODEL is not given (small-gqa)"})


def resolve_model(args) -> None:
    """args.model from MODEL or --model (vLLM refuses two different ones; so does kvjax)."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise UsageError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ: give one")
    args.model = args.model_tag or args.model or "small-gqa"


def run(args) -> int:
    from kvjax.entrypoints.openai.api_server import run_server

    resolve_model(args)
    if args.enable_per_request_metrics and args.disable_log_stats:  # vLLM's validate_parsed_serve_args
        raise UsageError("--enable-per-request-metrics requires engine statistics logging; remove "
                         "--disable-log-stats to enable per-request metrics.")
    try:  # every engine rule before the server starts: a bad flag is one line, not a dead server
        AsyncEngineArgs.from_cli_args(args).create_engine_config()
    except KvjaxError as e:
        raise UsageError(as_flags(str(e))) from None
    run_server(args)
    return 0
