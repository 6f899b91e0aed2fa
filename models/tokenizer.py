"""Text ↔ token ids for a checkpoint: its `tokenizer.json`, a GGUF's vocabulary, or UTF-8 bytes.

A Hugging Face folder with a `tokenizer.json` is read with the `tokenizers` library (the fast
tokenizer transformers itself wraps); a GGUF file's tokenizer is rebuilt from its metadata by
models.gguf as the same library's object and passed in as `backend`. The built-in small models
have a 256-token byte vocabulary and no tokenizer file: a text is its UTF-8 bytes, and ids
decode back to bytes (invalid UTF-8 shown as U+FFFD).

`Tokenizer` answers to transformers' names, which is what a vLLM user calls on
`llm.get_tokenizer()`. `encode(text, add_special_tokens=True)` adds what the tokenizer itself
adds around a text: its post-processor's tokens (a BOS only where the model's tokenizer.json, or
a GGUF's `tokenizer.ggml.add_bos_token`, prepends one; nothing for the byte vocabulary).
`decode` leaves special tokens out unless skip_special_tokens=False (kvjax's default, as vLLM's
SamplingParams; transformers' decode keeps them by default). The special ids are the ones the
folder's tokenizer_config.json names, read as transformers reads them, else those the loader
passes in (models.hub: the checkpoint's primary EOS; a GGUF's bos/eos/unknown/padding ids).

`render_chat` turns a conversation into a prompt with the checkpoint's Jinja chat template, the
way transformers' `apply_chat_template(..., tokenize=False)` does, with jinja2 alone.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import numpy as np

from kvjax.errors import KvjaxError, one_line
from kvjax.models.template_sandbox import BoundedSandbox, ChatTemplateError, compile_template, render, where
from kvjax.utils.checks import INT32_MAX
from kvjax.utils.input_files import check_input_file, decode_utf8, read_bytes
from kvjax.utils.strict_json import read_json_object


# transformers' named special tokens, in its SPECIAL_TOKENS_ATTRIBUTES order (all_special_ids follows it)
_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")


def _library_error(e: BaseException) -> bool:
    """An error of the tokenizers library: its Exception, or pyo3's PanicException (a Rust panic,
    which is a BaseException so that `except Exception` does not catch it)."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def _special_tokens(folder: str) -> dict:
    """The special tokens a checkpoint folder's tokenizer files name, as transformers reads them:
    tokenizer_config.json, and the legacy special_tokens_map.json over it when the config has no
    added_tokens_decoder. → {name: token text} for _NAMED, plus "extra": [token text, ...]."""
    config, names = {}, {}
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(path):
        config = read_json_object(path, "tokenizer_config.json")
    legacy = os.path.join(folder, "special_tokens_map.json")
    if "added_tokens_decoder" not in config and os.path.exists(legacy):
        config = {**config, **read_json_object(legacy, "special_tokens_map.json")}
    text = lambda t: t.get("content") if isinstance(t, Mapping) else t  # noqa: E731  (an AddedToken as a dict)
    for name in _NAMED:
        if isinstance(text(config.get(name)), str):
            names[name] = text(config[name])
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    names["extra"] = [text(t) for t in extra if isinstance(text(t), str)] if isinstance(extra, list) else []
    return names


