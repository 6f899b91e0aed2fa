"""`SamplingParams`: how one request generates (vLLM's `vllm/sampling_params.py`).

`SamplingParams` has vLLM's fields, defaults and ranges for everything kvjax implements: n,
presence/frequency/repetition penalties, temperature (default 1.0), top_p, top_k (0 or -1 =
off), min_p, seed, stop strings, stop_token_ids, ignore_eos, max_tokens (default 16; None =
up to max_model_len), min_tokens, logprobs, prompt_logprobs, detokenize, skip_special_tokens,
spaces_between_special_tokens, include_stop_str_in_output, output_kind, skip_clone, logit_bias,
allowed_token_ids and bad_words. Like vLLM's it is mutable (`sp.max_tokens = 8`): the
constructor checks and normalises every field, and `verify()` does it again for values set
afterwards (the engine calls it when a request is added). A vLLM field kvjax does not implement
(structured outputs, logits processors, ...) is refused by name, at construction and on
assignment, never silently ignored. `RequestOutputKind` says what each RequestOutput of a
streaming request carries. kvjax.engine.sampling applies the parameters to a step's logits.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Sequence

import numpy as np

from kvjax.errors import INT32_MAX, MAX_SEED, KvjaxError, check_int

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
MAX_LOGIT_BIAS = 100.0  # vLLM clamps each bias to [-100, 100] (SamplingParams.from_optional)
MAX_NUM_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default: token sequences after tokenization

# vLLM SamplingParams fields that kvjax does not implement: refused by name, with the reason.
# (truncate_prompt_tokens left SamplingParams before vLLM 0.33; it is named for older code.)
_NOT_IMPLEMENTED = {
    "watermarking": "watermarks", "structured_outputs": "structured outputs", "guided_decoding": "structured outputs",
    "logits_processors": "custom logits processors", "truncate_prompt_tokens": "prompt truncation",
    "stream_interval": "streaming outputs", "logprob_token_ids": "log-probabilities of chosen token ids",
    "prompt_logprob_token_ids": "log-probabilities of chosen token ids",
    "prompt_logprob_start": "log-probabilities of chosen token ids", "flat_logprobs": "flat log-probabilities",
    "extra_args": "extra arguments", "thinking_token_budget": "thinking budgets",
    "repetition_detection": "repetition detection", "skip_reading_prefix_cache": "per-request cache reads",
    "routed_experts_prompt_start": "routed-expert traces", "trace_decode_token_ids": "trace replays",
}


class SamplingParamsError(KvjaxError):
    """A sampling parameter outside its range; the message names it and the rule."""


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
    `update_from_tokenizer`, which the engine calls).

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
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] | None = dataclasses.field(default=None, repr=False)  # update_from_tokenizer

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
        def integer(name, value, low, high):
            return check_int(value, name, low, high, SamplingParamsError)

        def real(name, value, low, high, rule):
            if not _real(value) or not low <= value <= high:
                raise SamplingParamsError(f"{name} must be {rule}, got {value!r}")
            return float(value)

        self.n = integer("n", self.n, 1, MAX_N)
        self.presence_penalty = real("presence_penalty", self.presence_penalty, -2, 2, "in [-2, 2]")
        self.frequency_penalty = real("frequency_penalty", self.frequency_penalty, -2, 2, "in [-2, 2]")
        self.repetition_penalty = real("repetition_penalty", self.repetition_penalty, 0, math.inf,
                                       "a finite number > 0")
        if not 0 < self.repetition_penalty < math.inf:
            raise SamplingParamsError(f"repetition_penalty must be a finite number > 0, "
                                      f"got {self.repetition_penalty!r}")
        self.temperature = real("temperature", self.temperature, 0, 2, "in [0, 2] (0 = greedy)")
        self.top_p = real("top_p", self.top_p, 0, 1, "in (0, 1]")
        if self.top_p <= 0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_k = integer("top_k", self.top_k, -1, INT32_MAX)
        self.min_p = real("min_p", self.min_p, 0, 1, "in [0, 1]")
        if self.seed is not None:
            # JAX's threefry key keeps a seed's low 32 bits: a larger seed would alias a smaller one
            self.seed = None if self.seed == -1 else integer("seed", self.seed, 0, MAX_SEED)
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
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
            raise SamplingParamsError("stop strings need detokenize=True")
        if self.max_tokens is not None:
            self.max_tokens = integer("max_tokens", self.max_tokens, 1, INT32_MAX)
        self.min_tokens = integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                value = 1
            if value is not None:
                setattr(self, name, integer(name, value, -1, INT32_MAX))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise SamplingParamsError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                                      f"got {self.output_kind!r:.40}")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids, "an allowed token id")
            if not self.allowed_token_ids:
                raise SamplingParamsError("allowed_token_ids must not be empty (None allows every token)")
        words = [] if self.bad_words is None else self.bad_words
        self.bad_words = list(dict.fromkeys(_strings("bad_words", words, "a list of non-empty strings")))
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
                raise SamplingParamsError(f"n must be 1 when using greedy sampling, got {self.n}")
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if vocab_size is not None:
            self.verify_token_ids(vocab_size)

    def verify_token_ids(self, vocab_size: int) -> None:
        """vLLM's vocabulary checks (`_validate_logit_bias`, `_validate_allowed_token_ids`,
        `_validate_stop_token_ids`, run by its input processor): every id in logit_bias,
        allowed_token_ids and stop_token_ids must be below the model's vocab_size. Expects
        normalised fields (after `verify()`)."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(f"{name} has token id(s) {bad[:8]} outside the model's vocabulary "
                                          f"[0, {vocab_size})")

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
    loop runs it one step per call: stop strings are found in the detokenized text. (Bad words
    need no host: `SamplingRows.add_tokens` keeps their window of recent tokens on the device.)"""
    return bool(params.stop)
