"""vLLM 0.33's offline examples and docs snippets run against kvjax, and their outputs checked.

tests/examples/vllm/ holds copies of them with only their imports and model names changed (each
file's header says what). A test runs a copy in this process as `python COPY ARGS` would:
runpy.run_path with run_name "__main__", sys.argv patched, the working directory a fresh
tmp_path, stdout captured. A copy whose model is a placeholder ("<tiny-bpe-llama>" and
"<tiny-bpe-llama-128>": a random 2-layer Llama with a byte-level BPE tokenizer trained here on
the copies' own text and ChatML's template, so that the long prompts are ~1,500 tokens, not 4,500
byte positions) is read, the placeholder replaced by the path of a checkpoint folder made here,
and run from tmp_path. VLLM_CPU_KVCACHE_SPACE=1 is set, as vLLM's CPU platform reads it, so that
every LLM's pool is 1 GiB instead of a share of the machine's memory. What an example computes
inside main() without printing all of it (its RequestOutputs) is recorded by wrapping
LLM.generate, LLMEngine.step and AsyncLLM.generate for the test (`Recorder`); the example's own
code is not touched.

The outputs are checked against references that do not go through kvjax's engine:
- transformers on the same checkpoint folder: greedy tokens (`hf_greedy`, attention_mask passed;
  compared up to the first near-tie, as tests/engine/test_engine_hf.py does), teacher-forced
  log-probabilities (prompt_logprobs, logprobs, beam scores), and the top-p nucleus at the
  request's temperature that a sampled token must lie in;
- counts worked out from the prompts (small-gqa's byte tokenizer: a prompt's tokens are its UTF-8
  bytes; the BPE model's: transformers' tokenizer of the same folder);
- transformers' own chat-template renderer for the prompts LLM.chat builds;
- vLLM 0.33's beam score (get_beam_search_score), written out here;
- for the streaming example, the same seeded requests run through LLM.generate.

Marked slow: the examples of more than ~5 s on 2 cores (the long-prompt prefix-caching example:
two 4,500-byte prompts, 100 tokens each; prefix_caching_offline: three LLMs; reset_kv:
1,900-byte prompts and 128-token samples, preempted once; beam search: 50 steps), simple_profiling
(a trace of the whole call; run_one_batch in the fast set traces too), and those that compile
programs of their own that the fast set does not share (the chat examples, fp8 pages, the
streaming example's reference run, trace replay: transformers' teacher-forced log-probabilities;
tests/engine/test_trace_replay.py checks replay in the fast set). The fast set: basic, generate, llm_engine_example, metrics,
run_one_batch with a decode profile, the two LLM.generate snippets and the skip-layers snippet
(on small-gqa, then on a tiny Gemma-3 with sliding windows: refused in one line with hybrid
groups, run with them off).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import runpy
import sys
import time

import numpy as np
import pytest
import torch
import transformers as tf
from hf_fixtures import GEMMA3_ROPE, SLIDE, hf_greedy

from kvjax.engine.async_llm import AsyncLLM
from kvjax.engine.llm import LLM
from kvjax.engine.llm_engine import LLMEngine
from kvjax.engine.sampling_params import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
COPIES = os.path.join(HERE, "vllm")
ROOT = os.path.dirname(os.path.dirname(HERE))
SMALL_GQA = os.path.join(ROOT, "models", "checkpoints", "small-gqa")
BPE_VOCAB = 2048
MARGIN = 1e-4  # a greedy step whose top-2 logits are closer than this may go either way (test_engine_hf.py)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
OTHER_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
BASIC_PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
                 "The future of AI is"]  # basic.py's, generate.py's, metrics_offline.py's, simple_profiling's
CONVERSATION = [  # chat.py's and the docs' LLM.chat snippet's
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _cpu_kv_space(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module")
def bpe_llama(tmp_path_factory):
    """(folder, transformers' tokenizer of it): a random 2-layer GQA Llama (2 query heads on one kv
    head of 128, 2,048 positions) with a byte-level BPE tokenizer of BPE_VOCAB tokens trained on the
    copies' own text (<|im_start|> and <|im_end|> special), ChatML's chat_template.jinja, no EOS.
    Its KV block holds as many bytes as small-gqa's, so its pool has as many blocks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = str(tmp_path_factory.mktemp("tiny-bpe-llama"))
    corpus = []
    for name in sorted(EXAMPLES):
        with open(os.path.join(COPIES, name), encoding="utf-8") as f:
            corpus.append(f.read())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHATML)
    config = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=384,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                            max_position_embeddings=2048, initializer_range=0.15, bos_token_id=None,
                            eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    return folder, tf.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def bpe_llama_128(bpe_llama, tmp_path_factory):
    """bpe_llama's folder (the same weights and tokenizer) with max_position_embeddings 128."""
    folder = tmp_path_factory.mktemp("tiny-bpe-llama-128")
    for name in os.listdir(bpe_llama[0]):
        (folder / name).symlink_to(os.path.join(bpe_llama[0], name))
    with open(os.path.join(bpe_llama[0], "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["max_position_embeddings"] = 128
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


@pytest.fixture(scope="module")
def gemma3_tiny(tmp_path_factory):
    """A tiny random Gemma-3 text model (hf_fixtures' "gemma3": layer 5 full attention, the others
    sliding) with a 256-token vocabulary, so that the byte tokenizer fits it."""
    config = tf.Gemma3TextConfig(**{**SLIDE, "vocab_size": 256, "num_hidden_layers": 7}, head_dim=16,
                                 sliding_window=5, query_pre_attn_scalar=24, rope_parameters=GEMMA3_ROPE)
    torch.manual_seed(0)
    folder = str(tmp_path_factory.mktemp("gemma3-tiny"))
    tf.Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder, config


@pytest.fixture(scope="module")
def hf_small():
    return _hf(SMALL_GQA)


def _hf(folder: str):
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


class Recorder:
    """What the example's objects returned, recorded by wrapping their methods for one test:
    `generated` (llm, RequestOutputs) per LLM.generate call (LLM.chat's and beam_search's
    included), `finished` every finished RequestOutput LLMEngine.step returned, `streamed`
    request id → the RequestOutputs AsyncLLM.generate yielded."""

    def __init__(self, monkeypatch):
        self.generated, self.finished, self.streamed = [], [], {}
        generate, step, stream = LLM.generate, LLMEngine.step, AsyncLLM.generate

        def llm_generate(llm, *args, **kwargs):
            outputs = generate(llm, *args, **kwargs)
            self.generated.append((llm, outputs))
            return outputs

        def engine_step(engine):
            outputs = step(engine)
            self.finished += [o for o in outputs if o.finished]
            return outputs

        async def async_generate(engine, *args, **kwargs):
            async for out in stream(engine, *args, **kwargs):
                self.streamed.setdefault(out.request_id, []).append(out)
                yield out

        monkeypatch.setattr(LLM, "generate", llm_generate)
        monkeypatch.setattr(LLMEngine, "step", engine_step)
        monkeypatch.setattr(AsyncLLM, "generate", async_generate)


@pytest.fixture
def recorder(monkeypatch):
    return Recorder(monkeypatch)


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    """run(copy, *argv, models={placeholder: folder}) → (the script's globals, its stdout)."""

    def run_copy(name: str, *argv: str, models: dict[str, str] | None = None):
        path = os.path.join(COPIES, name)
        if models:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for placeholder, folder in models.items():
                assert f'"{placeholder}"' in text, f"{name} has no model placeholder {placeholder!r}"
                text = text.replace(f'"{placeholder}"', repr(folder))
            path = str(tmp_path / name)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [path, *argv])
        capsys.readouterr()
        scope = runpy.run_path(path, run_name="__main__")
        return scope, capsys.readouterr().out

    return run_copy


# ----------------------------------------------------------------------------------- references
def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def hf_logprobs(hf, tokens) -> np.ndarray:
    """f32[S, V]: transformers' log-probabilities of the token after each position of `tokens`."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    with torch.no_grad():
        logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


class Greedy:
    """Greedy outputs against transformers' greedy tokens, counting how many were compared."""

    def __init__(self, hf):
        self.hf, self.compared, self.total = hf, 0, 0

    def check(self, prompt_ids: list[int], tokens: list[int]) -> None:
        want, n = hf_greedy(self.hf, prompt_ids, len(tokens), MARGIN)
        assert list(tokens[:n]) == want[:n], f"greedy tokens differ from transformers' ({len(prompt_ids)}-token prompt)"
        self.compared, self.total = self.compared + n, self.total + len(tokens)

    def done(self) -> None:
        assert self.total and self.compared >= 0.9 * self.total, "too many near-ties to compare"


def hf_logprobs_fp8_kv(hf, tokens) -> np.ndarray:
    """hf_logprobs with every key and value that attention reads rounded to fp8 e4m3 (saturated at
    ±448, scale 1.0: vLLM's kv_cache_dtype="fp8" without calibration), as the fp8 pages hold them."""
    from transformers.models.llama import modeling_llama

    eager = modeling_llama.eager_attention_forward

    def fp8(x):
        return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)

    def attention(module, query, key, value, *args, **kwargs):
        return eager(module, query, fp8(key), fp8(value), *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_llama, "eager_attention_forward", attention)
        return hf_logprobs(hf, tokens)


