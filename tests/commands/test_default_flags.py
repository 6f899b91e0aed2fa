"""`kvjax decode`, `kvjax serve` and `kvjax bench serve` with no pool and no length flag, on one tiny
checkpoint of every family kvjax loads (issue 51): the commands size their pool through the
engine's resolver (kvjax.config.engine.resolve_num_blocks), never through a probe config, and
give the library's tokens.

The checkpoints are written here by transformers (tests/hf_fixtures.py, tests/moe_fixtures.py)
and by gguf's writer (tests/models/test_gguf.py's llama.cpp-style writer): dense MHA / GQA / MQA,
MLA, each sliding-window layout (every layer, upper layers, one layer, alternating, five local to
one global, a two-layer pattern with a soft-cap), each MoE routing family and gpt-oss, and a
quantized GGUF. Before issue 51, `kvjax decode` sized its default pool by building a throwaway
config with two blocks, which no model with two KV cache groups can hold: every sliding-window
family and gpt-oss exited 2 ("needs 2 blocks but the pool has only 1 usable").

The library's tokens: `LLM(folder)` with the pool `kvjax decode` reported (the same engine, so
the same compiled programs: the comparison costs no second compile), the same SamplingParams
(vLLM's defaults, temperature 1.0: every draw is keyed by request and position, so equal
engines give equal tokens) and the same prompts. Most families are marked slow (each compiles
its own model, ~20 s on 2 cores); the fast set keeps one family that failed before and one MoE.

`kvjax serve --max-num-seqs 128` and `kvjax bench serve --max-num-seqs 128` on a model whose 128
requests of max_model_len would not fit the host (issue 57 item 4): the CPU's default pool is a
share of the memory node (kvjax.config.engine.CPU_KV_SHARE), and preemption covers the rest,
where before the engine refused to start. The memory node and the host are made small here
(monkeypatched) so that no test allocates gigabytes.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
from hf_fixtures import make_hf_model, save_hf_model
from moe_fixtures import make_gpt_oss_model, make_moe_model

from kvjax.commands.main import main

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[5, 17, 3, 99, 41], [60, 2, 2, 8, 31, 77, 12, 90, 4], [33] * 3 + list(range(40, 50))]
MAX_TOKENS = 12  # past every window of the sliding fixtures (4 to 8 tokens)
FAST = {"gemma3"}  # a sliding family (exited 2 before); gpt-oss, an MoE with sliding layers, runs with default flags
# below (bench serve at 128 rows) and here in the slow set
FAMILIES = {  # family → (case name, what it covers)
    "llama-mha": "dense, MHA", "llama-gqa": "dense, GQA (llama3 RoPE)", "llama-mqa": "dense, MQA, tied embeddings",
    "deepseek-v3-mla": "MLA, every layer dense", "mistral-window": "sliding, every layer",
    "qwen2-window": "sliding, upper layers", "qwen3-window": "sliding, one layer", "gemma2": "sliding, alternating",
    "gemma3": "sliding, five local to one global", "gemma3-capped": "sliding, pattern 2, final soft-cap",
    "mixtral": "MoE, softmax top-2", "qwen2-moe": "MoE, shared expert", "qwen3-moe": "MoE, normalised top-k",
    "deepseek-v2-moe": "MoE + MLA, greedy", "deepseek-v3-moe": "MoE + MLA, noaux_tc groups",
    "gpt-oss": "MoE, sinks, alternating sliding", "gguf-llama": "GGUF, Q8_0 / Q4_1, tied",
    "bamba": "attention + Mamba2 (the block grown to 48, no prefix caching by default)",
}


def _gguf_writer():
    """tests/models/test_gguf.py (its llama.cpp-style writer), loaded by path: that folder is not a package."""
    spec = importlib.util.spec_from_file_location("_kvjax_test_gguf", os.path.join(HERE, "..", "models",
                                                                                   "test_gguf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_checkpoint(family: str, folder: str) -> str:
    """The tiny checkpoint of `family` in folder → what --model takes (a folder, or a .gguf file)."""
    os.makedirs(folder, exist_ok=True)
    if family == "gguf-llama":
        g = _gguf_writer()
        return g.write_gguf(os.path.join(folder, "tiny.gguf"), g.make_llama(len(g.train_vocab()[0]), True),
                            g._quant_types, g.train_vocab(), add_bos=True)
    if family == "gpt-oss":
        model = make_gpt_oss_model()
    elif family == "bamba":
        from hf_fixtures import random_model
        from mamba_fixtures import hybrid_config

        model = random_model(*hybrid_config("bamba"), seed=0)
    elif family in ("mixtral", "qwen2-moe", "qwen3-moe"):
        model = make_moe_model(family)
    elif family in ("deepseek-v2-moe", "deepseek-v3-moe"):  # moe_fixtures' names; hf_fixtures' are all dense
        model = make_moe_model(family.removesuffix("-moe"))
    else:
        model = make_hf_model(family.removesuffix("-mla"))
    return save_hf_model(model, folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family → its checkpoint, written on first use."""
    root, made = tmp_path_factory.mktemp("families"), {}

    def get(family):
        if family not in made:
            made[family] = write_checkpoint(family, str(root / family))
        return made[family]
    return get


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "requests.jsonl"
    path.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS))
    return str(path)


