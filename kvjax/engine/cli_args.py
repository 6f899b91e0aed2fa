"""The engine's command-line flags: one table, vLLM's `--kebab-case` names for EngineArgs' fields
(vLLM's `EngineArgs.add_cli_args`). `EngineArgs.add_cli_args(parser)` adds every flag; a `kvjax`
command adds the ones it takes (`add_engine_flags(parser, fields)`, with its own default, help
or type where its meaning differs), so a flag is defined once.

Each flag's type checks its value as the command line reads it (kvjax.utils.checks' int_arg /
float_arg, `human_int_arg` for vLLM's human-readable byte counts: `4G` = 4 GiB, `4g` = 4·10⁹), so
a bad value is argparse's one-line error; the rules across values are EngineArgs'
(`create_engine_config`). No JAX at import.
"""
from __future__ import annotations

import argparse
import re
from typing import Sequence

from kvjax.errors import KvjaxError
from kvjax.utils.argparse_utils import human_readable_int
from kvjax.utils.checks import INT32_MAX, MAX_GIB, float_arg, int_arg
from kvjax.utils.strict_json import loads

def human_int_arg(lo: int = 1, hi: int = INT32_MAX):
    """An argparse `type` for an integer flag in [lo, hi] that vLLM reads with human_readable_int
    (kvjax.utils.argparse_utils: `4G` = 4 GiB, `4g` = 4·10⁹, `25.6k` = 25,600)."""
    def parse(text: str) -> int:
        try:
            value = human_readable_int(text)
        except (ValueError, argparse.ArgumentTypeError) as e:
            why = str(e) if "suffix" in str(e) else "an integer, optionally with k/m/g/t or K/M/G/T"
            raise argparse.ArgumentTypeError(f"must be {why}, got {text[:40]!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo:,}, {hi:,}], got {text[:40]!r}")
        return value
    return parse


def kv_cache_dtype_arg(text: str) -> str:
    """vLLM's --kv-cache-dtype: "auto" (the model's dtype) or a kv dtype kvjax stores."""
    from kvjax.quant.kv_formats import KV_DTYPES, SpecError, kv_format

    if text.lower() == "auto":
        return "auto"
    try:
        kv_format(text)
    except SpecError:
        raise argparse.ArgumentTypeError(f"unknown kv cache dtype {text[:40]!r}; choose auto (the model's dtype) "
                                         f"or one of {', '.join(KV_DTYPES)}") from None
    return text


def skip_layer_arg(text: str) -> int | str:
    """One --kv-cache-dtype-skip-layers entry: a layer index or vLLM's layer type "sliding_window"."""
    from kvjax.config.engine import LAYER_TYPES

    if text in LAYER_TYPES:
        return text
    return int_arg(0)(text)


def json_object_arg(text: str) -> dict:
    """A flag holding a JSON object (vLLM's --hf-overrides, --kv-transfer-config, --profiler-config)."""
    try:
        value = loads(text)
    except KvjaxError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text[:40]!r}")
    return value


GIB = 2**30
BYTES_MAX = MAX_GIB * GIB


def gib_bytes_arg(text: str) -> int:
    """kvjax's --device-memory-gib: GiB (> 0) → bytes (EngineArgs.total_memory_bytes)."""
    return int(float_arg(0, MAX_GIB, lo_open=True)(text) * GIB)


