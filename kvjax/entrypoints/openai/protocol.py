"""The request bodies of kvjax's OpenAI-compatible server (vLLM 0.33's
`entrypoints/openai/completion/protocol.py` and `chat_completion/protocol.py`), and how each becomes
a SamplingParams (or beam search's BeamSearchParams).

Every field vLLM's request models declare is either honoured — a field of the models below, doing
what it does in vLLM — or refused: listed in REFUSED_FIELDS with the values that mean "not asked
for" (its default), any other value a 400 naming the field. Nothing vLLM accepts is ignored in
silence; docs/server_fields.md lists each field and which (a test walks vLLM's field lists).
A few fields change nothing in vLLM either (`user`, `session_id`, `return_token_offsets`,
`mm_payload`, `return_mm_kwargs`; `include_reasoning` and `parallel_tool_calls` without a
reasoning or tool parser): they are accepted and do nothing, as there. vLLM's removed
`guided_*` fields are refused (vLLM warns and ignores them), other unknown fields are ignored as
vLLM ignores them.

A field left out (None) keeps the engine's default (`AsyncLLM.get_default_sampling_params`:
vLLM's defaults, or the checkpoint's generation_config.json). Sampling values are checked by
SamplingParams and the engine, which say which rule a value broke; `check()` adds vLLM's
request-level rules (its `model_validator`s), each an `InvalidRequest` naming the field (the
server answers 400 with it as the error's `param`), in vLLM's words.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvjax.engine.beam_search import BeamSearchParams
from kvjax.engine.sampling import SamplingParams
from kvjax.engine.sampling_params import RequestOutputKind, StructuredOutputsParams
from kvjax.errors import KvjaxError

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # vLLM's renderers/params.py
_RENDER_ARGS = ("messages", "template")  # LLMEngine.render_chat's parameters, not template variables
_INT64 = 2 ** 63

# vLLM request fields kvjax does not implement: (values that ask for nothing, why any other is refused).
_NOT_IN_KVJAX = {
    "watermarking": ((None, False), "watermarks are not implemented in kvjax"),
    "logprob_token_ids": ((None, []), "log-probabilities of chosen token ids are not implemented in kvjax"),
    "prompt_embeds": ((None, []), "prompt embeddings are not implemented in kvjax"),
    "return_weight_versions": ((False, None), "kvjax serves one weight version"),
    "routed_experts_prompt_start": ((0, None), "routed-expert traces are not implemented in kvjax"),
    "cache_salt": ((None,), "per-request prefix-cache salts are not implemented in kvjax"),
    "kv_transfer_params": ((None,), "disaggregated serving (KV transfer) is not implemented in kvjax"),
    "ec_transfer_params": ((None,), "disaggregated serving (encoder-cache transfer) is not implemented in kvjax"),
    "vllm_xargs": ((None, {}), "custom extension arguments are not implemented in kvjax"),
    "repetition_detection": ((None,), "repetition detection is not implemented in kvjax"),
    "thinking_token_budget": ((None, -1), "thinking budgets are not implemented in kvjax"),
    "stream_interval": ((None, 1), "kvjax streams every token (vLLM's --stream-interval 1)"),
    "media_io_kwargs": ((None, {}), "multimodal inputs are not implemented in kvjax"),
    "mm_processor_kwargs": ((None, {}), "multimodal inputs are not implemented in kvjax"),
}
# vLLM's removed guided-decoding fields (vLLM warns that they are ignored; kvjax refuses them).
_REMOVED_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                   "guided_whitespace_pattern")
REFUSED_FIELDS = {**_NOT_IN_KVJAX, **{name: ((None,), "removed from vLLM: use `structured_outputs` or "
                                               "`response_format`") for name in _REMOVED_GUIDED}}


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


class JsonSchemaResponseFormat(BaseModel):
    """OpenAI's response_format.json_schema: {"name", "description", "schema", "strict"}."""

    model_config = ConfigDict(populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text", "json_object" or "json_schema" (vLLM's "structural_tag" is refused)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None

    model_config = ConfigDict(extra="allow")


class _Request(BaseModel):
    """The fields both endpoints share, vLLM's defaults."""

    model_config = ConfigDict(extra="allow")  # vLLM's OpenAIBaseModel: refused ones are caught in check()

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-_INT64, le=_INT64 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # OpenAI's end-user id: no effect (vLLM ignores it too)
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling fields
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] = Field(default_factory=list)
    # vLLM's extra parameters
    structured_outputs: dict[str, Any] | None = None
    priority: int = Field(0, ge=-_INT64, le=_INT64 - 1)
    request_id: str | None = None  # the response's id (after the endpoint's prefix), as vLLM's
    session_id: str | None = None  # a client's session id: no effect on one engine (vLLM forwards it to routing)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_token_offsets: bool | None = False  # vLLM: render endpoints only, ignored here
    mm_payload: Literal["tensors", "none"] = "tensors"  # vLLM: render endpoints only, ignored here
    return_mm_kwargs: bool | None = None  # vLLM: render endpoints only, ignored here

    @model_validator(mode="before")
    @classmethod
    def _empty_stream_options(cls, data):
        # vLLM tests the raw body's truthiness (`data.get("stream_options") and not data.get("stream")`):
        # `"stream_options": {}` is allowed without stream, so it is dropped here like a missing one.
        if isinstance(data, dict) and not data.get("stream_options"):
            data = {k: v for k, v in data.items() if k != "stream_options"}
        return data

    # ------------------------------------------------------------------ vLLM's rules
    def check(self) -> None:
        """vLLM's request-level rules and kvjax's refusals (InvalidRequest naming the field)."""
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED_FIELDS:
                neutral, why = REFUSED_FIELDS[name]
                if not any(value == v and type(value) is type(v) for v in neutral):
                    raise InvalidRequest(f"`{name}` is not supported by kvjax: {why}", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("Stream options can only be defined when `stream=True`.", "stream_options")
        if self.prompt_logprobs is not None:
            if self.stream and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
                raise InvalidRequest("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
            if self.prompt_logprobs < -1:
                raise InvalidRequest("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
        if self.use_beam_search and self.stream:  # vLLM's serving layer: a 400 too
            raise InvalidRequest("Streaming is not currently supported with beam search", "use_beam_search")
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise InvalidRequest("When response_format type is 'json_schema', the 'json_schema' field must be "
                                 "provided.", "response_format")
        if rf is not None and rf.type == "structural_tag":
            raise InvalidRequest("`response_format` type 'structural_tag' is not supported by kvjax: structural "
                                 "tags are not implemented", "response_format")
        so = self.structured_outputs
        if so is not None and sum(so.get(k) is not None for k in ("json", "regex", "choice")) > 1:
            raise InvalidRequest("You can only use one kind of constraints for structured outputs ('json', 'regex' "
                                 "or 'choice').", "structured_outputs")

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with integer keys (vLLM's from_optional: every key that is not an integer named at once)."""
        if self.logit_bias is None:
            return None
        bad = [k for k in self.logit_bias if not _is_int_text(k)]
        if bad:
            raise InvalidRequest(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
                                 "logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}

    def structured(self) -> StructuredOutputsParams | None:
        """vLLM's structured_outputs_from_response_format: response_format's constraint over structured_outputs."""
        so = dict(self.structured_outputs or {})
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            so = {**{k: v for k, v in so.items() if k not in _KINDS}, "json_object": True}
        elif rf is not None and rf.type == "json_schema":
            so = {**{k: v for k, v in so.items() if k not in _KINDS}, "json": rf.json_schema.json_schema}
        if not so:
            return None
        fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        unknown = sorted(set(so) - fields)
        if unknown:
            raise InvalidRequest(f"structured_outputs has no option {unknown[0]!r} (vLLM's: {', '.join(sorted(fields))})",
                                 "structured_outputs")
        try:
            return StructuredOutputsParams(**so)
        except KvjaxError as e:
            raise InvalidRequest(str(e), "structured_outputs") from None

    def usage_flags(self) -> tuple[bool, bool]:
        """(include_usage, continuous_usage_stats) of a stream (vLLM's should_include_usage): continuous
        usage only with include_usage."""
        opts = self.stream_options
        include = opts is not None and bool(opts.include_usage)
        return include, include and bool(opts.continuous_usage_stats)

    # ------------------------------------------------------------------ params
    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, max_tokens: int | None = ...,
                           default_sampling_params: SamplingParams | dict | None = None) -> SamplingParams:
        """vLLM's to_sampling_params: every field this request set over the server's defaults
        (default_sampling_params: a SamplingParams, or vLLM's dict of the fields that differ from its
        defaults) over vLLM's; DELTA when it streams (each chunk says what is new). max_tokens: what the
        server allows after the context-length rule (default: the request's own)."""
        max_tokens = self._max_tokens() if max_tokens is ... else max_tokens
        default = default_sampling_params
        default = SamplingParams(**(default or {})) if not isinstance(default, SamplingParams) else default
        fields = dict(n=self.n, temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop,
                      presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                      top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                      logprobs=self._logprobs(), prompt_logprobs=self._prompt_logprobs(),
                      skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias_ids(),
                      allowed_token_ids=self.allowed_token_ids, structured_outputs=self.structured())
        fields = {k: v for k, v in fields.items() if v is not None}
        stop_ids = list(dict.fromkeys([*(self.stop_token_ids or []), *default.stop_token_ids]))  # vLLM merges them
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return dataclasses.replace(default, **fields, max_tokens=max_tokens, output_kind=kind, stop_token_ids=stop_ids,
                                   ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, bad_words=self.bad_words,
                                   include_stop_str_in_output=self.include_stop_str_in_output,
                                   spaces_between_special_tokens=self.spaces_between_special_tokens, skip_clone=True)

    def to_beam_search_params(self, max_tokens: int, default: SamplingParams) -> BeamSearchParams:
        """vLLM's to_beam_search_params: beam_width n, the request's (or default) temperature."""
        if self.structured() is not None:
            raise InvalidRequest("structured outputs are not supported with beam search (vLLM's beam search "
                                 "does not apply them either)", "use_beam_search")
        return BeamSearchParams(beam_width=self.n or 1, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=default.temperature if self.temperature is None else self.temperature,
                                length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output,
                                skip_special_tokens=default.skip_special_tokens if self.skip_special_tokens is None
                                else self.skip_special_tokens)

    def beam_allowed_token_ids(self) -> list[int] | None:
        return self.allowed_token_ids


_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _is_int_text(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True


class CompletionRequest(_Request):
    """POST /v1/completions. prompt: a string, a list of them, token ids, or a list of token-id lists."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None  # fill-in-the-middle: vLLM refuses it for models without a FIM renderer (all of kvjax's)
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _null_max_tokens(cls, data):
        if isinstance(data, dict) and data.get("max_tokens") is None:  # vLLM's normalize_null_max_tokens
            data = {**data, "max_tokens": 16}
        return data

    def check(self) -> None:
        super().check()
        p = self.prompt
        if p is None or p == "" or p == []:
            raise InvalidRequest("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if self.logprobs is not None and self.logprobs < -1:
            raise InvalidRequest("`logprobs` must be a positive value or -1.", "logprobs")
        if self.use_beam_search and self.echo and self.logprobs is not None:
            raise InvalidRequest("`echo` with `logprobs` is not supported with beam search because beam search "
                                 "does not compute prompt logprobs.", "echo")
        if self.suffix is not None:
            if self.echo:
                raise InvalidRequest("Echo is unsupported with suffix.", "suffix")
            if self.truncate_prompt_tokens is not None:
                raise InvalidRequest("suffix is not supported with truncate_prompt_tokens", "suffix")
            raise InvalidRequest("suffix is only supported for models with FIM completion rendering", "suffix")

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        # vLLM: echo reports the prompt's log-probabilities as the logprobs field asks for the output's
        return self.logprobs if self.prompt_logprobs is None and self.echo else self.prompt_logprobs

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
    reply's role), tools (passed to the template; with tool_choice "none" only, as vLLM without a
    tool parser), reasoning_effort (a template variable, with enable_thinking = effort != "none")."""

    messages: list[dict]
    max_tokens: int | None = None  # None: up to the model's max length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int = 0  # null: 0, as OpenAI's spec allows it (vLLM's TopLogprobsParam)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "none"
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True  # no reasoning parser in kvjax: nothing to split off, as vLLM without one
    parallel_tool_calls: bool | None = True  # no tool parser in kvjax: no tool calls to limit, as vLLM without one
    return_prompt_text: bool | None = None

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _null_top_logprobs(cls, value):
        return 0 if value is None else value

    @model_validator(mode="before")
    @classmethod
    def _default_tool_choice(cls, data):
        # vLLM's check_tool_usage: tools without tool_choice mean "auto"
        if isinstance(data, dict) and "tool_choice" not in data and data.get("tools"):
            data = {**data, "tool_choice": "auto"}
        return data

    def check(self) -> None:
        super().check()
        top = self.top_logprobs
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
        if self.chat_template is not None or (self.chat_template_kwargs or {}).get("chat_template") is not None:
            raise InvalidRequest("Chat template is passed with request, but --trust-request-chat-template is not "
                                 "set. Refused request with untrusted chat template.", "chat_template")
        if self.tools == []:
            raise InvalidRequest("`tools` must not be an empty array. Either provide at least one tool or omit the "
                                 "field entirely.", "tools")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise InvalidRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice == "auto":  # kvjax has no tool parser: vLLM's answer without --enable-auto-tool-choice
            raise InvalidRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                                 'be set', "tool_choice")
        if choice not in (None, "none"):
            desc = (f'function "{choice.get("function", {}).get("name")}"' if isinstance(choice, dict)
                    else f'"{choice}"')
            raise InvalidRequest(f"tool_choice={desc} requires --tool-call-parser to be set", "tool_choice")

    def template_options(self) -> dict[str, Any]:
        """The template's variables besides messages: chat_template_kwargs under the request's own fields."""
        extra = {"add_generation_prompt": self.add_generation_prompt,
                 "continue_final_message": self.continue_final_message, "documents": self.documents}
        if self.tools is not None:
            extra["tools"] = self.tools
        if self.reasoning_effort is not None:
            extra["reasoning_effort"] = self.reasoning_effort
            if "enable_thinking" not in (self.chat_template_kwargs or {}):
                extra["enable_thinking"] = self.reasoning_effort != "none"
        return {**(self.chat_template_kwargs or {}), **extra}

    def response_role(self) -> str:
        """The reply's role (vLLM's get_chat_request_role): the assistant's, or with no generation prompt
        the last message's (the reply continues it)."""
        if self.add_generation_prompt or not self.messages:
            return "assistant"
        return str(self.messages[-1].get("role", "assistant"))

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def _logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    def _prompt_logprobs(self) -> int | None:
        return self.top_logprobs if self.prompt_logprobs is None and self.echo else self.prompt_logprobs


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch (vLLM's BatchChatCompletionRequest): messages is a list of
    conversations, each rendered and run as a chat completion of its own with the other fields; the reply
    has one choice per conversation (index i, in order). vLLM's rules: no beam search, n = 1, no tools;
    and no stream (vLLM's batch request has no such field; kvjax refuses it rather than ignore it)."""

    messages: list[list[dict]] = Field(..., min_length=1)

    def check(self) -> None:
        if self.use_beam_search:
            raise InvalidRequest("Batch chat completions do not support beam search. Please set `use_beam_search` to "
                                 "False.", "use_beam_search")
        if self.n is not None and self.n != 1:
            raise InvalidRequest("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
        if self.stream:
            raise InvalidRequest("Batch chat completions do not support streaming: set `stream` to false.", "stream")
        if self.tools is not None:
            raise InvalidRequest("Batch chat completions do not support tools: leave `tools` out.", "tools")
        for i, conversation in enumerate(self.messages):
            if not conversation:
                raise InvalidRequest(f"messages[{i}] is empty: each conversation needs at least one message.",
                                     "messages")
        for conversation in self.conversations():
            conversation.check()

    def conversations(self) -> list[ChatCompletionRequest]:
        """vLLM's to_chat_completion_request of each conversation: a ChatCompletionRequest with its messages."""
        data = self.model_dump(exclude={"messages"}, exclude_none=True)
        return [ChatCompletionRequest.model_validate({**data, "messages": m}) for m in self.messages]


__all__ = ["CompletionRequest", "ChatCompletionRequest", "BatchChatCompletionRequest", "InvalidRequest",
           "REFUSED_FIELDS", "StreamOptions"]
