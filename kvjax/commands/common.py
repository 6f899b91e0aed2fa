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


def load_model(name_or_dir: str, dtype: str | None = None, attn_impl: str | None = None):
    """(config, model, params) for a built-in name or a checkpoint folder; attn_impl None picks
    the backend's default (kvjax.attention.default_impl)."""
    from models import build_model
    from models.loader import load_checkpoint

    config, params = load_checkpoint(resolve_model(name_or_dir), dtype=dtype)
    return config, build_model(config, attn_impl=attn_impl), params


def tokenizer(folder: str):
    """(encode text → ids, decode ids → text): the folder's tokenizer.json through the
    `tokenizers` library when it has one, else UTF-8 bytes (the built-in models' vocabulary)."""
    path = os.path.join(folder, "tokenizer.json")
    if os.path.exists(path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(f"{folder!r} has a tokenizer.json: install the `tokenizers` package to read it") from None
        tok = Tokenizer.from_file(path)
        return (lambda text: tok.encode(text).ids), (lambda ids: tok.decode(ids))
    return (lambda text: list(text.encode("utf-8"))), \
        (lambda ids: bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace"))


def read_tokens(folder: str, path: str):
    """Token ids i32[N] of a text file for the model in `folder` (see `tokenizer`)."""
    import numpy as np

    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):  # bytes as they are, no UTF-8 decoding
        with open(path, "rb") as fh:
            return np.frombuffer(fh.read(), np.uint8).astype(np.int32)
    with open(path, encoding="utf-8") as fh:
        return np.asarray(tokenizer(folder)[0](fh.read()), np.int32)


def windows(tokens, seq_len: int, max_windows: int):
    """Non-overlapping windows i32[W, seq_len] from the start of a token stream."""
    n = min(max_windows, len(tokens) // seq_len)
    if n < 1:
        raise ValueError(f"the data holds {len(tokens)} tokens, fewer than one window of {seq_len}")
    return tokens[: n * seq_len].reshape(n, seq_len)
