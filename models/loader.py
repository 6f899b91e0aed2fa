"""Load a checkpoint into kvjax's Flax parameters: a Hugging Face folder (safetensors) or a GGUF file.

A folder holds `config.json` and either `model.safetensors` or a sharded set indexed by
`model.safetensors.index.json` (its `weight_map` names each tensor's shard), the layout
`save_pretrained` writes; its tensors are read with the safetensors library (numpy framework).
A `*.gguf` file (llama.cpp's format) is read by models.gguf, which presents its dequantized
tensors under the same Hugging Face names and layout.

Either way the tensors come from a models.tensors.TensorSource (Hugging Face names, torch
layout), and one filler, `load_params`, walks the Flax tree: `hf_name` maps each Flax path to
its Hugging Face name (the one place that mapping lives), the tensor is checked against the
shape the Flax model expects, cast to the dtype the model declares for it (the model dtype;
DeepSeek's MoE router float32, as transformers keeps it) and transposed where Flax's Dense keeps
[in, out] and torch's Linear [out, in]. A MoE layer's experts are one stacked Flax array per
projection, [E, in, out]: `expert_tensors` names the per-expert tensors a checkpoint holds (or
transformers 5's fused ones), and `save_checkpoint` writes the per-expert form. gpt-oss stores its
experts fused and [E, in, out] already, with the gate and up columns interleaved and biases beside
them, in bfloat16 (save_pretrained) or MXFP4 (the released checkpoints: models.mxfp4); `_gpt_oss_experts`
reads either form into models.moe's contiguous [gate | up] halves.

Refused, each with its own exception class (models.tensors: CheckpointError subclasses, all
ValueError):
- pickled weights (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`, `*.pkl`) when no safetensors file is
  present: unpickling runs arbitrary code from the file (torch.load's own warning);
- a tensor the model needs that the checkpoint lacks, named;
- a tensor whose shape differs, named with the expected and the found shape;
- a tensor the model does not use, named, except ones transformers also drops: rotary
  `inv_freq` buffers, `lm_head.weight` of a tied model, and DeepSeek-V3's multi-token-prediction
  layers (indices ≥ num_hidden_layers).
A GGUF file adds its own refusals (models.gguf: GGUFError and its subclasses, also CheckpointErrors).
"""
from __future__ import annotations

import contextlib
import glob
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from kvjax.accounting import memory as mem
from kvjax.config.hf import from_hf_config
from kvjax.config.model import ModelConfig
from kvjax.errors import KvjaxError, one_line
from kvjax.models import build_model, mxfp4, param_shapes
from kvjax.models.gguf import GGUFFile
from kvjax.models.tensors import (CheckpointError, MissingTensorError, PickledWeightsError, ShapeMismatchError,
                                  TensorSource, UnexpectedTensorError)
from kvjax.utils.input_files import check_input_file, file_kind
from kvjax.utils.output_files import write_file, write_json
from kvjax.utils.strict_json import read_json_object

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# A Mamba2 mixer's parameter leaves (models.mamba2) → their Hugging Face names under the mixer, none transposed
MIXER_LEAVES = {"conv1d": "conv1d.weight", "conv1d_bias": "conv1d.bias", "norm": "norm.weight", "dt_bias": "dt_bias",
                "A_log": "A_log", "D": "D"}


class SafetensorsSource(TensorSource):
    """The tensors of a Hugging Face folder: model.safetensors, or the shards its index names."""

    def __init__(self, folder: str):
        self.where = folder
        self._files = _tensor_files(folder)  # HF name → file
        self._stack = contextlib.ExitStack()
        try:
            self._handles = {f: self._stack.enter_context(_safe_open(f)) for f in sorted(set(self._files.values()))}
        except BaseException:
            self._stack.close()
            raise

    def names(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._files[name]].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        try:
            return self._handles[self._files[name]].get_tensor(name)
        except (SafetensorError, TypeError, ValueError) as e:  # e.g. a dtype numpy lacks, or truncated data
            raise CheckpointError(f"{self._files[name]!r}: tensor {name!r} cannot be read: {one_line(e)[:200]}") from None

    def origin(self, name: str) -> str:
        return os.path.basename(self._files[name])

    def close(self) -> None:
        self._stack.close()


