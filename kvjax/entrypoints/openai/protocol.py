"""The request bodies of kvjax's OpenAI-compatible server (vLLM's `entrypoints/openai/completion/protocol.py`
and `chat_completion/protocol.py`, the fields kvjax serves), and how each becomes a SamplingParams.

A field left out (None) keeps the engine's default (`AsyncLLM.get_default_sampling_params`: vLLM's
defaults, or the checkpoint's generation_config.json). Values are not checked here: SamplingParams and
the engine check them and say which rule a value broke (the server answers 400 with that message).
Fields OpenAI's API has and kvjax does not serve are ignored, as vLLM ignores unknown fields.
"""
from __future__ import annotations

import dataclasses

from pydantic import BaseModel, ConfigDict

from kvjax.engine.sampling import SamplingParams
from kvjax.engine.sampling_params import RequestOutputKind


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None

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
    """POST /v1/chat/completions. messages: [{"role", "content"}, ...], rendered with the model's chat template."""

    messages: list[dict]
    max_tokens: int | None = None  # None: up to the model's max length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
