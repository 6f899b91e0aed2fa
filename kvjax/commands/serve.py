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
    p.add_argument("--headless", action="store_true",
                   help="serve no API: a rank > 0 of a multi-process job (--nnodes, --node-rank) runs the engine rank "
                        "0 describes, in lockstep with it (vLLM's flag; docs/distributed.md)")
    p.add_argument("--data-parallel-routing", choices=("prefix", "load"), default="prefix",  # data_parallel.ROUTINGS
                   help="with --data-parallel-size > 1: send a request to the replica that may hold its first block "
                        "unless it is a full batch busier (prefix, default), or by load alone as vLLM does (load)")
    add_engine_flags(p, tuple(FLAGS), "engine arguments (vLLM's EngineArgs: kvjax.engine.cli_args)",
                     defaults={"model": None}, helps={"model": "the model, when MODEL is not given (small-gqa)"})


def resolve_model(args) -> None:
    """args.model from MODEL or --model (vLLM refuses two different ones; so does kvjax)."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise UsageError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ: give one")
    args.model = args.model_tag or args.model or "small-gqa"


# What a headless rank reads: the job's shape and the model it must share with rank 0 (kvjax.engine.lockstep).
HEADLESS_FLAGS = ("model", "tensor_parallel_size", "decode_context_parallel_size", "data_parallel_size", "nnodes",
                  "node_rank", "master_addr", "master_port", "distributed_timeout_seconds")
SERVER_DEFAULTS = {"host": "127.0.0.1", "port": 8000, "served_model_name": None, "chat_template": None,
                   "enable_prompt_tokens_details": False, "enable_request_id_headers": False,
                   "enable_per_request_metrics": False, "api_key": None, "data_parallel_routing": "prefix"}


def run(args) -> int:
    from kvjax.entrypoints.openai.api_server import run_server

    if args.headless or args.node_rank:
        return run_headless(args)
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


def run_headless(args) -> int:
    """`kvjax serve --headless --nnodes N --node-rank R`: this rank runs rank 0's engines until rank 0 ends the job
    (kvjax.engine.llm_engine.serve_rank0); MODEL, if given, must be rank 0's, and other flags are rank 0's to give."""
    from kvjax.engine.llm_engine import serve_rank0

    if not args.headless:
        raise UsageError(f"--node-rank {args.node_rank} serves no API (rank 0 does): start it with --headless")
    if args.nnodes == 1 or args.node_rank == 0:
        raise UsageError("--headless runs a rank > 0 of a multi-process job: give --nnodes N and --node-rank R, "
                         "0 < R < N (rank 0 serves the API, without --headless)")
    given = [FLAGS[name][0][0] for name in FLAGS if name not in HEADLESS_FLAGS and getattr(args, name) != _default(name)]
    given += ["--" + name.replace("_", "-") for name, default in SERVER_DEFAULTS.items() if getattr(args, name) != default]
    if given:
        raise UsageError(f"{', '.join(given)} on a headless rank: rank {args.node_rank} runs the engine rank 0 "
                         "describes; give engine and server flags to rank 0")
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise UsageError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ: give one")
    expect = args.model_tag or args.model
    try:
        AsyncEngineArgs.from_cli_args(args).parallel_config()  # joins the job's runtime
    except KvjaxError as e:
        raise UsageError(as_flags(str(e))) from None
    serve_rank0(expect_model=expect)
    return 0


def _default(field: str):
    """An engine flag's value when it is not given (kvjax.engine.cli_args.FLAGS)."""
    kwargs = FLAGS[field][1]
    return kwargs.get("default", False if kwargs.get("action") == "store_true" else None)
