"""The bad-input contract, fuzzed: every file reader either parses what it is given or raises
`kvjax.errors.KvjaxError`. Arbitrary bytes, arbitrary JSON values and near-valid documents (a
valid one with one or two fields replaced by anything) go to the trace reader
(`kvjax.core.replay.iter_trace`), the prompts reader (`kvjax.commands.prompts.read_prompts`), the fp8
scales reader (`kvjax.quant.formats.KVScales.load`), the config reader (`kvjax.config.model.from_hf_config`, a
file and a dict), the GGUF header reader (`models.loader.load_config` on a `.gguf` file: random,
truncated, byte-flipped, or with odd metadata) and the shared helpers (`kvjax.utils.input_files.read_text`,
`kvjax.utils.strict_json.read_json`, `read_jsonl`). Only `KvjaxError` is caught: a TypeError, a ZeroDivisionError, a
MemoryError or a plain ValueError escaping a reader fails the test, since the command line turns
only a `KvjaxError` into its one-line refusal. Where a reader returns, its value is checked
against the schema it promises (one of prompt/tokens per request; positive finite scales; ...),
so a reader that accepts what it should refuse fails too. `test_inputs_that_once_broke_a_reader` keeps
the minimal inputs that broke the contract when this file was first run.
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import textwrap

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvjax.commands.prompts import read_prompts
from kvjax.config.hf import from_hf_config
from kvjax.config.model import MODEL_TYPES, ModelConfig
from kvjax.core.replay import iter_trace
from kvjax.errors import KvjaxError
from kvjax.models.loader import load_config
from kvjax.quant.formats import FP8_FORMATS, SCALE_MODES, KVScales
from kvjax.utils.checks import INT32_MAX
from kvjax.utils.input_files import read_text
from kvjax.utils.strict_json import read_json, read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fuzz(n):
    """Hypothesis settings for one reader: n examples, no deadline (the first replay example compiles)."""
    return settings(max_examples=max(20, n // 2), deadline=None,  # half of n: CI time; raise locally to dig
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def parse_or_refuse(read, *args):
    """read(*args), or None when it raised KvjaxError. Anything else propagates: the test fails."""
    try:
        return read(*args)
    except KvjaxError:
        return None


def write(folder: str, name: str, data: bytes | str) -> str:
    path = os.path.join(folder, name)
    with open(path, "wb") as fh:
        fh.write(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    return path


def jsonl(values) -> str:
    return "\n".join(json.dumps(v) for v in values) + "\n"


# --------------------------------------------------------------------------------------------
# Shared strategies
# --------------------------------------------------------------------------------------------
# Text, sometimes with lone surrogates: JSON's "\ud800" escape parses to one, and a reader that
# encodes a string to UTF-8 (a hash, a file name) must refuse it rather than crash.
# (st.text drops surrogates from any alphabet, hence the join.)
TEXT = st.text(max_size=12) | st.lists(st.characters() | st.characters(categories=["Cs"]), max_size=4).map("".join)
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
           | TEXT)
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
                    max_leaves=12)
NOT_INT = JSON.filter(lambda v: isinstance(v, bool) or not isinstance(v, int))
# Numbers at the edges of the readers' limits (int32, int64, float32, float64).
EDGE_NUMBERS = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, -2**31, 2**63 - 1, 10**12, 10**19 - 1, 1.5, -0.0,
                                5e-324, 1e-45, 1e-46, 3.4e38, 3.5e38, 1.7e308])
BYTES = st.binary(max_size=200)
# Lines no JSON value dumps to: nesting past any limit, non-finite numbers, huge integers.
RAW_LINES = ["[" * 100000, "{" * 100000, "[" * 33 + "]" * 33, "[" * 32 + "]" * 32, "NaN", "-Infinity", "1e400",
             "[1e400]", '{"a": 1e400}', "1" * 5000, "-" + "9" * 19, "9" * 19, "\ufeff{}", '"\\ud800"', "{", "\x00",
             '{"op": "init", "num_blocks": 1e400, "block_size": 1}', '{"op": "add", "req": "\\udfff", "tokens": [1]}']


# --------------------------------------------------------------------------------------------
# 1. kvjax.core.replay.iter_trace
# --------------------------------------------------------------------------------------------
# A valid init compiles the pool for its shape (seconds each), so the valid sizes are few: num_blocks
# 2 or 3 with block_size 1. Every other value is out of range or not an int, and huge ones must be
# refused before anything is allocated.
NUM_BLOCKS = st.sampled_from([2, 3]) | st.sampled_from([-3, -1, 0, 1, 2**16 + 1, 2**31, 10**12]) | NOT_INT
BLOCK_SIZE = st.just(1) | st.sampled_from([-3, 0, 2**20 + 1, 2**31, 10**12]) | NOT_INT
REQ = st.sampled_from(["a", "b", "c"]) | TEXT | JSON
TOKENS = st.lists(st.integers(0, 20) | st.sampled_from([-1, 2**31 - 1, 2**31, 10**12, 1.0, True]), max_size=4) | JSON
OP_NAMES = st.sampled_from(["init", "add", "append", "free", "reset_prefix_cache", "bogus"])
INIT_OP = st.fixed_dictionaries({"op": st.just("init"), "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE},
                                optional={"prefix_caching": st.booleans() | JSON})
OP = st.one_of(
    INIT_OP,
    st.fixed_dictionaries({"op": st.just("add"), "req": REQ, "tokens": TOKENS}, optional={"salt": TEXT | JSON}),
    st.fixed_dictionaries({"op": st.just("append"), "req": REQ, "tokens": TOKENS}),
    st.fixed_dictionaries({"op": st.just("free"), "req": REQ}),
    st.just({"op": "reset_prefix_cache"}),
    # any op name with any of the keys
    st.fixed_dictionaries({}, optional={"op": OP_NAMES | JSON, "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
                                        "prefix_caching": JSON, "req": REQ, "tokens": TOKENS, "salt": JSON,
                                        "extra": JSON}),
)
VALID_INIT = st.fixed_dictionaries({"op": st.just("init"), "num_blocks": st.sampled_from([2, 3]),
                                    "block_size": st.just(1)}, optional={"prefix_caching": st.booleans()})


@st.composite
def traces(draw):
    """A trace stops at its first bad line, so to reach pool states with live and cached blocks
    most lines must be good: an init, requests that each live a few lines (add, maybe append, then
    free, names reused so that a stray op can hit a live or a freed one), and one op of anything
    inserted anywhere after the first line."""
    lines = [draw(VALID_INIT)]  # (bad inits come as the op of anything)
    for i in range(draw(st.integers(0, 4))):
        name = "abc"[i % 3]
        add = {"op": "add", "req": name, "tokens": draw(st.lists(st.integers(0, 3), min_size=1, max_size=2))}
        if draw(st.booleans()):
            add["salt"] = draw(TEXT)
        lines.append(add)
        if draw(st.booleans()):
            lines.append({"op": "append", "req": name, "tokens": [draw(st.integers(0, 3))]})
        if draw(st.booleans()):
            lines.append({"op": "reset_prefix_cache"})
        lines.append({"op": "free", "req": name})
    lines.insert(draw(st.integers(1, len(lines))), draw(OP))
    return lines


def replay(lines) -> None:
    for _ in iter_trace(lines):
        pass


@fuzz(150)
@given(st.lists(BYTES | st.binary(max_size=8).map(lambda b: b'{"op": "init"' + b), max_size=6))
def test_iter_trace_bytes_lines(lines):
    parse_or_refuse(replay, lines)


@fuzz(150)
@given(st.lists(JSON.map(json.dumps), max_size=6))
def test_iter_trace_json_lines(lines):
    parse_or_refuse(replay, lines)


@fuzz(200)
@given(traces())
def test_iter_trace_near_valid_ops(ops):
    parse_or_refuse(replay, [json.dumps(op) for op in ops])


@pytest.mark.parametrize("after_init", [False, True], ids=["alone", "after-init"])
@pytest.mark.parametrize("line", RAW_LINES, ids=range(len(RAW_LINES)))
def test_iter_trace_raw_lines(line, after_init):
    lines = ['{"op": "init", "num_blocks": 2, "block_size": 1}'] * after_init + [line]
    parse_or_refuse(replay, lines)
    parse_or_refuse(replay, [x.encode("utf-8", "surrogatepass") for x in lines])


# --------------------------------------------------------------------------------------------
# 2. kvjax.commands.prompts.read_prompts
# --------------------------------------------------------------------------------------------
# A file is refused at its first bad line, so most requests are good or nearly so.
OPTIONS = {"max_tokens": st.integers(-3, 100) | EDGE_NUMBERS | JSON,
           "priority": st.integers(-3, 3) | EDGE_NUMBERS | JSON}
REQUEST = st.one_of(
    st.fixed_dictionaries({"prompt": TEXT}, optional=OPTIONS),
    st.fixed_dictionaries({"tokens": TOKENS}, optional=OPTIONS),
    st.fixed_dictionaries({}, optional={"prompt": TEXT | JSON, "tokens": TOKENS, **OPTIONS, "other": JSON}),
)
PROMPT_LINES = (st.lists(REQUEST, max_size=4) | st.lists(JSON | REQUEST, max_size=4)).map(jsonl)


def read_prompts_checked(data: bytes | str) -> None:
    """read_prompts on the content as p.jsonl and as p.txt (with and without --scheduling-policy priority, and
    with --chat); each parse must be honest about the schema."""
    with tempfile.TemporaryDirectory() as folder:
        for name in ("p.jsonl", "p.txt"):
            path = write(folder, name, data)
            for allow_priority, chat in ((False, False), (True, False), (False, True)):
                requests = parse_or_refuse(read_prompts, path, allow_priority, chat)
                for r in requests or ():
                    assert not chat or r["tokens"] is None, r  # --chat renders text: a token-id line is refused
                    assert (r["prompt"] is None) != (r["tokens"] is None), r  # exactly one of the two
                    assert r["prompt"] is None or isinstance(r["prompt"], str), r
                    assert r["tokens"] is None or (isinstance(r["tokens"], list) and all(
                        type(t) is int and 0 <= t <= INT32_MAX for t in r["tokens"])), r
                    assert r["max_tokens"] is None or type(r["max_tokens"]) is int, r
                    assert type(r["priority"]) is int, r
                    assert allow_priority or r["priority"] == 0, r


@fuzz(150)
@given(BYTES)
def test_read_prompts_bytes(data):
    read_prompts_checked(data)


@fuzz(200)
@given(PROMPT_LINES)
def test_read_prompts_json_lines(text):
    read_prompts_checked(text)


# --------------------------------------------------------------------------------------------
# 3. kvjax.quant.formats.KVScales.load
# --------------------------------------------------------------------------------------------
SCALE = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-3, 10**19 - 1) | EDGE_NUMBERS | JSON
LAYERS = st.lists(st.lists(SCALE, max_size=4) | JSON, max_size=3) | JSON
SCALES_DOC = st.fixed_dictionaries(
    {"format": st.sampled_from(["fp8_e4m3", "fp8_e5m2", "banana", 5]) | JSON,
     "mode": st.sampled_from(["unit", "per_tensor", "per_head", "x"]) | JSON,
     "k": LAYERS},
    optional={"v": LAYERS, "amax_k": LAYERS, "amax_v": LAYERS, "other": JSON})
# a unit-mode file: every scale 1 (as floats or ints), so that some of them load
UNIT_DOC = st.fixed_dictionaries(
    {"format": st.sampled_from(FP8_FORMATS), "mode": st.just("unit"),
     "k": st.lists(st.lists(st.sampled_from([1, 1.0]), min_size=1, max_size=3), max_size=3)},
    optional={"v": LAYERS, "amax_k": LAYERS, "amax_v": LAYERS})


def load_scales_checked(data: bytes | str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        scales = parse_or_refuse(KVScales.load, write(folder, "scales.json", data))
    if scales is None:
        return
    assert scales.format in FP8_FORMATS and scales.mode in SCALE_MODES, scales
    assert scales.k, scales
    for a in scales.k + scales.v:
        assert a.dtype == np.float32 and a.size and np.all(np.isfinite(a)) and np.all(a > 0), scales
        assert scales.mode != "unit" or np.all(a == 1), scales
    for a in scales.amax_k + scales.amax_v:
        assert a.size and np.all(np.isfinite(a)) and np.all(a >= 0), scales


@fuzz(150)
@given(BYTES)
def test_kv_scales_bytes(data):
    load_scales_checked(data)


@fuzz(150)
@given(JSON)
def test_kv_scales_json(value):
    load_scales_checked(json.dumps(value))


@fuzz(250)
@given(SCALES_DOC | UNIT_DOC)
def test_kv_scales_near_valid(doc):
    load_scales_checked(json.dumps(doc))


# --------------------------------------------------------------------------------------------
# 4. kvjax.config.model.from_hf_config
# --------------------------------------------------------------------------------------------
LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
DEEPSEEK_V3 = dict(LLAMA, model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
                   rope_interleave=True,
                   rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
QWEN2_MOE = dict(LLAMA, model_type="qwen2_moe", num_experts=4, decoder_sparse_step=1, mlp_only_layers=[],
                 use_sliding_window=True, sliding_window=64, max_window_layers=1)
# Fields from_hf_config reads that a base may not have: replacing one adds it.
OPTIONAL_FIELDS = ["head_dim", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "dtype",
                   "torch_dtype", "rms_norm_eps", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias",
                   "sliding_window", "layer_types"]
BASES = [LLAMA, DEEPSEEK_V3, QWEN2_MOE]
ROPE = st.fixed_dictionaries({}, optional={
    "rope_type": st.sampled_from(["default", "linear", "llama3", "yarn", "dynamic"]) | JSON,
    "type": st.sampled_from(["linear", "yarn"]) | JSON, "rope_theta": EDGE_NUMBERS | JSON,
    "factor": EDGE_NUMBERS | JSON, "original_max_position_embeddings": EDGE_NUMBERS | JSON,
    "low_freq_factor": EDGE_NUMBERS | JSON, "high_freq_factor": EDGE_NUMBERS | JSON,
    "partial_rotary_factor": EDGE_NUMBERS | JSON})
FIELD_VALUES = (JSON | EDGE_NUMBERS | ROPE | st.sampled_from(MODEL_TYPES + ("float32", "bfloat16", "torch.float16"))
                | st.sampled_from([None, "", "8", [], {}, [1, 2], [[1]], ["sliding_attention"], -10**12, 10**30]))


@st.composite
def near_valid_configs(draw):
    """A valid config (llama, deepseek_v3 or qwen2_moe) with one or two fields replaced by anything."""
    cfg = dict(draw(st.sampled_from(BASES)))
    fields = draw(st.lists(st.sampled_from(sorted(cfg) + OPTIONAL_FIELDS), min_size=1, max_size=2, unique=True))
    for field in fields:
        cfg[field] = draw(FIELD_VALUES)
    return cfg


def layer_tuples_are_small(cfg) -> bool:
    """from_hf_config lists layer indices (range(first_k_dense_replace, num_hidden_layers)) for
    every type but llama and gemma: a huge count there is a MemoryError (or minutes of work) that
    would take this process down, so here it is left to test_config_huge_layer_count_in_child,
    which runs it under a memory cap."""
    layers, first = cfg.get("num_hidden_layers"), cfg.get("first_k_dense_replace", 0)
    span = (layers if isinstance(layers, int) else 0) - (first if isinstance(first, int) else 0)
    return cfg.get("model_type") in ("llama", "gemma") or span <= 10_000


def check_config(config) -> None:
    if config is not None:
        assert isinstance(config, ModelConfig) and config.model_type in MODEL_TYPES, config


def config_from_file(data: bytes | str):
    with tempfile.TemporaryDirectory() as folder:
        return parse_or_refuse(from_hf_config, write(folder, "config.json", data))


@fuzz(100)
@given(BYTES)
def test_config_file_bytes(data):
    check_config(config_from_file(data))


@fuzz(150)
@given(JSON)
def test_config_file_json(value):
    assume(not isinstance(value, dict) or layer_tuples_are_small(value))
    check_config(config_from_file(json.dumps(value)))


@fuzz(150)
@given(st.dictionaries(TEXT | st.sampled_from(sorted(QWEN2_MOE) + OPTIONAL_FIELDS), JSON, max_size=8))
def test_config_dict_json(cfg):
    assume(layer_tuples_are_small(cfg))
    check_config(parse_or_refuse(from_hf_config, cfg))


@fuzz(300)
@given(near_valid_configs())
def test_config_near_valid_dict(cfg):
    assume(layer_tuples_are_small(cfg))
    check_config(parse_or_refuse(from_hf_config, cfg))


@fuzz(100)
@given(near_valid_configs())
def test_config_near_valid_file(cfg):
    assume(layer_tuples_are_small(cfg))
    check_config(config_from_file(json.dumps(cfg)))


# The cases layer_tuples_are_small keeps out of this process: a layer count (or a negative
# first_k_dense_replace) far past int32 must be refused, not turned into a tuple of 10**12 layer
# indices. Run in a child whose address space is capped at 256 MiB, so a failure is a MemoryError
# traceback instead of a machine out of memory.
HUGE_LAYER_CONFIGS = {
    "deepseek_v3-layers": dict(DEEPSEEK_V3, num_hidden_layers=10**12),
    "deepseek_v3-first_k_dense_replace": dict(DEEPSEEK_V3, first_k_dense_replace=-10**12),
    "mixtral-layers": dict(LLAMA, model_type="mixtral", num_hidden_layers=10**12),
    "qwen2_moe-layers": dict(QWEN2_MOE, num_hidden_layers=10**12),
}
CHILD = textwrap.dedent("""
    import json, resource, sys
    from kvjax.config.hf import from_hf_config
    from kvjax.errors import KvjaxError
    resource.setrlimit(resource.RLIMIT_AS, (2**28, 2**28))
    try:
        from_hf_config(json.loads(sys.argv[1]))
    except KvjaxError:
        pass