class Tokenizer:
    """Text ↔ token ids, with the names a vLLM user calls on `llm.get_tokenizer()` (transformers'
    tokenizer API): encode, decode, __call__, eos/bos/pad/unk_token_id (None when unknown),
    vocab_size, len(), all_special_ids, convert_ids_to_tokens, convert_tokens_to_ids; plus
    encode_file(path) → ids i32[T], and vLLM's max_token_id."""

    def __init__(self, folder: str | None = None, *, backend=None, eos_token_id: int | None = None,
                 bos_token_id: int | None = None, pad_token_id: int | None = None, unk_token_id: int | None = None,
                 source: str | None = None):
        """folder: a checkpoint folder (its tokenizer.json, if it has one); backend: a
        `tokenizers.Tokenizer` built elsewhere (source: where from, for errors). Neither: the byte
        vocabulary. eos/bos/pad/unk_token_id: the model's special ids (models.hub passes the
        checkpoint's primary EOS and a GGUF's tokenizer.ggml.*_token_id); where the folder's
        tokenizer_config.json names the token itself, that one is the tokenizer's, as in transformers.
        A tokenizer that cannot be read, whose ids pass int32, or that fails on a plain text (a
        tokenizer.json whose post-processor names a token it does not define panics in the
        library's Rust code on every encode) is refused here, naming the file."""
        path = None if folder is None else os.path.join(folder, "tokenizer.json")
        self._tok = backend
        if backend is None and path is not None and os.path.exists(path):
            from tokenizers import Tokenizer as HFTokenizer

            check_input_file(path, "tokenizer file")  # a FIFO or a device is refused, never opened
            source = f"tokenizer file {path!r}"
            try:
                self._tok = HFTokenizer.from_file(path)
            except BaseException as e:  # the library's own Exception, or a Rust panic: name the file
                if not _library_error(e):
                    raise
                raise KvjaxError(f"{source} cannot be read: {one_line(e)[:200]}") from None
        if self._tok is not None:
            self._check(source or "the tokenizer")
        named = _special_tokens(folder) if self._tok is not None and folder is not None else {}
        given = dict(bos_token=bos_token_id, eos_token=eos_token_id, unk_token=unk_token_id, pad_token=pad_token_id)
        ids = {}
        for name in _NAMED:
            own = self.token_to_id(named[name]) if name in named else None
            ids[name] = own if own is not None else None if given[name] is None else int(given[name])
        self.bos_token_id: int | None = ids["bos_token"]
        self.eos_token_id: int | None = ids["eos_token"]
        self.unk_token_id: int | None = ids["unk_token"]
        self.pad_token_id: int | None = ids["pad_token"]
        extra = [self.token_to_id(t) for t in named.get("extra", [])]
        self.all_special_ids: list[int] = list(dict.fromkeys(  # transformers' order: named, then extra tokens
            i for i in [*ids.values(), *extra] if i is not None))

    def _check(self, source: str) -> None:
        """The ids fit the engine's int32 and a plain text encodes (special tokens added) and decodes."""
        if not self._tok.get_vocab_size(with_added_tokens=True):
            raise KvjaxError(f"{source}: the tokenizer has no tokens")
        if self.max_token_id > INT32_MAX:
            raise KvjaxError(f"{source}: token id {self.max_token_id:,} is past int32, the engine's token ids")
        try:
            ids = self._tok.encode("kvjax: a probe, 1 2 3.", add_special_tokens=True).ids
            self._tok.decode(ids, skip_special_tokens=False)
        except BaseException as e:
            if not _library_error(e):
                raise
            raise KvjaxError(f"{source}: the tokenizer fails on a plain text: {type(e).__name__}: "
                             f"{one_line(e)[:200]}") from None

    @property
    def is_bytes(self) -> bool:
        """True for the byte vocabulary (no tokenizer.json)."""
        return self._tok is None

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, added tokens not counted (transformers' vocab_size)."""
        return 256 if self._tok is None else self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """The vocabulary's size with the added tokens (transformers' len(tokenizer))."""
        return 256 if self._tok is None else self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest token id (vLLM's tokenizer property, which bounds bad words' ids)."""
        return 255 if self._tok is None else max(self._tok.get_vocab(with_added_tokens=True).values())

    @property
    def all_special_tokens(self) -> list[str]:
        return self.convert_ids_to_tokens(self.all_special_ids)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text. add_special_tokens: what the tokenizer adds around a text (its
        post-processor: a BOS where the model's tokenizer.json, or a GGUF's add_bos_token, asks
        for one); the byte vocabulary adds nothing. Refused (KvjaxError naming the position): a
        non-string, and a lone surrogate such as "\\ud800" (JSON's escapes can make one), which is
        no Unicode text."""
        if not isinstance(text, str):
            raise KvjaxError(f"a text to tokenize must be a string, got {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise KvjaxError(f"the text has a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}: "
                             "not valid Unicode") from None
        return list(data) if self._tok is None else self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, list]:
        """transformers' tokenizer(text): {"input_ids": ids, "attention_mask": ones} (lists of
        them for a list of texts)."""
        if isinstance(text, list):
            ids = [self.encode(t, add_special_tokens) for t in text]
            return {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]}
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of token ids (or of one id). skip_special_tokens: leave the special tokens
        out — kvjax's default, which the engine's text relies on (vLLM's skip_special_tokens=True);
        transformers' decode defaults to False. The byte vocabulary has none: invalid UTF-8
        shows as U+FFFD."""
        ids = [ids] if isinstance(ids, (int, np.integer)) else ids
        if self._tok is None:
            return bytes(int(t) for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token spelled as the vocabulary spells it (e.g. "<|im_end|>"), or None."""
        if self._tok is None:
            return None
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token an id spells, or None (out of range, or the byte vocabulary, whose tokens are
        bytes, not text)."""
        if self._tok is None:
            return None
        return self._tok.id_to_token(int(token_id))

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        """transformers' convert_ids_to_tokens: one id → its token (None if unknown); a list → a
        list, without the special ones when skip_special_tokens."""
        if isinstance(ids, (int, np.integer)):
            return self.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.id_to_token(i) for i in ids if int(i) not in special]

    def convert_tokens_to_ids(self, tokens):
        """transformers' convert_tokens_to_ids: one token → its id (unk_token_id, maybe None, if
        the vocabulary lacks it); a list → a list."""
        if isinstance(tokens, str):
            found = self.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def encode_file(self, path: str) -> np.ndarray:
        """Token ids i32[T] of a text file (the byte vocabulary takes its bytes as they are)."""
        data = read_bytes(path, "data file")
        if self._tok is None:
            return np.frombuffer(data, np.uint8).astype(np.int32)
        return np.asarray(self.encode(decode_utf8(data, path, "data file")), np.int32)


# transformers' marker for continue_final_message: appended to the final message, found in the
# rendered text, and everything from it on (the template's end-of-turn) cut off.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning goes under; transformers fills "thinking" and "reasoning_content".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, the tag transformers adds to mark the assistant's
    text for `return_assistant_tokens_mask`: its body renders as if the tag were not there."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the messages: {one_line(message)}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson; jinja's built-in one would HTML-escape <, >, & and ' and always sort keys
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    if not isinstance(format, str) or len(format) > 1000:  # strftime expands "%c" twelvefold
        raise ChatTemplateError(f"strftime_now takes a format string of at most 1000 characters, got {_clip(format)}")
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """The template in transformers' environment (`_compile_jinja_template`): sandboxed and
    immutable (templates come from the Hub), trim_blocks and lstrip_blocks, loop controls; and
    bounded in time, size and depth (models.template_sandbox)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return compile_template(env, template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template{where(template)} is not valid Jinja: {one_line(e.message)} "
                                f"(line {e.lineno})") from None


