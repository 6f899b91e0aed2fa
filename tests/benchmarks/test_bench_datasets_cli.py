"""`kvjax bench serve --dataset-name ...` through the `kvjax` command, in-process (kvjax.commands.main.main)
against one `kvjax serve` in a thread: a ShareGPT file's prompts (lengths worked out by hand in the
byte vocabulary), the corpus and prefix_repetition datasets, the progress bar on stderr only (stdout
is the JSON alone), --plot-dir's PNGs, whose throughput series sums to the output tokens; and every
bad dataset input as one error line naming the flag or file, before any request is sent."""
from __future__ import annotations

import json
import os
import random

import pytest

from serving import serving

from kvjax.benchmarks.plots import PLOTS, throughput_series
from kvjax.commands.main import main

COMMON = dict(model="small-gqa", num_gpu_blocks_override=64, max_num_seqs=4, use_tqdm_on_load=False)
NOWHERE = "http://127.0.0.1:9"  # nothing listens: a run refused before sending never notices

# A token is a UTF-8 byte (small-gqa's vocabulary); first-turn byte counts by hand:
SHAREGPT = [
    {"conversations": [{"from": "human", "value": "Tell me about paging."}, {"from": "gpt", "value": "Pages."}]},  # 21
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},  # 2: under 4, skipped
    {"conversations": [{"from": "human", "value": "one turn only"}]},  # dropped: fewer than 2 turns
    {"conversations": [{"from": "human", "value": "What is a block table?"}, {"from": "gpt", "value": "x"}]},  # 22
]
VALID_LENS = [21, 22]  # file order (--disable-shuffle)


@pytest.fixture(scope="module")
def url():
    with serving(**COMMON) as (_, base_url):
        yield base_url


@pytest.fixture(scope="module")
def sharegpt_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT), encoding="utf-8")
    return str(path)


def test_dataset_flags_default_as_vllm():
    from kvjax.commands.main import build_parser

    from kvjax.benchmarks.datasets import DATASETS
    from kvjax.commands.bench import DATASETS as CHOICES

    assert CHOICES == DATASETS  # the command's copy (no numpy imported to parse flags) names them all
    d = build_parser("bench").parse_args(["bench", "serve"])
    assert (d.dataset_name, d.dataset_path, d.tokenizer, d.sharegpt_output_len) == ("random", None, None, None)
    # vLLM 0.33's prefix repetition defaults (vllm/benchmarks/datasets/datasets.py, add_dataset_parser)
    assert (d.prefix_repetition_prefix_len, d.prefix_repetition_suffix_len, d.prefix_repetition_num_prefixes,
            d.prefix_repetition_output_len) == (256, 256, 10, 128)
    assert not (d.disable_tqdm or d.no_oversample or d.disable_shuffle) and d.plot_dir is None


def _bench(url, *flags):
    return main(["bench", "serve", "--base-url", url, "--model", "small-gqa", "--json", *flags])


def test_sharegpt_progress_and_plots(url, sharegpt_path, tmp_path, capsys):
    plots = tmp_path / "plots"
    assert _bench(url, "--dataset-name", "sharegpt", "--dataset-path", sharegpt_path, "--disable-shuffle",
                  "--num-prompts", "4", "--sharegpt-output-len", "3", "--plot-dir", str(plots)) == 0
    out, err = capsys.readouterr()
    r = json.loads(out)  # stdout is the JSON and nothing else
    assert "4/4" in err and "{" not in err  # the bar (vLLM's, over completed requests) went to stderr
    # two valid conversations in file order, then vLLM's oversampling: random.seed(seed), random.choice
    random.seed(0)
    want = VALID_LENS + [random.choice(VALID_LENS) for _ in range(2)]
    assert r["input_lens"] == want and r["output_lens"] == [3] * 4
    assert (r["completed"], r["total_input_tokens"], r["tokenizer_id"]) == (4, sum(want), "small-gqa")
    # the plots: two valid PNGs; the throughput series holds every output token (one per streamed output)
    assert sorted(os.listdir(plots)) == sorted(PLOTS)
    for name in PLOTS:
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(len(itl) + 1 == n for itl, n in zip(r["itls"], r["output_lens"]))
    total = sum(r["output_lens"])
    assert total == 12 and throughput_series(r).sum() == total