""")


@pytest.mark.parametrize("name", sorted(HUGE_LAYER_CONFIGS))
def test_config_huge_layer_count_in_child(name):
    # BUG (library, reported): every case here raises MemoryError in kvjax/config/model.py instead of a
    # ModelConfigError: _mla's tuple(range(first_k_dense_replace, layers)) (line 420), _gqa's
    # tuple(range(layers)) for mixtral (391) and its per-layer layer_types list for qwen2_moe (387).
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(HUGE_LAYER_CONFIGS[name])], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# 5. GGUF headers: models.loader.load_config on a .gguf file
# --------------------------------------------------------------------------------------------
T = gguf.GGUFValueType
# A tiny llama GGUF as llama.cpp's converter writes one (tests/models/test_gguf.py): metadata, a short
# token list, two small tensors (their infos are part of what is parsed).
GGUF_META = {
    "llama.block_count": (2, T.UINT32), "llama.context_length": (256, T.UINT32),
    "llama.embedding_length": (64, T.UINT32), "llama.feed_forward_length": (128, T.UINT32),
    "llama.attention.head_count": (4, T.UINT32), "llama.attention.head_count_kv": (2, T.UINT32),
    "llama.rope.freq_base": (10000.0, T.FLOAT32), "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32),
    "llama.rope.dimension_count": (16, T.UINT32), "llama.vocab_size": (128, T.UINT32),
    "tokenizer.ggml.tokens": (["a", "b", "<s>", "</s>"], T.ARRAY), "tokenizer.ggml.eos_token_id": (3, T.UINT32),
}
GGUF_KEYS = sorted(GGUF_META) + ["general.architecture", "llama.attention.key_length", "llama.expert_count",
                                 "llama.rope.scaling.type", "llama.rope.scaling.factor"]


def gguf_bytes(meta: dict) -> bytes:
    """A GGUF file with this metadata ({key: (value, GGUFValueType)}) and two small tensors."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.gguf")
        w = gguf.GGUFWriter(path, "llama")
        writer_log = logging.getLogger(gguf.gguf_writer.__name__)
        level, writer_log.level = writer_log.level, logging.ERROR  # no warning when general.architecture is replaced
        try:
            for key, (value, vtype) in meta.items():
                w.add_key_value(key, value, vtype)
        finally:
            writer_log.level = level
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float16))
        w.add_tensor("output_norm.weight", np.ones(8, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(path, "rb") as fh:
            return fh.read()


VALID_GGUF = gguf_bytes(GGUF_META)
# A metadata value of any GGUF type.
GGUF_VALUES = st.one_of(
    st.integers(0, 2**32 - 1).map(lambda v: (v, T.UINT32)), st.integers(-2**31, 2**31 - 1).map(lambda v: (v, T.INT32)),
    st.integers(0, 2**64 - 1).map(lambda v: (v, T.UINT64)), st.integers(-2**63, 2**63 - 1).map(lambda v: (v, T.INT64)),
    st.floats(width=32).map(lambda v: (v, T.FLOAT32)), st.floats().map(lambda v: (v, T.FLOAT64)),
    st.booleans().map(lambda v: (v, T.BOOL)), st.text(max_size=8).map(lambda v: (v, T.STRING)),
    st.sampled_from(["llama", "gpt2", "linear", "yarn", "none"]).map(lambda v: (v, T.STRING)),
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4).map(lambda v: (v, T.ARRAY)),
    st.lists(st.text(max_size=4), min_size=1, max_size=4).map(lambda v: (v, T.ARRAY)),
    st.just(None),  # the key is left out
)


def load_gguf(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        check_config(parse_or_refuse(load_config, write(folder, "m.gguf", data)))


def test_valid_gguf_loads():  # what the tests below cut and flip is a file that loads
    with tempfile.TemporaryDirectory() as folder:
        config = load_config(write(folder, "m.gguf", VALID_GGUF))
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.head_dim) == (2, 64, 2, 16)


@fuzz(100)
@given(BYTES)
def test_gguf_magic_then_bytes(data):
    load_gguf(b"GGUF" + data)


@fuzz(150)
@given(st.integers(0, len(VALID_GGUF) - 1))
def test_gguf_truncated(length):
    load_gguf(VALID_GGUF[:length])


@fuzz(150)
@given(st.integers(4, len(VALID_GGUF) - 1), st.integers(1, 255), st.booleans())
def test_gguf_byte_flipped(index, xor, cut):
    data = bytearray(VALID_GGUF)
    data[index] ^= xor
    load_gguf(bytes(data[:index + 1] if cut else data))


@fuzz(200)
@given(st.dictionaries(st.sampled_from(GGUF_KEYS), GGUF_VALUES, min_size=1, max_size=2))
def test_gguf_odd_metadata(changes):
    """One or two metadata fields of another type or value, or left out."""
    assume(changes.get("general.architecture", "") is not None)  # GGUFWriter always writes it
    meta = {**GGUF_META, **changes}
    load_gguf(gguf_bytes({key: value for key, value in meta.items() if value is not None}))


# --------------------------------------------------------------------------------------------
# 6. kvjax.utils.input_files.read_text, kvjax.utils.strict_json.read_json / read_jsonl
# --------------------------------------------------------------------------------------------
def read_all(data: bytes | str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = write(folder, "f.json", data)
        text = parse_or_refuse(read_text, path, "file")
        if text is not None and isinstance(data, bytes):
            assert text.encode("utf-8") == data
        value = parse_or_refuse(read_json, path, "file")
        if value is not None:  # finite numbers only
            assert all(math.isfinite(x) for x in _numbers(value)), value
        parse_or_refuse(lambda: list(read_jsonl(path, "file")))


def _numbers(value):
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, float):
            yield v


@fuzz(200)
@given(BYTES)
def test_read_helpers_bytes(data):
    read_all(data)


@fuzz(100)
@given(st.lists(JSON, max_size=4).map(jsonl))
def test_read_helpers_json_lines(text):
    read_all(text)


# --------------------------------------------------------------------------------------------
# Every reader on the raw lines, and the inputs that broke the contract
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("line", RAW_LINES, ids=range(len(RAW_LINES)))
def test_raw_lines_in_every_file_reader(line):
    read_all(line)
    read_prompts_checked(line)
    load_scales_checked(line)
    check_config(config_from_file(line))


# The smallest inputs that broke the contract when this file was first run, one per distinct bug
# (the exception each raised then, instead of a KvjaxError, is in its comment), kept so that each
# is checked on every run rather than when the fuzzer happens on it.
def _trace(*ops):
    return lambda: parse_or_refuse(replay, ['{"op": "init", "num_blocks": 2, "block_size": 1}', *ops])


def _config(base, **changes):
    return lambda: check_config(parse_or_refuse(from_hf_config, dict(base, **changes)))


def _gguf(**changes):
    return lambda: load_gguf(gguf_bytes({**GGUF_META, **{k.replace("__", "."): v for k, v in changes.items()}}))


ONCE_BROKEN = {
    # kvjax/core/kv_cache_utils.py:137 salt_key: UnicodeEncodeError (a lone surrogate, which JSON's \ud800 escape gives)
    "replay-salt-lone-surrogate": _trace('{"op": "add", "req": "a", "tokens": [1], "salt": "\\ud800"}'),
    # kvjax/commands/prompts.py read_prompts: returns a request with neither prompt nor tokens
    "prompts-tokens-null": lambda: read_prompts_checked('{"tokens": null}\n'),
    # kvjax/config/model.py:103 rope_from_hf dict(...): ValueError / TypeError
    "config-rope_scaling-string": _config(LLAMA, rope_scaling="ab"),
    "config-rope_scaling-list": _config(LLAMA, rope_scaling=[1, 2]),
    # kvjax/config/model.py:111 rope_from_hf float(theta): ValueError / TypeError
    "config-rope_theta-string": _config(LLAMA, rope_theta="x"),
    "config-rope_theta-list": _config(LLAMA, rope_theta=[1]),
    # kvjax/config/model.py:420 _mla range(first_dense, layers): TypeError
    "config-deepseek-first_k_dense_replace-null": _config(DEEPSEEK_V3, first_k_dense_replace=None),
    "config-deepseek-first_k_dense_replace-float": _config(DEEPSEEK_V3, first_k_dense_replace=1.5),
    # kvjax/config/model.py:387 _gqa i >= max_window_layers: TypeError
    "config-qwen2_moe-max_window_layers-string": _config(QWEN2_MOE, max_window_layers="x"),
    # kvjax/config/model.py:389 _gqa enumerate(layer_types): TypeError
    "config-qwen2_moe-layer_types-int": _config(QWEN2_MOE, layer_types=5),
    # kvjax/config/model.py:395 _gqa set(mlp_only_layers): TypeError (an int; [[1]] is unhashable, the same line)
    "config-qwen2_moe-mlp_only_layers-int": _config(QWEN2_MOE, mlp_only_layers=-1),
    # kvjax/config/model.py:396 _gqa (i + 1) % step: ZeroDivisionError / TypeError
    "config-qwen2_moe-decoder_sparse_step-0": _config(QWEN2_MOE, decoder_sparse_step=0),
    "config-qwen2_moe-decoder_sparse_step-string": _config(QWEN2_MOE, decoder_sparse_step="x"),
    # models/gguf.py:184 hf_config rotary / head_dim: TypeError
    "gguf-key_length-string": _gguf(llama__attention__key_length=("x", T.STRING)),
    # kvjax/config/model.py:111 (through models/gguf.py hf_config) float(rope_theta): ValueError
    "gguf-rope_freq_base-string": _gguf(llama__rope__freq_base=("x", T.STRING)),
}


@pytest.mark.parametrize("name", sorted(ONCE_BROKEN))
def test_inputs_that_once_broke_a_reader(name):
    ONCE_BROKEN[name]()


# --------------------------------------------------------------------------------------------
# kvjax.core.replay with a host offload tier: near-valid traces over a pool and a tier of 1 or 6 slots;
# after every op both indexes keep their invariants, and a failed op leaves the tier as it was.
# --------------------------------------------------------------------------------------------
# (Bad host keys are test_replay.py's; here the init is good, so that most ops reach the tier.)
HOST_INIT = st.fixed_dictionaries({"op": st.just("init"), "num_blocks": st.sampled_from([5, 6]),
                                   "block_size": st.just(1), "host_blocks": st.sampled_from([1, 6]),
                                   "host_policy": st.sampled_from(["lru", "arc"])})


@st.composite
def host_traces(draw):
    """Requests that reuse a few prompts, so that a small pool evicts them and the tier serves them
    back (host hits); half of the traces get one op of anything after the first line."""
    lines = [draw(HOST_INIT)]
    prompts = draw(st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=4), min_size=2, max_size=3))
    for i in range(draw(st.integers(3, 8))):
        name = f"r{i}"
        lines.append({"op": "add", "req": name, "tokens": draw(st.sampled_from(prompts))})
        if draw(st.booleans()):
            lines.append({"op": "append", "req": name, "tokens": [draw(st.integers(0, 1))]})
        if draw(st.integers(0, 3)):  # most requests end before the next: the pool has 4 or 5 blocks
            lines.append({"op": "free", "req": name})
    if draw(st.booleans()):
        lines.insert(draw(st.integers(1, len(lines))), draw(OP))
    return lines