def is_gguf(path: str | os.PathLike) -> bool:
    """A GGUF file is named by its suffix, as llama.cpp and transformers' `gguf_file=` name them."""
    return os.fspath(path).lower().endswith(".gguf")


def open_tensors(path: str | os.PathLike) -> TensorSource:
    """The TensorSource of a checkpoint: a Hugging Face folder or a GGUF file."""
    path = os.fspath(path)
    if is_gguf(path):
        return GGUFFile(path)
    _check_folder(path)
    return SafetensorsSource(path)


def load_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint (a folder's config.json, or a GGUF's metadata); dtype
    overrides the checkpoint's dtype (a GGUF's default is float32: its weights dequantize to it)."""
    path = os.fspath(path)
    if is_gguf(path):
        with GGUFFile(path) as gguf:
            return gguf.config(dtype)
    _check_folder(path)
    return from_hf_config(path, dtype=dtype)


def load_checkpoint(path: str | os.PathLike, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """(config, params) from a Hugging Face folder or a GGUF file; dtype overrides the checkpoint's dtype."""
    if is_gguf(path):
        with GGUFFile(path) as gguf:  # one read of its header (seconds for a large vocabulary)
            config = gguf.config(dtype)
            return config, load_params(gguf, config)
    config = load_config(path, dtype)
    return config, load_params(path, config)


def load_params(source: TensorSource | str | os.PathLike, config: ModelConfig) -> dict:
    """The Flax parameter tree of `build_model(config)` filled from `source` (a TensorSource, or
    the path of a checkpoint, opened with `open_tensors`)."""
    if not isinstance(source, TensorSource):
        with open_tensors(source) as opened:
            return load_params(opened, config)
    available = set(source.names())
    expected = param_shapes(build_model(config))
    mem.check_fits(f"the {config.dtype} weights of {source.where!r}", mem.tree_bytes(expected))
    used = set()

    def read(name, want, alternative=None):
        """The tensor `name` (or, when the checkpoint lacks it, `alternative`) after checking its shape."""
        if name not in available and alternative in available:
            name = alternative
        if name not in available:
            also = f" or {alternative!r}" if alternative else ""
            raise MissingTensorError(f"checkpoint {source.where!r} has no tensor {name!r}{also} "
                                     f"(expected shape {list(want)})")
        found = source.shape(name)
        if found != tuple(want):
            raise ShapeMismatchError(f"tensor {name!r} in {source.origin(name)}: expected shape "
                                     f"{list(want)}, found {list(found)}")
        used.add(name)
        return source.read(name)

    def load(path, leaf):  # each leaf in the dtype the model declares (the model dtype; DeepSeek's router f32)
        expert = _expert_leaf(path)
        if expert is not None and config.model_type == "gpt_oss":
            return jnp.asarray(_gpt_oss_experts(read, available, *expert, leaf.shape, leaf.dtype), dtype=leaf.dtype)
        if expert is not None:
            return jnp.asarray(_read_experts(read, available, config, *expert, leaf.shape), dtype=leaf.dtype)
        granite = _granite_experts(path)
        if granite is not None:  # Granite-4.0-H's stacked experts: [E, out, in] in the checkpoint, [E, in, out] here
            e, n_in, n_out = leaf.shape
            return jnp.asarray(np.swapaxes(read(granite, (e, n_out, n_in)), 1, 2), dtype=leaf.dtype)
        name, transpose = hf_name(path, config)
        array = read(name, tuple(reversed(leaf.shape)) if transpose else tuple(leaf.shape), _fused_name(name))
        return jnp.asarray(array.T if transpose else array, dtype=leaf.dtype)

    params = jax.tree_util.tree_map_with_path(load, expected)
    extra = sorted(name for name in available if name not in used and not _ignorable(name, config))
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise UnexpectedTensorError(f"checkpoint {source.where!r} has tensors the {config.model_type} model does not "
                                    f"use: {shown}")
    return params