def check_sampled(hf, prompt_ids: list[int], tokens: list[int], temperature: float, top_p: float = 1.0,
                  fp8_kv: bool = False) -> None:
    """Each sampled token lies in vLLM's top-p nucleus of transformers' distribution at `temperature`
    (the most likely tokens whose probability first reaches top_p): less than top_p of probability
    lies on tokens more likely than it. fp8_kv: transformers reads fp8-rounded keys and values."""
    lp = (hf_logprobs_fp8_kv if fp8_kv else hf_logprobs)(hf, prompt_ids + list(tokens))
    for i, t in enumerate(tokens):
        p = np.exp((lp[len(prompt_ids) - 1 + i] - lp[len(prompt_ids) - 1 + i].max()) / temperature)
        p /= p.sum()
        # fp8: an fp8 value here and in kvjax may round apart where the float32 inputs differ by ~1e-6
        tol = 1e-3 if fp8_kv else 1e-4
        assert p[p > p[t]].sum() < top_p + tol, f"token {i} ({t}) lies outside the top-p={top_p} nucleus"


def beam_score(seq, length_penalty: float = 1.0) -> float:
    """vLLM 0.33's get_beam_search_score: cum_logprob / max(generated tokens, 1) ** length_penalty."""
    return seq.cum_logprob / max(len(seq.logprobs), 1) ** length_penalty


