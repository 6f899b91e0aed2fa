"""An LLM survives Ctrl-C and threads (kvjax.utils.atomic): SIGINT at seeded random moments of a
generate call leaves it exactly usable, and threads calling generate / chat at once all get their
right outputs.

The reference for every output is a fresh LLM's run of the same requests, one call at a time
(greedy and seeded requests: their tokens depend on neither the schedule nor earlier calls). After
every interrupted or concurrent call the engine holds no request and every block is free again
(cached blocks count as free, as in vLLM's pool)."""
from __future__ import annotations

import random
import signal
import threading
import time

import numpy as np
import pytest

from kvjax import LLM, SamplingParams

ARGS = dict(num_gpu_blocks_override=96, max_num_seqs=4, use_tqdm_on_load=False)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def _requests(seed: int, n: int = 6):
    """n prompts of 8-40 byte tokens with greedy and seeded sampling parameters, 4-8 tokens each
    (more requests than max_num_seqs: some wait while others run)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 256, int(rng.integers(8, 40))).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 9)), temperature=0.0) if i % 2 else
              SamplingParams(max_tokens=int(rng.integers(4, 9)), temperature=0.8, seed=seed * 100 + i)
              for i in range(n)]
    return prompts, params


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _assert_idle(llm: LLM) -> None:
    """No request left in the engine, every block free (held by no request)."""
    core = llm.engine
    assert not llm.llm_engine.has_unfinished_requests() and core.get_num_unfinished_requests() == 0
    assert not core.scheduler.has_unfinished()
    assert core.scheduler.num_free_blocks() == core.usable_blocks


@pytest.fixture(scope="module")
def fresh():
    """A fresh LLM's outputs of each request set, computed once per seed."""
    llm, done = LLM("small-gqa", **ARGS), {}

    def outputs(seed: int):
        if seed not in done:
            prompts, params = _requests(seed)
            done[seed] = _tokens(llm.generate(prompts, params, use_tqdm=False))
        return done[seed]

    return outputs


def _interrupted(llm: LLM, prompts, params, delay: float):
    """llm.generate with SIGINT sent to the main thread after `delay` seconds: its outputs, or None
    when the KeyboardInterrupt came (a signal that fires just after the call returned lands here too)."""
    main = threading.main_thread().ident
    fired = threading.Event()

    def fire():
        fired.set()
        signal.pthread_kill(main, signal.SIGINT)

    timer = threading.Timer(delay, fire)
    try:
        timer.start()
        try:
            out = llm.generate(prompts, params, use_tqdm=False)
        finally:
            timer.cancel()
            timer.join()
            if fired.is_set():
                time.sleep(0.05)  # the signal's handler runs at the main thread's next bytecode
        return out
    except KeyboardInterrupt:
        return None


@pytest.mark.slow  # 40 s; the default run interrupts once: test_a_second_sigint_while_the_first_is_cleaned_up
def test_sigint_at_random_moments_leaves_the_llm_as_a_fresh_one(fresh):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    llm = LLM("small-gqa", **ARGS)
    start, calls = time.perf_counter(), []
    for rounds in range(3):  # every step shape compiled (a second call hits the prefix cache: shapes of its own)
        for seed in range(4):
            prompts, params = _requests(seed)
            t0 = time.perf_counter()
            assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == fresh(seed)
            calls.append(time.perf_counter() - t0)
    call = float(np.median(calls[8:]))  # a compiled call's duration
    rng, interrupted = random.Random(2026), 0
    for trial in range(20):
        seed = trial % 4
        prompts, params = _requests(seed)
        out = _interrupted(llm, prompts, params, rng.uniform(0, call))
        interrupted += out is None
        if out is not None:
            assert _tokens(out) == fresh(seed)
        _assert_idle(llm)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        again = llm.generate(prompts, params, use_tqdm=False)  # the very next call: a fresh LLM's tokens
        assert _tokens(again) == fresh(seed)
        _assert_idle(llm)
    assert interrupted >= 5, (interrupted, call, time.perf_counter() - start)  # signals did land mid-call


def test_a_second_sigint_while_the_first_is_cleaned_up():
    # the call's clean-up (aborting its requests) interrupted too: the next call aborts what was left
    llm = LLM("small-gqa", **ARGS)
    prompts, params = _requests(1)
    calls = []

    def progress(n):
        calls.append(n)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if Ctrl-C landed in the loop, between two engine steps

    abort = llm.llm_engine.abort_request

    def abort_interrupted(ids):
        if calls and len(calls) == 2:
            calls.append("abort")
            raise KeyboardInterrupt  # a second Ctrl-C before the clean-up ran
        return abort(ids)

    llm.llm_engine.abort_request = abort_interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False, progress=progress)
    assert calls[-1] == "abort" and llm.llm_engine.has_unfinished_requests()  # requests left behind
    del llm.llm_engine.abort_request
    out = llm.generate(prompts, params, use_tqdm=False)
    _assert_idle(llm)
    assert len(out) == len(prompts)


def test_threads_calling_generate_and_chat_at_once(fresh):
    llm = LLM("small-gqa", **ARGS)
    sets = [_requests(seed) for seed in range(4)]
    conversation = [{"role": "user", "content": "def f"}]
    chat_params = SamplingParams(max_tokens=6, temperature=0.0)
    want_chat = _tokens(llm.chat(conversation, chat_params, chat_template=TEMPLATE, use_tqdm=False))
    results, errors = {}, []
    barrier = threading.Barrier(6)

    def call(name, fn):
        try:
            barrier.wait()
            for _ in range(2):
                results.setdefault(name, []).append(_tokens(fn()))
        except BaseException as e:  # noqa: BLE001 (reported below, in the main thread)
            errors.append((name, e))

    threads = [threading.Thread(target=call, args=(seed, lambda p=prompts, s=params: llm.generate(
        p, s, use_tqdm=False))) for seed, (prompts, params) in enumerate(sets)]
    threads += [threading.Thread(target=call, args=(f"chat{i}", lambda: llm.chat(
        conversation, chat_params, chat_template=TEMPLATE, use_tqdm=False))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for seed in range(4):
        assert results[seed] == [fresh(seed)] * 2
    assert results["chat0"] == results["chat1"] == [want_chat] * 2
    _assert_idle(llm)


def test_threads_driving_one_llm_engine():
    # LLMEngine's add_request / step / abort_request from several threads: each call one unit
    llm = LLM("small-gqa", **ARGS)
    engine = llm.llm_engine
    prompts, params = _requests(2, 8)
    want = _tokens(llm.generate(prompts, params, use_tqdm=False))
    outputs, errors = {}, []

    def adder(lo, hi):
        try:
            for i in range(lo, hi):
                engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def stepper():
        try:
            deadline = time.monotonic() + 120
            while len(outputs) < len(prompts) and time.monotonic() < deadline:
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = list(out.outputs[0].token_ids)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=adder, args=(0, 4)), threading.Thread(target=adder, args=(4, 8)),
               threading.Thread(target=stepper), threading.Thread(target=stepper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == want
    _assert_idle(llm)
