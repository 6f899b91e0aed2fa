"""Data parallelism behind one server (kvjax.engine.data_parallel): `kvjax serve --data-parallel-size 2` as an
app in this process (two replicas on two of the 8 CPU devices tests/conftest.py asks for).

- Each request's greedy tokens over HTTP are those one engine gives the same request (`kvjax.LLM`, DP 1), and
  a seeded sampled request's too, whichever replica ran it.
- Routing by prefix sends a prompt that shares its first block with an earlier one to that one's replica, where
  load alone (vLLM's rotating start over idle replicas) sends it to the other; the rest go by load.
- /metrics lists each replica's series (engine="0", "1") and their sum (engine="all"): the prompt tokens
  counted are the prompts' lengths, added by hand.
"""
from __future__ import annotations

import contextlib
import json
import urllib.request

from kvjax import LLM, AsyncEngineArgs, SamplingParams

ARGS = dict(model="preset:tiny", block_size=4, num_gpu_blocks_override=48, use_tqdm_on_load=False)
SHARED = [1, 2, 3, 4]  # one block
PROMPTS = [SHARED + [10, 11], SHARED + [20, 21, 22], [40, 41, 42, 43, 44], [60, 61, 62, 63, 64, 65, 66]]
SEEDED = 3  # this one is sampled at temperature 1 with a seed


@contextlib.contextmanager
def _serving(engine):
    from serving import served_app

    from kvjax.entrypoints.openai.api_server import build_app

    try:
        with served_app(build_app(engine, api_key=[])) as url:
            yield url
    finally:
        engine.shutdown()


def _post(url, body) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _body(i: int) -> dict:
    sampled = dict(temperature=1.0, seed=7) if i == SEEDED else dict(temperature=0)
    return {"model": "preset:tiny", "prompt": PROMPTS[i], "max_tokens": 6, "return_token_ids": True, **sampled}


def test_two_replicas_serve_one_engines_tokens_routed_by_prefix():
    from kvjax.engine.data_parallel import DPAsyncLLM

    llm = LLM(**ARGS)
    params = [SamplingParams(**{k: v for k, v in _body(i).items() if k in ("max_tokens", "temperature", "seed")})
              for i in range(len(PROMPTS))]
    want = [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    del llm

    dp = DPAsyncLLM(AsyncEngineArgs(data_parallel_size=2, **ARGS), routing="prefix")
    with _serving(dp) as url:
        got = []
        for i in range(len(PROMPTS)):  # one at a time: each routed with the replicas idle
            choice = _post(url + "/v1/completions", _body(i))["choices"][0]
            got.append(choice["token_ids"])
        assert got == want
        # prompts 0 and 1 share their first block: replica 0 took 0, and 1 followed it there where load alone
        # sends it to the other idle replica (vLLM's rotating start); 2 and 3 went by load, to 0 and then 1
        assert dp.routed == [3, 1]
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            metrics = r.read().decode()
        counted = {line.split('engine="')[1].split('"')[0]: float(line.split()[-1])
                   for line in metrics.splitlines() if line.startswith("vllm:prompt_tokens_total{")}
        assert counted == {"0": 6 + 7 + 5, "1": 7, "all": 6 + 7 + 5 + 7}

        dp.routing = "load"  # vLLM's default: the same prompts, idle replicas, taken in turn
        order = []
        for p in PROMPTS:
            order.append(dp.route(p))
            dp._done(order[-1])
        assert order in ([0, 1, 0, 1], [1, 0, 1, 0])
