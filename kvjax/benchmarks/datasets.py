"""The request datasets of `kvjax bench serve` (vLLM 0.33, vllm/benchmarks/datasets/), as token ids.

    random             RandomDataset: seeded lengths, a token sequence per request (random_requests)
    prefix_repetition  PrefixRepetitionRandomDataset: num_prefixes random prefixes, each shared by
                       n // num_prefixes prompts with a random suffix of their own
    sharegpt           ShareGPTDataset: the first two turns of each conversation in a ShareGPT JSON
                       file, as prompt and expected output
    corpus             kvjax's: vLLM's create_txt_slices_dataset.py (a text file's tokens, cut at
                       random starts into prompts of the random dataset's lengths) on the text kvjax
                       ships, kvjax.data.PROSE (the Python Language Reference's prose), so that a
                       realistic-text benchmark runs offline

What differs from vLLM everywhere: kvjax sends every prompt as token ids. vLLM decodes its synthetic
ids to text, re-encodes and trims the text until it has the length asked for, and sends the text;
kvjax skips that round trip, so a prompt has exactly the tokens drawn (and the draws vLLM makes only
to pad a re-encoding that came out short are not made). The random draws are vLLM's, in its order,
from the same seeded generators, so the lengths, prefixes and orders are vLLM's.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvjax.errors import InputFileError, KvjaxError
from kvjax.utils.input_files import read_text
from kvjax.utils.strict_json import json_type, read_json

DATASETS = ("random", "prefix_repetition", "sharegpt", "corpus")
# vLLM's is_valid_sequence defaults (from benchmark_serving.py's sample_sharegpt_requests)
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass
class SampleRequest:
    """One benchmark request: its prompt as token ids and the tokens to generate."""
    prompt_token_ids: list[int]
    prompt_len: int
    expected_output_len: int


def sample_lengths(rng: np.random.Generator, n: int, range_ratio: float, input_len: int, output_len: int,
                   vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's get_sampling_params → (input lengths, output lengths, vocabulary offsets), each i64[n]:
    lengths uniform over the integers in [floor(len*(1-r)), ceil(len*(1+r))] (output at least 1),
    offsets uniform in [0, vocab_size), drawn in that order. vLLM first takes from input_len the
    special tokens its tokenizer adds to a text; kvjax sends ids and adds none."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    in_lo, in_hi = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    out_lo = max(math.floor(output_len * (1 - range_ratio)), 1)
    out_hi = max(math.ceil(output_len * (1 + range_ratio)), 1)
    return (rng.integers(in_lo, in_hi + 1, size=n), rng.integers(out_lo, out_hi + 1, size=n),
            rng.integers(0, vocab_size, size=n))


def min_input_len(input_len: int, range_ratio: float) -> int:
    """The shortest input sample_lengths can draw."""
    return math.floor(input_len * (1 - range_ratio))


# ---------------------------------------------------------------- random

def random_requests(n: int, input_len: int, output_len: int, *, range_ratio: float = 0.0, prefix_len: int = 0,
                    vocab_size: int, special_ids: Sequence[int] = (), seed: int = 0) -> list[SampleRequest]:
    """vLLM's RandomDataset: lengths by sample_lengths, a shared prefix of prefix_len random
    tokens, then request i's tokens allowed[(offset_i + i + arange(len_i)) % len(allowed)], where
    allowed is the vocabulary less special_ids. numpy's default_rng(seed), draws in vLLM's order."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if prefix_len + min_input_len(input_len, range_ratio) < 1:
        raise ValueError("--random-input-len is too small: a prompt needs at least one token")
    rng = np.random.default_rng(seed)
    input_lens, output_lens, offsets = sample_lengths(rng, n, range_ratio, input_len, output_len, vocab_size)
    allowed = np.array(sorted(set(range(vocab_size)) - set(special_ids)))
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []
    out = []
    for i in range(n):
        ids = prefix + allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        out.append(SampleRequest(ids, len(ids), int(output_lens[i])))
    return out


