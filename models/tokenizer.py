"""Text ↔ token ids for a checkpoint: its `tokenizer.json`, or UTF-8 bytes for the built-in models.

A Hugging Face folder with a `tokenizer.json` is read with the `tokenizers` library (the fast
tokenizer transformers itself wraps). The built-in small models have a 256-token byte
vocabulary and no tokenizer file: a text is its UTF-8 bytes, and ids decode back to bytes
(invalid UTF-8 shown as U+FFFD).
"""
from __future__ import annotations

import os

import numpy as np


class Tokenizer:
    """encode(text) → ids, decode(ids) → text, encode_file(path) → ids i32[N]."""

    def __init__(self, folder: str | None = None):
        path = None if folder is None else os.path.join(folder, "tokenizer.json")
        self._tok = None
        if path is not None and os.path.exists(path):
            from tokenizers import Tokenizer as HFTokenizer

            self._tok = HFTokenizer.from_file(path)

    @property
    def is_bytes(self) -> bool:
        """True for the byte vocabulary (no tokenizer.json)."""
        return self._tok is None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) if self._tok is None else self._tok.encode(text).ids

    def decode(self, ids) -> str:
        if self._tok is None:
            return bytes(int(t) for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")
        return self._tok.decode([int(t) for t in ids])

    def encode_file(self, path: str) -> np.ndarray:
        """Token ids i32[N] of a text file (the byte vocabulary takes its bytes as they are)."""
        if not os.path.isfile(path):
            raise ValueError(f"data file {path!r} does not exist")
        if self._tok is None:
            with open(path, "rb") as fh:
                return np.frombuffer(fh.read(), np.uint8).astype(np.int32)
        with open(path, encoding="utf-8") as fh:
            return np.asarray(self.encode(fh.read()), np.int32)