def save_checkpoint(folder: str | os.PathLike, hf_config: dict, params: dict) -> None:
    """Write `params` as a Hugging Face folder (config.json + model.safetensors) that both
    `load_checkpoint` and transformers' `from_pretrained` read: the inverse of `load_params`."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    # the names of MoE weights depend on the family and the expert count
    config = from_hf_config(hf_config) if any(_expert_leaf(path) for path, _ in leaves) else None
    tensors = {}
    for path, leaf in leaves:
        array = np.asarray(leaf)
        expert = _expert_leaf(path)
        if expert is not None and config.model_type == "gpt_oss":  # fused [E, in, out], gate/up interleaved
            tensors[f"model.layers.{expert[0]}.mlp.experts.{expert[1]}"] = np.ascontiguousarray(
                interleave(array) if expert[1].startswith("gate_up_proj") else array)
            continue
        if expert is not None:  # one [out, in] tensor per expert and projection, as checkpoints hold them
            per_expert, _ = expert_tensors(config, *expert)
            for e, names in enumerate(per_expert):
                for name, part in zip(names, np.split(array[e], len(names), axis=1)):
                    tensors[name] = np.ascontiguousarray(part.T)
            continue
        name, transpose = hf_name(path, config)
        tensors[name] = np.ascontiguousarray(array.T if transpose else array)
    with write_file(os.path.join(folder, SAFETENSORS), "checkpoint", binary=True) as fh:
        fh.write(save(tensors, metadata={"format": "pt"}))
    write_json(os.path.join(folder, "config.json"), hf_config, "checkpoint", sort_keys=True)


def hf_name(path, config: ModelConfig | None = None) -> tuple[str, bool]:
    """Flax parameter path → (Hugging Face tensor name, whether the HF tensor is transposed).

    Not for the stacked expert weights (`expert_tensors`). Mixtral's MoE block is HF's
    `block_sparse_moe` (its router `block_sparse_moe.gate`), kvjax's `mlp` as in every family."""
    keys = [getattr(p, "key", str(p)) for p in path]
    *modules, leaf = keys
    if modules and re.fullmatch(r"layers_\d+", modules[0]):
        modules[0] = "layers." + modules[0].split("_")[1]
        if config is not None and config.model_type == "mixtral" and modules[1:2] == ["mlp"]:
            modules[1] = "block_sparse_moe"
    # Nemotron-H's checkpoints (NVIDIA's and save_pretrained's) name the decoder "backbone"
    prefix = "" if modules[0] == "lm_head" else "backbone." if config and config.model_type == "nemotron_h" else "model."
    if modules[1:3] == ["block_sparse_moe", "router"]:  # Granite-4.0-H's router: a Linear named `layer`
        modules = modules[:3] + ["layer"]
    if leaf in MIXER_LEAVES:  # a Mamba2 mixer's own parameters (models.mamba2)
        return prefix + ".".join(modules + [MIXER_LEAVES[leaf]]), False
    suffix = leaf if leaf in ("e_score_correction_bias", "sinks", "bias") else "weight"  # kernel, embedding
    return prefix + ".".join(modules + [suffix]), leaf == "kernel"


# ---- MoE experts: one stacked Flax array per layer and projection --------------------------------
def _granite_experts(path) -> str | None:
    """The checkpoint name of Granite-4.0-H's stacked expert leaf (`layers_{i}/block_sparse_moe/experts/...`):
    `input_linear` [E, 2I, D] (gate then up) or `output_linear` [E, D, I]; else None."""
    keys = [getattr(p, "key", str(p)) for p in path]
    if len(keys) == 4 and keys[1:3] == ["block_sparse_moe", "experts"]:
        proj = {"gate_up_proj": "input_linear", "down_proj": "output_linear"}[keys[3]]
        return f"model.layers.{keys[0].split('_')[1]}.block_sparse_moe.{proj}.weight"
    return None


def _expert_leaf(path) -> tuple[int, str] | None:
    """(layer, leaf) of a stacked expert weight (`layers_{i}/mlp/experts/{leaf}`), else None."""
    keys = [getattr(p, "key", str(p)) for p in path]
    if len(keys) == 4 and re.fullmatch(r"layers_\d+", keys[0]) and keys[1:3] == ["mlp", "experts"]:
        return int(keys[0].split("_")[1]), keys[3]
    return None


