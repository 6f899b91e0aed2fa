"""AsyncLLM (vLLM's `vllm/v1/engine/async_llm.py`): requests from several coroutines batched into the
same engine steps, each streamed as its output_kind says, a consumer that leaves aborting its
request, a bad request refused in its caller, a dead engine said to everyone.

References: LLM.generate on the same model and requests (the synchronous path of the same
engine, already checked against transformers in tests/engine/test_llm.py), and the block pool's
own count of free blocks."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvjax import AsyncEngineArgs, AsyncLLM, LLM, LLMError, RequestOutputKind, SamplingParams
from kvjax.engine.async_llm import EngineDeadError

COMMON = dict(model="small-gqa", block_size=16, num_gpu_blocks_override=48, max_num_seqs=4, use_tqdm_on_load=False)
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:"]


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**COMMON))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def greedy_texts():
    llm = LLM(**COMMON)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    return [o.outputs[0].text for o in outs], [o.outputs[0].token_ids for o in outs]


def _idle(engine, timeout=30.0):
    """Wait until the engine thread has nothing left to run."""
    end = time.time() + timeout
    while engine.llm_engine.has_unfinished_requests() or engine.get_num_unfinished_requests():
        assert time.time() < end, "the engine did not drain"
        time.sleep(0.01)


def test_coroutines_share_steps_and_stream_what_generate_returns(engine, greedy_texts, monkeypatch):
    steps = []
    original = engine.llm_engine.engine.step

    def recording_step():
        results = original()
        steps.append({r.request_id for r in results})
        return results

    monkeypatch.setattr(engine.llm_engine.engine, "step", recording_step)

    async def one(i, kind):
        params = SamplingParams(max_tokens=12, temperature=0, output_kind=kind)
        outs = [out async for out in engine.generate(PROMPTS[i], params, request_id=f"r{i}")]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        if kind == RequestOutputKind.DELTA:
            return "".join(o.outputs[0].text for o in outs), sum((o.outputs[0].token_ids for o in outs), [])
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        return outs[-1].outputs[0].text, outs[-1].outputs[0].token_ids

    async def main():
        return await asyncio.gather(one(0, RequestOutputKind.DELTA), one(1, RequestOutputKind.CUMULATIVE),
                                    one(2, RequestOutputKind.FINAL_ONLY))

    got = asyncio.run(main())
    texts, tokens = greedy_texts
    assert [g[0] for g in got] == texts and [g[1] for g in got] == tokens
    assert any(len(s) == 3 for s in steps), "the three coroutines' requests never ran in one step"
    _idle(engine)


def test_a_consumer_that_leaves_aborts_its_request_and_frees_its_blocks(engine):
    pool = engine.llm_engine.engine.scheduler
    usable = engine.vllm_config.num_blocks - 1

    async def leave_after(n):
        params = SamplingParams(max_tokens=200, temperature=0, output_kind=RequestOutputKind.DELTA, ignore_eos=True)
        seen = 0
        async for _ in engine.generate(PROMPTS[0] * 4, params, request_id="leaver"):
            seen += 1
            if seen == n:
                break  # the generator is closed: vLLM aborts the request
        return seen

    assert asyncio.run(leave_after(3)) == 3
    _idle(engine)
    assert pool.num_free_blocks() == usable, "the abandoned request kept blocks"

    async def cancelled():
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

        async def consume():
            async for _ in engine.generate(PROMPTS[1] * 4, params, request_id="cancelled"):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    _idle(engine)
    assert pool.num_free_blocks() == usable, "the cancelled request kept blocks"


def test_a_bad_request_is_refused_in_its_caller_and_ids_are_unique(engine):
    async def bad(prompt, **kw):
        async for _ in engine.generate(prompt, SamplingParams(**kw), request_id="bad"):
            pass

    with pytest.raises(LLMError, match="vocabulary"):
        asyncio.run(bad({"prompt_token_ids": [1, 999]}))
    with pytest.raises(LLMError, match="max_logprobs"):
        asyncio.run(bad("x", logprobs=1000))

    async def twice():
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        first = engine.generate("a", params, request_id="same")
        await first.__anext__()
        with pytest.raises(LLMError, match="'same' is already in use"):
            await engine.generate("b", params, request_id="same").__anext__()
        await first.aclose()

    asyncio.run(twice())
    _idle(engine)


def test_n_samples_come_back_together_when_final_only(engine):
    async def main():
        params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=11, output_kind=RequestOutputKind.FINAL_ONLY)
        return [out async for out in engine.generate("def f(x):", params, request_id="n3")]

    (out,) = asyncio.run(main())
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)


def test_a_dead_engine_says_so_to_every_stream():
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**COMMON))

    def broken():
        raise RuntimeError("the device fell over")

    engine.llm_engine.step = broken

    async def run():
        async for _ in engine.generate("x", SamplingParams(max_tokens=3), request_id="0"):
            pass

    with pytest.raises(EngineDeadError, match="the device fell over"):
        asyncio.run(run())
    assert engine.errored and not engine.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(run())
