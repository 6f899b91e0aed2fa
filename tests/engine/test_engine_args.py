"""EngineArgs (vLLM's `vllm/engine/arg_utils.py`): its command line, and the values create_engine_config
resolves from the arguments vLLM users pass — checked against the checkpoint's own files, the
machine's /proc, and arithmetic done here. No weights are read and no pool is allocated."""
from __future__ import annotations

import json
import os

import pytest

from kvjax.config.hf import from_hf_config
from kvjax.engine.arg_utils import EngineArgs, LLMError
from kvjax.utils.argparse_utils import FlexibleArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_GQA = os.path.join(ROOT, "models", "checkpoints", "small-gqa")
GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 512, "sliding_window": 8, "sliding_window_pattern": 3, "torch_dtype": "float32"}


def _page_bytes(config, block_size=16) -> int:
    """One block of every layer of small-gqa, fp32 K and V: layers × 2 × kv heads × head dim × 4 × Z."""
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4 * block_size


def test_the_command_line_round_trips_with_vllms_spellings():
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", "small-gqa", "--max_num_seqs", "3", "--kv-cache-dtype=fp8",
                              "--no-enable-prefix-caching", "--kv-cache-dtype-skip-layers", "0", "sliding_window",
                              "--hf-overrides", '{"max_position_embeddings": 1024}', "--enforce-eager"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.max_num_seqs, engine_args.kv_cache_dtype, engine_args.enable_prefix_caching) == (3, "fp8",
                                                                                                      False)
    assert engine_args.kv_cache_dtype_skip_layers == [0, "sliding_window"] and engine_args.enforce_eager
    config = engine_args.create_engine_config()
    assert config.max_model_len == 1024 and config.max_num_seqs == 3 and config.steps_per_call == 1
    assert config.cache_config.kv_spec.kv_dtype == "fp8_e4m3" and config.cache_config.kv_spec.skip_layers == (0,)


def test_hf_overrides_change_the_config_json_before_it_is_read(tmp_path):
    with open(os.path.join(SMALL_GQA, "config.json")) as f:
        base = json.load(f)
    got = EngineArgs(model="small-gqa", hf_overrides={"max_position_embeddings": 512,
                                                      "rope_parameters": {"rope_theta": 500.0}},
                     num_gpu_blocks_override=8).create_engine_config()
    assert got.max_model_len == 512 and got.model_config.rope.theta == 500.0  # the nested dict merged
    assert got.model_config.num_layers == base["num_hidden_layers"]  # everything else the checkpoint's
    as_function = EngineArgs(model="small-gqa", num_gpu_blocks_override=8,
                             hf_overrides=lambda c: {**c, "max_position_embeddings": 256}).create_engine_config()
    assert as_function.max_model_len == 256
    with pytest.raises(LLMError, match="hf_overrides must be a dict"):
        EngineArgs(model="small-gqa", hf_overrides=[1]).create_engine_config()
    with pytest.raises(ValueError, match="preset"):
        EngineArgs(model="preset:tiny", hf_overrides={"x": 1}).create_engine_config()


def test_a_cpu_takes_vllms_kv_cache_space_and_its_memory_node(monkeypatch):
    with open(os.path.join(SMALL_GQA, "config.json")) as f:
        per_block = _page_bytes(json.load(f))
    monkeypatch.delenv("KVJAX_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert EngineArgs(model="small-gqa").create_engine_config().num_blocks == 1 + 2**30 // per_block
    monkeypatch.setenv("KVJAX_CPU_KVCACHE_SPACE", "2")  # kvjax's name first
    assert EngineArgs(model="small-gqa").create_engine_config().num_blocks == 1 + 2 * 2**30 // per_block
    monkeypatch.setenv("KVJAX_CPU_KVCACHE_SPACE", "")  # empty: unset, as vLLM reads its own
    assert EngineArgs(model="small-gqa").create_engine_config().num_blocks == 1 + 2**30 // per_block
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "x")
    with pytest.raises(LLMError, match="VLLM_CPU_KVCACHE_SPACE='x' must be a whole number of GiB"):
        EngineArgs(model="small-gqa").create_engine_config()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.delenv("KVJAX_CPU_KVCACHE_SPACE")
    # vLLM's CPU platform: a utilization's share of memory node 0's MemTotal (the profile sizes the pool later)
    node = "/sys/devices/system/node/node0/meminfo"
    path, key = (node, "MemTotal:") if os.path.exists(node) else ("/proc/meminfo", "MemTotal:")
    with open(path) as f:
        words = next(line.split() for line in f if key in line)
    total = int(words[words.index(key) + 1]) * 1024
    config = EngineArgs(model="small-gqa", gpu_memory_utilization=0.4).create_engine_config()
    assert config.cache_config.total_memory_bytes == total and config.cache_config.num_gpu_blocks is None
    assert config.cache_config.gpu_memory_utilization == 0.4