@pytest.mark.parametrize("family", [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_decode_with_no_pool_or_length_flag_gives_the_librarys_tokens(family, checkpoints, prompts_file, capsys):
    from kvjax import LLM, SamplingParams

    model = checkpoints(family)
    assert main(["decode", "--model", model, "--prompts", prompts_file, "--max-tokens", str(MAX_TOKENS), "--json",
                 "--no-progress"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    got = [r["outputs"][0]["token_ids"] for r in out["outputs"]]
    assert [r["error"] for r in out["outputs"]] == [None] * len(PROMPTS)
    assert out["summary"]["preemptions"] == 0  # the default pool holds every request whole
    # the 3 requests (17, 21 and 25 tokens with their 12 generated ones; 8 rows run at once) hold cdiv(n, 16) = 2
    # blocks each in every KV cache group (a window of <= 8 tokens spans two blocks of 16 too): 1 + 3 × 2 × groups
    # (kvjax.config.engine.resolve_num_blocks' rule, worked here), not 8 rows of max_model_len; Bamba's blocks of 48
    # (grown so that a page holds a Mamba state) hold each request in one block of every group
    config = out["config"]
    llm = LLM(model, num_gpu_blocks_override=config["num_gpu_blocks"], use_tqdm_on_load=False)
    groups = len(llm.vllm_config.cache_config.groups.windows)
    per_group = 1 if family == "bamba" else 2
    assert config["block_size"] == (48 if family == "bamba" else 16)
    assert config["num_gpu_blocks"] == 1 + 3 * per_group * groups and config["max_model_len"] == llm.max_model_len
    want = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert got == [list(o.outputs[0].token_ids) for o in want] and all(got)  # some configs have an EOS: a stop


# ----------------------------------------------------------------------------------- serving
@pytest.fixture
def small_machine(monkeypatch):
    """A 512 MiB memory node (the CPU default's KV budget is CPU_KV_SHARE of it) and a 1 GiB host, whatever this
    machine has: 128 requests of tiny gpt-oss's 131,072 positions (8 GiB of KV) cannot fit it."""
    from kvjax.accounting import memory
    from kvjax.engine import arg_utils

    for name in ("KVJAX_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(arg_utils, "_node_memory_bytes", lambda: 512 * 2**20)
    monkeypatch.setattr(memory, "host_ram_bytes", lambda: 2**30)


def _served(monkeypatch, argv: list[str], client) -> object:
    """Run `kvjax serve ARGV` in this process; uvicorn.run is replaced by a server on a free loopback port in a
    thread, client(base url) runs against it, and the server is shut down. → what client returned."""
    import uvicorn
    from serving import served_app

    got = []

    def run(app, host, port, log_level):
        with served_app(app) as url:
            got.append(client(url))

    monkeypatch.setattr(uvicorn, "run", run)
    assert main(["serve", *argv]) == 0
    return got[0]


@pytest.mark.slow  # two gpt-oss engines of 128 rows; the bench serve test below starts the same server by default
def test_serve_with_128_rows_starts_within_the_cpus_kv_budget(small_machine, checkpoints, monkeypatch):
    from serving import http

    from kvjax import LLM, SamplingParams
    from kvjax.config.engine import CPU_KV_SHARE

    model = checkpoints("gpt-oss")

    def client(base):
        return [json.loads(http(f"{base}/v1/completions", {"model": model, "prompt": p, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0})[2])["choices"][0]
                for p in PROMPTS]

    choices = _served(monkeypatch, [model, "--max-num-seqs", "128"], client)
    llm = LLM(model, max_num_seqs=128, use_tqdm_on_load=False)  # the same default pool, in the library
    config = llm.vllm_config
    per_block = 2 * 16 * 2 * 16 * 2 * 4  # a block of one group: 2 layers × 16 tokens × 2 kv heads × 16 dims × K, V × f32
    assert config.num_blocks == 1 + int(CPU_KV_SHARE * 512 * 2**20) // per_block < 1 + 128 * 131_072 // 16
    want = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=MAX_TOKENS,
                                                                                    temperature=0), use_tqdm=False)
    assert [c["finish_reason"] for c in choices] == ["length"] * len(PROMPTS)
    assert [c["text"] for c in choices] == [o.outputs[0].text for o in want]


def test_bench_serve_with_128_rows_runs_within_the_cpus_kv_budget(small_machine, checkpoints, capsys):
    model = checkpoints("gpt-oss")
    assert main(["bench", "serve", "--model", model, "--max-num-seqs", "128", "--num-prompts", "6",
                 "--random-input-len", "12", "--random-output-len", "6", "--vocab-size", "128", "--disable-tqdm",
                 "--json"]) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == 6 and result["total_output_tokens"] == 36
