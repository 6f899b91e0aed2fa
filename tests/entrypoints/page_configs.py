"""The calculator page's table of configs: what a user does on the page (from its first state, SPEC
group A) and the `kvjax plan` flags that must come out of it, for the browser tests (the page's
readout against `kvjax plan --json`) and the Python ones (kvjax.accounting.formulas.page_plan
against it). The seed's groups A, B and C, then 20 others over every input. SEED: the seed's own
numbers for A, B and C (SPEC "The simulator", "Budget → blocks", Table 2), written out here."""
import contextlib
import io
import json

from kvjax.commands.main import main

GiB, KiB = 1024**3, 1024

CONFIGS = [
    ("A", [], ["--group", "A"]),
    ("B", [("click", "group-B")], ["--group", "B"]),
    ("C", [("click", "group-C")], ["--group", "C"]),
    ("A at 32K", [("set", "context", "32768")], ["--group", "A", "--max-model-len", "32768"]),
    ("A fp8", [("select", "kv_dtype", "fp8")], ["--group", "A", "--kv-cache-dtype", "fp8"]),
    ("A 141 GiB at 0.95", [("set", "gpu_gib", "141"), ("set", "util", "0.95")],
     ["--group", "A", "--device-memory-gib", "141", "--gpu-memory-utilization", "0.95"]),
    ("Table 2: fp8 KV + fp8 weights", [("select", "kv_dtype", "fp8"), ("set", "weights_gib", "65.2")],
     ["--group", "A", "--kv-cache-dtype", "fp8", "--weights-gib", "65.2"]),
    ("A on TP 4", [("select", "tp", "4")], ["--group", "A", "--tensor-parallel-size", "4"]),
    ("A, blocks of 16, 100K tokens", [("set", "context", "100000"), ("select", "block_size", "16")],
     ["--group", "A", "--max-model-len", "100000", "--block-size", "16"]),
    ("B nvfp4", [("click", "group-B"), ("select", "kv_dtype", "nvfp4")], ["--group", "B", "--kv-cache-dtype", "nvfp4"]),
    ("B with activations and CUDA graphs",
     [("click", "group-B"), ("set", "activations_gib", "2.5"), ("set", "cudagraph_gib", "0.75")],
     ["--group", "B", "--activations-gib", "2.5", "--cudagraph-gib", "0.75"]),
    ("Llama-3-8B on 80 GiB", [("select", "preset", "llama-3-8b"), ("set", "gpu_gib", "80")],
     ["--preset", "llama-3-8b", "--device-memory-gib", "80"]),
    ("Llama-2-7B int8 per token head", [("select", "preset", "llama-2-7b"), ("select", "kv_dtype", "int8_per_token_head"),
                                        ("set", "gpu_gib", "24")],
     ["--preset", "llama-2-7b", "--kv-cache-dtype", "int8_per_token_head", "--device-memory-gib", "24"]),
    ("DeepSeek-V3 counted weights on TP 8 (no budget)",
     [("select", "preset", "deepseek-v3"), ("set", "gpu_gib", "141"), ("select", "tp", "8"), ("set", "context", "32768")],
     ["--preset", "deepseek-v3", "--max-model-len", "32768", "--device-memory-gib", "141", "--tensor-parallel-size", "8"]),
    ("Mixtral fp8_e5m2", [("select", "preset", "mixtral-8x7b"), ("select", "kv_dtype", "fp8_e5m2"),
                          ("set", "gpu_gib", "80"), ("set", "weights_gib", "47")],
     ["--preset", "mixtral-8x7b", "--kv-cache-dtype", "fp8_e5m2", "--device-memory-gib", "80", "--weights-gib", "47"]),
    ("Gemma-3-27B (hybrid)", [("select", "preset", "gemma-3-27b"), ("set", "gpu_gib", "80")],
     ["--preset", "gemma-3-27b", "--device-memory-gib", "80"]),
    ("custom GQA, 40 layers", [("set", "layers", "40")],
     ["--kind", "gqa", "--layers", "40", "--heads", "64", "--kv-heads", "8", "--head-dim", "128", "--kv-cache-dtype",
      "bf16", "--device-memory-gib", "160", "--weights-gib", "130"]),
    ("Llama-3-70B as MHA", [("set", "kv_heads", "64")],
     ["--kind", "mha", "--layers", "80", "--heads", "64", "--kv-heads", "64", "--head-dim", "128", "--kv-cache-dtype",
      "bf16", "--device-memory-gib", "160", "--weights-gib", "130"]),
    ("MQA", [("set", "kv_heads", "1")],
     ["--kind", "mqa", "--layers", "80", "--heads", "64", "--kv-heads", "1", "--head-dim", "128", "--kv-cache-dtype",
      "bf16", "--device-memory-gib", "160", "--weights-gib", "130"]),
    ("f = 1: MLA", [("click", "f1")],
     ["--kind", "mla", "--layers", "80", "--heads", "64", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64",
      "--kv-cache-dtype", "bf16", "--device-memory-gib", "160", "--weights-gib", "130"]),
    ("head dim 96, nvfp4, 128K, blocks of 256",
     [("set", "head_dim", "96"), ("select", "kv_dtype", "nvfp4"), ("set", "context", "131072"),
      ("select", "block_size", "256")],
     ["--kind", "gqa", "--layers", "80", "--heads", "64", "--kv-heads", "8", "--head-dim", "96", "--kv-cache-dtype",
      "nvfp4", "--max-model-len", "131072", "--block-size", "256", "--device-memory-gib", "160", "--weights-gib", "130"]),
    ("Qwen3-30B-A3B, activations, 4K prefill chunks",
     [("select", "preset", "qwen3-30b-a3b"), ("set", "gpu_gib", "48"), ("set", "util", "0.9"),
      ("set", "activations_gib", "1.25"), ("set", "batched_tokens", "4096")],
     ["--preset", "qwen3-30b-a3b", "--device-memory-gib", "48", "--gpu-memory-utilization", "0.9", "--activations-gib",
      "1.25", "--max-num-batched-tokens", "4096"]),
    ("a custom model without weights", [("set", "weights_gib", ""), ("set", "layers", "2"), ("set", "gpu_gib", "1.5")],
     ["--kind", "gqa", "--layers", "2", "--heads", "64", "--kv-heads", "8", "--head-dim", "128", "--kv-cache-dtype",
      "bf16", "--device-memory-gib", "1.5"]),
]