def expert_tensors(config: ModelConfig, layer: int, leaf: str) -> tuple[list[list[str]], str]:
    """How a checkpoint stores the stacked expert weight `leaf` of `layer` ([E, in, out] in Flax):
    (for each expert, the [out_part, in] tensors whose transposes, side by side, make its [in, out]
    slice; the name of transformers 5's fused [E, out, in] tensor).

    Real checkpoints, and transformers 5.24's save_pretrained for Mixtral, Qwen2/3-MoE and DeepSeek,
    hold one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`, Mixtral
    `block_sparse_moe.experts.{e}.w1` (gate) / `w3` (up) / `w2` (down)); transformers 5 concatenates them
    when it loads (conversion_mapping.py: gate then up along the output axis) into `mlp.experts.gate_up_proj`
    [E, 2I, D] and `mlp.experts.down_proj` [E, D, I], the form a checkpoint saved from its state dict has."""
    if leaf not in ("gate_up_proj", "down_proj"):
        raise CheckpointError(f"{config.model_type}: expert parameter {leaf!r} has no Hugging Face mapping")
    if config.model_type == "mixtral":
        prefix, parts = f"model.layers.{layer}.block_sparse_moe.experts", {"gate_up_proj": ("w1", "w3"),
                                                                          "down_proj": ("w2",)}
    else:
        prefix, parts = f"model.layers.{layer}.mlp.experts", {"gate_up_proj": ("gate_proj", "up_proj"),
                                                             "down_proj": ("down_proj",)}
    per_expert = [[f"{prefix}.{e}.{part}.weight" for part in parts[leaf]] for e in range(config.moe.num_experts)]
    return per_expert, f"model.layers.{layer}.mlp.experts.{leaf}"


def _read_experts(read, available: set, config: ModelConfig, layer: int, leaf: str, shape) -> np.ndarray:
    """The stacked [E, in, out] array of an expert leaf from either form `expert_tensors` names; `read(name,
    shape)` checks and reads one tensor. Per-expert tensors are preferred when both forms are present
    (the fused ones are then named as unused)."""
    per_expert, fused = expert_tensors(config, layer, leaf)
    experts, n_in, n_out = shape
    width = n_out // len(per_expert[0])  # of one part: gate or up, or down
    if per_expert[0][0] not in available:
        if fused in available:  # transformers 5's [E, out, in]
            return np.swapaxes(read(fused, (experts, n_out, n_in)), 1, 2)
        read(per_expert[0][0], (width, n_in), alternative=fused)  # neither form: MissingTensorError naming both
    return np.stack([np.concatenate([read(name, (width, n_in)).T for name in names], axis=1)  # [in, out]
                     for names in per_expert])