def render(template: str, conversation) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([conversation], chat_template=template, add_generation_prompt=True)
    return rendered[0]


def printed(stdout: str, label: str) -> list[str]:
    """The reprs an example printed after `label` (e.g. "Output:    "), read back."""
    import ast

    return [ast.literal_eval(m) for m in re.findall(rf"^{re.escape(label)}('.*'|\".*\")", stdout, re.M)]


def trace_files(folder) -> tuple[list[str], list[dict]]:
    """(the .xplane.pb files, the events of the Perfetto trace) JAX's profiler wrote under folder."""
    runs = sorted((folder / "plugins" / "profile").iterdir())
    assert len(runs) == 1, runs
    xplanes = [str(p) for p in runs[0].glob("*.xplane.pb")]
    with gzip.open(runs[0] / "perfetto_trace.json.gz") as f:
        trace = json.load(f)
    return xplanes, trace["traceEvents"] if isinstance(trace, dict) else trace


def engine_steps(events) -> int:
    """LLMEngine.step calls in a trace (JAX's Python tracer names them '$llm_engine.py:LINE step')."""
    return sum(1 for e in events if re.fullmatch(r"\$llm_engine\.py:\d+ step", str(e.get("name"))))


def single(recorder: Recorder):
    (llm, outputs), = recorder.generated
    return llm, outputs


# ----------------------------------------------------------------------------------- the fast set
def test_basic(run, recorder, hf_small):
    # examples/basic/offline_inference/basic.py: 4 prompts, temperature 0.8, top_p 0.95, vLLM's 16 tokens
    _, out = run("basic.py")
    _, outputs = single(recorder)
    assert [o.prompt for o in outputs] == BASIC_PROMPTS == printed(out, "Prompt:    ")
    assert [o.outputs[0].text for o in outputs] == printed(out, "Output:    ")
    for o in outputs:
        c, = o.outputs
        assert len(c.token_ids) == 16 and c.finish_reason == "length"
        assert c.text == bytes(c.token_ids).decode()
        check_sampled(hf_small, _ids(o.prompt), c.token_ids, temperature=0.8, top_p=0.95)


