"""The bad-input contract of every `kvjax` command, checked by a table of hostile inputs.

For each case (built here: corrupt, truncated and pickled checkpoints, non-UTF-8 and deeply
nested files, numbers at the edge of floats and ints, unwritable outputs, conflicting flags):
exit status 2, exactly one stderr line `kvjax CMD: error: ...` that names the offending flag
or file (the expected fragment in the table), no traceback, nothing written to the working
folder, no pickle ever run (a pickled payload would create a marker file), and an answer
within seconds. The cases run in-process through `kvjax.commands.main.main` (a hang trips an alarm);
a few also run through the installed `kvjax` script to check the real entry point.
"""
from __future__ import annotations

import argparse
import builtins
import json
import os
import pickle
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time

import pytest

from kvjax.commands.main import main

TINY_CONFIG = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256}
MARKER = "PICKLE_RAN"  # created only if some reader unpickles a payload


class _Payload:
    """Unpickling this creates MARKER in the working folder (builtins.open(MARKER, "w"))."""

    def __reduce__(self):
        return builtins.open, (MARKER, "w")


def _write(root, name: str, data) -> None:
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)


def _checkpoint(root, name: str, files: dict) -> None:
    _write(root, f"{name}/config.json", json.dumps(TINY_CONFIG))
    for fname, data in files.items():
        _write(root, f"{name}/{fname}", data)


def _safetensors_header_only() -> bytes:
    """A safetensors header announcing a tensor whose bytes are missing (a truncated download)."""
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [128, 64],
                                                       "data_offsets": [0, 128 * 64 * 4]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 100


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bad_input"))
    pickled = pickle.dumps(_Payload())
    files = {
        "ok.txt": "hello\n",
        "ok.jsonl": '{"prompt": "hi"}\n',
        "deep.json": "[" * 200_000,
        "deep.jsonl": "[" * 200_000 + "\n",
        "bin.txt": b"\xff\xfe\x00abc\n\x80\x81",
        "bin.jsonl": b'{"prompt": "ok"}\n{"prompt": "\xff"}\n',
        "list.json": "[1, 2]",
        "nan_config.json": '{"model_type": NaN}',
        "p_tokens5.jsonl": '{"tokens": 5}\n',
        "p_null.jsonl": '{"tokens": [null]}\n',
        "p_inf.jsonl": '{"tokens": [1e400]}\n',
        "p_prompt123.jsonl": '{"prompt": 123}\n',
        "p_float.jsonl": '{"tokens": [65.9, 66.2]}\n',
        "p_unknown.jsonl": '{"prompt": "a", "temperature": 1}\n',
        "p_both.jsonl": '{"prompt": "a", "tokens": [1]}\n',
        "p_priority.jsonl": '{"prompt": "a", "priority": 1}\n',
        "p_bigint.jsonl": '{"tokens": [1099511627776]}\n',
        "p_line3.jsonl": '{"prompt": "a"}\n{"tokens": [1, 2]}\n{"tokens": "abc"}\n',
        "p_array.jsonl": '[1, 2, 3]\n',
        "p_maxtok.jsonl": '{"prompt": "a", "max_tokens": 2.5}\n',
        "s_k5.json": '{"format": "fp8_e4m3", "mode": "per_tensor", "k": 5}',
        "s_banana.json": json.dumps({"format": "banana", "mode": "per_tensor", "k": [[1.0]], "v": [[1.0]]}),
        "s_e5m2.json": json.dumps({"format": "fp8_e5m2", "mode": "per_tensor", "k": [[1.0, 1.0]] * 4,
                                   "v": [[1.0, 1.0]] * 4}),
        "s_negative.json": json.dumps({"format": "fp8_e4m3", "mode": "per_tensor", "k": [[-1.0]], "v": [[1.0]]}),
        "s_mode.json": json.dumps({"format": "fp8_e4m3", "mode": "per_channel", "k": [[1.0]], "v": [[1.0]]}),
        "s_extra.json": json.dumps({"format": "fp8_e4m3", "mode": "unit", "k": [[1.0]], "scale": 2}),
        "t_init_float.jsonl": '{"op": "init", "num_blocks": 1e20, "block_size": 16}\n',
        "t_init_huge.jsonl": '{"op": "init", "num_blocks": 1000000000000, "block_size": 16}\n',
        "t_nan.jsonl": '{"op": "init", "num_blocks": NaN, "block_size": 16}\n',
        "t_unknown.jsonl": '{"op": "explode"}\n',
        "fake.gguf": pickled,
        "trunc.gguf": b"GGUF\x03\x00\x00\x00" + b"\x01" * 7,
    }
    for name, data in files.items():
        _write(root, name, data)
    os.makedirs(os.path.join(root, "folder", "config.json"))  # a config path that is a folder
    _checkpoint(root, "ckpt_corrupt", {"model.safetensors": b"\x10\0\0\0\0\0\0\0{garbage"})
    _checkpoint(root, "ckpt_pickle_st", {"model.safetensors": pickled})
    _checkpoint(root, "ckpt_pickle_bin", {"pytorch_model.bin": pickled})
    _checkpoint(root, "ckpt_truncated", {"model.safetensors": _safetensors_header_only()})
    _checkpoint(root, "ckpt_index", {"model.safetensors.index.json": '{"weight_map": 7}'})
    _write(root, "ckpt_deep_config/config.json", "[" * 100_000)
    # Files that are not regular files: opening a FIFO blocks until a writer comes, and a device
    # like /dev/zero reads without end; every reader and writer must refuse them by stat.
    for name in ("pipe.txt", "pipe.jsonl", "pipe.json", "pipe.png", "pipe_out.json", "pipe.gguf"):
        os.mkfifo(os.path.join(root, name))
    os.symlink("/dev/zero", os.path.join(root, "zero.txt"))
    os.makedirs(os.path.join(root, "dir.gguf"))  # a folder named like a GGUF file
    from kvjax.models.hub import BUILTIN

    for name, fifo in (("ckpt_fifo_shard", "model.safetensors"), ("ckpt_fifo_tokenizer", "tokenizer.json")):
        shutil.copytree(BUILTIN["small-gqa"], os.path.join(root, name))
        if os.path.exists(os.path.join(root, name, fifo)):
            os.remove(os.path.join(root, name, fifo))
        os.mkfifo(os.path.join(root, name, fifo))  # a library (safetensors, tokenizers) would block on it
    _write(root, "p_tokens.jsonl", '{"prompt": "a"}\n{"tokens": [1, 2]}\n')
    return root