@pytest.mark.parametrize("max_num_seqs, node_gib, blocks", [
    (2, 1, 1 + 2 * 128),  # two whole 2,048-token requests of 128 blocks fit a 1 GiB node's quarter: no more
    (4096, 1, 1 + 2**28 // 32_768),  # 4,096 would need 128 GiB: a quarter of the node, 256 MiB of 32 KiB blocks
    (4096, 2**-10, 1 + 128),  # a 1 MiB node's quarter holds no whole request: one, at least
])
def test_the_cpu_default_pool_is_its_requests_within_a_share_of_the_memory_node(monkeypatch, max_num_seqs, node_gib,
                                                                               blocks):
    """vLLM's CPU backend sizes its cache from a memory budget (VLLM_CPU_KVCACHE_SPACE, else its share of the memory
    node) and preempts; kvjax's default takes max_num_seqs whole requests of max_model_len when they fit a quarter of
    the node, else that quarter (never fewer blocks than one request needs): it never refuses to start because
    max_num_seqs × max_model_len does not fit. small-gqa: 2,048 positions, 32 KiB blocks of 16 tokens."""
    from kvjax.config.engine import CPU_KV_SHARE
    from kvjax.engine import arg_utils

    for name in ("KVJAX_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(arg_utils, "_node_memory_bytes", lambda: int(node_gib * 2**30))
    assert CPU_KV_SHARE == 0.25
    config = EngineArgs(model="small-gqa", max_num_seqs=max_num_seqs).create_engine_config()
    assert config.num_blocks == blocks and config.scheduler_config.max_model_len == 2048


def test_a_caller_that_knows_its_requests_sizes_the_default_pool_for_them(monkeypatch):
    from kvjax.engine import arg_utils

    for name in ("KVJAX_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(arg_utils, "_node_memory_bytes", lambda: 2**30)
    # kvjax decode: 16-token blocks; the 3 longest of 100, 40, 10**6 (max_model_len's 2,048: 128 blocks), 17, 33
    # tokens run at once: 1 + 128 + 7 + 3 blocks; 2 requests of 100 tokens need 7 each, whatever max_num_seqs is
    lens = [100, 40, 10**6, 17, 33]
    assert EngineArgs(model="small-gqa", max_num_seqs=3).create_engine_config(request_lens=lens).num_blocks == \
        1 + 128 + 7 + 3
    assert EngineArgs(model="small-gqa", max_num_seqs=4096).create_engine_config(
        request_lens=[100, 100]).num_blocks == 1 + 2 * 7
    with pytest.raises(LLMError, match="a request_lens entry must be an integer in"):
        EngineArgs(model="small-gqa").create_engine_config(request_lens=[5, 0])


def test_skip_layers_by_layer_type_and_the_enforce_eager_rule():
    config = from_hf_config(GEMMA3)
    sliding = tuple(i for i, w in enumerate(config.layer_windows) if w is not None)
    assert sliding and len(sliding) < config.num_layers
    got = EngineArgs(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["sliding_window"],
                     disable_hybrid_kv_cache_manager=True, num_gpu_blocks_override=8).create_engine_config(config)
    assert got.cache_config.kv_spec.skip_layers == sliding
    assert all(got.cache_config.kv_spec.layer_dtype(i).name == ("fp32" if i in sliding else "fp8_e4m3")
               for i in range(config.num_layers))
    with pytest.raises(LLMError, match="disable_hybrid_kv_cache_manager=True keeps every layer in one group"):
        EngineArgs(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["sliding_window"],
                   num_gpu_blocks_override=8).create_engine_config(config)
    with pytest.raises(LLMError, match="enforce_eager=True runs one decode step per device call"):
        EngineArgs(enforce_eager=True, steps_per_call=8).create_engine_config(config)


@pytest.mark.parametrize("max_model_len", [13, 64, 200])
def test_the_cpu_default_pool_holds_max_num_seqs_whole_requests_of_a_hybrid_model(max_model_len):
    """The CPU default (no utilization, no override) is enough blocks that nothing is preempted: for
    tiny-gpt-oss (window 8, blocks of 16, a sliding and a full group) a request holds cdiv(n, 16) full
    blocks plus, in the sliding group, at most cdiv(8 - 1 + budget, 16) + 1 blocks (window plus one
    step's chunk) and never more than the full group's. Worked by hand here; a pool sized for one group
    only (before) held 1 usable block for n = 13 and refused to start."""
    seqs, budget = 3, 32
    config = EngineArgs(model="preset:tiny-gpt-oss", block_size=16, max_num_seqs=seqs, max_model_len=max_model_len,
                        max_num_batched_tokens=budget).create_engine_config()
    full = -(-max_model_len // 16)
    sliding = min(full, -(-(8 - 1 + budget) // 16) + 1)
    assert config.num_blocks == 1 + seqs * (full + sliding)
    assert config.scheduler_config.max_model_len == max_model_len  # the pool holds a whole request