def test_generate_cli(run, recorder, hf_small):
    # examples/basic/offline_inference/generate.py: engine flags and sampling flags from the command line
    _, out = run("generate.py", "--seed", "7", "--max-tokens", "12", "--temperature", "0")
    llm, outputs = single(recorder)
    assert (llm.model.name, llm.vllm_config.seed) == ("small-gqa", 7)
    assert printed(out, "Prompt: ") == BASIC_PROMPTS
    greedy = Greedy(hf_small)
    for o, text in zip(outputs, printed(out, "Generated text: "), strict=True):
        c, = o.outputs
        assert c.text == text and len(c.token_ids) == 12
        greedy.check(_ids(o.prompt), c.token_ids)
    greedy.done()


def test_llm_engine_example(run, recorder, bpe_llama):
    # examples/deployment/llm_engine_example.py: LLMEngine driven step by step from EngineArgs' CLI
    folder, tok = bpe_llama
    _, out = run("llm_engine_example.py", "--model", folder)
    outputs = {o.request_id: o for o in recorder.finished}
    assert sorted(outputs) == ["0", "1", "2"]
    assert out.count("RequestOutput(request_id=") == 3

    # "0": greedy, logprobs=1, prompt_logprobs=1, against transformers' log-probabilities
    o = outputs["0"]
    prompt = tok.encode("A robot may not injure a human being")
    assert o.prompt_token_ids == prompt
    c, = o.outputs
    assert len(c.token_ids) == 16 and c.finish_reason == "length"
    hf = _hf(folder)
    greedy = Greedy(hf)
    greedy.check(prompt, c.token_ids)
    greedy.done()
    lp = hf_logprobs(hf, prompt + c.token_ids)
    assert len(o.prompt_logprobs) == len(prompt) and o.prompt_logprobs[0] is None
    for i, entry in enumerate(o.prompt_logprobs[1:], start=1):
        row, t = lp[i - 1], prompt[i]
        assert entry[t].logprob == pytest.approx(row[t], abs=1e-4)
        assert entry[t].rank == 1 + int((row > row[t]).sum())
        assert int(row.argmax()) in entry and len(entry) <= 2  # the prompt token and the top-1
    assert len(c.logprobs) == 16
    for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert entry[t].logprob == pytest.approx(lp[len(prompt) - 1 + i][t], abs=1e-4) and entry[t].rank == 1
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))

    # "1": one sample of 16 tokens; "2": n=2, two completions of 16 tokens, indexed 0 and 1
    assert len(outputs["1"].outputs) == 1 and len(outputs["1"].outputs[0].token_ids) == 16
    assert [c.index for c in outputs["2"].outputs] == [0, 1]
    assert all(len(c.token_ids) == 16 and c.logprobs is None for c in outputs["2"].outputs)
    assert outputs["1"].prompt_logprobs is None and outputs["2"].prompt_logprobs is None


def test_metrics(run, recorder):
    # examples/observability/metrics/offline.py: vLLM's metrics after 4 requests of 16 tokens
    _, out = run("metrics_offline.py")
    llm, outputs = single(recorder)
    prompt_tokens = sum(len(p.encode("utf-8")) for p in BASIC_PROMPTS)  # the byte tokenizer: 97
    assert f"vllm:prompt_tokens (counter) = {prompt_tokens}\n" in out
    assert "vllm:generation_tokens (counter) = 64\n" in out  # 4 × 16
    metrics = llm.get_metrics()
    success = {m.labels["finished_reason"]: m.value for m in metrics if m.name == "vllm:request_success"}
    assert success["length"] == 4 and sum(success.values()) == 4
    hists = {m.name: m for m in metrics if hasattr(m, "buckets")}
    assert (hists["vllm:request_prompt_tokens"].sum, hists["vllm:request_prompt_tokens"].count) == (prompt_tokens, 4)
    assert (hists["vllm:request_generation_tokens"].sum, hists["vllm:request_generation_tokens"].count) == (64, 4)
    for m in metrics:  # every metric the example printed, in get_metrics()'s order
        assert f"{m.name} (" in out
    # vLLM's reader returns vllm:cache_config_info last (log_metrics_info runs once the pool is sized)
    info, config = metrics[-1], llm.llm_engine.engine.config
    assert (info.name, info.value, info.labels["engine"]) == ("vllm:cache_config_info", 1.0, "0")
    assert info.labels["num_gpu_blocks"] == str(config.num_blocks) and "model_name" not in info.labels
    assert "vllm:cache_config_info (gauge) = 1.0\n" in out


