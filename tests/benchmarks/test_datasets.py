"""kvjax.benchmarks.datasets against vLLM 0.33's datasets: prefix_repetition's structure worked out
by hand and its draws against vLLM's algorithm re-stated here (its global numpy and Python
generators, as vLLM seeds them); sharegpt's filters and lengths on a file written here, counted by
hand in the byte vocabulary of the built-in models (a token is a UTF-8 byte); the corpus prompts
are slices of the shipped text's bytes. No engine: these run in well under a second."""
from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest

from kvjax.benchmarks.datasets import (corpus_requests, load_corpus, load_sharegpt, oversample,
                                       prefix_repetition_requests, random_requests, sharegpt_requests)
from kvjax.data import PROSE
from kvjax.errors import KvjaxError
from kvjax.models.tokenizer import Tokenizer

BYTES = Tokenizer()  # the built-in models' vocabulary: a text's tokens are its UTF-8 bytes


# ---------------------------------------------------------------- prefix_repetition

def _vllm_prefix_repetition(n, prefix_len, suffix_len, num_prefixes, output_len, vocab_size, seed, shuffle=True):
    """vLLM's PrefixRepetitionRandomDataset (its __init__ seeds the global generators; sample draws
    with np.random.randint and shuffles with random.shuffle), less the text round trip, on the
    process's global generators (their state restored after) → [(ids, output_len)]."""
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        random.seed(seed)
        np.random.seed(seed)
        requests = []
        for _ in range(num_prefixes):
            prefix_tokens = np.random.randint(0, vocab_size, size=prefix_len).tolist()
            for _ in range(n // num_prefixes):
                suffix_tokens = np.random.randint(0, vocab_size, size=suffix_len).tolist()
                requests.append((prefix_tokens + suffix_tokens, output_len))
        if shuffle:
            random.shuffle(requests)
        return requests
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def test_prefix_repetition_structure():
    # 10 prompts over 3 prefixes: 10 // 3 = 3 prompts per prefix, 9 in all (vLLM does not oversample);
    # each 5 prefix + 3 suffix = 8 tokens, 7 output tokens
    reqs = prefix_repetition_requests(10, 5, 3, 3, 7, vocab_size=256, seed=1, shuffle=False)
    assert len(reqs) == 9
    assert all(r.prompt_len == 8 == len(r.prompt_token_ids) and r.expected_output_len == 7 for r in reqs)
    assert all(0 <= t < 256 for r in reqs for t in r.prompt_token_ids)
    prefixes = Counter(tuple(r.prompt_token_ids[:5]) for r in reqs)
    assert sorted(prefixes.values()) == [3, 3, 3]  # three shared prefixes, three prompts each
    assert len({tuple(r.prompt_token_ids[5:]) for r in reqs}) == 9  # a suffix of its own per prompt
    # unshuffled, the prompts of one prefix are consecutive: prefix 0's three, then 1's, then 2's
    assert [tuple(r.prompt_token_ids[:5]) for r in reqs] == [p for p in prefixes for _ in range(3)]
    shuffled = prefix_repetition_requests(10, 5, 3, 3, 7, vocab_size=256, seed=1)
    assert sorted(r.prompt_token_ids for r in shuffled) == sorted(r.prompt_token_ids for r in reqs)


@pytest.mark.parametrize("n, prefix_len, suffix_len, num_prefixes, seed, shuffle", [
    (10, 5, 3, 3, 1, True), (10, 5, 3, 3, 1, False), (12, 16, 0, 4, 7, True), (5, 0, 4, 5, 0, True),
])
def test_prefix_repetition_draws_are_vllms(n, prefix_len, suffix_len, num_prefixes, seed, shuffle):
    got = prefix_repetition_requests(n, prefix_len, suffix_len, num_prefixes, 9, vocab_size=300, seed=seed,
                                     shuffle=shuffle)
    want = _vllm_prefix_repetition(n, prefix_len, suffix_len, num_prefixes, 9, 300, seed, shuffle)
    assert [(r.prompt_token_ids, r.expected_output_len) for r in got] == want


def test_prefix_repetition_refuses():
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes"):
        prefix_repetition_requests(2, 4, 4, 3, 1, vocab_size=10)
    with pytest.raises(ValueError, match="at least 1"):
        prefix_repetition_requests(3, 0, 0, 1, 1, vocab_size=10)


def test_random_requests_unchanged_by_the_move():
    """serve.py re-exports the dataset names; the draws stay default_rng's in vLLM's order."""
    from kvjax.benchmarks import serve

    assert serve.random_requests is random_requests
    rng = np.random.default_rng(3)  # vLLM's order: input lengths, output lengths, offsets (range ratio 0)
    in_lens, _, offsets = rng.integers(12, 13, size=4), rng.integers(2, 3, size=4), rng.integers(0, 50, size=4)
    got = random_requests(4, 12, 2, vocab_size=50, seed=3)
    assert [r.prompt_token_ids for r in got] == [[(offsets[i] + i + j) % 50 for j in range(in_lens[i])]
                                                 for i in range(4)]


# ---------------------------------------------------------------- sharegpt

def _turns(*values, speakers=("human", "gpt", "human")):
    return {"conversations": [{"from": s, "value": v} for s, v in zip(speakers, values)]}


# Byte counts (prompt, second turn): a token per UTF-8 byte.
CONVERSATIONS = [
    _turns("What is a page?", "A block of KV."),       # 0: (15, 14) valid
    _turns("Hi", "Hello!"),                             # 1: (2, 6) prompt < 4
    _turns("Only one turn"),                            # 2: one turn: dropped when loaded
    {"id": "no conversations"},                         # 3: dropped when loaded
    _turns("Why page the cache?", "Ok"),                # 4: (19, 2) output < 4 (valid with an output length)
    _turns("Define é", "an accent", "more"),            # 5: (9, 9) valid: "Define " 7 + é 2; turn 3 unread
    _turns("x" * 1025, "long prompt"),                  # 6: prompt > 1024
    _turns("y" * 1000, "z" * 1049),                     # 7: 1000 + 1049 > 2048 (valid with a short output)
    _turns("abcd", "efgh", speakers=("gpt", "human")),  # 8: (4, 4) valid at the bounds; "from" is not read
]
KEPT = [0, 1, 4, 5, 6, 7, 8]  # 2 turns or more, in file order
PAIRS = {i: (c["conversations"][0]["value"], c["conversations"][1]["value"]) for i, c in enumerate(CONVERSATIONS)
         if i in KEPT}
LENS = {0: (15, 14), 5: (9, 9), 8: (4, 4)}  # the valid ones, by hand


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(CONVERSATIONS), encoding="utf-8")
    return str(path)


