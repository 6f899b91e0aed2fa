"""The requests `kvjax decode` runs: the prompts file, --synthetic prompts, each one's SamplingParams.

Prompts: `--prompts FILE` holds one prompt per line (an empty line is an empty prompt, which
fails alone); a `.jsonl` file holds one JSON object per line, {"prompt": text} or {"tokens":
[ids]}, with an optional per-request "max_tokens" (and "priority" with --scheduling-policy
priority). Text becomes tokens through the checkpoint's tokenizer (tokenizer.json, or a GGUF's
vocabulary), else as UTF-8 bytes (the built-in models' 256-token vocabulary); with --chat each
line is a user message rendered with the model's chat template first (SmolLM2's adds the same
system prompt to every request: prefix-cache hits). `--synthetic N` makes N random prompts of
--prompt-len/2 .. --prompt-len tokens (seeded by --seed), each after the same --shared-prefix
tokens (a fixed system prompt: prefix-cache hits).

A request is a dict: prompt (text, or None), tokens (ids), max_tokens, priority. `read_prompts`
checks the file line by line before any model is loaded; `build_requests` makes the token ids
(through the tokenizer and, with --chat, the chat template) and checks the lengths against the
model's; `sampling_params` gives each request its SamplingParams, and one whose own max_tokens
breaks their rules fails alone, as in vLLM, with `refused_output` as its output.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.errors import InputFileError, KvjaxError, UsageError
from kvjax.utils.checks import INT32_MAX, check_int
from kvjax.utils.input_files import read_text
from kvjax.utils.strict_json import json_type, read_jsonl

_JSONL_KEYS = {"prompt", "tokens", "max_tokens", "priority"}


def read_prompts(path: str, allow_priority: bool = False, chat: bool = False) -> list[dict]:
    """A prompts file, checked line by line before any model is loaded. One dict per request:
    prompt (text, or None), tokens (ids, or None), max_tokens (None: the flag's), priority.

    Plain text: one prompt per line, lines ended by "\n" (or "\r\n") only, as the .jsonl reader
    splits (form feeds and U+2028 stay inside a prompt). `.jsonl` (any case): one object per non-blank line with exactly one of
    "prompt" (a string) and "tokens" (a list of ints in [0, 2**31)), optional "max_tokens" (an
    int; one ≤ 0 fails that request alone, as vLLM's would) and "priority" (an int, with
    --scheduling-policy priority). With `chat` (--chat) a "tokens" line is refused: a chat
    template renders text. Anything else is an InputFileError naming the line."""
    if not path.lower().endswith(".jsonl"):
        text = read_text(path, "prompts file")
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()  # the last line's end, not an empty prompt after it
        return [dict(prompt=line.removesuffix("\r"), tokens=None, max_tokens=None, priority=0) for line in lines]
    requests = []
    for n, obj in read_jsonl(path, "prompts file"):
        bad = lambda msg: InputFileError(path, msg, n)  # noqa: E731
        if not isinstance(obj, dict):
            raise bad(f"expected a JSON object, got a JSON {json_type(obj)}")
        unknown = sorted(set(obj) - _JSONL_KEYS)
        if unknown:
            raise bad(f"unknown key(s) {unknown}; a request has {', '.join(sorted(_JSONL_KEYS))}")
        if ("prompt" in obj) == ("tokens" in obj):
            raise bad('need exactly one of "prompt" and "tokens"')
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise bad(f'"prompt" must be a string, got a JSON {json_type(obj["prompt"])}')
        tokens = obj.get("tokens")
        if "tokens" in obj:
            if not isinstance(tokens, list):
                raise bad(f'"tokens" must be a list of token ids, got a JSON {json_type(tokens)}')
            try:
                tokens = [check_int(t, f"token {i}", 0, INT32_MAX) for i, t in enumerate(tokens)]
            except KvjaxError as e:
                raise bad(str(e)) from None
            if chat:
                raise bad('"tokens" with --chat: a chat template renders text, so token ids would be sent '
                          'without it; give "prompt" text')
        if "priority" in obj and not allow_priority:
            raise bad('a "priority" needs --scheduling-policy priority (it would be ignored)')
        try:
            max_tokens = None if "max_tokens" not in obj else \
                check_int(obj["max_tokens"], '"max_tokens"', -INT32_MAX, INT32_MAX)
            priority = check_int(obj.get("priority", 0), '"priority"', -INT32_MAX, INT32_MAX)
        except KvjaxError as e:
            raise bad(str(e)) from None
        requests.append(dict(prompt=obj.get("prompt"), tokens=tokens, max_tokens=max_tokens, priority=priority))
    return requests


def build_requests(args, loaded, raw: list[dict] | None) -> list[dict]:
    """The requests (prompt text or None, token ids, max_tokens, priority), from the prompts file
    or --synthetic, checked against the model's max length."""
    limit = loaded.config.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
        raise UsageError(f"--max-model-len {args.max_model_len} exceeds the model's maximum length {limit}")
    limit = args.max_model_len or limit
    if args.synthetic is not None and args.shared_prefix + args.prompt_len >= limit:
        raise UsageError(f"--shared-prefix {args.shared_prefix} + --prompt-len {args.prompt_len} leave no room "
                         f"to generate within the max length {limit}")
    return _synthetic(args, loaded.config.vocab_size) if raw is None else _encode(args, loaded, raw)


def _encode(args, loaded, raw: list[dict]) -> list[dict]:
    """The prompts file's requests with token ids and each one's max_tokens (the flag's unless its
    own). A text prompt goes through the tokenizer; with --chat it is a user message, rendered with
    the chat template first, and the rendered text becomes the prompt."""
    render = lambda text: text  # noqa: E731
    if args.chat:
        from kvjax.models.tokenizer import render_chat

        if not loaded.chat_template:
            raise UsageError(f"--chat: model {args.model!r} has no chat template")
        render = lambda text: render_chat(loaded.chat_template, [{"role": "user", "content": text}])  # noqa: E731
    requests = []
    for r in raw:
        text = None if r["prompt"] is None else render(r["prompt"])
        requests.append(dict(r, prompt=text, tokens=r["tokens"] if text is None else loaded.tokenizer.encode(text),
                             max_tokens=args.max_tokens if r["max_tokens"] is None else r["max_tokens"]))
    return requests


def _synthetic(args, vocab_size: int) -> list[dict]:
    """--synthetic N random prompts after the same --shared-prefix tokens (seeded by --seed)."""
    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(0, vocab_size, args.shared_prefix).tolist()
    lengths = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, args.synthetic)
    return [dict(prompt=None, tokens=prefix + rng.integers(0, vocab_size, n).tolist(), max_tokens=args.max_tokens,
                 priority=0) for n in lengths]


def sampling_params(requests: list[dict], base) -> tuple[list[tuple[int, dict, object]], dict[int, str]]:
    """(index, request, its SamplingParams) for each request that may run, and why the others
    may not: a request's own bad max_tokens fails it alone, as in vLLM."""
    from kvjax.engine.sampling import SamplingParamsError

    runnable, refused = [], {}
    for i, r in enumerate(requests):
        try:
            runnable.append((i, r, dataclasses.replace(base, max_tokens=r["max_tokens"])))
        except SamplingParamsError as e:
            refused[i] = str(e)
    return runnable, refused


def refused_output(request: dict, error: str):
    """The RequestOutput of a request refused before the run: no completions, the error."""
    from kvjax.engine.outputs import RequestOutput

    return RequestOutput(None, request["prompt"], request["tokens"], None, [], True, None, None, error)