@pytest.mark.slow
def test_trace_replay(run, recorder, hf_small):
    # examples/generate/trace_replay_offline.py: a greedy run's 8 tokens replayed (enable_trace_replay,
    # trace_decode_token_ids); the replay's per-token log-probabilities and ranks are transformers' teacher-forced
    # ones of those tokens (its distribution, not kvjax's sampling), its text the byte tokenizer's
    _, out = run("trace_replay_offline.py")
    (llm, (normal,)), (_, (replay,)) = recorder.generated
    prompt = _ids("Hello, my name is")
    tokens = list(normal.outputs[0].token_ids)
    greedy = Greedy(hf_small)
    greedy.check(prompt, tokens)
    greedy.done()
    assert llm.vllm_config.enable_trace_replay and list(replay.outputs[0].token_ids) == tokens
    assert f"  Replayed  output token IDs : {tokens}\n" in out
    assert "Replayed tokens match the requested trace exactly." in out
    assert replay.outputs[0].text == bytes(tokens).decode("utf-8", errors="replace") == normal.outputs[0].text
    lp = hf_logprobs(hf_small, prompt + tokens)[len(prompt) - 1:-1]  # [8, V]: the distribution before each token
    steps = re.findall(r"step +(\d+): token_id= *(\d+)  logprob=(\S+)  rank=(\d+)", out)
    assert [int(t) for _, t, _, _ in steps] == tokens
    for k, (t, entry) in enumerate(zip(tokens, replay.outputs[0].logprobs)):
        assert abs(entry[t].logprob - lp[k, t]) < 1e-4 and abs(float(steps[k][2]) - lp[k, t]) < 1e-4
        assert int(steps[k][3]) == entry[t].rank == int((lp[k] >= lp[k, t] - 1e-5).sum())
        assert len(entry) in (5, 6)  # the forced token and the 5 most likely (vLLM's logprobs=5)


def test_docs_generate_greedy(run, hf_small):
    # docs/models/generative_models.md: LLM.generate with SamplingParams(temperature=0)
    scope, out = run("docs_generative_models_greedy.py")
    o, = scope["outputs"]
    c, = o.outputs
    assert len(c.token_ids) == 16 and f"Generated text: {c.text!r}" in out
    greedy = Greedy(hf_small)
    greedy.check(_ids("Hello, my name is"), c.token_ids)
    greedy.done()


def test_docs_generate_default(run):
    # docs/models/generative_models.md: LLM.generate with the default SamplingParams (vLLM's: 16 tokens)
    scope, out = run("docs_generative_models_generate.py")
    o, = scope["outputs"]
    c, = o.outputs
    assert o.prompt == "Hello, my name is" and len(c.token_ids) == 16 and c.finish_reason == "length"
    assert f"Prompt: 'Hello, my name is', Generated text: {c.text!r}" in out


def test_docs_kv_cache_dtype_skip_sliding_window(run):
    # docs/features/quantization/quantized_kvcache.md: kv_cache_dtype_skip_layers=["sliding_window"] on
    # the snippet's Llama: no layer of it has a window, so every layer's pages are fp8 (vLLM's attention
    # layer skips a layer by type only when it has a sliding window)
    scope, _ = run("docs_quantized_kvcache_skip_layers.py")
    llm = scope["llm"]
    spec = llm.kv_spec
    assert spec.kv_dtype == "fp8_e4m3" and tuple(spec.skip_layers) == ()
    assert {str(layer.k.dtype) for layer in llm.engine.cache.layers} == {"float8_e4m3fn"}


