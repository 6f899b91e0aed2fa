"""What a `--model` argument (or `kvjax.LLM(model)`) names, loaded into one `LoadedModel`.

    small-gqa, small-mla   the built-in checkpoints shipped in models/checkpoints/
    PATH                   a Hugging Face folder (config.json + model.safetensors)
    preset:NAME            a kvjax.config preset with random weights (nothing is downloaded)

A LoadedModel bundles what running a model needs: its config, the Flax module, the parameters,
the tokenizer and the EOS ids generation stops at (`eos_token_id` of config.json and of
generation_config.json, an int or a list, as transformers reads them).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax

from kvjax.config import ModelConfig, preset
from models.tokenizer import Tokenizer

CHECKPOINTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
BUILTIN = {"small-gqa": os.path.join(CHECKPOINTS, "small-gqa"),
           "small-mla": os.path.join(CHECKPOINTS, "small-mla")}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    name: str  # what the caller passed
    config: ModelConfig
    module: Any  # models.layers.CausalLM
    params: Any  # its parameter tree
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...] = ()
    folder: str | None = None  # the checkpoint folder; None for random weights

    def replace(self, **changes) -> "LoadedModel":
        return dataclasses.replace(self, **changes)


def resolve_model(name_or_dir: str) -> str:
    """A checkpoint folder: a built-in name (small-gqa, small-mla) or a Hugging Face folder."""
    folder = BUILTIN.get(name_or_dir, name_or_dir)
    if not os.path.isdir(folder):
        known = ", ".join(BUILTIN)
        raise ValueError(f"model {name_or_dir!r} is neither a built-in model ({known}), a preset:NAME, "
                         "nor a checkpoint folder")
    return folder


def eos_token_ids(folder: str) -> tuple[int, ...]:
    """EOS ids of a checkpoint folder: config.json's and generation_config.json's eos_token_id."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            value = json.load(fh).get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        ids |= {v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    return tuple(sorted(ids))


def load_model(name_or_dir: str, *, dtype: str | None = None, attn_impl: str | None = None,
               seed: int = 0) -> LoadedModel:
    """Load what `name_or_dir` names (see the module docstring). dtype overrides the weights'
    dtype; attn_impl None picks the backend's default (kvjax.attention.default_impl)."""
    from models import build_model, init_params
    from models.loader import load_checkpoint

    if name_or_dir.startswith("preset:"):
        config = preset(name_or_dir.split(":", 1)[1])
        config = config.replace(dtype=dtype) if dtype else config
        module = build_model(config, attn_impl=attn_impl)
        return LoadedModel(name_or_dir, config, module, init_params(module, jax.random.key(seed)), Tokenizer())
    folder = resolve_model(name_or_dir)
    config, params = load_checkpoint(folder, dtype=dtype)
    return LoadedModel(name_or_dir, config, build_model(config, attn_impl=attn_impl), params, Tokenizer(folder),
                       eos_token_ids(folder), folder)
