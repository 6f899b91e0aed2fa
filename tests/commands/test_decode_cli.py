"""`kvjax decode` end to end, in process, on a tiny random-init Llama checkpoint (vocab 128:
ASCII prompts are valid byte tokens). The engine's correctness against transformers is in
tests/engine/test_engine_hf.py; here: what the command reads, prints and refuses.

The checkpoint folder, block size, row count, max_model_len and pool sizes (64 and 10 blocks)
are those of tests/engine/test_engine_hf.py, so that in one pytest session both files share their
compiled steps (a model's jit cache key includes its config, whose name is the folder's).
"""
from __future__ import annotations

import json

import pytest
from hf_fixtures import make_hf_model, save_hf_model

from kvjax.commands.main import main

LINES = ["def add(a, b):", "", "import os", "class Pool:", "x = 1"]  # line 2: an empty prompt
BASE = ["--block-size", "4", "--max-num-seqs", "4", "--max-model-len", "40", "--no-progress"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.getbasetemp() / "decode-cli" / "llama-gqa"
    return save_hf_model(make_hf_model("llama-gqa"), str(folder))


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(LINES) + "\n")
    return str(path)


def decode_json(capsys, *argv):
    assert main(["decode", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def tokens(out) -> list[list[int]]:
    """Each prompt's first completion's token ids ([] for a refused prompt)."""
    return [r["outputs"][0]["token_ids"] if r["outputs"] else [] for r in out["outputs"]]


@pytest.mark.slow
def test_prompts_file_json_and_same_tokens_for_1_and_8_steps_per_call(ckpt, prompts_file, capsys):
    runs = [decode_json(capsys, "--model", ckpt, "--prompts", prompts_file, "--max-tokens", "6",
                        "--num-gpu-blocks-override", "64", "--steps-per-call", k, *BASE) for k in ("1", "8")]
    for out in runs:
        reqs = out["outputs"]
        assert [len(r["prompt_token_ids"]) for r in reqs] == [len(line) for line in LINES]
        assert [r["prompt"] for r in reqs] == LINES
        assert "The decoder prompt cannot be empty" in reqs[1]["error"] and all(c["token_ids"] == [] for c in reqs[1]["outputs"])
        assert all(r["error"] is None and len(r["outputs"][0]["token_ids"]) == 6 for i, r in enumerate(reqs) if i != 1)
        first = reqs[0]["outputs"][0]
        assert first["text"] == bytes(first["token_ids"]).decode("utf-8", errors="replace")
        s = out["summary"]
        assert s["requests"] == 5 and s["failed"] == 1 and s["generated_tokens"] == 24
        assert len(s["blocks_in_use"]) == s["steps"] and s["usable_blocks"] == 63
        assert out["config"]["num_gpu_blocks"] == 64 and out["config"]["sampling_params"]["temperature"] == 1.0
    assert tokens(runs[0]) == tokens(runs[1])  # sampled, but each draw is keyed by (request, position)
    assert runs[1]["summary"]["device_calls"] < runs[0]["summary"]["device_calls"]


@pytest.mark.slow
def test_jsonl_per_request_errors_and_others_complete(ckpt, tmp_path, capsys):
    path = tmp_path / "reqs.jsonl"
    rows = [{"prompt": "import os"}, {"prompt": "x" * 60}, {"tokens": [1, 2, 3], "max_tokens": 0},
            {"tokens": list(range(32)), "max_tokens": 8}, {"tokens": [5, 6, 7], "max_tokens": 3}, {"tokens": [1, 500]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = decode_json(capsys, "--model", ckpt, "--prompts", str(path), "--max-tokens", "5",
                      "--num-gpu-blocks-override", "10", *BASE)
    errs = [r["error"] for r in out["outputs"]]
    assert errs[0] is None and errs[4] is None
    assert "This model's maximum context length is 40 tokens. However, your prompt contains 60 input tokens" in errs[1]
    assert "max_tokens must be at least 1, got 0." in errs[2]
    assert "needs 10 blocks of 4 tokens (32 prompt + 8 new), but the pool has only 9 usable blocks" in errs[3]
    assert "Token id 500 is out of vocabulary (the model's token ids are [0, 128))" in errs[5]
    assert [len(t) for t in tokens(out)] == [5, 0, 0, 0, 3, 0]
    assert out["summary"]["requests"] == 6 and out["summary"]["failed"] == 4


@pytest.mark.slow
def test_synthetic_shared_prefix_hits_and_a_small_pool_preempts(ckpt, capsys):
    common = ["--model", ckpt, "--synthetic", "6", "--shared-prefix", "12", "--prompt-len", "8", "--max-tokens", "8",
              "--steps-per-call", "8", "--greedy", *BASE]
    on = decode_json(capsys, *common, "--num-gpu-blocks-override", "64")
    off = decode_json(capsys, *common, "--num-gpu-blocks-override", "64", "--no-enable-prefix-caching")
    small = decode_json(capsys, *common, "--num-gpu-blocks-override", "10")
    assert tokens(on) == tokens(off) == tokens(small)
    assert on["summary"]["prefix_hit_tokens"] == 5 * 12 and off["summary"]["prefix_hit_tokens"] == 0
    assert [r["num_cached_tokens"] for r in on["outputs"]] == [0] + [12] * 5
    assert small["summary"]["preemptions"] > 0 and small["summary"]["peak_blocks_used"] <= 9


@pytest.mark.slow
def test_text_output_and_util_sizing(ckpt, capsys):
    """--gpu-memory-utilization sizes the pool with kvjax.accounting.sizing's profile (one prefill of the largest
    step: 4 rows × 40 tokens), so blocks = (ceil(total × util) − weights − activations) // block bytes,
    worked out here from the profile's own weights and activations."""
    from kvjax.accounting.sizing import profile_and_size
    from kvjax.models.hub import load_model

    # weights: 90,432 fp32 parameters = 361,728 B; a block: 4 tokens × 2 layers × (K, V) × 2 heads × 16 × 4 B
    # = 2,048 B; total = int(0.004 × 2^30) = 4,294,967 B.
    assert main(["decode", "--model", ckpt, "--synthetic", "2", "--max-tokens", "3", "--gpu-memory-utilization", "0.5",
                 "--device-memory-gib", "0.004", "--temperature", "0.8", "--seed", "3", *BASE]) == 0
    out = capsys.readouterr().out
    for key in ("prefix-cache hits", "decode tokens/s", "step latency", "peak blocks used", "preemptions"):
        assert key in out
    m = load_model(ckpt)
    r = profile_and_size(m.module, m.params, m.config.kv_spec(), util=0.5, total_bytes=4_294_967, block_size=4,
                         max_num_batched_tokens=160, max_num_seqs=4, max_model_len=40)
    assert r.weights_bytes == 361_728 and r.activations_bytes > 0
    blocks = (-(-4_294_967 // 2) - 361_728 - r.activations_bytes) // 2_048
    assert f"of {blocks - 1} usable" in out


@pytest.mark.parametrize("argv, message", [
    (["--synthetic", "2", "--max-tokens", "0"], "argument --max-tokens: must be in [1, 2147483647], got '0'"),
    (["--prompts", "/nonexistent.txt", "--max-tokens", "2"], "prompts file '/nonexistent.txt' does not exist"),
    (["--synthetic", "2", "--max-tokens", "2", "--scales", "s.json"], "--scales are fp8 dequantization scales"),
    (["--synthetic", "2", "--max-tokens", "2", "--num-gpu-blocks-override", "1"],
     "argument --num-gpu-blocks-override: must be in [2, 2147483647], got '1'"),
    (["--synthetic", "2", "--max-tokens", "2", "--gpu-memory-utilization", "2"],
     "argument --gpu-memory-utilization: must be in (0, 1], got '2'"),
    (["--synthetic", "2", "--max-tokens", "2", "--temperature", "3"],
     "argument --temperature: must be in [0, 2], got '3'"),
    (["--synthetic", "2", "--max-tokens", "2", "--kv-cache-dtype", "fp9"], "unknown kv cache dtype 'fp9'"),
    (["--synthetic", "2", "--max-tokens", "2", "--max-model-len", "99999"],
     "--max-model-len=99999 must be in [1, "),
    (["--synthetic", "2", "--max-tokens", "2", "--greedy", "--top-p", "0.5"], "--top-p filters what --temperature"),
    (["--synthetic", "2", "--max-tokens", "2", "--temperature", "0", "--n", "2"], "--n 2 needs sampling"),
    (["--synthetic", "2", "--max-tokens", "2", "--min-tokens", "3"], "--min-tokens 3 exceeds --max-tokens 2"),
    (["--synthetic", "2", "--max-tokens", "2", "--kv-cache-memory-bytes", "1.5G"],
     "decimals are not allowed with the binary suffix G"),
    (["--synthetic", "2", "--kv-util", "1"], "unrecognized arguments: --kv-util 1"),
])
def test_bad_flags_exit_2_with_one_line(ckpt, capsys, argv, message):
    assert main(["decode", "--model", ckpt, *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvjax decode: error: ") and message in err and "\n" not in err


@pytest.mark.slow
def test_stop_token_ids_ignore_eos_logprobs_and_priority_flags(ckpt, tmp_path, capsys):
    common = ["--model", ckpt, "--synthetic", "3", "--max-tokens", "8", "--num-gpu-blocks-override", "64", "--greedy",
              *BASE]
    free = decode_json(capsys, *common, "--ignore-eos")
    assert free["config"]["sampling_params"]["ignore_eos"]
    assert all(c["finish_reason"] == "length" for r in free["outputs"] for c in r["outputs"])
    first = tokens(free)[0]
    stop = first[3]
    out = decode_json(capsys, *common, "--ignore-eos", "--stop-token-ids", f"{stop},127", "--logprobs", "0")
    row = out["outputs"][0]["outputs"][0]
    assert row["token_ids"] == first[: first.index(stop) + 1] and row["finish_reason"] == "stop"
    assert row["stop_reason"] == stop
    assert out["config"]["sampling_params"]["stop_token_ids"] == [stop, 127]
    # logprobs 0: the sampled token's alone, rank 1 under greedy decoding
    assert [list(d) for d in row["logprobs"]] == [[str(t)] for t in row["token_ids"]]
    assert all(d[str(t)]["rank"] == 1 for d, t in zip(row["logprobs"], row["token_ids"]))
    path = tmp_path / "prio.jsonl"
    path.write_text('{"tokens": [1, 2, 3], "priority": 1}\n{"tokens": [4, 5], "priority": 0}\n')
    prio = decode_json(capsys, "--model", ckpt, "--prompts", str(path), "--max-tokens", "2",
                       "--scheduling-policy", "priority", *BASE)
    assert prio["config"]["scheduling_policy"] == "priority" and prio["summary"]["failed"] == 0
    assert main(["decode", "--model", ckpt, "--prompts", str(path), "--max-tokens", "2", *BASE]) == 2
    assert "a \"priority\" needs --scheduling-policy priority" in capsys.readouterr().err
    assert main(["decode", *common, "--stop-token-ids", "1,x"]) == 2
    assert "--stop-token-ids must be comma-separated integers, got '1,x'" in capsys.readouterr().err


def test_chat_needs_a_chat_template(ckpt, prompts_file, capsys):
    assert main(["decode", "--model", ckpt, "--prompts", prompts_file, "--chat", "--max-tokens", "2", *BASE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvjax decode: error: --chat: model") and "has no chat template" in err


# ------------------------------------------------------------------ vLLM's engine args on small-gqa
SMALL_GQA = ["--model", "small-gqa", "--synthetic", "4", "--shared-prefix", "32", "--max-tokens", "2",
             "--max-num-seqs", "4", "--no-progress"]
COMPLETION_KEYS = ["index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason"]
OUTPUT_KEYS = ["index", "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished",
               "metrics", "num_cached_tokens", "error"]


def test_vllm_engine_args_json_shape(capsys):
    """The vLLM command line of the issue, --logprobs 2 and --n 2 added: vLLM's RequestOutput shape."""
    out = decode_json(capsys, *SMALL_GQA, "--kv-cache-dtype", "fp8", "--num-gpu-blocks-override", "64",
                      "--no-enable-prefix-caching", "--logprobs", "2", "--n", "2")
    c = out["config"]
    assert (c["kv_cache_dtype"], c["num_gpu_blocks"], c["enable_prefix_caching"], c["max_num_seqs"]) == \
        ("fp8_e4m3", 64, False, 4)
    assert c["sampling_params"]["n"] == 2 and c["sampling_params"]["logprobs"] == 2
    assert [r["index"] for r in out["outputs"]] == [0, 1, 2, 3]
    for r in out["outputs"]:
        assert list(r) == OUTPUT_KEYS and r["error"] is None and r["finished"] and r["num_cached_tokens"] == 0
        assert r["prompt"] is None and len(r["prompt_token_ids"]) >= 32 + 16  # the prefix + prompt_len // 2
        assert [x["index"] for x in r["outputs"]] == [0, 1]
        assert r["metrics"]["num_generation_tokens"] == 4 and r["metrics"]["num_cached_tokens"] == 0
        for x in r["outputs"]:
            assert list(x) == COMPLETION_KEYS and x["finish_reason"] == "length" and x["stop_reason"] is None
            assert len(x["token_ids"]) == 2 and x["text"] == bytes(x["token_ids"]).decode("utf-8", errors="replace")
            chosen = []
            for token, entry in zip(x["token_ids"], x["logprobs"]):
                # the sampled token and the 2 most likely (the sampled one may be among them)
                assert str(token) in entry and len(entry) in (2, 3)
                ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token) or v["rank"] <= 2)
                assert ranks[:2] == [1, 2]
                best = max(entry.values(), key=lambda v: v["logprob"])
                assert best["rank"] == 1 and all(v["logprob"] <= 0 for v in entry.values())
                assert all(v["decoded_token"] == bytes([int(k)]).decode("utf-8", errors="replace")
                           for k, v in entry.items())
                chosen.append(entry[str(token)]["logprob"])
            assert x["cumulative_logprob"] == pytest.approx(sum(chosen))
    s = out["summary"]
    assert s["requests"] == 8 and s["generated_tokens"] == 16 and s["prefix_hit_tokens"] == 0


def test_prefix_caching_flags_and_warmup_starts_cold(capsys):
    """4 prompts after the same 32-token prefix (two blocks of 16): with prefix caching every prompt
    after the first finds both blocks; off, none does. --warmup runs the workload once first and
    then resets the prefix cache, so the measured run's first prompt still finds nothing (without
    the reset it would find its whole prompt's full blocks)."""
    on = decode_json(capsys, *SMALL_GQA, "--enable-prefix-caching", "--greedy", "--warmup")
    off = decode_json(capsys, *SMALL_GQA, "--no-enable-prefix-caching", "--greedy")
    assert [r["num_cached_tokens"] for r in on["outputs"]] == [0, 32, 32, 32]
    assert on["summary"]["prefix_hit_tokens"] == 3 * 32 and on["config"]["warmup"]
    assert [r["num_cached_tokens"] for r in off["outputs"]] == [0, 0, 0, 0]
    assert off["summary"]["prefix_hit_tokens"] == 0
    assert tokens(on) == tokens(off)