def test_skip_sliding_window_on_a_model_with_windows(gemma3_tiny):
    # the snippet's arguments on a model with sliding windows: float32 windowed layers beside fp8 full ones
    # give the two KV cache groups pages of two sizes; vLLM gives the fp8 group a 4x block size
    # (unify_kv_cache_spec_page_size), kvjax's groups share one block size and say so in one line
    folder, config = gemma3_tiny
    args = dict(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["sliding_window"], use_tqdm_on_load=False)
    with pytest.raises(ValueError) as e:
        LLM(folder, **args)
    assert "\n" not in str(e.value) and "disable_hybrid_kv_cache_manager=True" in str(e.value)
    assert "1,024" in str(e.value) and "4,096" in str(e.value)  # the two page sizes, per block of 16 tokens
    # every layer in one full-attention group: the windowed layers keep float32 pages
    llm = LLM(folder, disable_hybrid_kv_cache_manager=True, **args)
    sliding = tuple(i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention")
    assert sliding == (0, 1, 2, 3, 4, 6)
    spec, cache = llm.kv_spec, llm.engine.cache
    assert spec.kv_dtype == "fp8_e4m3" and tuple(spec.skip_layers) == sliding and spec.model_dtype == "fp32"
    for i in range(config.num_hidden_layers):
        assert spec.layer_dtype(i).name == ("fp32" if i in sliding else "fp8_e4m3")
        assert str(cache.layers[cache.slot_of(i)].k.dtype) == ("float32" if i in sliding else "float8_e4m3fn")


# ----------------------------------------------------------------------------------- the slow set
@pytest.mark.slow
def test_docs_fp8(run, recorder, hf_small):
    # docs/features/quantization/quantized_kvcache.md example 1: LLM(model, kv_cache_dtype="fp8")
    scope, out = run("docs_quantized_kvcache_fp8.py")
    llm = scope["llm"]
    assert llm.kv_spec.kv_dtype == "fp8_e4m3" and not llm.kv_spec.skip_layers
    assert {str(layer.k.dtype) for layer in llm.engine.cache.layers} == {"float8_e4m3fn"}
    _, outputs = single(recorder)
    c, = outputs[0].outputs
    assert out == c.text + "\n" and len(c.token_ids) == 16
    check_sampled(hf_small, _ids(scope["prompt"]), c.token_ids, temperature=0.7, top_p=0.8, fp8_kv=True)


@pytest.mark.slow
def test_docs_chat(run, bpe_llama):
    # docs/models/generative_models.md: LLM.chat renders the conversation with the model's template
    folder, tok = bpe_llama
    scope, out = run("docs_generative_models_chat.py", models={"<tiny-bpe-llama>": folder})
    o, = scope["outputs"]
    assert o.prompt == render(CHATML, CONVERSATION) and o.prompt_token_ids == tok.encode(o.prompt)
    assert o.prompt_token_ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5  # ChatML's, one token each
    c, = o.outputs
    assert len(c.token_ids) == 16 and c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert f"Generated text: {c.text!r}" in out


@pytest.mark.slow
def test_chat_cli(run, recorder, bpe_llama, tmp_path):
    # examples/basic/offline_inference/chat.py: one conversation, ten, then ten with --chat-template-path
    template = tmp_path / "other.jinja"
    template.write_text(OTHER_TEMPLATE)
    _, out = run("chat.py", "--max-tokens", "8", "--temperature", "0", "--chat-template-path", str(template),
                 models={"<tiny-bpe-llama>": bpe_llama[0]})
    assert [len(outputs) for _, outputs in recorder.generated] == [1, 10, 10]
    assert out.count("Generated text: ") == 21
    greedy, tok = Greedy(_hf(bpe_llama[0])), bpe_llama[1]
    for (_, outputs), template_text in zip(recorder.generated, [CHATML, CHATML, OTHER_TEMPLATE]):
        want = render(template_text, CONVERSATION)
        for o in outputs:
            assert o.prompt == want and o.prompt_token_ids == tok.encode(want)
        greedy.check(tok.encode(want), outputs[0].outputs[0].token_ids)
        assert {tuple(o.outputs[0].token_ids) for o in outputs} == {tuple(outputs[0].outputs[0].token_ids)}
    greedy.done()


@pytest.mark.slow
def test_docs_beam_search(run, bpe_llama, bpe_llama_128):
    # docs/models/generative_models.md: LLM.beam_search, 5 beams of 50 tokens
    scope, out = run("docs_generative_models_beam_search.py", models={"<tiny-bpe-llama-128>": bpe_llama_128})
    result, = scope["outputs"]
    tok, hf = bpe_llama[1], _hf(bpe_llama_128)
    prompt = tok.encode("Hello, my name is ")
    assert len(result.sequences) == 5
    scores = [beam_score(s) for s in result.sequences]
    assert scores == sorted(scores, reverse=True)  # best first, by vLLM's score
    assert len({tuple(s.tokens) for s in result.sequences}) == 5
    for s in result.sequences:
        generated = s.tokens[len(prompt):]
        assert s.tokens[:len(prompt)] == prompt and len(generated) == len(s.logprobs) == 50
        assert s.text == tok.decode(s.tokens, skip_special_tokens=True)
        lp = hf_logprobs(hf, s.tokens)
        want = sum(lp[len(prompt) - 1 + i][t] for i, t in enumerate(generated))
        assert s.cum_logprob == pytest.approx(want, abs=1e-3)
    assert f"Generated text: {result.sequences[0].text!r}" in out


@pytest.mark.slow
def test_simple_profiling(run, recorder, hf_small, tmp_path, monkeypatch):
    # examples/features/profiling/simple_profiling_offline.py: a trace of the whole generate call
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)  # its 10 s wait for a background profiler
    _, out = run("simple_profiling_offline.py")
    assert slept == [10]
    xplanes, events = trace_files(tmp_path / "vllm_profile")
    assert xplanes and engine_steps(events) >= 1
    _, outputs = single(recorder)
    assert [o.outputs[0].text for o in outputs] == printed(out, "Generated text: ")
    for o in outputs:
        check_sampled(hf_small, _ids(o.prompt), o.outputs[0].token_ids, temperature=0.8, top_p=0.95)


