"""Structured outputs: a request's `StructuredOutputsParams` (kvjax.engine.sampling_params) as a
grammar matcher over the model's tokenizer, which says before each token which tokens may come
next (a bitmask) and takes each sampled token (vLLM V1's `vllm/v1/structured_output/`, its
"guidance" backend, `backend_guidance.py`, whose library this is: llguidance).

    manager = StructuredOutputManager(tokenizer, vocab_size=256, eos_token_ids=())
    grammar = manager.compile(StructuredOutputsParams(choice=["yes", "no"]))
    mask = manager.bitmask([grammar, None])  # i32[2, 8]: row 0 allows "y" and "n", row 1 everything
    grammar.accept([ord("n")])

The grammar of each kind, as vLLM's `serialize_guidance_grammar` writes it: json (a schema),
json_object (the schema {"type": "object"}), regex, choice, grammar (Lark or GBNF). The JSON ones
take whitespace between tokens unless disable_any_whitespace, whitespace_pattern as the regex for
it, and with disable_additional_properties an object schema without "additionalProperties" takes
none (vLLM's `process_for_additional_properties`). vLLM reads those three options from the
server's config; kvjax from the request.

The tokenizer is any of kvjax's (models.tokenizer.Tokenizer: a `tokenizers` tokenizer.json, a
GGUF's vocabulary rebuilt as one, or the built-in models' UTF-8 bytes) or a transformers fast
tokenizer: llguidance reads each token's bytes from it. A model with no EOS token (the built-in
byte models) gets a virtual one past its vocabulary, which the mask never lets the model sample:
such a request ends ("stop") as soon as its grammar is complete (`Grammar.terminated`) — with an
EOS, the mask then allows only EOS and the request ends when the model samples it, as in vLLM.

How the engine uses it (kvjax.engine.core): a constrained request runs one decode step per device
call (`needs_host_every_token`); before each step its row of the bitmask goes into the step's
SamplingRows and the jitted sampler sets every token the mask leaves out to −inf before anything
else (vLLM's `apply_grammar_bitmask`, before the sampler: the reported log-probabilities are of
the masked logits, as in vLLM); after the step the host's matcher takes the new token. A step
without a constrained request traces exactly the program it traced before (no mask).
"""
from __future__ import annotations

import copy
import functools
import json
import logging

import numpy as np

from kvjax.engine.sampling_params import StructuredOutputsParams
from kvjax.errors import KvjaxError


class StructuredOutputError(KvjaxError):
    """A grammar that does not compile, or a tokenizer llguidance cannot read."""


def _llguidance():
    try:
        import llguidance
    except ImportError:  # declared in pyproject.toml; a trimmed install may lack it
        raise StructuredOutputError("structured outputs need the llguidance package (pip install llguidance)") from None
    return llguidance


# ----------------------------------------------------------------------------------- grammars
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items", "prefixItems", "allOf",
               "anyOf", "oneOf")


def _no_additional_properties(schema) -> None:
    """vLLM's `_walk_json_for_additional_properties`: every object schema with properties and no
    additionalProperties gets additionalProperties false, in place."""
    if isinstance(schema, list):
        for item in schema:
            _no_additional_properties(item)
        return
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _no_additional_properties(sub)
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), (dict, list)):
            _no_additional_properties(schema[key])
    if "additionalProperties" not in schema and (isinstance(schema.get("properties"), dict)
                                                 or isinstance(schema.get("patternProperties"), dict)):
        schema["additionalProperties"] = False


