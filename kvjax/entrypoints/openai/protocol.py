"""The request bodies of kvjax's OpenAI-compatible server (vLLM's `entrypoints/openai/completion/protocol.py`
and `chat_completion/protocol.py`, the fields kvjax serves), and how each becomes a SamplingParams.

A field left out (None) keeps the engine's default (`AsyncLLM.get_default_sampling_params`: vLLM's
defaults, or the checkpoint's generation_config.json). Sampling values are checked by SamplingParams
and the engine, which say which rule a value broke; `check()` adds vLLM's request-level rules (its
`model_validator`s: stream_options only with stream, top_logprobs only with logprobs, ...), each an
`InvalidRequest` naming the field (the server answers 400 with it as the error's `param`).
Fields OpenAI's API has and kvjax does not serve are ignored, as vLLM ignores unknown fields.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from kvjax.engine.sampling import SamplingParams
from kvjax.engine.sampling_params import RequestOutputKind
from kvjax.errors import KvjaxError


_RENDER_ARGS = ("messages", "template")  # LLMEngine.render_chat's parameters, not template variables


class InvalidRequest(KvjaxError):
    """A request that breaks one of vLLM's request-level rules (its VLLMValidationError); param: the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    """vLLM's StreamOptions. include_usage: a last chunk with `"choices": []` and the whole request's
    usage; continuous_usage_stats (only with include_usage): every chunk carries its choice's usage so far."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _empty_stream_options(cls, data):
        # vLLM tests the raw body's truthiness (`data.get("stream_options") and not data.get("stream")`):
        # `"stream_options": {}` is allowed without stream, so it is dropped here like a missing one.
        if isinstance(data, dict) and not data.get("stream_options"):
            data = {k: v for k, v in data.items() if k != "stream_options"}
        return data

    def check(self) -> None:
        """vLLM's request-level rules (InvalidRequest naming the field)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("Stream options can only be defined when `stream=True`.", "stream_options")

    def usage_flags(self) -> tuple[bool, bool]:
        """(include_usage, continuous_usage_stats) of a stream (vLLM's should_include_usage): continuous
        usage only with include_usage."""
        opts = self.stream_options
        include = opts is not None and bool(opts.include_usage)
        return include, include and bool(opts.continuous_usage_stats)

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def _logprobs(self) -> int | None:
        return None

    def to_sampling_params(self, default: SamplingParams) -> SamplingParams:
        """default with every field this request set; DELTA when it streams (each chunk says what is new)."""
        fields = dict(n=self.n, temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop,
                      presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                      top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                      ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
                      logprobs=self._logprobs())
        fields = {k: v for k, v in fields.items() if v is not None}
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return dataclasses.replace(default, **fields, max_tokens=self._max_tokens(), output_kind=kind)


class CompletionRequest(_Request):
    """POST /v1/completions. prompt: a string, a list of them, token ids, or a list of token-id lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list:
        """The prompts as a list, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. messages: [{"role", "content"}, ...], rendered with the model's chat template.

    logprobs: whether each choice reports its tokens' log-probabilities (OpenAI's chat format);
    top_logprobs: how many of the most likely tokens each position lists too (-1: the whole vocabulary),
    only with logprobs; SamplingParams.logprobs is top_logprobs (0: the chosen token's alone), as in vLLM.
    vLLM's extras: add_generation_prompt (open the assistant's turn), continue_final_message (leave the
    last message open so the reply continues it; not with add_generation_prompt), documents and
    chat_template_kwargs (more template variables; the request's own fields win over them, as vLLM
    merges them), echo (the reply starts with the last message's content when that message has the
    reply's role)."""

    messages: list[dict]
    max_tokens: int | None = None  # None: up to the model's max length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None  # None: 0, as OpenAI's spec allows null
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        top = self.top_logprobs or 0
        if top < -1:
            raise InvalidRequest(f"`top_logprobs` must be a positive value or -1, got {top}.", "top_logprobs")
        if top != 0 and not self.logprobs:
            raise InvalidRequest(f"when using `top_logprobs` ({top}), `logprobs` must be set to true.", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True "
                                 "(add_generation_prompt defaults to True).", "continue_final_message")
        taken = [k for k in _RENDER_ARGS if k in (self.chat_template_kwargs or {})]
        if taken:  # LLMEngine.render_chat's own arguments: "template" would swap the server's chat template
            raise InvalidRequest(f"chat_template_kwargs may not set {taken[0]!r}: the server renders the request's "
                                 f"messages with its own chat template", "chat_template_kwargs")

    def template_options(self) -> dict[str, Any]:
        """The template's variables besides messages: chat_template_kwargs under the request's own fields."""
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "documents": self.documents}

    def response_role(self) -> str:
        """The reply's role (vLLM's get_chat_request_role): the assistant's, or with no generation prompt
        the last message's (the reply continues it)."""
        if self.add_generation_prompt or not self.messages:
            return "assistant"
        return str(self.messages[-1].get("role", "assistant"))

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