def test_run_one_batch_decode_profile(run, recorder, tmp_path):
    # examples/features/profiling/run_one_batch_offline.py --profile decode: delay_iterations=1 skips
    # the prefill step, so the trace holds the 15 decode steps of the 16 tokens
    _, out = run("run_one_batch_offline.py", "--profile", "decode", "--profile-dir", "prof", "--batch-size", "2",
                 "--prompt-size", "40")
    _, outputs = single(recorder)
    assert [o.prompt for o in outputs] == [("Hello, my name is" * 3)[:40]] * 2
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)
    assert printed(out, "Generated text: ") == [o.outputs[0].text for o in outputs]
    xplanes, events = trace_files(tmp_path / "prof")
    assert xplanes and engine_steps(events) == 15


@pytest.mark.slow
def test_reset_kv(run, recorder, bpe_llama):
    # examples/features/reset_kv/reset_kv_offline.py: reset_prefix_cache(reset_running_requests=True)
    # at step 10 preempts every running request; each recomputes and must finish as if never stopped
    folder, tok = bpe_llama
    _, out = run("reset_kv_offline.py", "--model", folder)
    assert "Resetting prefix cache at 10\n" in out
    outputs = {o.request_id: o for o in recorder.finished}
    assert sorted(outputs) == ["0", "1", "2", "3"]
    # all four ran at step 10, and each was preempted once (request 3's two samples: once each)
    assert [outputs[rid].metrics.num_preemptions for rid in "0123"] == [1, 1, 1, 2]
    prompt = tok.encode("A robot may not injure a human being " * 50)
    hf = _hf(folder)
    greedy = Greedy(hf)
    for rid in "01":
        c, = outputs[rid].outputs
        assert outputs[rid].prompt_token_ids == prompt
        greedy.check(prompt, c.token_ids)
        lp = hf_logprobs(hf, prompt + c.token_ids)
        for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            assert entry[t].logprob == pytest.approx(lp[len(prompt) - 1 + i][t], abs=1e-3)
        assert len(outputs[rid].prompt_logprobs) == len(prompt)
    greedy.done()
    assert outputs["0"].outputs[0].token_ids == outputs["1"].outputs[0].token_ids
    assert [len(c.token_ids) for c in outputs["2"].outputs] == [128]
    assert [len(c.token_ids) for c in outputs["3"].outputs] == [128, 128]


