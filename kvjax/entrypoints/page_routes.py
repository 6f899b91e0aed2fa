"""The browser pages' routes on `kvjax serve` (kvjax.entrypoints.pages builds the pages themselves).

    GET  /          the KV cache calculator; every change asks POST /api/plan
    POST /api/plan  {"argv": [kvjax plan's flags], "hf_config": {a pasted config.json} (optional)}:
                    {"plan": what `kvjax plan ARGV --json` prints, "human": its byte counts in
                    1024-based units, "sweeps": concurrency at the calculator's plotted points}
    GET  /pool      the live block pool; it polls GET /api/pool (/pool?replica=N: data parallel replica N's)
    GET  /api/pool  the engine's block pool, read by the engine thread between two steps
                    (AsyncLLM.call_between_steps, kvjax.engine.pool_snapshot); ?replica=N (default 0)
                    picks one replica's under --data-parallel-size

/api/plan runs `kvjax plan`'s own code (kvjax.commands.plan.plan_json) on flags read by `kvjax
plan`'s own parser, so the page and the command cannot disagree; it takes only the flags of the
model and the memory (no file is read or written on the server: a config.json comes pasted, as
JSON). Bad flags answer 400 with plan's one line, in the server's error shape. Like /metrics, these
routes are outside /v1 and stay open when --api-key guards /v1.
"""
from __future__ import annotations

import argparse
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from kvjax.accounting import formulas
from kvjax.commands.main import build_parser
from kvjax.commands.plan import plan_json
from kvjax.engine.pool_snapshot import pool_snapshot
from kvjax.entrypoints.pages import calculator_page, pool_page
from kvjax.errors import KvjaxError, UsageError

# The flags /api/plan takes: the model and the memory; never one that names a file.
PLAN_FLAGS = frozenset((
    "--group", "--preset", "--kind", "--layers", "--heads", "--kv-heads", "--head-dim", "--kv-lora-rank",
    "--qk-rope-head-dim", "--kv-cache-dtype", "--max-model-len", "--block-size", "--device-memory-gib",
    "--gpu-memory-utilization", "--extensible", "--weights-gib", "--params-b", "--weight-dtype", "--activations-gib",
    "--cudagraph-gib", "--kv-cache-memory-bytes", "--tensor-parallel-size", "-tp", "--kv-offloading-size", "--pooled",
    "--max-num-batched-tokens", "--async-scheduling", "--no-async-scheduling"))
BYTE_FIELDS = ("bytes_per_token", "bytes_per_block", "kv_bytes_per_request", "total_bytes", "requested_bytes",
               "weights_bytes", "activations_bytes", "cudagraph_bytes", "budget_bytes", "host_offload_bytes",
               "host_bytes", "prefill_attention.tiled_bytes", "prefill_attention.reference_scores_bytes")
MAX_ARGS = 64


def _parse(argv: Any, hf_config: Any) -> argparse.Namespace:
    if not isinstance(argv, list) or len(argv) > MAX_ARGS or not all(isinstance(a, str) and len(a) <= 200
                                                                      for a in argv):
        raise UsageError(f"argv must be a list of at most {MAX_ARGS} strings")
    for a in argv:
        if a.startswith("-") and a.split("=", 1)[0] not in PLAN_FLAGS:
            raise UsageError(f"{a.split('=', 1)[0]}: not a flag of the calculator's model and memory")
    args = build_parser("plan").parse_args(["plan", *argv])
    if hf_config is not None:
        if not isinstance(hf_config, dict):
            raise UsageError("hf_config must be a config.json object")
        args.hf_config = hf_config  # kvjax.config.hf.from_hf_config reads the dict as it reads the file
    return args


def _field(plan: dict, key: str):
    for part in key.split("."):
        plan = plan.get(part) if isinstance(plan, dict) else None
    return plan


def plan_answer(body: Any) -> dict[str, Any]:
    """What POST /api/plan answers (the module docstring); UsageError (400) for bad input."""
    if not isinstance(body, dict) or set(body) - {"argv", "hf_config"}:
        raise UsageError('the body must be {"argv": [...], "hf_config": {...}}')
    args = _parse(body.get("argv"), body.get("hf_config"))
    plan = plan_json(args)
    human = {k: formulas.human_bytes(v) for k in BYTE_FIELDS if (v := _field(plan, k)) is not None}

    def point(**change) -> list:
        try:
            p = plan_json(argparse.Namespace(**{**vars(args), **change}))
        except KvjaxError:  # a point the flags refuse (the utilization beside --kv-cache-memory-bytes)
            return [None, None]
        return [p["concurrency"], p["concurrency_blocks"]]

    return {"plan": plan, "human": human,
            "sweeps": {"context": [[t, *point(max_model_len=t)] for t in formulas.CONTEXT_POINTS],
                       "util": [[n / d, *point(gpu_memory_utilization=str(n / d), extensible=False)]
                                for n, d in formulas.UTIL_POINTS]}}


def add_page_routes(app: FastAPI, engine) -> None:
    """Register the pages' routes on the server's app; engine: its AsyncLLM."""

    @app.get("/", response_class=HTMLResponse)
    async def calculator():
        return HTMLResponse(calculator_page(static=False))

    @app.post("/api/plan")
    def api_plan(body: dict):  # a plain def: FastAPI runs it in its thread pool
        return plan_answer(body)

    @app.get("/pool", response_class=HTMLResponse)
    async def pool():
        return HTMLResponse(pool_page({"mode": "live"}))

    @app.get("/api/pool")
    async def api_pool(replica: int = 0):
        replicas = getattr(engine, "replicas", None) or [engine]  # --data-parallel-size N: a pool per replica
        if not 0 <= replica < len(replicas):
            raise UsageError(f"replica {replica}: this server has {len(replicas)}, numbered from 0")
        one = replicas[replica]
        # taken by the engine thread between two steps: a waiting lock could starve
        snapshot = await one.call_between_steps(lambda: pool_snapshot(one.llm_engine.engine))
        return dict(snapshot, replica=replica, num_replicas=len(replicas))