@fuzz(60)
@given(host_traces())
@pytest.mark.slow
def test_iter_trace_host_tier(ops):
    from kvjax.core import kv_cache_manager as manager
    from kvjax.kv_offload import manager as host_cache

    def run():
        before = None
        for out, rep in iter_trace([json.dumps(op) for op in ops]):
            if rep.host is not None:
                host_cache.check_invariants(rep.host)
                manager.check_invariants(rep.state)
                if not out["ok"] and before is not None:
                    assert out["host"] == before, (out, before)
                before = out["host"]

    parse_or_refuse(run)


# --------------------------------------------------------------------------------------------
# Issue 23's classes, fuzzed: files that are not regular files, exact decimals of any size,
# text with lone surrogates, and the memory ceiling of sizes that follow from input.
# --------------------------------------------------------------------------------------------
def _special_files(folder: str) -> dict[str, str]:
    """A FIFO, a folder, a character device and a socket, each as a path a reader may be given."""
    import socket

    paths = {"fifo": os.path.join(folder, "f.json"), "folder": os.path.join(folder, "d.json"),
             "device": "/dev/zero", "socket": os.path.join(folder, "s.json")}
    os.mkfifo(paths["fifo"])
    os.mkdir(paths["folder"])
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(paths["socket"])
    sock.close()
    return paths