# (command line, a fragment the one error line must contain). "{w}" is the working folder.
GPU_A = "plan --group A"
DECODE = "decode --model small-gqa --max-tokens 2"
DECODE_OK = DECODE + " --prompts ok.txt"
ROUND_TWO = [  # issue 23: special files and numeric extremes
    ("decode --model small-gqa --max-tokens 2 --prompts pipe.txt", "'pipe.txt' is a FIFO (named pipe)"),
    ("decode --model small-gqa --max-tokens 2 --prompts pipe.jsonl", "'pipe.jsonl' is a FIFO (named pipe)"),
    ("decode --model small-gqa --max-tokens 2 --prompts zero.txt", "'zero.txt' is a character device"),
    ("plan --hf-config pipe.json", "'pipe.json' is a FIFO (named pipe)"),
    ("replay pipe.jsonl", "'pipe.jsonl' is a FIFO (named pipe)"),
    ("replay zero.txt", "'zero.txt' is a character device"),
    ("plan --group A --plot pipe.png", "--plot 'pipe.png' is a FIFO (named pipe)"),
    ("calibrate --model small-gqa --data pipe.txt --out c.json", "'pipe.txt' is a FIFO (named pipe)"),
    ("calibrate --model small-gqa --data ok.txt --out pipe_out.json", "'pipe_out.json' is a FIFO (named pipe)"),
    ("plan --group A --device-memory-gib 1e999999999", "an exponent of at most 400"),
    ("plan --group A --gpu-memory-utilization 1e-999999999", "an exponent of at most 400"),
    ("plan --group A --kv-offloading-size 1e999999999", "an exponent of at most 400"),
    ("plan --group A --weights-gib 1" + "0" * 200, "at most 100 characters"),
    # checkpoints and GGUF files that a library opens: refused by stat first, named as what they are
    (DECODE_OK.replace("small-gqa", "dir.gguf"), "GGUF file 'dir.gguf' is a folder, not a file"),
    (DECODE_OK.replace("small-gqa", "pipe.gguf"), "GGUF file 'pipe.gguf' is a FIFO (named pipe)"),
    (DECODE_OK.replace("small-gqa", "ok.txt"), "model 'ok.txt' is a file, not a checkpoint folder"),
    (DECODE_OK.replace("small-gqa", "ckpt_fifo_shard"), "model.safetensors' is a FIFO (named pipe)"),
    (DECODE_OK.replace("small-gqa", "ckpt_fifo_tokenizer"), "tokenizer.json' is a FIFO (named pipe)"),
    ("memory --model pipe.gguf --device-memory-gib 1", "'pipe.gguf' is a FIFO (named pipe)"),
    # memory: what follows from the input is checked before it is allocated
    ("memory --model small-gqa --device-memory-gib 0.0001", "per device, more than the device's 107,375 B"),
    (DECODE + " --synthetic 2 --kv-cache-memory-bytes 1T", "of KV cache need"),  # (the default pool fits its requests)
    (DECODE_OK + " --kv-offloading-size 10000", "more than the host's RAM"),
    # flags that would be ignored, or whose effect another flag fixes
    (DECODE + " --prompts p_tokens.jsonl --chat", "p_tokens.jsonl:2: \"tokens\" with --chat"),
    (DECODE_OK + " --logprobs 2", "--logprobs 2: only --json prints"),
    (DECODE_OK + " --kv-cache-dtype-skip-layers 0", "--kv-cache-dtype-skip-layers"),
    (GPU_A + " --kv-cache-memory-bytes 4G --gpu-memory-utilization 0.5", "--gpu-memory-utilization with "
                                                                          "--kv-cache-memory-bytes"),
    (GPU_A + " --kv-cache-memory-bytes 4G --weights-gib 3", "--weights-gib with --kv-cache-memory-bytes"),
    (GPU_A + " --kv-cache-memory-bytes 4G --activations-gib 1", "--activations-gib with --kv-cache-memory-bytes"),
    (GPU_A + " --kv-cache-memory-bytes 4G --extensible", "--extensible with --kv-cache-memory-bytes"),
]

