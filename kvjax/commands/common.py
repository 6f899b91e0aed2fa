"""What the model-running subcommands share: resolving `small-gqa` / `small-mla` / a folder, and
loading a checkpoint into a model."""
from __future__ import annotations

import os

MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models")
BUILTIN = {"small-gqa": os.path.join(MODELS_DIR, "checkpoints", "small-gqa"),
           "small-mla": os.path.join(MODELS_DIR, "checkpoints", "small-mla")}


def resolve_model(name_or_dir: str) -> str:
    """A checkpoint folder: a built-in name (small-gqa, small-mla) or a Hugging Face folder."""
    folder = BUILTIN.get(name_or_dir, name_or_dir)
    if not os.path.isdir(folder):
        known = ", ".join(BUILTIN)
        raise ValueError(f"model {name_or_dir!r} is neither a built-in model ({known}) nor a checkpoint folder")
    return folder


def load_model(name_or_dir: str, dtype: str | None = None, attn_impl: str = "reference"):
    """(config, model, params) for a built-in name or a checkpoint folder."""
    from models import build_model
    from models.loader import load_checkpoint

    config, params = load_checkpoint(resolve_model(name_or_dir), dtype=dtype)
    return config, build_model(config, attn_impl=attn_impl), params