# The readout's rows: plan --json's fields (a dot: a nested one).
FIELDS = ("bytes_per_token", "bytes_per_block", "kv_bytes_per_request", "total_bytes", "requested_bytes",
          "weights_bytes", "activations_bytes", "cudagraph_bytes", "budget_bytes", "num_blocks", "usable_blocks",
          "token_slots", "blocks_per_request", "tail_waste_tokens", "concurrency", "concurrency_exact",
          "concurrency_blocks", "prefill_attention.tiled_bytes", "prefill_attention.reference_scores_bytes")

# The seed's numbers, as its page shows them: a row's shown text or exact value; the unrounded concurrency to 2 decimals.
SEED = {
    "A": {"bytes_per_token": "320 KiB", "bytes_per_block": "20 MiB", "kv_bytes_per_request": "2.5 GiB",
          "requested_bytes": "147.2 GiB", "weights_bytes": "130 GiB", "budget_bytes": "17.2 GiB", "num_blocks": "880",
          "usable_blocks": "879", "token_slots": "56,256", "blocks_per_request": "128", "concurrency": "6",
          "concurrency_exact": 6.88},
    "B": {"bytes_per_token": "68.625 KiB", "kv_bytes_per_request": str(int(2.14453125 * GiB)),
          "weights_bytes": "78.125 GiB", "budget_bytes": "51.595 GiB", "concurrency": "24", "concurrency_exact": 24.06},
    "C": {"kv_bytes_per_request": "40 GiB", "budget_bytes": "17.2 GiB", "concurrency": "0", "concurrency_exact": 0.43},
}
SEED_C_WARNING = "budget 17.2 GiB cannot hold one request of 131072 tokens (40 GiB): concurrency 0"


def plan_json(argv) -> dict:
    """What `kvjax plan ARGV --json` prints (the command's own entry point, in this process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *argv, "--json"]) == 0, argv
    return json.loads(out.getvalue())


def field(plan: dict, key: str):
    for part in key.split("."):
        plan = plan[part]
    return plan