CASES = [
    # plan: numbers at the edge of floats and ints, conflicting and ignored flags, files, outputs
    (GPU_A + " --device-memory-gib 1e400", "--device-memory-gib"),
    (GPU_A + " --kv-cache-memory-bytes 1e307", "--kv-cache-memory-bytes"),
    (GPU_A + " --kv-cache-memory-bytes 1.5G", "decimals are not allowed with the binary suffix G"),
    (GPU_A + " --kv-cache-memory-bytes 0", "--kv-cache-memory-bytes"),
    (GPU_A + " --kv-cache-memory-bytes 99999T", "--kv-cache-memory-bytes"),
    (GPU_A + " --device-memory-gib inf", "--device-memory-gib"),
    (GPU_A + " --device-memory-gib nan", "--device-memory-gib"),
    (GPU_A + " --device-memory-gib -80", "--device-memory-gib"),
    (GPU_A + " --gpu-memory-utilization 1.5", "--gpu-memory-utilization"),
    (GPU_A + " --gpu-memory-utilization nan", "--gpu-memory-utilization"),
    (GPU_A + " --params-b 1e400", "--params-b"),
    (GPU_A + " --weight-dtype int3", "int3"),
    (GPU_A + " --kv-cache-dtype fp4", "fp4"),
    (GPU_A + " --max-model-len 0", "--max-model-len"),
    (GPU_A + " --block-size 4294967296", "--block-size"),
    (GPU_A + " --tensor-parallel-size 0", "--tensor-parallel-size"),
    (GPU_A + " -tp x", "--tensor-parallel-size"),
    (GPU_A + " --kv-offloading-size -1", "--kv-offloading-size"),
    (GPU_A + " --kv-offloading-size abc", "abc"),
    (GPU_A + " --kv-offloading-size nan", "--kv-offloading-size"),
    (GPU_A + " --kv-offloading-size inf", "--kv-offloading-size"),
    (GPU_A + " --kv-offloading-size 1e-9", "smaller than one block of 20971520 bytes"),
    ("plan --kind gqa --layers " + "1" * 31 + " --kv-heads 8 --head-dim 128", "--layers"),
    ("plan --kind gqa --layers 1e30 --kv-heads 8 --head-dim 128", "--layers"),
    ("plan --preset llama-3-8b --layers 4", "--layers"),
    (GPU_A + " --heads 8", "--heads"),
    ("plan --kind mla --layers 4 --kv-lora-rank 512 --qk-rope-head-dim 64 --kv-heads 8", "--kv-heads"),
    ("plan --kind mla --layers 4 --kv-lora-rank 512 --qk-rope-head-dim 64 --head-dim 3", "--head-dim"),
    ("plan --kind gqa --layers 4 --kv-heads 8 --head-dim 128 --kv-lora-rank 5", "--kv-lora-rank"),
    ("plan --kind gqa --layers 4 --kv-heads 3 --heads 8 --head-dim 128", "num_kv_heads 3"),
    ("plan --preset llama-9", "llama-9"),
    ("plan --preset tiny --kind gqa", "choose one model source"),
    ("plan --hf-config folder", "folder"),
    ("plan --hf-config deep.json", "deep.json"),
    ("plan --hf-config bin.txt", "bin.txt:1"),
    ("plan --hf-config missing.json", "missing.json"),
    ("plan --hf-config list.json", "list.json"),
    ("plan --hf-config nan_config.json", "nan_config.json"),
    (GPU_A + " --plot nodir/x.png", "--plot"),
    (GPU_A + " --plot ok.txt/x.png", "--plot"),
    (GPU_A + " --plot folder", "--plot"),
    (GPU_A + " --plot c.txt", "must end in .png, .svg, .pdf"),
    (GPU_A + " --plot concurrency", "must end in .png, .svg, .pdf"),
    (GPU_A + " --plot c.jpeg", "--plot 'c.jpeg'"),
    ("plan", "no model"),
    ("tables --bogus", "--bogus"),
    # replay: malformed traces and pools too large to be a reading exercise
    ("replay deep.jsonl", "deep.jsonl: line 1"),
    ("replay bin.txt", "bin.txt: line 1"),
    ("replay folder", "folder"),
    ("replay missing.jsonl", "missing.jsonl"),
    ("replay t_init_float.jsonl", "num_blocks"),
    ("replay t_init_huge.jsonl", "num_blocks"),
    ("replay t_nan.jsonl", "NaN"),
    ("replay t_unknown.jsonl", "explode"),
    # decode: flags
    (DECODE_OK + " --num-gpu-blocks-override 1e20", "--num-gpu-blocks-override"),
    (DECODE_OK + " --num-gpu-blocks-override 100000000000000000000", "--num-gpu-blocks-override"),
    (DECODE_OK + " --num-gpu-blocks-override 8 --kv-cache-memory-bytes 4M", "not allowed with argument"),
    (DECODE_OK + " --kv-cache-memory-bytes 4Q", "--kv-cache-memory-bytes"),
    (DECODE_OK + " --block-size 4294967296", "--block-size"),
    (DECODE_OK + " --gpu-memory-utilization 0.5 --device-memory-gib inf", "--device-memory-gib"),
    (DECODE_OK + " --device-memory-gib 2", "--device-memory-gib"),
    (DECODE_OK + " --gpu-memory-utilization 0", "--gpu-memory-utilization"),
    (DECODE_OK + " --temperature nan", "--temperature"),
    (DECODE_OK + " --temperature 1 --top-p 2", "--top-p"),
    (DECODE_OK + " --greedy --top-k 5", "--top-k"),
    (DECODE_OK + " --greedy --temperature 0.5", "not allowed with argument"),
    (DECODE_OK + " --top-k -2", "--top-k"),
    (DECODE_OK + " --min-p 1.5", "--min-p"),
    (DECODE_OK + " --presence-penalty 3", "--presence-penalty"),
    (DECODE_OK + " --frequency-penalty -2.5", "--frequency-penalty"),
    (DECODE_OK + " --repetition-penalty 0", "--repetition-penalty"),
    (DECODE_OK + " --min-tokens 3", "--min-tokens 3 exceeds --max-tokens 2"),
    (DECODE_OK + " --greedy --n 2", "--n 2"),
    (DECODE_OK + " --n 0", "--n"),
    (DECODE_OK + " --logprobs -2", "--logprobs"),
    (DECODE_OK + " --logprobs", "--logprobs"),
    (DECODE_OK + " --scheduling-policy lifo", "--scheduling-policy"),
    (DECODE_OK + " --attention-backend flash", "--attention-backend"),
    (DECODE_OK + " --dtype fp64", "--dtype"),
    (DECODE_OK + " --seed -1", "--seed"),
    (DECODE_OK + " --max-num-seqs 4294967296", "--max-num-seqs"),
    (DECODE_OK + " --stop-token-ids 1,x", "--stop-token-ids"),
    (DECODE_OK + " --stop-token-ids 99999999999", "--stop-token-ids"),
    (DECODE_OK + " --shared-prefix 4", "--shared-prefix"),
    (DECODE_OK + " --kv-offloading-size -1", "--kv-offloading-size"),
    (DECODE_OK + " --kv-offloading-size 1GiB", "--kv-offloading-size"),
    (DECODE_OK + " --kv-offloading-size 1e-12", "--kv-offloading-size 1e-12 GiB = 1 bytes is smaller than one block"),
    (DECODE_OK + " --kv-offloading-size 0.5 --no-enable-prefix-caching", "--kv-offloading-size"),
    (DECODE_OK + " --kv-offloading-size 0.5 --kv-transfer-config "
     '{"kv_connector_extra_config":{"eviction_policy":"mru"}}', "kv offload policy must be one of lru, arc"),
    (DECODE_OK + ' --kv-offloading-size 0.5 --kv-transfer-config {"kv_role":"kv_both","x":1}', "'x'"),
    (DECODE_OK + " --kv-offloading-size 0.5 --kv-transfer-config [1]", "--kv-transfer-config: must be a JSON object"),
    (DECODE_OK + " --kv-offloading-size 0.5 --kv-transfer-config {", "--kv-transfer-config: must be a JSON object: "
                                                                    "not valid JSON"),
    (DECODE_OK + " --kv-transfer-config {}", "--kv-transfer-config"),
    (DECODE + " --synthetic 0", "--synthetic"),
    (DECODE + " --synthetic 2 --chat", "--chat"),
    (DECODE + " --max-tokens 0 --prompts ok.txt", "--max-tokens"),
    # decode: prompts files
    (DECODE + " --prompts deep.jsonl", "deep.jsonl:1"),
    (DECODE + " --prompts bin.txt", "bin.txt:1"),
    (DECODE + " --prompts bin.jsonl", "bin.jsonl:2"),
    (DECODE + " --prompts missing.txt", "missing.txt"),
    (DECODE + " --prompts folder", "folder"),
    (DECODE + " --prompts p_tokens5.jsonl", "p_tokens5.jsonl:1"),
    (DECODE + " --prompts p_null.jsonl", "p_null.jsonl:1"),
    (DECODE + " --prompts p_inf.jsonl", "p_inf.jsonl:1"),
    (DECODE + " --prompts p_prompt123.jsonl", "p_prompt123.jsonl:1"),
    (DECODE + " --prompts p_float.jsonl", "p_float.jsonl:1"),
    (DECODE + " --prompts p_unknown.jsonl", "temperature"),
    (DECODE + " --prompts p_both.jsonl", "p_both.jsonl:1"),
    (DECODE + " --prompts p_priority.jsonl", "--scheduling-policy priority"),
    (DECODE + " --prompts p_bigint.jsonl", "p_bigint.jsonl:1"),
    (DECODE + " --prompts p_line3.jsonl", "p_line3.jsonl:3"),
    (DECODE + " --prompts p_array.jsonl", "p_array.jsonl:1"),
    (DECODE + " --prompts p_maxtok.jsonl", "max_tokens"),
    # decode: scales files and their match with the cache
    (DECODE_OK + " --kv-cache-dtype fp8_e4m3 --scales s_k5.json", "s_k5.json"),
    (DECODE_OK + " --kv-cache-dtype fp8_e4m3 --scales s_banana.json", "banana"),
    (DECODE_OK + " --kv-cache-dtype fp8_e4m3 --scales s_e5m2.json", "fp8_e5m2"),
    (DECODE_OK + " --kv-cache-dtype fp8_e4m3 --scales s_negative.json", "s_negative.json"),
    (DECODE_OK + " --kv-cache-dtype fp8_e4m3 --scales s_mode.json", "per_channel"),
    (DECODE_OK + " --kv-cache-dtype fp8_e4m3 --scales s_extra.json", "scale"),
    (DECODE_OK + " --kv-cache-dtype fp8_e4m3 --scales deep.json", "deep.json"),
    (DECODE_OK + " --kv-cache-dtype fp8_e4m3 --scales missing.json", "missing.json"),
    (DECODE_OK + " --scales s_e5m2.json", "--scales"),
    # decode: checkpoints (corrupt, truncated, pickled) and limits that need the model
    ("decode --model ckpt_corrupt --max-tokens 2 --prompts ok.txt", "model.safetensors"),
    ("decode --model ckpt_pickle_st --max-tokens 2 --prompts ok.txt", "model.safetensors"),
    ("decode --model ckpt_pickle_bin --max-tokens 2 --prompts ok.txt", "pickled"),
    ("decode --model ckpt_truncated --max-tokens 2 --prompts ok.txt", "ckpt_truncated"),
    ("decode --model ckpt_index --max-tokens 2 --prompts ok.txt", "weight_map"),
    ("decode --model ckpt_deep_config --max-tokens 2 --prompts ok.txt", "config.json"),
    ("decode --model fake.gguf --max-tokens 2 --prompts ok.txt", "fake.gguf"),
    ("decode --model trunc.gguf --max-tokens 2 --prompts ok.txt", "trunc.gguf"),
    ("decode --model nowhere --max-tokens 2 --prompts ok.txt", "nowhere"),
    (DECODE_OK + " --max-model-len 100000000", "--max-model-len"),
    (DECODE_OK + " --num-gpu-blocks-override 2000000000", "int32"),
    (DECODE_OK + " --num-gpu-blocks-override 100000000", "need 3,276,800,000,000 B"),
    (DECODE + " --synthetic 2 --prompt-len 5000", "--prompt-len"),
    (DECODE_OK + " --chat", "chat template"),
    # calibrate
    ("calibrate --model small-gqa --data ok.txt --out nodir/s.json", "--out"),
    ("calibrate --model small-gqa --data ok.txt --out folder", "--out"),
    ("calibrate --model small-gqa --data ok.txt --out /proc/kvjax_scales.json", "cannot be written"),
    ("calibrate --model small-gqa --data missing.txt --out s.json", "missing.txt"),
    ("calibrate --model small-gqa --data ok.txt --seq-len 100000 --out s.json", "--seq-len"),
    ("calibrate --model small-gqa --data ok.txt --seq-len 0 --out s.json", "--seq-len"),
    ("calibrate --model small-gqa --data ok.txt --out s.json", "ok.txt"),
    ("calibrate --model small-gqa --data ok.txt --mode per_channel --out s.json", "--mode"),
    # accuracy
    ("accuracy --outlier-channels --outlier-factor nan", "--outlier-factor"),
    ("accuracy --outlier-factor 5", "--outlier-channels"),
    ("accuracy --out ok.txt", "--out"),
    ("accuracy --data missing.txt", "missing.txt"),
    ("accuracy --seq-len -5", "--seq-len"),
    ("accuracy --variants fp9", "'fp9'"),
    ("accuracy --max-windows 1e9", "--max-windows"),
    # memory
    ("memory --model small-gqa --device-memory-gib inf", "--device-memory-gib"),
    ("memory --model small-gqa --device-memory-gib 1e400", "--device-memory-gib"),
    ("memory --model small-gqa --device-memory-gib 1 --gpu-memory-utilization 2", "--gpu-memory-utilization"),
    ("memory --model small-gqa --device-memory-gib 1 --max-model-len 100000000", "--max-model-len"),
    ("memory --model small-gqa --device-memory-gib 1 --max-num-batched-tokens 1G", "--max-num-batched-tokens"),
    ("memory --model small-gqa --device-memory-gib 1 --tensor-parallel-size 0", "--tensor-parallel-size"),
    ("memory --model small-gqa --device-memory-gib 1 --kv-cache-dtype fp9", "--kv-cache-dtype"),
    ("memory --model small-gqa --device-memory-gib 1 --dtype double", "--dtype"),
    ("memory --model ckpt_pickle_st --device-memory-gib 1", "model.safetensors"),
    ("memory --model preset:nope --device-memory-gib 1", "nope"),
    # report and the top level
    ("report --out ok.txt/x", "--out"),
    ("report --skip bogus", "bogus"),
    ("", "the following arguments are required"),
    ("explode", "explode"),
]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def _listing(root: str) -> dict[str, float]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = os.stat(path).st_mtime_ns
    return out


