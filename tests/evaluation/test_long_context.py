"""The accuracy lab past 8K positions, on a model whose config has them (issue 40, point 4).

- A 16K window scored chunk by chunk through the paged cache (kvjax.evaluation.scoring, the tiled
  attention above its bound) equals transformers' logits at every position, for a Llama with
  Llama 3.1's rope scaling over 32K positions: RoPE is scaled as the config says, out to 16K,
  and the tolerance is far below what unscaled RoPE changes.
- evaluate() runs a 16K passkey grid and a 16K long window on preset:tiny-long (random weights),
  reporting the 8K–32K position bucket; the lengths a model does not have are refused, naming them.
- A haystack shorter than the longest prompt repeats end to start; the flags reach evaluate().
The RoPE formulas themselves are checked against transformers in tests/engine/test_engine_hf.py
and tests/models/test_gpt_oss.py; what is new here is the long path.
"""
import numpy as np
import pytest

from kvjax.commands.accuracy import _positions_markdown, evaluate_kwargs, markdown
from kvjax.commands.main import build_parser
from kvjax.data import CALIB, HELDOUT
from kvjax.errors import KvjaxError, UsageError
from kvjax.evaluation import accuracy, passkey
from kvjax.evaluation.metrics import BUCKETS

S = 16384
ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=4096)


@pytest.mark.slow
def test_16k_scoring_matches_transformers_with_scaled_rope(tmp_path):
    import torch
    import transformers as tf
    from hf_fixtures import BASE, random_model, save_hf_model

    from kvjax import LLM
    from kvjax.evaluation.scoring import ChunkedScorer

    def hf_logprobs(model, tokens):  # sdpa: transformers' eager attention would hold 4 GiB of scores
        model.config._attn_implementation = "sdpa"
        with torch.no_grad():
            return torch.log_softmax(model(torch.as_tensor(tokens[None])).logits[0].float(), -1).numpy()

    hf = random_model(tf.LlamaConfig(**BASE, num_key_value_heads=2, rope_parameters=ROPE,
                                     max_position_embeddings=32768), tf.LlamaForCausalLM)
    tokens = np.random.RandomState(0).randint(0, 128, size=S)
    want = hf_logprobs(hf, tokens)
    unscaled = random_model(tf.LlamaConfig(**BASE, num_key_value_heads=2, rope_theta=500000.0,
                                           max_position_embeddings=32768), tf.LlamaForCausalLM)
    unscaled.load_state_dict(hf.state_dict())
    far = np.abs(hf_logprobs(unscaled, tokens)[8192:] - want[8192:]).max()

    llm = LLM(save_hf_model(hf, str(tmp_path / "model")), kv_cache_dtype="fp32", max_num_seqs=1, max_model_len=16,
              use_tqdm_on_load=False)
    assert llm.config.rope.rope_type == "llama3" and llm.config.rope.factor == 8.0
    got = np.concatenate([np.asarray(lp) for _, lp in ChunkedScorer(llm, S, 4096).chunks(tokens)])
    err = np.abs(got - want)
    assert err.max() < 2e-3 and far > 1.0, (err.max(), far)  # measured: 7.6e-4 against 6.96
    assert err[8192:].max() < 2e-3  # past 8K, and past the 4K the frequencies were trained on


@pytest.mark.slow
def test_evaluate_passkey_and_long_window_at_16k():
    res = accuracy.evaluate("preset:tiny-long", HELDOUT, CALIB, seq_len=64, max_windows=1, prompts=1,
                            decode_tokens=2, only=(), long_windows=1, long_len=S, long_chunk=4096, long_variants=(),
                            passkey_lengths=(S,), passkey_depths=(0.75,), passkey_trials=1)
    pk = res["passkey"]
    assert [t["length"] for t in pk["trials"]] == [S] and pk["trials"][0]["needle_at"] > 8192
    assert pk["haystack_copies"] == 1 and len(pk["answers"]["bf16"]) == 1  # 131,385 bytes hold 16K tokens
    long = res["long"]["variants"]["bf16"]
    assert res["long"]["seq_len"] == S and long["tokens"] == S - 1
    buckets = {(b["start"], b["end"]): b["tokens"] for b in long["buckets"]}
    assert buckets[(8192, 32768)] == S - 1 - 8192 and (32768, 131072) not in buckets
    assert "8K–32K" in markdown(res) and "16K (1 trials)" in markdown(res)