SPECIAL_READERS = {
    "read_text": lambda p: read_text(p, "text"),
    "read_json": lambda p: read_json(p, "json"),
    "read_prompts": lambda p: read_prompts(p),
    "KVScales.load": KVScales.load,
    "from_hf_config": from_hf_config,
    "load_config": load_config,
    "load_config-gguf": lambda p: load_config(p + ".gguf"),
}


@pytest.mark.parametrize("reader", sorted(SPECIAL_READERS))
def test_every_reader_refuses_special_files_without_opening_them(reader, tmp_path):
    """Opening a FIFO would block until a writer came: a refusal by stat answers at once."""
    paths = _special_files(str(tmp_path))
    for kind, path in paths.items():
        if kind == "folder" and reader in ("from_hf_config", "load_config"):
            continue  # a checkpoint folder is what these take (its config.json is read)
        if reader == "load_config-gguf":
            if kind == "device":
                continue  # /dev/zero has no .gguf name
            path = path[:-len(".json")]
            os.rename(path + ".json", path + ".gguf")
        with pytest.raises(KvjaxError, match="not a regular file|not a file|is a folder|not a folder"):
            SPECIAL_READERS[reader](path)
        if reader == "load_config-gguf":
            os.rename(path + ".gguf", path + ".json")


DECIMALS = (st.text(alphabet="0123456789eE+-.", max_size=30)
            | st.builds(lambda m, e: f"{m}e{e}", st.integers(-10**6, 10**6), st.integers(-10**12, 10**12))
            | st.decimals(allow_nan=True).map(str) | TEXT)