# field → (flags, argparse keyword arguments). The order is vLLM's help order, roughly.
FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "model": (("--model",), dict(default="small-gqa", help="small-gqa | small-mla | smollm2-135m | a Hugging Face "
                                 "folder | PATH.gguf | preset:NAME (random weights)")),
    "dtype": (("--dtype",), dict(default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
                                 help="weights dtype (auto: the checkpoint's; a GGUF's is float32)")),
    "seed": (("--seed",), dict(type=int_arg(0, 2**32 - 1), default=0, help="sampling seed (0)")),
    "max_model_len": (("--max-model-len",), dict(type=human_int_arg(1), metavar="TOKENS",
                                                 help="prompt + generated tokens (default: the model's maximum)")),
    "hf_overrides": (("--hf-overrides",), dict(type=json_object_arg, metavar="JSON",
                                               help="config.json fields over the checkpoint's")),
    "max_logprobs": (("--max-logprobs",), dict(type=int_arg(-1), default=20,
                                               help="the most logprobs a request may ask for (20; -1: no limit)")),
    "generation_config": (("--generation-config",), dict(default="auto", help="auto (the checkpoint's "
                          "generation_config.json), vllm (SamplingParams' defaults) or a folder")),
    "enforce_eager": (("--enforce-eager",), dict(action="store_true", help="one decode step per device call")),
    "enable_trace_replay": (("--enable-trace-replay",), dict(
        action="store_true", help="let requests force their output (SamplingParams.trace_decode_token_ids)")),
    "block_size": (("--block-size",), dict(type=int_arg(1), default=16, help="tokens per block (16)")),
    "kv_cache_dtype": (("--kv-cache-dtype",), dict(type=kv_cache_dtype_arg, default="auto",
                       help="auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2, bf16, int8_per_token_head, ...")),
    "kv_cache_dtype_skip_layers": (("--kv-cache-dtype-skip-layers",), dict(
        type=skip_layer_arg, nargs="+", default=[], metavar="LAYER",
        help="layers that keep the model's dtype: indices, or sliding_window (every windowed layer)")),
    "enable_prefix_caching": (("--enable-prefix-caching",), dict(
        action=argparse.BooleanOptionalAction, default=None, help="share the KV blocks of common prompt prefixes "
        "(default on; off for attention + Mamba hybrids, as vLLM's mamba_cache_mode 'none')")),
    "num_gpu_blocks_override": (("--num-gpu-blocks-override",), dict(type=int_arg(2), metavar="K",
                                help="pool size, null block included")),
    "gpu_memory_utilization": (("--gpu-memory-utilization",), dict(
        type=float_arg(0, 1, lo_open=True), metavar="U",
        help="size the pool from a profiled budget of U × the device's memory (a CPU's: its memory node's)")),
    "kv_cache_memory_bytes": (("--kv-cache-memory-bytes",), dict(type=human_int_arg(1, BYTES_MAX), metavar="BYTES",
                              help="the KV budget in bytes (4G = 4 GiB, 4g = 4e9)")),
    "total_memory_bytes": (("--device-memory-gib",), dict(type=gib_bytes_arg, metavar="GIB",
                           help="kvjax: the device memory --gpu-memory-utilization takes a share of (default: the "
                                "device's)")),
    "kv_offloading_size": (("--kv-offloading-size",), dict(type=float_arg(0, MAX_GIB), metavar="GIB",
                           help="host-memory tier for evicted KV blocks, in GiB (default: none)")),
    "kv_transfer_config": (("--kv-transfer-config",), dict(type=json_object_arg, metavar="JSON", help="the host "
                           "tier's connector settings, e.g. '{\"kv_connector_extra_config\": {\"eviction_policy\": "
                           "\"arc\"}}' (default lru)")),
    "disable_hybrid_kv_cache_manager": (("--disable-hybrid-kv-cache-manager",), dict(
        action="store_true", help="a model with sliding windows keeps every layer full (default: vLLM's hybrid KV "
                                  "cache, a block table per group)")),
    "enable_chunked_prefill": (("--enable-chunked-prefill",), dict(
        action=argparse.BooleanOptionalAction, default=True,
        help="split long prompts over steps (default on; off: the step budget covers the longest prompt)")),
    "max_num_seqs": (("--max-num-seqs",), dict(type=int_arg(1, 2**16), default=8, help="requests running at once "
                                                                                        "(8)")),
    "max_num_batched_tokens": (("--max-num-batched-tokens",), dict(
        type=human_int_arg(1), metavar="N", help="tokens per engine step (default 2048; without chunked prefill at "
                                                 "least max_model_len)")),
    "scheduling_policy": (("--scheduling-policy",), dict(choices=["fcfs", "priority"], default="fcfs",
                          help="priority: lower priority values first")),
    "attention_backend": (("--attention-backend",), dict(
        choices=["reference", "pallas"], help="default: pallas on GPU, except for per-token-scaled KV; reference "
                                              "elsewhere")),
    "tensor_parallel_size": (("--tensor-parallel-size", "-tp"), dict(
        type=int_arg(1, 256), default=1, metavar="N", help="devices the weights and KV pages are split over (1)")),
    "decode_context_parallel_size": (("--decode-context-parallel-size", "-dcp"), dict(
        type=int_arg(1, 256), default=1, metavar="D", help="split MLA's latent cache by token over D of the "
                                                           "tensor-parallel ranks (1; D divides -tp)")),
    "data_parallel_size": (("--data-parallel-size", "-dp"), dict(
        type=int_arg(1, 1024), default=1, metavar="N", help="engine replicas behind one server (1; kvjax serve)")),
    "nnodes": (("--nnodes", "-n"), dict(type=int_arg(1, 4096), default=1, metavar="N",
                                        help="processes (hosts) of one multi-process job (1)")),
    "node_rank": (("--node-rank", "-r"), dict(type=int_arg(0, 4095), default=0, metavar="R",
                                              help="this process's rank in the job (0: the one with the front end)")),
    "master_addr": (("--master-addr",), dict(default="127.0.0.1", metavar="HOST",
                                             help="rank 0's address, where the job's ranks meet (127.0.0.1)")),
    "master_port": (("--master-port",), dict(type=int_arg(1, 65535), default=29501, metavar="PORT",
                                             help="rank 0's port for the job (29501)")),
    "distributed_timeout_seconds": (("--distributed-timeout-seconds",), dict(
        type=int_arg(1, 86400), metavar="S", help="how long ranks wait for each other to join, and a silent rank "
                                                  "lives on, before every process ends (default 60)")),
    "profiler_config": (("--profiler-config",), dict(type=json_object_arg, metavar="JSON",
                        help='e.g. \'{"profiler": "torch", "torch_profiler_dir": "./trace"}\' (a JAX trace)')),
    "disable_log_stats": (("--disable-log-stats",), dict(action="store_true", help="accepted; kvjax logs no stats")),
    "trust_remote_code": (("--trust-remote-code",), dict(action="store_true",
                          help="refused: kvjax runs no code from checkpoints")),
    "scales": (("--scales",), dict(metavar="FILE", help="kvjax: fp8 scales from `kvjax calibrate` (default 1.0)")),
    "steps_per_call": (("--steps-per-call",), dict(type=int_arg(1, 1024), default=1,
                                                   help="kvjax: decode steps per device call (1)")),
}