@pytest.mark.slow
def test_prefix_caching_offline(run, recorder, bpe_llama):
    # examples/features/automatic_prefix_caching/prefix_caching_offline.py
    folder, tok = bpe_llama
    _, out = run("prefix_caching_offline.py", models={"<tiny-bpe-llama>": folder})
    assert "Generated answers are the same: True\n" in out
    (regular, first), (cached, warmup), (_, second) = recorder.generated
    assert cached.vllm_config.cache_config.enable_prefix_caching
    prompts = [o.prompt for o in first]
    texts = [o.outputs[0].text for o in first]
    assert [o.outputs[0].text for o in second] == texts
    # the same prompts with prefix caching off
    off = LLM(folder, enable_prefix_caching=False)
    reference = off.generate(prompts, SamplingParams(temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].text for o in reference] == texts and all(o.num_cached_tokens == 0 for o in reference)
    greedy = Greedy(_hf(folder))
    for o in reference:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        greedy.check(o.prompt_token_ids, o.outputs[0].token_ids)
    greedy.done()
    # the warm-up cached prompt 0's blocks; the others share the prefix's full blocks
    prefix = os.path.commonprefix([o.prompt_token_ids for o in first])
    assert warmup[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == (len(second[0].prompt_token_ids) - 1) // 16 * 16
    assert all(o.num_cached_tokens >= len(prefix) // 16 * 16 for o in second[1:])


@pytest.mark.slow
def test_automatic_prefix_caching(run, recorder, bpe_llama):
    # examples/features/automatic_prefix_caching/automatic_prefix_caching_offline.py: two 4,500-byte
    # prompts sharing a markdown table; the second hits every full block of the shared part
    folder, tok = bpe_llama
    _, out = run("automatic_prefix_caching_offline.py", models={"<tiny-bpe-llama>": folder})
    (_, first), (_, second) = recorder.generated
    (a,), (b,) = first, second
    for o in (a, b):
        assert o.prompt_token_ids == tok.encode(o.prompt)
    assert len(a.prompt_token_ids) > 1024  # the table alone spans over 64 blocks
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == len(os.path.commonprefix([a.prompt_token_ids, b.prompt_token_ids])) // 16 * 16
    assert out.count("Generation time: ") == 2
    assert [f"Output: {o.outputs[0].text}\n" in out for o in (a, b)] == [True, True]
    greedy = Greedy(_hf(folder))
    for o in (a, b):
        assert len(o.outputs[0].token_ids) == 100
        greedy.check(o.prompt_token_ids, o.outputs[0].token_ids)
    greedy.done()


@pytest.mark.slow
def test_async_llm_streaming(run, recorder, hf_small):
    # examples/deployment/async_llm_streaming.py: DELTA outputs streamed from AsyncLLM; their
    # concatenation is the whole request, the same as LLM.generate gives with the same seed
    _, out = run("async_llm_streaming.py")
    prompts = ["The future of artificial intelligence is", "In a galaxy far, far away", "The key to happiness is"]
    assert sorted(recorder.streamed) == [f"stream-example-{i}" for i in (1, 2, 3)]
    printed_texts = re.findall(r"💬 Response: (.*?)\n✅ Generation complete!", out, re.S)
    params = SamplingParams(max_tokens=100, temperature=0.8, top_p=0.95, seed=42)
    reference = LLM("small-gqa", enforce_eager=True).generate(prompts, params, use_tqdm=False)
    for i, (prompt, ref) in enumerate(zip(prompts, reference), start=1):
        deltas = recorder.streamed[f"stream-example-{i}"]
        assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        text = "".join(d.outputs[0].text for d in deltas)
        tokens = [t for d in deltas for t in d.outputs[0].token_ids]
        assert text == printed_texts[i - 1] == ref.outputs[0].text
        assert tokens == ref.outputs[0].token_ids and len(tokens) == 100
        check_sampled(hf_small, _ids(prompt), tokens, temperature=0.8, top_p=0.95)


# ----------------------------------------------------------------------------------- the copies
EXAMPLES = ("basic.py", "generate.py", "chat.py", "automatic_prefix_caching_offline.py", "prefix_caching_offline.py",
            "simple_profiling_offline.py", "run_one_batch_offline.py", "reset_kv_offline.py", "metrics_offline.py",
            "llm_engine_example.py", "async_llm_streaming.py", "docs_generative_models_generate.py",
            "docs_generative_models_greedy.py", "docs_generative_models_beam_search.py",
            "docs_generative_models_chat.py", "docs_quantized_kvcache_fp8.py", "docs_quantized_kvcache_skip_layers.py",
            "trace_replay_offline.py")


def test_every_copy_names_its_source_and_imports_kvjax_only():
    copies = sorted(n for n in os.listdir(COPIES) if n != "__pycache__")  # an import may leave bytecode there
    assert copies == sorted(EXAMPLES)  # each one is run by a test above
    for name in EXAMPLES:
        with open(os.path.join(COPIES, name), encoding="utf-8") as f:
            text = f.read()
        assert re.match(r"# Source: vLLM 0\.33, (examples|docs)/\S+", text), name
        assert "# SPDX-License-Identifier: Apache-2.0\n" in text, name
        assert not re.search(r"^\s*(from|import) vllm\b", text, re.M), name
        assert not name.startswith("test_"), name
        # the imports changed are vLLM's with `vllm` → `kvjax`, nothing else (kvjax has vLLM's module paths)
        for was, now in re.findall(r"^#   ((?:from|import) vllm\b.*)\n#     -> (.*)$", text, re.M):
            assert now == re.sub(r"\bvllm\b", "kvjax", was), (name, was, now)