# ---------------------------------------------------------------- prefix_repetition

def prefix_repetition_requests(n: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, *,
                               vocab_size: int, seed: int = 0, shuffle: bool = True) -> list[SampleRequest]:
    """vLLM's PrefixRepetitionRandomDataset: for each of num_prefixes prefixes, prefix_len token
    ids, then n // num_prefixes suffixes of suffix_len ids each; prompt = prefix + suffix, output
    output_len tokens. The ids are numpy's legacy generator seeded with seed (vLLM's
    np.random.seed, then np.random.randint(0, vocab_size) per prefix and suffix in that order),
    over the whole vocabulary, special ids included (as vLLM draws them); then Python's
    random.Random(seed) shuffles the list (vLLM's random.seed and random.shuffle) unless shuffle is
    False (--disable-shuffle). So there are num_prefixes * (n // num_prefixes) requests, fewer
    than n when num_prefixes does not divide it: vLLM does not oversample this dataset."""
    if num_prefixes < 1 or n // num_prefixes == 0:
        raise ValueError(f"--num-prompts ({n}) must be at least --prefix-repetition-num-prefixes ({num_prefixes})")
    if prefix_len + suffix_len < 1:
        raise ValueError("--prefix-repetition-prefix-len + --prefix-repetition-suffix-len must be at least 1 "
                         "(a prompt needs a token)")
    draws = np.random.RandomState(seed)
    out = []
    for _ in range(num_prefixes):
        prefix = draws.randint(0, vocab_size, size=prefix_len).tolist()
        for _ in range(n // num_prefixes):
            ids = prefix + draws.randint(0, vocab_size, size=suffix_len).tolist()
            out.append(SampleRequest(ids, len(ids), output_len))
    if shuffle:
        random.Random(seed).shuffle(out)
    return out


# ---------------------------------------------------------------- sharegpt

def oversample(requests: list[SampleRequest], n: int, seed: int = 0) -> list[SampleRequest]:
    """vLLM's maybe_oversample_requests: fewer than n requests are topped up to n with
    random.Random(seed).choice of the ones there are (each draw over the original list)."""
    if len(requests) >= n:
        return requests
    if not requests:
        raise ValueError("no request to oversample from")
    rng = random.Random(seed)
    return requests + [rng.choice(requests) for _ in range(n - len(requests))]


def load_sharegpt(path: str, *, seed: int = 0, shuffle: bool = True) -> list[tuple[str, str]]:
    """A ShareGPT JSON file → (first turn, second turn) of each conversation vLLM keeps, in vLLM's
    order. The file is a list of {"conversations": [{"from": ..., "value": TEXT}, ...], ...};
    vLLM's ShareGPTDataset keeps the entries with >= 2 turns (whoever speaks them: "from" is not
    read) and shuffles them with random.Random(seed) (its random.seed and random.shuffle) unless
    shuffle is False. Where vLLM would fail later on a malformed entry (a turn without a text
    "value"), kvjax refuses the file here, naming the entry (its index in the file)."""
    data = read_json(path, "--dataset-path")
    if not isinstance(data, list):
        raise InputFileError(path, f"a ShareGPT file holds a JSON array of conversations; this one holds a JSON "
                                    f"{json_type(data)}")
    kept = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise InputFileError(path, f"entry {i} is a JSON {json_type(entry)}, not an object with \"conversations\"")
        turns = entry.get("conversations")
        if turns is None:
            continue
        if not isinstance(turns, list):
            raise InputFileError(path, f"entry {i}: \"conversations\" is a JSON {json_type(turns)}, "
                                       "not an array of turns")
        if len(turns) < 2:
            continue
        for t, turn in enumerate(turns[:2]):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise InputFileError(path, f"entry {i}: turn {t} is not an object with a text \"value\"")
        kept.append((turns[0]["value"], turns[1]["value"]))
    if shuffle:
        random.Random(seed).shuffle(kept)
    return kept


def is_valid_sequence(prompt_len: int, output_len: int, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's is_valid_sequence with its defaults: prompt >= 4 tokens, output >= 4 (unless
    skipped), prompt <= 1024, prompt + output <= 2048."""
    return not (prompt_len < SHAREGPT_MIN_LEN or (not skip_min_output_len_check and output_len < SHAREGPT_MIN_LEN)
                or prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN)


def sharegpt_requests(conversations: Sequence[tuple[str, str]], n: int, tokenizer, *, output_len: int | None = None,
                      seed: int = 0, no_oversample: bool = False) -> list[SampleRequest]:
    """vLLM's ShareGPTDataset.sample on load_sharegpt's conversations: each prompt tokenized
    (tokenizer.encode, the special tokens the tokenizer adds included, as vLLM's
    tokenizer(prompt).input_ids), the output length the second turn's token count unless
    output_len is given; pairs that fail is_valid_sequence are skipped; the first n valid ones are
    kept, then oversampled to n (vLLM's maybe_oversample_requests) unless no_oversample.
    vLLM sends the prompt text, which its server tokenizes the same way; kvjax sends the ids."""
    out = []
    for prompt, completion in conversations:
        if len(out) >= n:
            break
        ids = tokenizer.encode(prompt)
        out_len = len(tokenizer.encode(completion)) if output_len is None else output_len
        if is_valid_sequence(len(ids), out_len, skip_min_output_len_check=output_len is not None):
            out.append(SampleRequest(ids, len(ids), out_len))
    if not out:
        raise ValueError(f"none of its {len(conversations)} conversations of 2 turns or more passes vLLM's "
                         f"is_valid_sequence (a prompt of {SHAREGPT_MIN_LEN} to {SHAREGPT_MAX_PROMPT_LEN} tokens, "
                         f"an output of {SHAREGPT_MIN_LEN} or more unless output_len is given, together at most "
                         f"{SHAREGPT_MAX_TOTAL_LEN})")
    return out if no_oversample else oversample(out, n, seed)


# ---------------------------------------------------------------- corpus

def load_corpus(path: str | None = None) -> str:
    """The corpus dataset's text: a UTF-8 text file, by default the prose kvjax ships
    (kvjax.data.PROSE, 128 KiB of the Python Language Reference)."""
    from kvjax.data import PROSE

    text = read_text(path or PROSE, "--dataset-path")
    if not text.strip():
        raise InputFileError(path or PROSE, "the corpus text is empty")
    return text


def corpus_requests(text: str, n: int, input_len: int, output_len: int, tokenizer, *, range_ratio: float = 0.0,
                    seed: int = 0) -> list[SampleRequest]:
    """vLLM's create_txt_slices_dataset.py, whose JSON-lines output `--dataset-name custom` reads,
    in one step: the text tokenized once without special tokens; lengths by sample_lengths from
    numpy's default_rng(seed); request i starts at random.Random(seed).randint(0, T - 1) of the
    T tokens and takes input_len_i of them, wrapping round to the start at the end. vLLM decodes the
    slice to text for its server to re-encode (adding a BOS where its tokenizer adds one); kvjax
    sends the slice's ids as they are."""
    if min_input_len(input_len, range_ratio) < 1:
        raise ValueError("--random-input-len is too small: a prompt needs at least one token")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise KvjaxError("the corpus text tokenizes to no tokens")
    input_lens, output_lens, _ = sample_lengths(np.random.default_rng(seed), n, range_ratio, input_len, output_len,
                                                tokenizer.vocab_size)
    starts = random.Random(seed)
    out = []
    for i in range(n):
        start = starts.randint(0, len(ids) - 1)
        prompt = [ids[(start + j) % len(ids)] for j in range(int(input_lens[i]))]
        out.append(SampleRequest(prompt, len(prompt), int(output_lens[i])))
    return out