CASES += ROUND_TWO


def test_the_table_is_large():
    assert len(CASES) >= 60 and len({c for c, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("command,fragment", CASES, ids=[c or "(none)" for c, _ in CASES])
def test_bad_input_exits_2_with_one_line(command, fragment, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    before = _listing(workdir)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    start = time.perf_counter()
    try:
        rc = main(command.split())
    except _Timeout:
        pytest.fail(f"kvjax {command} ran for 60 s without answering")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = err.splitlines()
    name = command.split()[0] if command else ""
    prefix = f"kvjax {name}: error: " if name in ("plan", "tables", "replay", "decode", "calibrate", "accuracy",
                                                   "memory", "report") else "kvjax: error: "
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(workdir, MARKER)), "a pickle was unpickled"
    assert _listing(workdir) == before, "a refused command wrote to the working folder"
    assert elapsed < 30, f"{elapsed:.1f} s before refusing"


@pytest.mark.parametrize("command,fragment", [
    ("decode --model ckpt_pickle_st --max-tokens 2 --prompts ok.txt", "model.safetensors"),
    ("decode --model ckpt_pickle_bin --max-tokens 2 --prompts ok.txt", "pickled"),
    ("plan --group A --device-memory-gib 1e400", "--device-memory-gib"),
    ("replay deep.jsonl", "deep.jsonl: line 1"),
])
def test_the_installed_script_keeps_the_contract(command, fragment, workdir):
    """The real entry point (a fresh process, the console script's exit status)."""
    script = shutil.which("kvjax", path=os.path.dirname(sys.executable)) or shutil.which("kvjax")
    argv = [script] if script else [sys.executable, "-m", "kvjax.commands.main"]
    proc = subprocess.run(argv + command.split(), cwd=workdir, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not os.path.exists(os.path.join(workdir, MARKER))


def test_replay_keeps_state_after_a_refused_op(tmp_path, capsys):
    """Errors stop a replay, but every op before them printed the exact state (kept from before)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"op":"init","num_blocks":6,"block_size":4}\n{"op":"add","req":"a","tokens":[1,2,3,4,5]}\n'
                     '{"op":"add","req":"b","tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}\n'
                     '{"op":"add","req":"c","tokens":[1e400]}\n')
    assert main(["replay", str(trace)]) == 2
    out, err = capsys.readouterr()
    states = [json.loads(line) for line in out.splitlines()]
    assert [s["ok"] for s in states] == [True, True, False]
    # the refused add of b left a's blocks and the free queue exactly as after a's add
    assert states[2]["free_queue"] == states[1]["free_queue"] and states[2]["num_free"] == states[1]["num_free"]
    assert err.startswith(f"kvjax replay: error: {trace}: line 4:") and len(err.splitlines()) == 1


# Every old kvjax flag name, in the commands that had it: refused with one line naming vLLM's
# name (or kvjax's one name for a kvjax concept), before argparse or any work, in both forms.
OLD_FLAGS = {  # old: (its new name, the commands that had it)
    "--kv-dtype": ("--kv-cache-dtype", ("plan", "decode", "memory")),
    "--util": ("--gpu-memory-utilization", ("plan", "decode", "memory")),
    "--num-blocks": ("--num-gpu-blocks-override", ("decode",)),
    "--no-prefix-caching": ("--no-enable-prefix-caching", ("decode",)),
    "--no-chunked-prefill": ("--no-enable-chunked-prefill", ("decode",)),
    "--kv-offload-gib": ("--kv-offloading-size", ("plan", "decode")),
    "--kv-offload-policy": ("--kv-transfer-config", ("decode",)),
    "--tp": ("--tensor-parallel-size", ("plan", "memory")),
    "--kv-cache-memory-gib": ("--kv-cache-memory-bytes", ("plan",)),
    "--priority": ("--scheduling-policy", ("decode",)),
    "--attn-impl": ("--attention-backend", ("decode",)),
    "--context": ("--max-model-len", ("plan",)),
    "--gpu-gib": ("--device-memory-gib", ("plan",)),
    "--total-gib": ("--device-memory-gib", ("memory", "decode")),
}
COMMAND_LINES = {"plan": GPU_A, "decode": DECODE_OK, "memory": "memory --model small-gqa"}
OLD_CASES = [(old, new, cmd, form) for old, (new, cmds) in OLD_FLAGS.items() for cmd in cmds
             for form in ("{old} 1", "{old}=1")]


def test_the_old_flag_table_is_the_cli_table():
    from kvjax.commands.main import RENAMED

    assert set(OLD_FLAGS) == set(RENAMED)


def _options(command: str) -> set[str]:
    from kvjax.commands.main import build_parser

    sub = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices[command]._option_string_actions)


@pytest.mark.parametrize("old, new, command, form", OLD_CASES,
                         ids=[f"{c}-{f.format(old=o)}" for o, _, c, f in OLD_CASES])
def test_old_flag_names_are_refused_with_the_new_name(old, new, command, form, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    before = _listing(workdir)
    assert main([*COMMAND_LINES[command].split(), *form.format(old=old).split()]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"kvjax {command}: error: {old} is now {new}"), err
    assert _listing(workdir) == before
    options = _options(command)
    assert new in options and old not in options  # the hint names a flag the command has


def test_an_output_check_leaves_no_target_behind_a_dangling_symlink(tmp_path):
    from kvjax.utils.output_files import check_output_file

    link = tmp_path / "plot.png"
    os.symlink(tmp_path / "target.png", link)  # the target does not exist yet
    check_output_file(str(link), "--plot")
    assert not os.path.exists(tmp_path / "target.png") and os.path.islink(link)


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    """`kvjax tables | true`: the reader left before the output came (`true` exits at once, kvjax
    takes a moment to start); no traceback, SIGPIPE's status 141. (With `| head -c 10` the status
    depends on a race: output that reaches the pipe before head exits is written, status 0.)"""
    script = shutil.which("kvjax", path=os.path.dirname(sys.executable)) or "kvjax"
    proc = subprocess.run(f"'{script}' tables | true; echo \"${{PIPESTATUS[0]}}\"", shell=True,
                          executable="/bin/bash", capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.stderr == "" and proc.stdout.strip() == "141"


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    import kvjax.commands.tables as tables

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tables, "run", interrupted)
    assert main(["tables"]) == 130
    assert capsys.readouterr().err == "kvjax tables: interrupted\n"


def test_the_python_api_refuses_special_files_too(tmp_path):
    from kvjax.errors import KvjaxError
    from kvjax.quant.formats import KVScales
    from kvjax.utils.input_files import read_text

    fifo = tmp_path / "scales.json"
    os.mkfifo(fifo)
    for reader in (lambda: read_text(str(fifo), "text"), lambda: KVScales.load(str(fifo)),
                   lambda: read_text("/dev/zero", "text")):
        with pytest.raises(KvjaxError, match="not a regular file"):
            reader()


def test_a_byte_order_mark_is_no_part_of_a_prompt_or_a_json_file(tmp_path):
    """Windows editors start UTF-8 files with U+FEFF; it was read as the first prompt's first
    three byte tokens (and a JSON file holding one was refused)."""
    from kvjax.commands.prompts import read_prompts
    from kvjax.utils.strict_json import read_json

    bom = b"\xef\xbb\xbf"
    (tmp_path / "p.txt").write_bytes(bom + b"hello\r\nworld\n")
    (tmp_path / "p.JSONL").write_bytes(bom + b'{"prompt": "hi"}\n{"tokens": [1, 2]}\n')
    (tmp_path / "c.json").write_bytes(bom + b'{"a": 1}')
    assert [r["prompt"] for r in read_prompts(str(tmp_path / "p.txt"))] == ["hello", "world"]
    assert [(r["prompt"], r["tokens"]) for r in read_prompts(str(tmp_path / "p.JSONL"))] == [("hi", None),
                                                                                           (None, [1, 2])]
    assert read_json(tmp_path / "c.json", "config") == {"a": 1}
    (tmp_path / "mid.txt").write_bytes(b"a" + bom + b"b\n")  # only a leading one is a mark: inside, it is text
    assert read_prompts(str(tmp_path / "mid.txt"))[0]["prompt"] == "a\ufeffb"


def test_text_prompts_split_on_newlines_only_and_jsonl_in_any_case(tmp_path):
    from kvjax.commands.prompts import read_prompts

    text = tmp_path / "p.txt"
    text.write_bytes("a\fb\u2028c\nsecond\r\n\nthird\n".encode())
    # str.splitlines would also split at \f and U+2028; the .jsonl reader does not, nor does this one
    assert [r["prompt"] for r in read_prompts(str(text))] == ["a\fb\u2028c", "second", "", "third"]
    upper = tmp_path / "P.JSONL"
    upper.write_text('{"prompt": "hi"}\n')
    assert [r["prompt"] for r in read_prompts(str(upper))] == ["hi"]


def test_a_lone_surrogate_is_refused_before_the_tokenizer():
    from kvjax.errors import KvjaxError
    from kvjax.models.tokenizer import Tokenizer

    with pytest.raises(KvjaxError, match=r"lone surrogate U\+D800 at character 2"):
        Tokenizer().encode("ab\ud800c")
    with pytest.raises(KvjaxError, match="must be a string, got NoneType"):
        Tokenizer().encode(None)


# ----------------------------------------------------------------------------------- the Python API's types
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=4),
                 st.binary(max_size=4), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_INT, _BOOL, _STR, _NONE = ("int",), ("bool",), ("str",), ("none",)
LLM_ARGS = {  # argument → the kinds of value it takes (anything else must be refused)
    **{n: _INT for n in ("seed", "steps_per_call", "max_logprobs", "tensor_parallel_size")},
    # None: vLLM's platform default (EngineArgs' None for block_size, max_num_seqs, the two switches)
    **{n: _INT + _NONE for n in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                                 "kv_cache_memory_bytes", "total_memory_bytes", "block_size", "max_num_seqs")},
    **{n: _BOOL + _NONE for n in ("enable_prefix_caching", "enable_chunked_prefill")},
    **{n: _BOOL for n in ("use_tqdm_on_load", "enforce_eager", "disable_hybrid_kv_cache_manager",
                          "disable_log_stats")},
    **{n: ("real", "none") for n in ("gpu_memory_utilization", "kv_offloading_size")},
    **{n: _STR for n in ("dtype", "kv_cache_dtype", "scheduling_policy", "kv_layout", "generation_config")},
    **{n: _STR + _NONE for n in ("attention_backend", "kv_skip_dtype", "chat_template", "scales")},
    "kv_transfer_config": ("dict", "none"),
}
SAMPLING_ARGS = {
    **{n: _INT for n in ("n", "top_k", "min_tokens")},
    **{n: _INT + _NONE for n in ("max_tokens", "seed", "logprobs", "prompt_logprobs")},
    **{n: ("real",) for n in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                              "top_p", "min_p")},
    **{n: _BOOL for n in ("ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output")},
    "stop": ("str", "list", "none"), "stop_token_ids": ("list", "none"),
}


def _kind(value) -> set[str]:
    if value is None:
        return {"none"}
    if isinstance(value, bool):
        return {"bool"}
    if isinstance(value, int):
        return {"int", "real"}
    if isinstance(value, float):
        return {"real"}
    return {type(value).__name__}


@pytest.mark.parametrize("name", sorted(LLM_ARGS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_ANY)
def test_llm_refuses_a_wrong_type_for_every_argument(name, value):
    from kvjax import LLM
    from kvjax.errors import KvjaxError

    if _kind(value) & set(LLM_ARGS[name]) or (name == "logprobs" and isinstance(value, bool)):
        return  # a value of a kind the argument takes: not this test's subject
    with pytest.raises(KvjaxError):  # refused before any model is loaded: never a TypeError from deep inside
        LLM("small-gqa", **{name: value})


@pytest.mark.parametrize("name", sorted(SAMPLING_ARGS))
@settings(max_examples=40, deadline=None)
@given(value=_ANY)
def test_sampling_params_refuse_a_wrong_type_for_every_field(name, value):
    from kvjax import SamplingParams
    from kvjax.errors import KvjaxError

    if _kind(value) & set(SAMPLING_ARGS[name]) or (name in ("logprobs", "prompt_logprobs") and value is True):
        return
    with pytest.raises(KvjaxError):
        SamplingParams(**{name: value})


def test_a_config_eos_id_of_the_wrong_kind_is_refused_not_dropped(tmp_path):
    from kvjax.errors import KvjaxError
    from kvjax.models.hub import eos_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert eos_token_ids(str(tmp_path)) == (7, 3)  # config.json's first: the primary EOS
    for bad in ("10", 2.5, [1, "2"], -1):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(KvjaxError, match="generation_config.json: eos_token_id must be a token id"):
            eos_token_ids(str(tmp_path))


# --------------------------------------------------------------------------------------------
# Writing: every output goes through kvjax.utils.output_files.write_file (atomic, failures as one line)
# --------------------------------------------------------------------------------------------
def _kvjax_script() -> str:
    return shutil.which("kvjax", path=os.path.dirname(sys.executable)) or "kvjax"


def test_a_write_that_fails_is_one_line_and_leaves_the_old_file(tmp_path):
    """`--plot` under a 4 KB file-size limit: the PNG (~50 KB) cannot be written. One line, exit
    2, the old file untouched, no temporary file left."""
    # A first plot without the limit, elsewhere: on a new machine it makes the caches the limited run
    # would fail to write, each failure a line of its own (matplotlib's font list).
    (tmp_path / "warm").mkdir()
    subprocess.run([_kvjax_script(), "plan", "--group", "A", "--plot", "w.png"], cwd=tmp_path / "warm", timeout=120,
                   capture_output=True, check=True)
    old = tmp_path / "c.png"
    old.write_bytes(b"the old plot")
    # bash's `ulimit -f` counts KiB; SIGXFSZ ignored (and so across exec), a write past it fails with EFBIG
    proc = subprocess.run(["bash", "-c", f"trap '' XFSZ; ulimit -f 4; exec '{_kvjax_script()}' plan --group A "
                           "--plot c.png"], cwd=tmp_path, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == "kvjax plan: error: --plot 'c.png': writing failed: File too large\n"
    assert old.read_bytes() == b"the old plot" and sorted(os.listdir(tmp_path)) == ["c.png", "warm"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this platform")
@pytest.mark.parametrize("command", [["tables"], ["plan", "--group", "A", "--json"]])
def test_a_full_stdout_is_one_line(command, tmp_path):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([_kvjax_script(), *command], cwd=tmp_path, timeout=120, stdout=full,
                              stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 2
    assert proc.stderr == f"kvjax {command[0]}: error: cannot write to standard output: No space left on device\n"


def test_write_file_replaces_atomically_replaces_links_and_keeps_modes(tmp_path):
    from kvjax.errors import OutputPathError
    from kvjax.utils.output_files import write_file, write_text

    target = tmp_path / "out.md"
    target.write_text("old")
    os.chmod(target, 0o600)
    with pytest.raises(RuntimeError):  # any failure in the middle: the old file stays, no temp file
        with write_file(target, "--out") as fh:
            fh.write("half")
            raise RuntimeError("the work failed")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.md"]
    with pytest.raises(OutputPathError, match="--out .*out.md.*: writing failed: No space left on device"):
        with write_file(target, "--out") as fh:
            raise OSError(28, "No space left on device")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.md"]
    write_text(target, "new", "--out")
    assert target.read_text() == "new" and os.stat(target).st_mode & 0o777 == 0o600  # a replaced file keeps its mode
    (tmp_path / "real.md").write_text("the link's target")
    os.chmod(tmp_path / "real.md", 0o600)
    link = tmp_path / "link.md"
    os.symlink("real.md", link)  # replaced by the new file, never followed: its target stays as it was
    old_mask = os.umask(0o022)
    try:
        write_text(link, "not through the link", "--out")
    finally:
        os.umask(old_mask)
    assert not os.path.islink(link) and link.read_text() == "not through the link"
    assert (tmp_path / "real.md").read_text() == "the link's target"
    assert os.stat(link).st_mode & 0o777 == 0o644  # a new file: 0666 less the umask, not the target's mode
    fifo = tmp_path / "fifo.md"
    os.mkfifo(fifo)  # never opened (it would block) nor replaced by a file
    with pytest.raises(OutputPathError, match="'.*fifo.md' is a FIFO"):
        write_text(fifo, "x", "--out")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("ext, magic", [(".svg", b"<?xml"), (".pdf", b"%PDF"), (".png", b"\x89PNG")])
def test_the_plot_is_written_at_the_path_checked_in_its_format(ext, magic, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--group", "A", "--plot", f"c{ext}"]) == 0
    assert os.listdir(tmp_path) == [f"c{ext}"] and (tmp_path / f"c{ext}").read_bytes().startswith(magic)


# --------------------------------------------------------------------------------------------
# Memory: sizes that follow from the input are checked before allocation
# --------------------------------------------------------------------------------------------
@pytest.fixture
def small_host(monkeypatch):
    """A host with 8 GiB of RAM (the CPU device's ceiling), whatever this machine has."""
    from kvjax.accounting import memory

    monkeypatch.setattr(memory, "host_ram_bytes", lambda: 8 * 2**30)


def test_weights_that_cannot_fit_are_refused_before_any_is_made(small_host, capsys):
    from kvjax import LLM
    from kvjax.accounting.memory import WontFitError

    start = time.perf_counter()
    with pytest.raises(WontFitError, match=r"bfloat16 weights of a llama model \(80 layers.* need 141,107,412,992 B"):
        LLM("preset:llama-3-70b", use_tqdm_on_load=False)
    assert main(["memory", "--model", "preset:llama-3-70b", "--device-memory-gib", "80"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvjax memory: error: the bfloat16 weights of preset:llama-3-70b (70,553,706,496 "
                          "parameters) need 141,107,412,992 B") and err.count("\n") == 1
    assert time.perf_counter() - start < 30


def test_the_schedulers_tables_are_sized_from_their_shapes_and_checked(small_host):
    from kvjax.accounting.memory import WontFitError, tree_bytes
    from kvjax.config.scheduler import SchedulerConfig
    from kvjax.core.sched.scheduler import Scheduler
    from kvjax.core.sched.tables import state_bytes

    config = SchedulerConfig(num_blocks=300, block_size=16, max_num_seqs=4, max_model_len=1000, num_host_blocks=50,
                             host_policy="arc")
    sched = Scheduler(config)
    assert state_bytes(config) == tree_bytes((sched.state, sched.host))  # the shapes' bytes = what was allocated
    huge = SchedulerConfig(num_blocks=2**20, block_size=16, max_num_seqs=65536, max_model_len=2**17)
    # block tables i32[2·65536, 2¹³] and block hashes u32[2·65536, 2¹³, 2]: 12 GiB
    with pytest.raises(WontFitError, match=r"scheduler's tables \(num_blocks=1,048,576, max_num_seqs=65,536 "
                                           r"\(131,072 request slots\)"):
        Scheduler(huge)


def test_the_engine_checks_cache_tables_and_logits_together(monkeypatch):
    from kvjax import LLM
    from kvjax.accounting import memory
    from kvjax.accounting.memory import WontFitError

    # 16 MiB: the 100 blocks of KV (3.2 MB) fit alone, but not with 8192 request slots' tables (10 MiB)
    # and 4096 rows of logits
    monkeypatch.setattr(memory, "host_ram_bytes", lambda: 16 * 2**20)
    with pytest.raises(WontFitError, match=r"the KV cache \(3,276,8\d\d B\), the scheduler's tables \(num_blocks=100, "
                                           r"max_num_seqs=4,096 .* and one step's logits"):
        LLM("small-gqa", max_num_seqs=4096, num_gpu_blocks_override=100, use_tqdm_on_load=False)


def test_a_pool_sized_by_the_cpu_default_says_so(small_host, monkeypatch):
    from kvjax import LLM
    from kvjax.accounting.memory import WontFitError
    from kvjax.engine import arg_utils

    # 65536 requests of 2048 tokens would need 1 + 65536 × cdiv(2048, 16) blocks of 32 KiB (256 GiB); the CPU's
    # default takes a quarter of the memory node instead, here a 64 GiB node's 16 GiB: 524,288 blocks, + the null
    # block, which an 8 GiB host cannot hold either
    monkeypatch.setattr(arg_utils, "_node_memory_bytes", lambda: 64 * 2**30)
    with pytest.raises(WontFitError, match=r"num_blocks 524,289 \(the CPU's KV budget of 17,179,869,184 B // 32,768 B "
                                           r"per block, at least the longest request's 128 blocks; "
                                           r"max_num_seqs=65,536 requests of 2,048 tokens, 128 blocks each would need "
                                           r"8,388,608: preemption covers the rest\) of 32,768 B of KV cache need"):
        LLM("small-gqa", max_num_seqs=65536, use_tqdm_on_load=False)
