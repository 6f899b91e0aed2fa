"""`kvjax plan` and `kvjax tables` run as a user runs them: a subprocess, JSON out, exit codes; and
what every command shares: --version, vLLM's flag types (auto kv dtype, human-readable byte
counts), --plot formats, and --json output that parses on every command."""
import json
import math
import os
import subprocess
import sys

import pytest

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def kvjax(*args):
    p = subprocess.run([sys.executable, "-m", "kvjax.commands.main", *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    return p.returncode, p.stdout, p.stderr


def plan_json(*args):
    code, out, err = kvjax("plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_group_a_json():
    got = plan_json("--group", "A")
    assert got["bytes_per_token"] == 320 * KiB
    assert got["bytes_per_block"] == 20 * MiB
    assert got["kv_bytes_per_request"] == 2.5 * GiB
    assert got["budget_bytes"] == math.ceil(160 * GiB * 92 / 100) - 130 * GiB
    assert (got["num_blocks"], got["usable_blocks"], got["token_slots"]) == (880, 879, 56256)
    assert (got["blocks_per_request"], got["concurrency"], got["concurrency_blocks"]) == (128, 6, 6)
    assert got["concurrency_exact"] == pytest.approx(6.88, abs=1e-6)
    assert got["warnings"] == []
    for key in ("bytes_per_token", "bytes_per_block", "kv_bytes_per_request", "budget_bytes", "num_blocks"):
        assert isinstance(got[key], int), key


def test_groups_b_and_c():
    assert plan_json("--group", "B")["concurrency"] == 24
    c = plan_json("--group", "C")
    assert c["concurrency"] == 0
    assert any("cannot hold one request" in w for w in c["warnings"])


def test_human_readout_has_units_and_warnings():
    code, out, _ = kvjax("plan", "--group", "C")
    assert code == 0
    assert "320 KiB" in out and "20 MiB" in out and "40 GiB" in out
    assert "0.4300" in out  # unrounded concurrency beside the floor
    assert "warning:" in out


def test_manual_and_preset_and_hf_config(tmp_path):
    got = plan_json("--kind", "gqa", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
                    "--device-memory-gib", "80", "--weights-gib", "15", "--max-model-len", "8192")
    assert got["bytes_per_token"] == 128 * KiB and got["concurrency"] == 58
    mla = plan_json("--kind", "mla", "--layers", "61", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64",
                    "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "1G")
    assert mla["bytes_per_token"] == 61 * 576 and mla["num_blocks"] == GiB // (61 * 576 * 64)
    # preset with weights from its parameter count × fp8 bytes
    p = plan_json("--preset", "llama-3-8b", "--device-memory-gib", "80", "--weight-dtype", "fp8")
    assert p["weights_bytes"] == 8_030_261_248
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4, "num_attention_heads": 16,
                               "num_key_value_heads": 4, "hidden_size": 512, "head_dim": 128}))
    q = plan_json("--hf-config", cfg, "--kv-cache-memory-bytes", "1G", "--block-size", "16")
    assert q["bytes_per_token"] == 2 * 4 * 4 * 128 * 2
    assert q["bytes_per_block"] == 2 * 4 * 4 * 128 * 2 * 16


def test_tp_flags():
    got = plan_json("--preset", "llama-3-70b", "--tensor-parallel-size", "8", "--device-memory-gib", "80",
                    "--weights-gib", "130")
    assert got["spec"]["num_kv_heads"] == 1
    assert got["bytes_per_token"] == 2 * 80 * 128 * 2
    assert got["weights_bytes"] == 130 * GiB // 8
    ds = plan_json("--preset", "deepseek-v3", "-tp", "8", "--device-memory-gib", "141", "--weights-gib", "625")
    assert ds["bytes_per_token"] == 70272  # 68.625 KiB: MLA is replicated, not split


@pytest.mark.parametrize("name, magic", [("c.png", b"\x89PNG\r\n\x1a\n"), ("c.PDF", b"%PDF"), ("c.svg", b"<?xml")])
def test_plot_formats(tmp_path, name, magic):
    path = tmp_path / name
    code, _, err = kvjax("plan", "--group", "A", "--plot", path)
    assert code == 0, err
    assert path.read_bytes()[:len(magic)] == magic and [p.name for p in tmp_path.iterdir()] == [name]


def test_plot_without_a_known_extension_writes_nothing(tmp_path):
    for name in ("c", "c.txt", "c.jpg"):
        code, out, err = kvjax("plan", "--group", "A", "--plot", tmp_path / name)
        assert code == 2 and out == "" and "must end in .png, .svg, .pdf" in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_version():
    import tomllib

    from kvjax import __file__ as package
    with open(os.path.join(os.path.dirname(os.path.dirname(package)), "pyproject.toml"), "rb") as fh:
        version = tomllib.load(fh)["project"]["version"]
    code, out, err = kvjax("--version")
    assert (code, out, err) == (0, f"kvjax {version}\n", "")


def test_kv_cache_dtype_auto_is_the_models_dtype(tmp_path):
    assert plan_json("--preset", "llama-3-8b")["spec"] == plan_json("--preset", "llama-3-8b", "--kv-cache-dtype",
                                                                    "bf16")["spec"]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "hidden_size": 256, "torch_dtype": "float32"}))
    assert plan_json("--hf-config", cfg)["bytes_per_token"] == 2 * 2 * 2 * 64 * 4  # (K, V) × L × Hkv × D × fp32
    assert plan_json("--hf-config", cfg, "--kv-cache-dtype", "fp8")["bytes_per_token"] == 2 * 2 * 2 * 64