def _gpt_oss_experts(read, available: set, layer: int, leaf: str, shape, dtype) -> np.ndarray:
    """gpt-oss's stacked expert leaf (`gate_up_proj` [E, D, 2I], `down_proj` [E, I, D] or their biases [E, 2I],
    [E, D]) from transformers' fused tensor of that name or, for the two projections, from MXFP4
    `{name}_blocks` u8[E, out, in / 32, 16] and `{name}_scales` u8[E, out, in / 32], dequantized to dtype
    as transformers does (models.mxfp4). The checkpoint interleaves the gate and up columns (transformers'
    `gate_up[..., ::2]`, `gate_up[..., 1::2]`); models.moe wants them as two halves."""
    name = f"model.layers.{layer}.mlp.experts.{leaf}"
    gate_up = leaf.startswith("gate_up_proj")
    if name not in available and f"{name}_blocks" in available and not leaf.endswith("_bias"):
        experts, n_in, n_out = shape
        if n_in % mxfp4.BLOCK:
            raise CheckpointError(f"{name}_blocks: MXFP4 packs the input dim in groups of {mxfp4.BLOCK}, and "
                                  f"{n_in} is not a multiple")
        blocks = read(f"{name}_blocks", (experts, n_out, n_in // mxfp4.BLOCK, mxfp4.BLOCK // 2))
        scales = read(f"{name}_scales", (experts, n_out, n_in // mxfp4.BLOCK))
        if gate_up:  # the packed output rows are the interleaved axis: reorder them, a quarter of the bytes
            blocks, scales = deinterleave(blocks, axis=1), deinterleave(scales, axis=1)
        return mxfp4.unpack_experts(blocks, scales, np.dtype(dtype))  # [E, in, out]
    array = read(name, tuple(shape), None if leaf.endswith("_bias") else f"{name}_blocks")  # missing: names both
    return deinterleave(array) if gate_up else array


def deinterleave(array: np.ndarray, axis: int = -1) -> np.ndarray:
    """Columns gate_0, up_0, gate_1, up_1, … along `axis` (2I long) → [gate_0 … gate_{I-1} | up_0 … up_{I-1}]."""
    evens, odds = (np.take(array, np.arange(start, array.shape[axis], 2), axis=axis) for start in (0, 1))
    return np.concatenate([evens, odds], axis=axis)


def interleave(array: np.ndarray) -> np.ndarray:
    """The inverse of `deinterleave`: [gate | up] halves → gate_0, up_0, gate_1, up_1, …"""
    gate, up = np.split(array, 2, axis=-1)
    return np.stack([gate, up], axis=-1).reshape(array.shape)


def _fused_name(name: str) -> str | None:
    """Mixtral's router under transformers 5's name (`mlp.gate`), for checkpoints in its fused form."""
    return name.replace(".block_sparse_moe.", ".mlp.") if ".block_sparse_moe." in name else None


def _check_folder(folder: str) -> None:
    if os.path.isfile(folder) and folder.endswith(PICKLE_SUFFIXES):
        raise _pickled([folder])
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder!r} is {file_kind(os.stat(folder).st_mode)}, not a folder")
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder!r} does not exist")


def _tensor_files(folder: str) -> dict[str, str]:
    index = os.path.join(folder, INDEX)
    single = os.path.join(folder, SAFETENSORS)
    if os.path.exists(index):
        try:
            weight_map = read_json_object(index, "safetensors index").get("weight_map")
        except KvjaxError as e:
            raise CheckpointError(str(e)) from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index!r} is not a safetensors index: it needs a weight_map of tensor → file")
        files = {name: os.path.join(folder, shard) for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not os.path.exists(shard):
                raise CheckpointError(f"{index!r} names shard {os.path.basename(shard)!r}, which is missing")
        return files
    if os.path.exists(single):
        with _safe_open(single) as fh:
            return {name: single for name in fh.keys()}
    pickled = sorted(f for f in glob.glob(os.path.join(folder, "*")) if f.endswith(PICKLE_SUFFIXES))
    if pickled:
        raise _pickled(pickled)
    raise CheckpointError(f"checkpoint {folder!r} has neither {SAFETENSORS} nor {INDEX}")


def _safe_open(path: str):
    """safetensors' safe_open, its own errors (a corrupt, truncated or non-safetensors file: e.g.
    a pickle renamed) converted to CheckpointError naming the file. It never unpickles. A shard
    that is a folder, FIFO or device is refused by kvjax.utils.input_files.check_input_file, never opened."""
    try:
        check_input_file(path, "safetensors file")
        return safe_open(path, framework="numpy")
    except KvjaxError as e:
        raise CheckpointError(str(e)) from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path!r} is not a readable safetensors file: {one_line(e)[:200]}") from None


def _pickled(files: list[str]) -> PickledWeightsError:
    names = ", ".join(os.path.basename(f) for f in files)
    return PickledWeightsError(
        f"refusing to load pickled weights ({names}): unpickling a PyTorch checkpoint can execute arbitrary "
        f"code from the file. Convert it to safetensors (model.safetensors) with a tool you trust.")


def _ignorable(name: str, config: ModelConfig) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True  # a recomputed buffer older checkpoints saved
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return True  # the tied head is the embedding
    match = re.match(r"model\.layers\.(\d+)\.", name)
    # DeepSeek-V3 ships its multi-token-prediction module as extra layers; transformers drops them.
    return bool(config.model_type == "deepseek_v3" and match and int(match.group(1)) >= config.num_layers)
