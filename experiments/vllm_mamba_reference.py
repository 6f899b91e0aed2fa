"""kvjax.accounting.hybrid's Mamba arithmetic beside vLLM 0.33's own functions, on the published hybrid configs
(kvjax.config.mamba_presets: Granite-4.0-H tiny and small, Nemotron-H-8B, Bamba-9B, Falcon-H1-0.5B, Jamba-v0.1).

    pip download vllm==0.33.0 --no-deps -d W && unzip -q W/vllm-0.33.0-*.whl -d SRC
    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 transformers==5.25.0 \
        cbor2 pyzmq aiohttp openai openai-harmony pybase64 cachetools msgspec cloudpickle py-cpuinfo xgrammar \
        fastapi partial-json-parser llguidance pydantic psutil prometheus_client urllib3 requests pillow uvloop
    PYTHONPATH=. /tmp/vllm-venv/bin/python experiments/vllm_mamba_reference.py --vllm-src SRC

vLLM lives in its own venv (it is not a kvjax dependency), and kvjax's arithmetic here is plain Python, so both
run in that venv (PYTHONPATH=. puts this checkout's kvjax on the path). vLLM's side, for each case:
transformers' config class reads the config.json (as vLLM's ModelConfig does), and its `layers_block_type` /
`layer_types` give the layers' kinds; the model class's `get_mamba_state_shape_from_config` and
`get_mamba_state_dtype_from_config` give the state (`NemotronHForCausalLMConfig.verify_and_update_config` sets
Nemotron-H's SSM dtype first; vLLM 0.33 removed BambaForCausalLM, so Bamba-9B's state comes from
GraniteMoeHybridForCausalLM's, which reads the same mamba_* fields); `Platform._align_hybrid_block_size` grows
the block size with FlashAttention's kernel block (`MultipleOf(16)`, CUDA's) and pads the Mamba page;
`FullAttentionSpec` and `MambaSpec(mamba_cache_mode="none", block_size=max_model_len)` per layer, in the
layers' order, go through `kv_cache_planning.get_kv_cache_groups`, `_get_kv_cache_bytes_per_block` (layer-outer
layout), num_blocks = budget // bytes per block, and `get_max_concurrency_for_kv_cache_config`.

The budget is what `kvjax plan --preset NAME --device-memory-gib 141` gives one rank of an H200 (ceil(141 GiB
× 0.92) − the bf16 weights ÷ tp). Prints one line per case, writes experiments/results/vllm_mamba_reference.json
and .md, and prints the rows tests/accounting/test_mamba.py holds (--rows); exits 1 if any figure differs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import types

from kvjax.accounting import budget as bud
from kvjax.accounting.hybrid import plan_model
from kvjax.config.mamba_presets import MAMBA_CONFIGS
from kvjax.config.presets import preset
from kvjax.utils.output_files import write_json, write_text

# (preset, max_model_len, kv_cache_dtype, block size asked for, tp, mamba_ssm_cache_dtype)
CASES = [(name, ctx, "auto", 16, 1, "auto") for name in MAMBA_CONFIGS
         for ctx in sorted({min(c, preset(name).max_position_embeddings) for c in (8192, 131072)})]
CASES += [("granite-4.0-h-small", 32768, "fp8", 16, 1, "auto"), ("granite-4.0-h-small", 32768, "auto", 16, 2, "auto"),
          ("granite-4.0-h-tiny", 32768, "auto", 64, 1, "float32"), ("nemotron-h-8b", 8192, "fp8", 16, 2, "auto"),
          ("bamba-9b", 32768, "auto", 16, 4, "auto"), ("jamba-v0.1", 32768, "fp8", 16, 2, "auto"),
          ("falcon-h1-0.5b", 16384, "auto", 16, 2, "float32")]
BATCHED, BATCHES = 8192, 1  # max_num_batched_tokens; Mamba groups hold one block whatever is in flight
VLLM_CLASS = {"granitemoehybrid": "GraniteMoeHybridForCausalLM", "bamba": "GraniteMoeHybridForCausalLM",
              "nemotron_h": "NemotronHForCausalLM", "falcon_h1": "FalconH1ForCausalLM", "jamba": "JambaForCausalLM"}


def budget_bytes(name: str, tp: int) -> int:
    config = preset(name)
    return bud.plan(config.kv_spec(), context=8192, block_size=16, total_bytes=bud.gib("141"),
                    weights_bytes=bud.weight_bytes(config.num_params, "bf16"), tp=tp).budget_bytes


def kvjax_figures(name, ctx, kv_dtype, block, tp, ssm_dtype):
    config = preset(name)
    p = plan_model(config, budget_bytes(name, tp), kv_dtype=None if kv_dtype == "auto" else kv_dtype,
                   block_size=block, max_model_len=ctx, max_num_batched_tokens=BATCHED,
                   max_concurrent_batches=BATCHES, tp=tp, mamba_ssm_cache_dtype=ssm_dtype)
    return dict(state_shapes=[list(s) for s in p.state.shapes], state_dtypes=list(p.state.dtypes),
                state_bytes=p.state.page_bytes, block_size=p.block_size,
                groups=[[g.kind, list(g.layers)] for g in p.groups], bytes_per_block=p.bytes_per_block,
                num_blocks=p.num_blocks, max_concurrency=p.max_concurrency)


def _layer_kinds(hf) -> list[str]:
    """Each layer's kinds as transformers' config reads them, in vLLM's construction order."""
    kinds = getattr(hf, "layers_block_type", None) or getattr(hf, "layer_types", None)
    names = {"linear_attention": ["mamba"], "mamba": ["mamba"], "full_attention": ["attention"],
             "attention": ["attention"], "hybrid": ["attention", "mamba"], "mlp": [], "moe": []}
    return [names[k] for k in kinds]