def test_sharegpt_filters_and_lengths(sharegpt_file):
    conv = load_sharegpt(sharegpt_file, shuffle=False)
    assert conv == [PAIRS[i] for i in KEPT]
    reqs = sharegpt_requests(conv, 3, BYTES, no_oversample=True)
    assert [(r.prompt_len, r.expected_output_len) for r in reqs] == [LENS[0], LENS[5], LENS[8]]
    assert reqs[1].prompt_token_ids == list("Define é".encode())
    assert len(sharegpt_requests(conv, 2, BYTES)) == 2  # the first n valid ones
    # --sharegpt-output-len 3: no minimum output, so 4 and 7 pass too (7: 1000 + 3 <= 2048); 1 and 6 still fail
    fixed = sharegpt_requests(conv, 10, BYTES, output_len=3, no_oversample=True)
    assert [(r.prompt_len, r.expected_output_len) for r in fixed] == [(15, 3), (19, 3), (9, 3), (1000, 3), (4, 3)]


def test_sharegpt_oversamples_as_vllm(sharegpt_file):
    conv = load_sharegpt(sharegpt_file, shuffle=False)
    reqs = sharegpt_requests(conv, 7, BYTES, seed=5)
    base = [LENS[0], LENS[5], LENS[8]]
    random.seed(5)  # vLLM's maybe_oversample_requests: random.seed, then random.choice per missing request
    extra = [random.choice(base) for _ in range(4)]
    assert [(r.prompt_len, r.expected_output_len) for r in reqs] == base + extra


def test_sharegpt_shuffles_as_vllm(sharegpt_file):
    for seed in (0, 1, 2):
        data = [PAIRS[i] for i in KEPT]
        random.seed(seed)  # vLLM's load_data: filter, random.seed, random.shuffle
        random.shuffle(data)
        assert load_sharegpt(sharegpt_file, seed=seed) == data


@pytest.mark.parametrize("content, fragment", [
    ('{"conversations": []}', "holds a JSON array of conversations; this one holds a JSON object"),
    ("[1, 2]", "entry 0 is a JSON number"),
    ('[{"conversations": "ab"}]', 'entry 0: "conversations" is a JSON string'),
    ('[{"conversations": [{"value": "a"}, {"from": "gpt"}]}]', 'entry 0: turn 1 is not an object with a text "value"'),
    ('[{"conversations": [', "not valid JSON"),
])
def test_sharegpt_bad_files(tmp_path, content, fragment):
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(KvjaxError, match="bad.json") as e:
        load_sharegpt(str(path))
    assert fragment in str(e.value)


def test_sharegpt_with_nothing_valid():
    with pytest.raises(ValueError, match="none of its 1 conversations"):
        sharegpt_requests([("Hi", "Hello")], 4, BYTES)
    with pytest.raises(ValueError):
        oversample([], 3)


# ---------------------------------------------------------------- corpus

def test_corpus_prompts_are_slices_of_the_shipped_text():
    with open(PROSE, "rb") as fh:
        data = fh.read()
    assert load_corpus() == data.decode("utf-8")
    reqs = corpus_requests(load_corpus(), 40, 64, 8, BYTES, range_ratio=0.5, seed=3)
    assert len(reqs) == 40 and len({r.prompt_len for r in reqs}) > 5
    for r in reqs:
        assert 32 <= r.prompt_len <= 96 and 4 <= r.expected_output_len <= 12  # [64 * 0.5, 64 * 1.5], [4, 12]
        assert bytes(r.prompt_token_ids) in data + data  # the text's bytes from a start, wrapping at its end
    # the starts are vLLM's create_txt_slices_dataset draws: random.Random(seed).randint(0, T - 1)
    starts = random.Random(3)
    for r in reqs:
        s = starts.randint(0, len(data) - 1)
        assert bytes(r.prompt_token_ids) == (data + data)[s:s + r.prompt_len]
    wrap = corpus_requests("abcdef", 30, 4, 1, BYTES, seed=0)  # a 6-byte text: every slice wraps or not
    assert all(bytes(r.prompt_token_ids) in b"abcdefabcdef" for r in wrap)


def test_corpus_refuses(tmp_path):
    with pytest.raises(ValueError, match="--random-input-len is too small"):
        corpus_requests("some text", 2, 1, 1, BYTES, range_ratio=0.5)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(KvjaxError, match="empty"):
        load_corpus(str(empty))


def test_the_hand_counts():
    """LENS, the byte counts worked out by hand above, recounted from the strings."""
    for i, lens in LENS.items():
        assert (len(PAIRS[i][0].encode()), len(PAIRS[i][1].encode())) == lens