@fuzz(300)
@given(DECIMALS)
def test_exact_decimals_answer_at_once(text):
    """Every exact-decimal reader (GiB sizes, utilizations) answers within a second or refuses:
    an exponent like 1e999999999 must not build a billion-digit number."""
    import time

    from kvjax.accounting import budget as bud

    for read in (lambda: bud.gib(text, "--device-memory-gib"), lambda: bud.utilization(text, "--util"),
                 lambda: bud.exact(text, "--params-b")):
        start = time.perf_counter()
        parse_or_refuse(read)
        assert time.perf_counter() - start < 1.0, text


@fuzz(200)
@given(TEXT)
def test_the_tokenizer_encodes_or_refuses_any_text(text):
    from kvjax.models.tokenizer import Tokenizer

    ids = parse_or_refuse(Tokenizer().encode, text)
    assert ids is None or ids == list(text.encode("utf-8"))
    if ids is None:  # only a lone surrogate is refused
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in text)


@fuzz(15)
@given(num_blocks=st.integers(2, 2**31), block_size=st.sampled_from([1, 16, 64]),
       max_num_seqs=st.integers(1, 2**16), max_model_len=st.integers(1, 2**20))
def test_scheduler_sizes_are_checked_before_allocation(num_blocks, block_size, max_num_seqs, max_model_len):
    """Any scheduler config either builds (its tables at most the host's RAM, here capped at
    64 MiB so that a test never allocates much) or is refused by a KvjaxError before allocation."""
    from unittest import mock

    from kvjax.accounting import memory
    from kvjax.accounting.memory import tree_bytes
    from kvjax.config.scheduler import SchedulerConfig
    from kvjax.core.sched.scheduler import Scheduler

    with mock.patch.object(memory, "host_ram_bytes", lambda: 64 * 2**20):
        config = parse_or_refuse(lambda: SchedulerConfig(num_blocks=num_blocks, block_size=block_size,
                                                         max_num_seqs=max_num_seqs, max_model_len=max_model_len))
        sched = None if config is None else parse_or_refuse(Scheduler, config)
    if sched is not None:
        assert tree_bytes(sched.state) <= 64 * 2**20