def _copy(value):
    """A fresh copy of nested dicts, lists and tuples, so rendering never edits the caller's."""
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value] if isinstance(value, list) else tuple(_copy(v) for v in value)
    return value


def _clip(value) -> str:
    return one_line(repr(value))[:80]


def _chat(messages) -> list[dict]:
    """The messages as transformers' apply_chat_template hands them to the template: copies with
    their None-valued keys dropped (templates test for a missing key; many print a None as "None"),
    and reasoning under both names templates read ("thinking", "reasoning_content")."""
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of message dicts, got {_clip(messages)}")
    if not messages:
        raise ChatTemplateError("messages is empty: a conversation needs at least one message")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} must be a dict with a string 'role', got {_clip(m)}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise ChatTemplateError(f"message {i}'s content must be a string, a list of parts or None, "
                                    f"got {_clip(content)}")
        m = {k: _copy(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    return chat


def _tag_final_message(chat: list[dict], template: str) -> str:
    """Appends the continue tag to the final message's text (its content, or its last text part
    when the content is a list of parts) and returns that text as it was."""
    final = chat[-1].get("content")
    if final is None:
        raise ChatTemplateError("continue_final_message: the final message has no content to continue")
    if "content" not in template:
        raise ChatTemplateError("continue_final_message: the chat template never reads a message's 'content'")
    if isinstance(final, str):
        chat[-1]["content"] = final + _CONTINUE_TAG
        return final
    for part in reversed(final):
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            text, part["text"] = part["text"], part["text"] + _CONTINUE_TAG
            return text
    raise ChatTemplateError("continue_final_message: the final message's content has no text part to continue")


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                documents: list[dict] | None = None, **variables) -> str:
    """A conversation as the prompt text its model was trained on: the checkpoint's Jinja chat
    template rendered as transformers' `apply_chat_template(..., tokenize=False)` renders it
    (transformers/utils/chat_template_utils.py, `_compile_jinja_template`, `render_jinja_template`).

    messages: [{"role": str, "content": str | [{"type": "text", "text": str}, ...] | None, ...}];
    keys whose value is None are dropped, as transformers drops them (an assistant turn with
    tool_calls and content None). The template sees `messages`, `add_generation_prompt`, `tools`,
    `documents` and every other keyword (vLLM's chat_template_kwargs; bos_token, eos_token, which
    transformers fills from its tokenizer); it may call `raise_exception(msg)` (a ChatTemplateError)
    and `strftime_now(format)`, and filter with transformers' `tojson` (non-ASCII kept as is).
    continue_final_message: leave the final message open (its end-of-turn cut off) so generation
    continues it; it needs add_generation_prompt=False, as in transformers and vLLM.
    A template that runs past models.template_sandbox's limits of time, size or depth is a
    ChatTemplateLimitError; errors name the template's file when it is a `ChatTemplate`."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message=True needs add_generation_prompt=False: one continues "
                                "the final message, the other opens a new assistant turn")
    if not isinstance(template, str):
        raise ChatTemplateError(f"the chat template must be a string of Jinja, got {_clip(template)}")
    for name, items in (("tools", tools), ("documents", documents)):
        if items is not None and (not isinstance(items, (list, tuple))
                                  or not all(isinstance(x, Mapping) for x in items)):
            raise ChatTemplateError(f"{name} must be a list of dicts (JSON schemas for tools), got {_clip(items)}")
    compiled = _compile(template)
    chat = _chat(messages)
    final = _tag_final_message(chat, template) if continue_final_message else None
    try:
        rendered = render(compiled, template, dict(messages=chat, tools=_copy(tools), documents=_copy(documents),
                                                    add_generation_prompt=add_generation_prompt, **variables))
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as e:
        raise ChatTemplateError(f"the chat template{where(template)} does not render: {type(e).__name__}: "
                                f"{one_line(e)[:300]}") from None
    if final is None:
        return rendered
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("continue_final_message: the chat template drops part of the final message, "
                                "so there is no end of it to continue from")
    at = rendered.rindex(tag)
    # the tag's trailing space survived: cut exactly; a template that strips it also stripped
    # the message's own trailing whitespace, so strip what is left (transformers' rule)
    return rendered[:at] if rendered.startswith(_CONTINUE_TAG, at) else rendered[:at].rstrip()