def test_lengths_beyond_the_model_are_refused_by_value():
    with pytest.raises(KvjaxError, match="long_len 40000 must exceed seq_len 256 and stay within the model's "
                                         "context 32768"):
        accuracy.evaluate("preset:tiny-long", HELDOUT, CALIB, long_windows=1, long_len=40000)
    with pytest.raises(KvjaxError, match="passkey length 32768 and its 7 answer tokens exceed the model's "
                                         "maximum length 32768"):
        accuracy.evaluate("preset:tiny-long", HELDOUT, CALIB, passkey_lengths=(32768,))
    with pytest.raises(KvjaxError, match="long_len 9000 must exceed seq_len 256 and stay within the model's "
                                         "context 256"):
        accuracy.evaluate("preset:tiny", HELDOUT, CALIB, long_windows=1, long_len=9000)


def test_long_len_defaults_to_at_most_8k():
    assert accuracy.LONG_LEN == 8192 and BUCKETS[-1] >= 131072 and BUCKETS[:5] == (0, 128, 512, 2048, 8192)


def test_haystack_repeats_end_to_start():
    text = np.arange(100, 130)
    same, copies = passkey.repeat_haystack(text, 30)
    assert copies == 1 and np.array_equal(same, text)
    longer, copies = passkey.repeat_haystack(text, 61)
    assert copies == 3 and longer.tolist() == text.tolist() * 3
    with pytest.raises(KvjaxError, match="no tokens"):
        passkey.repeat_haystack([], 10)


def kwargs(*argv):
    return evaluate_kwargs(build_parser("accuracy").parse_args(["accuracy", *argv]))


def test_long_len_flag():
    kw = kwargs("--model", "preset:tiny-long", "--long-len", "16384", "--long-chunk", "4096")
    assert (kw["long_len"], kw["long_chunk"], kw["long_windows"]) == (16384, 4096, 1)  # the full suite's one window
    assert "long_len" not in kwargs("--model", "small-gqa")
    with pytest.raises(UsageError, match="--long-len 16384 applies with --long-windows above 0"):
        kwargs("--model", "small-gqa", "--long-len", "16384")
    with pytest.raises(UsageError, match="--long-len 16384 applies with --long-windows above 0"):
        kwargs("--model", "preset:tiny-long", "--long-windows", "0", "--long-len", "16384")


def _bucket(start, end, kl):
    return dict(start=start, end=end, tokens=1, kl_vs_bf16=kl, top1_agreement=1.0, perplexity=2.0)


def test_position_table_shows_the_buckets_the_windows_reach():
    def res(ends):
        buckets = [_bucket(a, b, 1e-3) for a, b in zip(BUCKETS, BUCKETS[1:]) if b <= ends]
        return dict(long=dict(windows=1, seq_len=ends, chunk=2048, scored_tokens=ends - 1,
                              variants={"bf16": dict(buckets=buckets), "fp8_e4m3 unit": dict(buckets=buckets,
                                                                                            kl_vs_bf16=1e-3)}),
                    positions=dict(variants={"bf16": buckets[:2], "fp8_e4m3 unit": buckets[:2]}), seq_len=256,
                    results=[dict(variant="fp8_e4m3 unit", kl_vs_bf16=1e-3)])
    head = _positions_markdown(res(8192)).splitlines()[2]
    assert head.endswith("| 2K–8K | all |") and "32K" not in head  # 8K results read as before
    assert _positions_markdown(res(32768)).splitlines()[2].endswith("| 2K–8K | 8K–32K | all |")