@pytest.mark.parametrize("text, nbytes", [("1073741824", GiB), ("1G", GiB), ("1g", 10**9), ("512M", 512 * MiB),
                                          ("1.5g", 1_500_000_000), ("2T", 2 * 1024 * GiB)])
def test_kv_cache_memory_bytes_reads_vllms_suffixes(text, nbytes):
    got = plan_json("--group", "A", "--kv-cache-memory-bytes", text)
    assert got["kv_cache_memory_bytes"] == got["budget_bytes"] == nbytes
    assert got["num_blocks"] == nbytes // (20 * MiB)


def test_json_on_the_quick_commands(tmp_path):
    """plan and tables above; replay --json (one object a line, the drawing inside with --show);
    report --json with only its tables section."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"op": "init", "num_blocks": 4, "block_size": 2}\n'
                     '{"op": "add", "req": "a", "tokens": [1, 2, 3]}\n')
    code, out, err = kvjax("replay", trace, "--json", "--show")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["op"] for x in lines] == ["init", "add"] and lines[1]["blocks"] == [1, 2]
    assert "free queue (head -> tail)" in lines[1]["drawing"]
    code, plain, err = kvjax("replay", trace)
    assert code == 0 and [json.loads(line) for line in plain.splitlines()] == \
        [{k: v for k, v in x.items() if k != "drawing"} for x in lines]
    code, out, err = kvjax("report", "--quick", "--skip", "decode,accuracy,memory,smollm", "--out", tmp_path / "r",
                           "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [r["concurrency"] for r in data["tables"]["table2"]] == [58, 6, 13, 65, 192, 24]
    assert data["outputs"]["report_md"].endswith("REPORT.md") and (tmp_path / "r" / "report.json").exists()
    assert set(data) == {"tables", "outputs", "seconds"}


@pytest.mark.slow
def test_json_on_calibrate_and_accuracy(tmp_path):
    from kvjax.data import CALIB

    code, out, err = kvjax("calibrate", "--model", "small-gqa", "--data", CALIB, "--seq-len", "64", "--max-windows",
                           "2", "--out", tmp_path / "s.json", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["scales"] == json.loads((tmp_path / "s.json").read_text()) and got["windows"] == 2
    code, out, err = kvjax("accuracy", "--model", "small-gqa", "--max-windows", "2", "--seq-len", "64",
                           "--prompts", "1", "--decode-tokens", "2", "--variants", "fp8_e4m3 unit", "--out",
                           tmp_path / "acc", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert [r["variant"] for r in got["results"]] == ["bf16", "fp8_e4m3 unit"]  # the baseline and what was asked
    assert os.path.exists(got["outputs"]["json"])


def test_tables_json_order_and_values():
    code, out, err = kvjax("tables", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [r["model"] for r in data["table1"]] == ["Llama-2-7B", "Llama-3-8B", "Llama-3-70B", "DeepSeek-V3"]
    assert [r["fp8_bytes_per_token"] for r in data["table1"]] == [256 * KiB, 64 * KiB, 160 * KiB, 61 * 576]
    assert [r["concurrency"] for r in data["table2"]] == [58, 6, 13, 65, 192, 24]
    keys = {"scenario", "gpu_gib", "util", "weights_gib", "budget_gib", "context", "kv_bytes_per_request",
            "budget_per_request", "concurrency"}
    assert keys <= set(data["table2"][0])


@pytest.mark.parametrize("args, needle", [
    (["--group", "A", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--group", "A", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--group", "A", "--gpu-memory-utilization", "abc"], "abc"),
    (["--group", "A", "--max-model-len", "0"], "--max-model-len"),
    (["--group", "A", "--block-size", "-64"], "--block-size"),
    (["--group", "A", "--device-memory-gib", "-1"], "-1"),
    (["--kind", "gqa", "--layers", "4", "--heads", "8", "--kv-heads", "3", "--head-dim", "64"], "num_kv_heads 3"),
    (["--kind", "gqa", "--layers", "4", "--heads", "8"], "--kv-heads"),
    (["--preset", "llama-3-70b", "--tensor-parallel-size", "3"], "tp 3"),
    (["--preset", "llama-3-70b", "-tp", "0"], "--tensor-parallel-size"),
    (["--preset", "llama-3-8b", "--kv-cache-dtype", "fp6"], "fp6"),
    (["--preset", "llama-9b"], "llama-9b"),
    (["--hf-config", "/nonexistent/config.json"], "/nonexistent/config.json"),
    (["--group", "Z"], "Z"),
    (["--preset", "llama-3-8b", "--weight-dtype", "fp7", "--device-memory-gib", "80"], "fp7"),
    (["--preset", "llama-3-8b", "--layers", "x"], "'x'"),
    ([], "no model"),
])
def test_bad_input_exit_2_one_line(args, needle):
    code, out, err = kvjax("plan", *args)
    assert code == 2, (args, out, err)
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0], lines[0]


def test_malformed_config_exit_2(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{]")
    code, _, err = kvjax("plan", "--hf-config", bad)
    assert code == 2 and "not valid JSON" in err and "Traceback" not in err
    bad.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    code, _, err = kvjax("plan", "--hf-config", bad)
    assert code == 2 and "num_attention_heads" in err


# The host tier (`--kv-offloading-size`, vLLM's): the size is summed over the TP
# ranks, each rank holds (size // tp) // bytes per block blocks of its own device layout.
def test_host_tier_json_against_the_formula():
    # Llama-3-8B by hand: 2 (K, V) × 32 layers × 8 kv heads × 128 dims × 2 bytes × 64 tokens per block
    per_block = 2 * 32 * 8 * 128 * 2 * 64
    assert per_block == 8 * MiB
    got = plan_json("--kind", "gqa", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
                    "--device-memory-gib", "80", "--weights-gib", "15", "--kv-offloading-size", "10.5")
    host_blocks = (21 * GiB // 2) // per_block
    assert got["bytes_per_block"] == per_block
    assert (got["host_offload_bytes"], got["host_bytes"]) == (21 * GiB // 2, 21 * GiB // 2)
    assert (got["num_host_blocks"], got["host_tokens"]) == (host_blocks, host_blocks * 64) == (1344, 86016)
    assert got["total_tokens"] == got["token_slots"] + 86016
    # an fp8 cache with per-token-head int8 scales: 4 scale bytes per vector join the block, host and device alike
    q = plan_json("--kind", "gqa", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                  "--kv-cache-dtype", "int8_per_token_head", "--kv-offloading-size", "1", "--block-size", "16")
    per_block = 2 * 32 * 8 * (128 + 4) * 16
    assert q["bytes_per_block"] == per_block and q["num_host_blocks"] == GiB // per_block
    assert q["total_tokens"] is None  # no GPU memory given: the device slots are unknown


def test_host_tier_with_tp_is_per_rank():
    # Llama-3-70B at TP=8: one kv head per rank, 2 × 80 × 1 × 128 × 2 bytes × 64 tokens per block per rank
    per_block = 2 * 80 * 1 * 128 * 2 * 64
    got = plan_json("--preset", "llama-3-70b", "-tp", "8", "--device-memory-gib", "80", "--weights-gib", "130",
                    "--kv-offloading-size", "64")
    assert got["bytes_per_block"] == per_block
    assert (got["host_offload_bytes"], got["host_bytes"]) == (64 * GiB, 8 * GiB)
    assert got["num_host_blocks"] == 8 * GiB // per_block == 3276
    assert got["host_tokens"] == 3276 * 64


def test_no_host_tier_is_null_and_leaves_the_readout_alone():
    keys = ("host_offload_bytes", "host_bytes", "num_host_blocks", "host_tokens", "total_tokens")
    for args in ([], ["--kv-offloading-size", "0"]):
        got = plan_json("--group", "A", *args)
        assert [got[k] for k in keys] == [None] * 5
    assert kvjax("plan", "--group", "A", "--kv-offloading-size", "0") == kvjax("plan", "--group", "A")
    assert "host" not in kvjax("plan", "--group", "A")[1]


def test_host_tier_text_rows():
    code, out, err = kvjax("plan", "--group", "A", "--kv-offloading-size", "100")
    assert code == 0, err
    rows = {line[:22].strip(): line[22:].split() for line in out.splitlines()}
    # group A: 20 MiB blocks, 879 usable device blocks; 100 GiB / 20 MiB = 5,120 host blocks
    assert rows["host tier"][:2] == ["100", "GiB"]
    assert rows["host blocks"][0] == "5,120" and "no null block" in out
    assert rows["host token slots"][0] == f"{5120 * 64:,}"
    assert rows["device + host tokens"][:4] == [f"{879 * 64 + 5120 * 64:,}", f"{879 * 64:,}", "+", f"{5120 * 64:,}"]
    code, out, err = kvjax("plan", "--preset", "llama-3-70b", "-tp", "8", "--kv-offloading-size", "64")
    assert code == 0, err
    assert "1/8 per rank = 8 GiB" in out and "unrounded per rank" in out
    assert "device + host tokens" not in out  # no GPU memory given


@pytest.mark.parametrize("value, needle", [
    ("-1", "'-1'"), ("abc", "'abc'"), ("nan", "'nan'"), ("inf", "'inf'"), ("1e400", "'1e400'"),
    # 1e-9 GiB is 2 bytes (a partly used byte counts): below one 20 MiB block of group A
    ("1e-9", f"--kv-offloading-size 1e-9: 2 bytes per device is smaller than one block of {20 * MiB} bytes"),
])
def test_host_tier_bad_input_exit_2_one_line(value, needle):
    code, out, err = kvjax("plan", "--group", "A", f"--kv-offloading-size={value}")
    assert code == 2 and out == "", (value, out, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "--kv-offloading-size" in err and needle in err, err


@pytest.mark.parametrize("text, value", [("1k", 1000), ("1K", 1024), ("25.6k", 25_600), ("2M", 2 * MiB),
                                         ("3g", 3 * 10**9), ("7", 7), (" 4G ", 4 * GiB)])
def test_human_int_is_vllms_human_readable_int(text, value):
    """vLLM's examples (vllm/utils/argparse_utils.py human_readable_int): decimal k/m/g/t, binary K/M/G/T."""
    from kvjax.utils.argparse_utils import human_readable_int

    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "1e9", "G", "4GiB", ""])
def test_human_int_refuses(text):
    import argparse

    from kvjax.utils.argparse_utils import human_readable_int

    with pytest.raises((ValueError, argparse.ArgumentTypeError)):
        human_readable_int(text)