def add_engine_flags(parser, fields=None, group_title: str | None = "engine arguments (vLLM's EngineArgs)", *,
                     defaults: dict | None = None, helps: dict | None = None, types: dict | None = None,
                     required: Sequence[str] = ()) -> None:
    """Add the flags of `fields` (default: every one in FLAGS) to parser, in one argument group
    (group_title None: into `parser` itself, a parser or one of its argument groups). The two
    pool-size flags and --gpu-memory-utilization are mutually exclusive when all are added.

    A flag keeps the table's names, dest (the EngineArgs field) and type in every command. Where a
    command's meaning differs, it says so by field, and only in these ways:
    - defaults: its own default (`kvjax memory` sizes with vLLM's GPU defaults, --block-size 64);
    - helps: its own help line, for its own default or meaning;
    - types: its own argparse type, where the command reads the value differently from the engine:
      `str` keeps the text as typed, under the field's dest (`kvjax memory` and `kvjax plan` read
      --gpu-memory-utilization and --device-memory-gib as exact decimals, kvjax.accounting.budget);
    - required: fields it cannot run without (--model, for a command that loads a model).
    Every action added carries `engine_field` (its field), so a test can tell an engine flag taken
    from this table from one a command defined by hand."""
    names = list(FLAGS) if fields is None else list(fields)
    unknown = [n for n in names if n not in FLAGS]
    if unknown:
        raise KeyError(f"no engine flag for {unknown}")
    overrides = {"default": defaults or {}, "help": helps or {}, "type": types or {},
                 "required": dict.fromkeys(required, True)}
    stray = sorted({n for by_field in overrides.values() for n in by_field} - set(names))
    if stray:
        raise KeyError(f"overrides for flags not added: {stray}")
    group = parser if group_title is None else parser.add_argument_group(group_title)
    sizes = {"num_gpu_blocks_override", "gpu_memory_utilization", "kv_cache_memory_bytes"}
    exclusive = group.add_mutually_exclusive_group() if sizes <= set(names) else None
    for name in names:
        flags, kwargs = FLAGS[name]
        kwargs = {**kwargs, **{key: by_field[name] for key, by_field in overrides.items() if name in by_field}}
        target = exclusive if exclusive is not None and name in sizes else group
        action = target.add_argument(*flags, dest=name, **kwargs)
        action.engine_field = name


def as_flags(message: str) -> str:
    """An engine-argument message in the command line's words: a field the message starts with, or
    names as `field=value`, becomes its flag (the command's one error line then names the flag)."""
    for name, (flags, _) in FLAGS.items():
        if message.startswith(name + " ") or message.startswith(name + "="):
            message = flags[0] + message[len(name):]
        message = re.sub(rf"\b{name}=", flags[0] + "=", message)
    return message