def test_corpus_and_prefix_repetition(url, capsys):
    assert _bench(url, "--dataset-name", "corpus", "--num-prompts", "3", "--random-input-len", "16",
                  "--random-output-len", "2", "--disable-tqdm") == 0
    out, err = capsys.readouterr()
    r = json.loads(out)
    assert err == ""  # --disable-tqdm: no bar
    assert (r["completed"], r["input_lens"], r["total_output_tokens"]) == (3, [16] * 3, 6)
    # 5 prompts over 2 prefixes: 5 // 2 = 2 each, 4 in all (vLLM does not oversample this dataset); 8 + 4 tokens
    assert _bench(url, "--dataset-name", "prefix_repetition", "--num-prompts", "5", "--prefix-repetition-num-prefixes",
                  "2", "--prefix-repetition-prefix-len", "8", "--prefix-repetition-suffix-len", "4",
                  "--prefix-repetition-output-len", "2", "--disable-tqdm") == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["completed"], r["num_prompts"], r["input_lens"], r["total_output_tokens"]) == (4, 5, [12] * 4, 8)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.json").write_text('{"conversations": []}', encoding="utf-8")
    (tmp_path / "broken.json").write_text('[{"conversations": [', encoding="utf-8")
    (tmp_path / "short.json").write_text(json.dumps([SHAREGPT[1]]), encoding="utf-8")
    (tmp_path / "noval.json").write_text('[{"conversations": [{"from": "human"}, {"value": "a"}]}]', encoding="utf-8")
    (tmp_path / "empty.txt").write_text("\n", encoding="utf-8")
    (tmp_path / "file").write_text("x", encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("flags, fragment", [
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--dataset-name", "sharegpt", "--dataset-path", "missing.json"], "--dataset-path 'missing.json' does not exist"),
    (["--dataset-name", "sharegpt", "--dataset-path", "list.json"], "list.json: a ShareGPT file holds a JSON array"),
    (["--dataset-name", "sharegpt", "--dataset-path", "broken.json"], "broken.json: --dataset-path: not valid JSON"),
    (["--dataset-name", "sharegpt", "--dataset-path", "noval.json"], 'noval.json: entry 0: turn 0 is not an object'),
    (["--dataset-name", "sharegpt", "--dataset-path", "short.json", "--base-url", NOWHERE],
     "--dataset-path 'short.json': none of its 1 conversations"),
    (["--dataset-name", "sharegpt", "--dataset-path", "list.json", "--base-url", NOWHERE, "--tokenizer", "nope"],
     "list.json"),  # the file is read before the tokenizer is looked for
    (["--dataset-name", "corpus", "--base-url", NOWHERE, "--tokenizer", "nope"],
     "--tokenizer 'nope' gives no tokenizer"),
    (["--dataset-name", "corpus", "--base-url", NOWHERE, "--model", "nope"], "(else --model): --model 'nope'"),
    (["--dataset-name", "corpus", "--dataset-path", "empty.txt"], "empty.txt: the corpus text is empty"),
    (["--dataset-name", "corpus", "--random-input-len", "1", "--random-range-ratio", "0.5"],
     "--random-input-len 1 is too small"),
    (["--dataset-name", "corpus", "--random-range-ratio", "1"], "--random-range-ratio must be < 1"),
    (["--dataset-name", "prefix_repetition", "--num-prompts", "3"],
     "--num-prompts (3) must be at least --prefix-repetition-num-prefixes (10)"),
    (["--dataset-name", "prefix_repetition", "--num-prompts", "10", "--prefix-repetition-prefix-len", "0",
      "--prefix-repetition-suffix-len", "0"], "--prefix-repetition-prefix-len + --prefix-repetition-suffix-len"),
    (["--prefix-repetition-suffix-len", "-1"], "--prefix-repetition-suffix-len"),
    (["--sharegpt-output-len", "0"], "--sharegpt-output-len"),
    (["--dataset-name", "sharegpt2"], "--dataset-name"),
    (["--dataset-path", "list.json"], "--dataset-path is for --dataset-name sharegpt or corpus, not random"),
    (["--tokenizer", "small-gqa"], "--tokenizer is for --base-url"),
    (["--plot-dir", "file/sub"], "--plot-dir 'file/sub'"),
])
def test_bad_dataset_input(workdir, capsys, flags, fragment):
    assert main(["bench", "serve", "--num-prompts", "2", *flags, "--save-result", "r.json"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvjax bench: error: ") and fragment in lines[0], err
    assert not os.path.exists(workdir / "r.json") and "Traceback" not in err
