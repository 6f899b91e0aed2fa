"""`SamplingParams`: how one request generates (vLLM's `vllm/sampling_params.py`).

`SamplingParams` has vLLM's fields, defaults and ranges for everything kvjax implements: n,
presence/frequency/repetition penalties, temperature (default 1.0), top_p, top_k (0 or -1 =
off), min_p, seed, stop strings, stop_token_ids, ignore_eos, max_tokens (default 16; None =
up to max_model_len), min_tokens, logprobs, prompt_logprobs, detokenize, skip_special_tokens,
spaces_between_special_tokens, include_stop_str_in_output, output_kind, skip_clone, logit_bias,
allowed_token_ids, bad_words and structured_outputs (`StructuredOutputsParams`: a JSON schema, any
JSON object, a regex, a choice or a grammar the output must match). Like vLLM's it is mutable (`sp.max_tokens = 8`): the
constructor checks and normalises every field, and `verify()` does it again for values set
afterwards (the engine calls it when a request is added). A vLLM field kvjax does not implement
(logits processors, watermarks, ...) is refused by name, at construction and on
assignment, never silently ignored. `RequestOutputKind` says what each RequestOutput of a
streaming request carries. kvjax.engine.sampling applies the parameters to a step's logits.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import math
import os
from collections.abc import Mapping
from typing import Sequence

import numpy as np

from kvjax.errors import KvjaxError
from kvjax.utils.checks import INT32_MAX, MAX_SEED, check_int, is_int

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
MAX_LOGIT_BIAS = 100.0  # vLLM clamps each bias to [-100, 100] (SamplingParams.from_optional)
MAX_NUM_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default: token sequences after tokenization


def max_n_sequences() -> int:
    """The largest n a request may ask for: $VLLM_MAX_N_SEQUENCES (vLLM's variable, read at each check as
    vLLM's envs are), else MAX_N."""
    text = os.environ.get("VLLM_MAX_N_SEQUENCES")
    if text is None:
        return MAX_N
    try:
        return int(text)
    except ValueError:
        raise SamplingParamsError(f"VLLM_MAX_N_SEQUENCES={text!r} is not an integer") from None


# vLLM SamplingParams fields that kvjax does not implement: refused by name, with the reason.
# (truncate_prompt_tokens left SamplingParams before vLLM 0.33; it is named for older code.)
_NOT_IMPLEMENTED = {
    "watermarking": "watermarks", "guided_decoding": "structured outputs (vLLM renamed it structured_outputs)",
    "logits_processors": "custom logits processors", "truncate_prompt_tokens": "prompt truncation",
    "stream_interval": "streaming outputs", "logprob_token_ids": "log-probabilities of chosen token ids",
    "prompt_logprob_token_ids": "log-probabilities of chosen token ids",
    "prompt_logprob_start": "log-probabilities of chosen token ids", "flat_logprobs": "flat log-probabilities",
    "extra_args": "extra arguments", "thinking_token_budget": "thinking budgets",
    "repetition_detection": "repetition detection", "skip_reading_prefix_cache": "per-request cache reads",
    "routed_experts_prompt_start": "routed-expert traces",
}


class SamplingParamsError(KvjaxError):
    """A sampling parameter outside its range; the message names it and the rule."""


# StructuredOutputsParams' constraint kinds (vLLM's; exactly one is set). structural_tag is refused.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: the one constraint a request's output must match (exactly
    one of json — a JSON schema, as a dict or its text —, regex, choice — the output is one of
    these strings —, grammar — Lark or GBNF —, json_object — any JSON object), with the JSON
    options disable_any_whitespace (no whitespace between JSON tokens), disable_additional_properties
    (objects without "additionalProperties" take none) and whitespace_pattern (a regex for it).
    vLLM reads those three options from the server's config; kvjax honours them per request.
    structural_tag (tool-call tags) is refused. The grammar is compiled by
    kvjax.engine.structured_output; an invalid one is refused when the request is checked."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:  # vLLM's two messages
            rule = "You can only use" if given else "You must use"
            raise SamplingParamsError(f"{rule} one kind of structured outputs constraint but "
                                      f"{'multiple are' if given else 'none are'} specified: {given or 'none'} "
                                      f"(one of {', '.join(STRUCTURED_KINDS)})")
        if self.structural_tag is not None:
            raise SamplingParamsError("structured_outputs.structural_tag: structural tags are not implemented in kvjax")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise SamplingParamsError(f"structured_outputs.json must be a JSON schema (a dict or its text), "
                                      f"got {self.json!r:.80}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise SamplingParamsError(f"structured_outputs.{name} must be a string, got {getattr(self, name)!r:.80}")
        if self.choice is not None:
            self.choice = _strings("structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
            if not self.choice:
                raise SamplingParamsError("structured_outputs.choice must not be empty")
        if self.json_object is not None and self.json_object is not True:
            raise SamplingParamsError(f"structured_outputs.json_object must be true when given, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"structured_outputs.{name} must be True or False, "
                                          f"got {getattr(self, name)!r:.40}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_KINDS."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None)


class RequestOutputKind(enum.IntEnum):
    """vLLM's RequestOutputKind: what each RequestOutput of a running request carries. (vLLM's
    is a plain Enum; an IntEnum has the same names and values and stays JSON-serialisable
    through `dataclasses.asdict(params)`.)"""

    CUMULATIVE = 0  # the whole output so far
    DELTA = 1  # only what is new since the last RequestOutput
    FINAL_ONLY = 2  # nothing until the request finishes


def _refusal(name: str, where: str) -> SamplingParamsError:
    if name in _NOT_IMPLEMENTED:
        return SamplingParamsError(f"{where}: {_NOT_IMPLEMENTED[name]} are not implemented in kvjax")
    return SamplingParamsError(f"SamplingParams has no parameter {name!r}")


def _real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and x == x


def _token_ids(name: str, ids, each: str) -> list[int]:
    """ids as a list of ints in [0, INT32_MAX]; name is the container, each one element."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise SamplingParamsError(f"{name} must be a sequence of token ids, got {ids!r:.80}")
    return [check_int(t, each, 0, INT32_MAX, SamplingParamsError) for t in ids]


def _strings(name: str, value, rule: str) -> list[str]:
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence) or \
            not all(isinstance(s, str) and s for s in value):
        raise SamplingParamsError(f"{name} must be {rule}, got {value!r:.80}")
    return list(value)


def _logit_bias(bias) -> dict[int, float]:
    """vLLM's logit_bias as its `from_optional` (the OpenAI server's path) makes it: keys token
    ids (strings of integers converted), each bias clamped to [-100, 100]."""
    if not isinstance(bias, Mapping):
        raise SamplingParamsError(f"logit_bias must be a dict of token id → bias, got {bias!r:.80}")
    out = {}
    for token, value in bias.items():
        if isinstance(token, str):
            try:
                token = int(token)
            except ValueError:
                raise SamplingParamsError(f"logit_bias keys must be token ids, got {token!r:.40}") from None
        token = check_int(token, "a logit_bias token id", 0, INT32_MAX, SamplingParamsError)
        if not _real(value):
            raise SamplingParamsError(f"logit_bias[{token}] must be a number, got {value!r:.40}")
        out[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
    return out


@dataclasses.dataclass
class SamplingParams:
    """How one request generates: vLLM's `SamplingParams` fields, in vLLM's order, with vLLM's
    defaults and ranges (see the module docstring for the order they apply in). Mutable, as
    vLLM's: a field set after construction is checked by `verify()`.

    n: independent samples of the prompt (they share its KV blocks). max_tokens: None = up to
    max_model_len. stop: strings that end the output (finish_reason "stop", stop_reason the
    string, cut from the text unless include_stop_str_in_output). stop_token_ids: tokens that end
    it (stop_reason the id; the token stays in the output). logprobs / prompt_logprobs: k most
    likely alternatives per token (plus the chosen one), -1 = the whole vocabulary (up to the
    LLM's max_logprobs). seed: -1 = None. skip_special_tokens: whether the text leaves special
    tokens out. spaces_between_special_tokens: vLLM's detokenizer option; False matters in vLLM
    only together with skip_special_tokens=False, a pair kvjax refuses. output_kind: what each
    RequestOutput of a running request carries (RequestOutputKind). skip_clone: clone() copies
    shallowly. logit_bias: {token id: bias} added to the logits. allowed_token_ids: the only
    tokens that may be sampled (None = all). bad_words: words never to complete (tokenized by
    `update_from_tokenizer`, which the engine calls). trace_decode_token_ids: vLLM's trace replay,
    the output the engine emits instead of sampling (an engine with enable_trace_replay; the
    log-probabilities and ranks are the forced tokens'; kvjax.engine.processor.normalize_trace_replay).

    After construction stop, stop_token_ids and bad_words are lists (vLLM's normalisation:
    stop_token_ids and bad_words without repeats), logit_bias a dict of int ids to clamped
    floats, allowed_token_ids a list.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    skip_clone: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's place
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] | None = dataclasses.field(default=None, repr=False)  # update_from_tokenizer
    trace_decode_token_ids: list[int] | None = None  # trace replay: the output to emit (checked by the engine)

    def __new__(cls, *args, **kwargs):
        # A vLLM field kvjax lacks would be a TypeError from the dataclass __init__: name it instead.
        for name in kwargs:
            if name not in _FIELDS:
                raise _refusal(name, f"SamplingParams({name}=...)")
        if len(args) > len(_FIELDS):
            raise SamplingParamsError(f"SamplingParams takes at most {len(_FIELDS)} arguments, got {len(args)}")
        return super().__new__(cls)

    def __setattr__(self, name, value):
        # vLLM's params take any attribute; here a misspelt or unimplemented one is refused, not ignored
        if name not in _FIELDS:
            raise _refusal(name, f"SamplingParams.{name}")
        object.__setattr__(self, name, value)

    def __post_init__(self):
        self.verify()

    def verify(self, vocab_size: int | None = None) -> None:
        """Check every field and normalise it, as the constructor does (so a value set after
        construction is checked, and a second call changes nothing); with vocab_size, also
        `verify_token_ids` (vLLM's `verify`, which its input processor runs on each request)."""
        def integer(name, value, low, high, below: str = "", above: str = ""):
            # vLLM's words for a value out of range where it has them ("{}": the value), else check_int's
            if is_int(value) and value < low and below:
                raise SamplingParamsError(below.format(value))
            if is_int(value) and high is not None and value > high and above:
                raise SamplingParamsError(above.format(value))
            return check_int(value, name, low, high, SamplingParamsError)

        def real(name, value, low, high, rule):  # vLLM's words: "top_p must be in (0, 1], got 0.0."
            if not _real(value) or not low <= value <= high:
                raise SamplingParamsError(f"{name} must be {rule}, got {value if _real(value) else repr(value)}.")
            return float(value)

        max_n = max_n_sequences()
        self.n = integer("n", self.n, 1, max_n, "n must be at least 1, got {}.",
                         f"n must be at most {max_n}, got {{}}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
                         "environment variable.")
        self.presence_penalty = real("presence_penalty", self.presence_penalty, -2, 2, "in [-2, 2]")
        self.frequency_penalty = real("frequency_penalty", self.frequency_penalty, -2, 2, "in [-2, 2]")
        for name in ("repetition_penalty", "temperature"):
            value = getattr(self, name)
            if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
                    and not math.isfinite(value):
                raise SamplingParamsError(f"{name} must be a finite number, got {getattr(self, name)}.")
        self.repetition_penalty = real("repetition_penalty", self.repetition_penalty, -math.inf, math.inf,
                                       "a finite number > 0")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if _real(self.temperature) and self.temperature < 0:
            raise SamplingParamsError(f"temperature must be non-negative, got {self.temperature}.")
        self.temperature = real("temperature", self.temperature, 0, 2, "in [0, 2]")
        self.top_p = real("top_p", self.top_p, 0, 1, "in (0, 1]")
        if self.top_p <= 0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}.")
        self.top_k = integer("top_k", self.top_k, -1, INT32_MAX, "top_k must be 0 (disable), or at least 1, got {}.")
        self.min_p = real("min_p", self.min_p, 0, 1, "in [0, 1]")
        if self.seed is not None:
            # JAX's threefry key keeps a seed's low 32 bits: a larger seed would alias a smaller one
            self.seed = None if self.seed == -1 else integer("seed", self.seed, 0, MAX_SEED)
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if isinstance(stop, (list, tuple)) and "" in stop:
            raise SamplingParamsError("stop cannot contain an empty string.")
        self.stop = _strings("stop", stop, "a non-empty string or a list of them")
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.stop_token_ids = list(dict.fromkeys(_token_ids("stop_token_ids", ids, "a stop token id")))
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "skip_clone"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not (self.skip_special_tokens or self.spaces_between_special_tokens):
            raise SamplingParamsError("spaces_between_special_tokens=False with skip_special_tokens=False is not "
                                      "implemented in kvjax (vLLM's detokenizer then drops the space between "
                                      "consecutive special tokens)")
        if self.stop and not self.detokenize:
            raise SamplingParamsError("stop strings are only supported when detokenize is True. Set detokenize=True "
                                      "to use stop.")
        if self.max_tokens is not None:
            self.max_tokens = integer("max_tokens", self.max_tokens, 1, INT32_MAX, "max_tokens must be at least 1, got {}.")
        self.min_tokens = integer("min_tokens", self.min_tokens, 0, self.max_tokens,
                                  "min_tokens must be greater than or equal to 0, got {}.",
                                  f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {{}}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                value = 1
            if value is not None:
                setattr(self, name, integer(name, value, -1, INT32_MAX, f"{name} must be non-negative or -1, got {{}}."))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise SamplingParamsError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                                      f"got {self.output_kind!r:.40}")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids, "an allowed token id")
            if not self.allowed_token_ids:
                raise SamplingParamsError("allowed_token_ids is not None and empty! (None allows every token)")
        words = [] if self.bad_words is None else self.bad_words
        self.bad_words = list(dict.fromkeys(_strings("bad_words", words, "a list of non-empty strings")))
        if isinstance(self.structured_outputs, Mapping):  # vLLM's request bodies give it as a dict
            fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
            unknown = sorted(set(self.structured_outputs) - fields)
            if unknown:
                raise SamplingParamsError(f"structured_outputs has no option {unknown[0]!r} (vLLM's options: "
                                          f"{', '.join(sorted(fields))})")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError(f"structured_outputs must be a StructuredOutputsParams, "
                                      f"got {self.structured_outputs!r:.80}")
        if self._bad_words_token_ids is not None:
            seqs = self._bad_words_token_ids
            if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
                raise SamplingParamsError(f"_bad_words_token_ids must be a list of token id lists, got {seqs!r:.80}")
            self._bad_words_token_ids = [_token_ids("a bad word's token ids", s, "a bad word token id") for s in seqs]
            if not all(self._bad_words_token_ids):
                raise SamplingParamsError("a bad word must have at least one token")
        if self.temperature < SAMPLING_EPS:  # greedy: vLLM resets the filters and refuses n > 1
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise SamplingParamsError(f"n must be 1 when using greedy sampling, got {self.n}.")
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if vocab_size is not None:
            self.verify_token_ids(vocab_size)
            self.verify_trace_replay(vocab_size)

    def verify_token_ids(self, vocab_size: int) -> None:
        """vLLM's vocabulary checks (`_validate_logit_bias`, `_validate_allowed_token_ids`,
        `_validate_stop_token_ids`, run by its input processor): every id in logit_bias,
        allowed_token_ids and stop_token_ids must be below the model's vocab_size. Expects
        normalised fields (after `verify()`)."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad and name == "allowed_token_ids":  # vLLM's words for each
                raise SamplingParamsError(f"allowed_token_ids contains out-of-vocab token id! ({bad[:8]}; "
                                          f"vocabulary size {vocab_size})")
            if bad:
                raise SamplingParamsError(f"token_id(s) {bad[:8]} in {name} contain out-of-vocab token ids. "
                                          f"Vocabulary size: {vocab_size}")

    def verify_trace_replay(self, vocab_size: int) -> None:
        """vLLM's `_validate_trace_replay`, in its words (its input processor runs it on each
        request, not the constructor): trace_decode_token_ids, when set, is a non-empty list of
        token ids in the vocabulary, on a request with n = 1 and none of what a forced output
        cannot honour (prompt_logprobs, structured outputs, bad_words). The engine must also have
        trace replay enabled (kvjax.engine.llm_engine)."""
        trace = self.trace_decode_token_ids
        if trace is None:
            return
        if isinstance(trace, (str, bytes)) or not isinstance(trace, Sequence) or len(trace) == 0:
            raise SamplingParamsError("trace_decode_token_ids must be a non-empty list.")
        if self.n != 1:
            raise SamplingParamsError("trace_decode_token_ids requires n=1.")
        if not all(is_int(t) and t >= 0 for t in trace):
            raise SamplingParamsError("trace_decode_token_ids must contain non-negative integers.")
        for what, used in (("prompt_logprobs", self.prompt_logprobs is not None),
                           ("structured outputs", self.structured_outputs is not None), ("bad_words", self.bad_words)):
            if used:
                raise SamplingParamsError(f"trace_decode_token_ids is not supported with {what}.")
        bad = [int(t) for t in trace if t >= vocab_size]
        if bad:
            raise SamplingParamsError(f"token_id(s) {bad} in trace_decode_token_ids contain out-of-vocab token ids. "
                                      f"Vocabulary size: {vocab_size}")
        self.trace_decode_token_ids = [int(t) for t in trace]

    def update_from_tokenizer(self, tokenizer) -> None:
        """vLLM's `update_from_tokenizer`: each bad word's token ids, tokenized without special
        tokens as it stands (leading spaces stripped) and, when that makes a different first
        token with as many tokens, with one leading space (a word in mid-text); at most
        MAX_NUM_BAD_WORDS sequences, every id <= the tokenizer's max_token_id. tokenizer: anything
        with encode(text, add_special_tokens=False) and max_token_id (or len())."""
        if not self.bad_words:
            return
        if tokenizer is None:  # vLLM skips the call without one, and then bans nothing: refused here
            raise SamplingParamsError("bad_words need a tokenizer to be tokenized (the engine has none)")
        seqs: list[list[int]] = []
        for word in self.bad_words:
            for prefix_space in (False, True):
                ids = list(tokenizer.encode((" " if prefix_space else "") + word.lstrip(), add_special_tokens=False))
                if not ids:
                    if not prefix_space:
                        raise SamplingParamsError(f"bad word {word!r:.40} tokenizes to no token")
                    continue
                if not prefix_space or (ids[0] != seqs[-1][0] and len(ids) == len(seqs[-1])):
                    seqs.append(ids)
                    if len(seqs) > MAX_NUM_BAD_WORDS:
                        raise SamplingParamsError(f"bad_words make more than {MAX_NUM_BAD_WORDS} token sequences "
                                                  "after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS)")
        top = tokenizer.max_token_id if hasattr(tokenizer, "max_token_id") else len(tokenizer) - 1
        bad = [t for s in seqs for t in s if not 0 <= t <= top]
        if bad:
            raise SamplingParamsError(f"bad_words tokenize to id(s) {bad[:8]} outside the vocabulary [0, {top}]")
        self._bad_words_token_ids = seqs

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """The bad words' token sequences, once `update_from_tokenizer` ran (vLLM's property)."""
        return self._bad_words_token_ids

    def clone(self) -> "SamplingParams":
        """A copy the engine may change (vLLM's: deep, or shallow with skip_clone)."""
        return copy.copy(self) if self.skip_clone else copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def stop_ids(self, eos_token_ids: Sequence[int]) -> frozenset[int]:
        """Tokens that end this request: stop_token_ids, plus the model's EOS ids unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    def banned_until_min_tokens(self, eos_token_ids: Sequence[int]) -> frozenset[int]:
        """Tokens masked while fewer than min_tokens were generated: vLLM's all_stop_token_ids
        (stop_token_ids and every EOS id, even with ignore_eos)."""
        return frozenset(self.stop_token_ids) | frozenset(eos_token_ids) if self.min_tokens else frozenset()


_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def needs_host_every_token(params: SamplingParams) -> bool:
    """True when the host must look at the request after every token, so the engine's device
    loop runs it one step per call: stop strings are found in the detokenized text, and a
    structured output's grammar matcher takes each token and makes the next token's mask
    (kvjax.engine.structured_output). (Bad words need no host: `SamplingRows.add_tokens` keeps
    their window of recent tokens on the device.)"""
    return bool(params.stop) or params.structured_outputs is not None