def vllm_figures(name, ctx, kv_dtype, block, tp, ssm_dtype):
    import torch
    import transformers
    # Imported by name from the wheel's folder on sys.path (as experiments/vllm_replay_reference.py does): vLLM is a
    # reference here, not a dependency.
    mod = importlib.import_module
    model_configs = mod("vllm.model_executor.models.config")
    ModelRegistry = mod("vllm.model_executor.models.registry").ModelRegistry
    Platform = mod("vllm.platforms.interface").Platform
    convertor = mod("vllm.transformers_utils.model_arch_config_convertor")
    ModelArchConfigConvertorBase = convertor.ModelArchConfigConvertorBase
    STR_DTYPE_TO_TORCH_DTYPE = mod("vllm.utils.torch_utils").STR_DTYPE_TO_TORCH_DTYPE
    MultipleOf = mod("vllm.v1.attention.backend").MultipleOf
    kp, utils = mod("vllm.v1.core.kv_cache_planning"), mod("vllm.v1.core.kv_cache_utils")
    interface = mod("vllm.v1.kv_cache_interface")
    FullAttentionSpec, KVCacheConfig, MambaSpec = (interface.FullAttentionSpec, interface.KVCacheConfig,
                                                   interface.MambaSpec)
    get_kv_quant_mode = interface.get_kv_quant_mode

    cfg = MAMBA_CONFIGS[name]
    hf = transformers.CONFIG_MAPPING[cfg["model_type"]](**{k: v for k, v in cfg.items() if k != "model_type"})
    arch = ModelArchConfigConvertorBase(hf, hf)
    heads, head = arch.get_total_num_kv_heads(), arch.get_head_size()
    cache = types.SimpleNamespace(cache_dtype=kv_dtype, block_size=block, user_specified_block_size=True,
                                  mamba_cache_mode="none", mamba_page_size_padded=None, mamba_block_size=ctx,
                                  mamba_cache_dtype="auto", mamba_ssm_cache_dtype=ssm_dtype,
                                  kv_cache_dtype_skip_layers=[], use_replayssm=False)
    model = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=torch.bfloat16, use_mla=False,
                                  architecture=VLLM_CLASS[cfg["model_type"]], max_model_len=ctx, is_hybrid=True,
                                  get_num_kv_heads=lambda pc: max(1, heads // pc.tensor_parallel_size),
                                  get_head_size=lambda: head)
    vllm_config = types.SimpleNamespace(
        model_config=model, cache_config=cache, parallel_config=types.SimpleNamespace(
            tensor_parallel_size=tp, decode_context_parallel_size=1), num_speculative_tokens=0,
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=types.SimpleNamespace(hisparse_config=None), max_in_flight_tokens=BATCHES * BATCHED)
    if cfg["model_type"] == "nemotron_h":
        model_configs.NemotronHForCausalLMConfig.verify_and_update_config(vllm_config)
    model_cls = ModelRegistry._try_load_model_cls(model.architecture)

    class FlashAttention:  # FlashAttentionBackend on CUDA (vllm/v1/attention/backends/flash_attn.py)
        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return [MultipleOf(16)]

        @staticmethod
        def customize_spec(spec):
            return spec

        @staticmethod
        def get_name():
            return "FLASH_ATTN"

    class Cuda(Platform):
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config):
            return [FlashAttention]

    ModelRegistry.resolve_model_cls = lambda architecture, model_config=None: (model_cls, architecture)
    Cuda._align_hybrid_block_size(vllm_config, FlashAttention)
    dtype = torch.bfloat16 if kv_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[kv_dtype]
    attn = FullAttentionSpec(block_size=cache.block_size, num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
                             head_size=head, dtype=dtype, kv_quant_mode=get_kv_quant_mode(kv_dtype))
    shapes = model_cls.get_mamba_state_shape_from_config(vllm_config)
    dtypes = model_cls.get_mamba_state_dtype_from_config(vllm_config)
    mamba = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=ctx, page_size_padded=cache.mamba_page_size_padded,
                      mamba_cache_mode="none")
    specs = {}
    for i, kinds in enumerate(_layer_kinds(hf)):
        for kind in kinds:
            specs[f"model.layers.{i}.{kind}"] = attn if kind == "attention" else mamba
    cache.get_resolved_kv_cache_layout = lambda: types.SimpleNamespace(is_block_outermost=False)
    groups = kp.get_kv_cache_groups(vllm_config, specs)
    per_block = kp._get_kv_cache_bytes_per_block(groups, types.SimpleNamespace(is_block_outermost=False))
    budget = budget_bytes(name, tp)
    config = KVCacheConfig(num_blocks=budget // per_block, kv_cache_tensors=[], kv_cache_groups=groups)
    kind = {"FullAttentionSpec": "full_attention", "MambaSpec": "mamba"}
    return dict(state_shapes=[list(s) for s in shapes], state_dtypes=[str(d).replace("torch.", "") for d in dtypes],
                state_bytes=mamba.real_page_size_bytes, block_size=cache.block_size,
                groups=[[kind[type(g.kv_cache_spec).__name__], [int(n.split(".")[2]) for n in g.layer_names]]
                        for g in groups],
                bytes_per_block=per_block, num_blocks=budget // per_block,
                max_concurrency=utils.get_max_concurrency_for_kv_cache_config(vllm_config, config))


def _same(mine: dict, theirs: dict) -> bool:
    dtype_names = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
    theirs = dict(theirs, state_dtypes=[dtype_names[d] for d in theirs["state_dtypes"]])
    return mine == theirs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vllm_mamba_reference", description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-src", required=True, help="vLLM 0.33's unzipped wheel (the folder holding vllm/)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--rows", action="store_true", help="print the rows tests/accounting/test_mamba.py holds")
    args = ap.parse_args(argv)
    if not os.path.isdir(os.path.join(args.vllm_src, "vllm")):
        ap.error(f"--vllm-src {args.vllm_src!r} holds no vllm/ folder")
    sys.path.insert(0, args.vllm_src)
    rows, differ = [], 0
    for case in CASES:
        mine, theirs = kvjax_figures(*case), vllm_figures(*case)
        same = _same(mine, theirs)
        differ += not same
        rows.append(dict(case=list(case), same=same, vllm=theirs, kvjax=mine))
        print(f"{'same' if same else 'DIFFERENT':9} {case}: block {theirs['block_size']}, state {theirs['state_bytes']:,} B, "
              f"{len(theirs['groups'])} groups, {theirs['bytes_per_block']:,} B per block, {theirs['num_blocks']:,} "
              f"blocks, concurrency {theirs['max_concurrency']:.4f}" + ("" if same else f"; kvjax: {mine}"))
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "vllm_mamba_reference.json"), rows, "--out", indent=1)
    lines = ["| preset | max_model_len | kv dtype | block asked | tp | SSM dtype | state B | block | groups | B / block "
             "| blocks | max concurrency | same |", "|" + "---|" * 13]
    for r in rows:
        v = r["vllm"]
        lines.append(f"| {' | '.join(map(str, r['case']))} | {v['state_bytes']:,} | {v['block_size']} | "
                     f"{len(v['groups'])} | {v['bytes_per_block']:,} | {v['num_blocks']:,} | {v['max_concurrency']:.4f} | "
                     f"{'yes' if r['same'] else 'NO'} |")
    write_text(os.path.join(args.out, "vllm_mamba_reference.md"), "vLLM 0.33's hybrid Mamba arithmetic beside kvjax's "
               "(experiments/vllm_mamba_reference.py)\n\n" + "\n".join(lines) + "\n", "--out")
    if args.rows:
        for r in rows:
            v = r["vllm"]
            print(f"    ({tuple(r['case'])!r}, {v['state_bytes']}, {v['block_size']}, {len(v['groups'])}, "
                  f"{v['bytes_per_block']}, {v['num_blocks']}, {v['max_concurrency']!r}),")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
