"""Text ↔ token ids for a checkpoint: its `tokenizer.json`, a GGUF's vocabulary, or UTF-8 bytes.

A Hugging Face folder with a `tokenizer.json` is read with the `tokenizers` library (the fast
tokenizer transformers itself wraps); a GGUF file's tokenizer is rebuilt from its metadata by
models.gguf as the same library's object and passed in as `backend`. The built-in small models
have a 256-token byte vocabulary and no tokenizer file: a text is its UTF-8 bytes, and ids
decode back to bytes (invalid UTF-8 shown as U+FFFD).
"""
from __future__ import annotations

import os

import numpy as np

from kvjax.errors import KvjaxError, decode_utf8, one_line, read_bytes


class Tokenizer:
    """encode(text) → ids, decode(ids) → text, encode_file(path) → ids i32[N]."""

    def __init__(self, folder: str | None = None, *, backend=None):
        """folder: a checkpoint folder (its tokenizer.json, if it has one); backend: a
        `tokenizers.Tokenizer` built elsewhere. Neither: the byte vocabulary."""
        path = None if folder is None else os.path.join(folder, "tokenizer.json")
        self._tok = backend
        if backend is None and path is not None and os.path.exists(path):
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._tok = HFTokenizer.from_file(path)
            except Exception as e:  # the tokenizers library raises its own Exception: name the file
                raise KvjaxError(f"tokenizer file {path!r} cannot be read: {one_line(e)[:200]}") from None

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

    def token_to_id(self, token: str) -> int | None:
        """The id of a token spelled as the vocabulary spells it (e.g. "<|im_end|>"), or None."""
        if self._tok is None:
            return None
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        if self._tok is None:
            return None
        return self._tok.id_to_token(int(token_id))

    def encode_file(self, path: str) -> np.ndarray:
        """Token ids i32[N] of a text file (the byte vocabulary takes its bytes as they are)."""
        data = read_bytes(path, "data file")
        if self._tok is None:
            return np.frombuffer(data, np.uint8).astype(np.int32)
        return np.asarray(self.encode(decode_utf8(data, path, "data file")), np.int32)


class ChatTemplateError(KvjaxError):
    """A chat template that cannot render the given messages; the message says why."""


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True, **variables) -> str:
    """A conversation as the prompt text its model was trained on: the checkpoint's Jinja chat
    template rendered the way transformers' `apply_chat_template` does (a sandboxed environment
    with trim_blocks and lstrip_blocks, `raise_exception` available to the template).
    messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]; variables: e.g.
    bos_token and eos_token, which some templates use."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i} must be {{'role': str, 'content': str}}, got {m!r:.80}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not render: {e}") from None