def serialize_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of one constraint (vLLM's `serialize_guidance_grammar`, with the JSON
    options read from params). Raises StructuredOutputError naming the field for a schema that is
    not JSON."""
    llg = _llguidance()
    kind = params.kind
    if kind in ("json", "json_object"):
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        schema = params.json if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise StructuredOutputError(f"structured_outputs.json is not valid JSON: {e}") from None
        if params.disable_additional_properties:
            schema = copy.deepcopy(schema)
            _no_additional_properties(schema)
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as e:
            raise StructuredOutputError(f"structured_outputs.json: invalid JSON schema: {e}") from None
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(params.choice))
    if kind == "regex":
        return llg.grammar_from("regex", params.regex)
    try:
        return llg.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(f"structured_outputs.grammar: {e}") from None


# ----------------------------------------------------------------------------------- tokenizers
class _ByteTokens:
    """The built-in models' vocabulary for llguidance's TokenizerWrapper: id i is the byte i, and
    a virtual EOS after them when the model has none."""

    def __init__(self, n_vocab: int, eos: int):
        self.tokens = [bytes([i]) for i in range(256)] + [b""] * (n_vocab - 256)
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = list(range(256, n_vocab))
        if eos >= 256:
            self.tokens[eos] = b"<|kvjax_virtual_eos|>"

    def __call__(self, text):
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids=()):
    """llguidance's LLTokenizer of a kvjax Tokenizer (byte vocabulary or a `tokenizers` backend) or a
    transformers fast tokenizer, over the model's vocab_size ids, with the model's EOS ids (none: a
    virtual EOS at id max(vocab_size, len(tokenizer)), which the model cannot sample)."""
    llg = _llguidance()
    size = max(vocab_size, len(tokenizer))
    eos = [int(t) for t in eos_token_ids] or [size]
    n_vocab = max(size, max(eos) + 1)
    if getattr(tokenizer, "is_bytes", False):
        return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens(n_vocab, eos[0])), n_vocab=n_vocab, eos_token=eos)
    backend = getattr(tokenizer, "_tok", None) or getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise StructuredOutputError(f"structured outputs need a tokenizer whose token bytes llguidance can read "
                                    f"(kvjax's, or a fast Hugging Face tokenizer), got {type(tokenizer).__name__}")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    try:
        return llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
    except (ValueError, RuntimeError) as e:
        raise StructuredOutputError(f"llguidance cannot read this tokenizer: {e}") from None


# ----------------------------------------------------------------------------------- matchers
class Grammar:
    """One request's matcher: the tokens it took so far decide the next token's mask."""

    def __init__(self, matcher, eos_token_ids: frozenset[int]):
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids  # the model's own EOS ids (not a virtual one)
        self.num_accepted = 0  # output tokens the matcher has seen

    def accept(self, tokens) -> bool:
        """Take the request's new output tokens; False when one breaks the grammar (the matcher is
        then in its error state: `error`). An EOS after the grammar completed is not fed to it."""
        for t in tokens:
            self.num_accepted += 1
            if self.matcher.is_stopped() and int(t) in self.eos_token_ids:
                continue
            if not self.matcher.consume_token(int(t)):
                return False
        return True

    def advance(self, output, request_id: str) -> str | None:
        """After a step: take the request's new tokens (output: all its tokens so far). → "stop" when
        the grammar is complete and the model has no EOS to end it with (the mask would allow
        nothing), "error" when a token broke the grammar (a warning names the request; only a
        sampler that ignored the mask can do that), else None."""
        if not self.accept(output[self.num_accepted:]):
            logging.getLogger("kvjax").warning("request %s: output token %d breaks its structured-output grammar "
                                               "(%s); it ends with finish_reason 'error'", request_id,
                                               self.num_accepted - 1, self.error)
            return "error"
        return "stop" if self.terminated and not self.eos_token_ids else None

    @property
    def terminated(self) -> bool:
        """The grammar is complete and takes no more tokens (only an EOS may follow)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class StructuredOutputManager:
    """One engine's grammar compiler: the tokenizer read once (on the first constrained request),
    each request's Grammar, and the step's bitmask."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=()):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.words = -(-vocab_size // 32)  # the bitmask's int32 words per row

    @functools.cached_property
    def ll_tokenizer(self):
        if self.tokenizer is None:
            raise StructuredOutputError("structured outputs need a tokenizer (the engine was built without one)")
        return ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def check(self, params: StructuredOutputsParams) -> str | None:
        """Why this constraint is refused (vLLM's "Grammar error: ..."), or None."""
        try:
            grammar = serialize_grammar(params)
            error = _llguidance().LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        except StructuredOutputError as e:
            return str(e)
        return None if not error or error.startswith("WARNING") else f"Grammar error: {error}"

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for one request (StructuredOutputError if the grammar does not compile)."""
        llg = _llguidance()
        matcher = llg.LLMatcher(self.ll_tokenizer, serialize_grammar(params), log_level=0)
        if matcher.get_error():
            raise StructuredOutputError(f"Grammar error: {matcher.get_error()}")
        return Grammar(matcher, frozenset(self.eos_token_ids))

    def bitmask(self, grammars) -> np.ndarray:
        """i32[B, cdiv(V, 32)]: bit t of row b says token t may come next (llguidance's and
        xgrammar's layout: word t // 32, bit t % 32); rows without a Grammar allow everything."""
        import llguidance.numpy as lln

        width = -(-self.ll_tokenizer.vocab_size // 32)  # >= self.words: llguidance's ids cover the model's
        full = np.full((len(grammars), width), -1, np.int32)
        for b, g in enumerate(grammars):
            if g is not None:
                lln.fill_next_token_bitmask(g.matcher, full, b)
        return np.ascontiguousarray(full[:, :self.words])  # bits of ids past the model's vocabulary: never read


__all__ = ["StructuredOutputError", "StructuredOutputManager", "Grammar", "serialize_grammar", "ll_tokenizer"]
