"""A llama, gemma2, gemma3, qwen2moe, qwen3moe, gpt-oss or deepseek2 GGUF file (llama.cpp's) read as a HF checkpoint.

GGUF (llama.cpp `docs/gguf.md`) is one file: a header of typed key-value metadata (the model's hyper-parameters
under `{architecture}.*`, its tokenizer under `tokenizer.ggml.*`), then tensor infos (name, dims in ggml order —
innermost first —, ggml type, offset) and the tensor data, many of them block-quantized (Q8_0: 32 int8 values and
one f16 scale per block; Q4_1: 32 4-bit values, an f16 scale and an f16 minimum; ...). It is read with the `gguf`
library (llama.cpp's own Python package): `GGUFReader` for the layout, `gguf.quants.dequantize` for the values.

`GGUFFile` turns one into what models.loader reads from a Hugging Face folder, the way
transformers' GGUF loader does (`modeling_gguf_pytorch_utils.load_gguf_checkpoint`,
`integrations/ggml.py` GGUF_CONFIG_MAPPING, `integrations/gguf/gguf_tokenizer_mapping.py`):

- `hf_config()`: the `{architecture}.*` metadata as a config.json dict (block_count →
  num_hidden_layers, embedding_length → hidden_size, rope.dimension_count → head_dim, ...; tied
  embeddings when the file has no `output.weight`), parsed by kvjax.config.hf.from_hf_config;
- a `TensorSource`: `blk.N.attn_q.weight` → `model.layers.N.self_attn.q_proj.weight`, etc.,
  dequantized to f32 in torch's [out, in] layout (ggml's dims reversed), so models.loader's
  `load_params` fills the Flax tree with its own name mapping and shape checks. llama.cpp's
  converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders the rows of each head of a
  llama's attn_q and attn_k so that its rotary embedding rotates adjacent pairs (GPT-J style);
  reading undoes it (transformers' `LlamaTensorProcessor._reverse_permute_weights`);
- gemma2 / gemma3 (not permuted): every norm weight is stored as 1 + w, which reading undoes
  (transformers' `Gemma2TensorProcessor`); ffn_norm is the pre_feedforward_layernorm, beside
  post_attention_norm, post_ffw_norm, attn_q_norm and attn_k_norm. What the metadata leaves out
  is filled in as llama.cpp's `load_hparams` does (transformers' loader keeps its config class's
  defaults instead): sliding layers every other (gemma2) or five in six (gemma3) unless
  `attention.sliding_window_pattern` says otherwise, the sliding layers' RoPE base 10000 (or
  `rope.freq_base_swa`), softmax scale head_dim^-0.5 but hidden / heads for the 27B models (or
  `attention.scale`), gemma2's soft-caps 50 and 30, no attention soft-cap on gemma3. A file
  without `attention.sliding_window` is refused;
- mixture-of-experts files (qwen2moe, qwen3moe, llama with experts: Mixtral, gpt-oss, deepseek2): models.gguf_moe;
- `tokenizer()`: the byte-level BPE of `tokenizer.ggml.model = gpt2` rebuilt with the
  `tokenizers` library from the file's tokens and merges (models.gguf_tokenizer), exactly as
  transformers' `byte_level_tokenizer` + `add_gguf_special_tokens` + `set_split_regex` build it
  (so ids equal `AutoTokenizer.from_pretrained(folder, gguf_file=name)`'s); `eos_token_ids`, `chat_template`.

Model files are data: every metadata value read goes through a typed accessor (`meta_int`, ...)
that checks its type and range, naming key, value and file; special token ids must be in the
vocabulary (`special_ids`: 0xFFFFFFFF too); the chat template is a ChatTemplate naming the file.

Refused, each with its own GGUFError subclass (a models.tensors.CheckpointError, so a ValueError):
not a GGUF file, one truncated or corrupt, or a metadata value of the wrong type or range (GGUFFormatError);
an architecture other than these, or a feature kvjax's models do not implement — per-layer head counts, rope
scaling other than linear (yarn: gpt-oss and deepseek2 only), llama.cpp's `rope_freqs` (GGUFArchitectureError); a
tensor type `gguf.quants.dequantize` cannot dequantize, or one the gguf library does not know (GGUFTensorTypeError);
a tokenizer model other than gpt2, a pre-tokenizer whose split models.gguf_tokenizer does not reproduce, or a
vocabulary it cannot build (GGUFTokenizerError).
"""
from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from kvjax.config.model import MAX_LAYERS, MIN_EPS
from kvjax.errors import KvjaxError, one_line
from kvjax.models import gguf_moe
from kvjax.models.gguf_tokenizer import PRE_SPLITS, byte_level_bpe
from kvjax.models.template_sandbox import ChatTemplate
from kvjax.models.tensors import CheckpointError, TensorSource
from kvjax.utils.checks import INT32_MAX, is_int
from kvjax.utils.input_files import check_input_file

ARCHITECTURES = {"llama": "llama", "gemma2": "gemma2", "gemma3": "gemma3_text", **gguf_moe.ARCHITECTURES}
GEMMA = ("gemma2", "gemma3")
MAGIC = b"GGUF"
SPECIAL_IDS = ("bos", "eos", "unknown", "padding")  # tokenizer.ggml.{name}_token_id

# GGUF's standardized tensor names (ggml docs/gguf.md, "Standardized tensor names"; gguf's
# TensorNameMap for MODEL_ARCH.LLAMA) → Hugging Face Llama names.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# gguf's MODEL_TENSORS[GEMMA2 / GEMMA3]: FFN_PRE_NORM is written as ffn_norm, the MLP's pre-norm.
GEMMA_BLOCK_NAMES = {
    **BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


class GGUFError(CheckpointError):
    """A GGUF file kvjax will not load; subclasses say why."""


class GGUFFormatError(GGUFError):
    """Not a GGUF file, a truncated or corrupt one, or one without a field the model needs."""


class GGUFArchitectureError(GGUFError):
    """An architecture models.gguf does not read, or a feature kvjax's models do not implement."""


class GGUFTensorTypeError(GGUFError):
    """A tensor type the gguf library does not know or cannot dequantize."""


class GGUFTokenizerError(GGUFError):
    """A tokenizer models.gguf_tokenizer does not rebuild exactly."""


class GGUFFile(TensorSource):
    """One GGUF file: metadata, config, tokenizer, and its tensors as a models.tensors.TensorSource.

    Opening reads the header and the tensor infos (the data stays memory-mapped); a tensor is
    dequantized when `read` asks for it, so loading holds one f32 tensor at a time beside the
    model's parameters."""

    def __init__(self, path: str | os.PathLike):
        self.where = path = os.fspath(path)
        self.name = os.path.splitext(os.path.basename(path))[0]
        self._reader = _open_reader(path)
        self._meta: dict[str, Any] = {}
        self.architecture = self.meta("general.architecture", None)
        if not isinstance(self.architecture, str) or self.architecture not in ARCHITECTURES:
            raise GGUFArchitectureError(
                f"GGUF file {path!r} holds a {self.architecture!r} model (general.architecture); kvjax loads "
                f"only {' / '.join(repr(a) for a in ARCHITECTURES)} GGUF files")
        by_type: dict[Any, list[str]] = {}
        for t in self._reader.tensors:
            by_type.setdefault(t.tensor_type, []).append(t.name)
        for qtype, names in by_type.items():
            if not _dequantizable(qtype):
                raise GGUFTensorTypeError(
                    f"GGUF file {path!r}: tensor {names[0]!r} has ggml type {qtype.name}, which gguf "
                    f"{_version()} cannot dequantize ({len(names)} tensor(s) of that type)")
        self._tensors = gguf_moe.group(self._reader.tensors, self.architecture, hf_tensor_name)  # HF name → parts

    # ------------------------------------------------------------------ metadata
    def meta(self, key: str, default: Any = ...) -> Any:
        """A metadata value as Python (str, int, float, bool, or a list of them); `default` when
        absent (GGUFFormatError if no default is given)."""
        if key not in self._meta:
            field = self._reader.fields.get(key)
            if field is None:
                if default is ...:
                    raise GGUFFormatError(f"GGUF file {self.where!r} has no metadata field {key!r}")
                return default
            try:
                self._meta[key] = _field_value(field)
            except (ValueError, IndexError) as e:
                raise GGUFFormatError(f"GGUF file {self.where!r}: metadata field {key!r} is unreadable ({e})") from None
        return self._meta[key]

    # Typed reads: every value the loader uses is checked here, by its GGUF key, before it is used.
    def _bad(self, key: str, rule: str, value: Any) -> GGUFFormatError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return GGUFFormatError(f"GGUF file {self.where!r}: {key} must be {rule}, got {shown}")

    def _typed(self, key: str, default: Any, ok, rule: str) -> Any:
        """The value of `key` if ok(value), else GGUFFormatError naming the key, the rule and the
        value; `default` when absent (GGUFFormatError when no default is given)."""
        if default is not ... and key not in self._reader.fields:
            return default
        value = self.meta(key)
        if not ok(value):
            raise self._bad(key, rule, value)
        return value

    def meta_int(self, key: str, default: Any = ..., lo: int = 1, hi: int = INT32_MAX) -> Any:
        return self._typed(key, default, lambda v: is_int(v) and lo <= v <= hi, f"an integer in [{lo:,}, {hi:,}]")

    def meta_number(self, key: str, default: Any = ..., lo: float = -math.inf, hi: float = math.inf,
                    open_lo: bool = False) -> Any:
        """A finite int or float (not a bool) in [lo, hi] ((lo, hi] with open_lo)."""
        bounds = [f"> {lo:g}" if open_lo else f">= {lo:g}"] if lo > -math.inf else []
        bounds += [f"<= {hi:g}"] if hi < math.inf else []
        rule = "a finite number" + (" " + " and ".join(bounds) if bounds else "")

        def ok(v):
            return (is_int(v) or isinstance(v, float)) and math.isfinite(v) and (lo < v if open_lo else lo <= v) \
                and v <= hi

        return self._typed(key, default, ok, rule)

    def meta_str(self, key: str, default: Any = ...) -> Any:
        return self._typed(key, default, lambda v: isinstance(v, str), "a string")

    def meta_bool(self, key: str, default: Any = ...) -> Any:
        return self._typed(key, default, lambda v: isinstance(v, bool), "a boolean")

    def meta_list(self, key: str, kind: type, default: Any = ...) -> Any:
        """An array whose items are all `kind` (int: integers, not bools)."""
        item = is_int if kind is int else lambda v: isinstance(v, kind)
        return self._typed(key, default, lambda v: isinstance(v, list) and all(map(item, v)),
                           f"an array of {({str: 'strings', int: 'integers', bool: 'booleans'})[kind]}")

    def num_tokens(self) -> int | None:
        """How many tokens tokenizer.ggml.tokens lists (None: the file has no token list), counted
        without decoding them."""
        from gguf import GGUFValueType

        field = self._reader.fields.get("tokenizer.ggml.tokens")
        if field is not None and field.types[:1] != [GGUFValueType.ARRAY]:
            raise self._bad("tokenizer.ggml.tokens", "an array of strings", self.meta("tokenizer.ggml.tokens"))
        return None if field is None else len(field.data)

    def special_ids(self) -> dict[str, int | None]:
        """tokenizer.ggml.{bos,eos,unknown,padding}_token_id: each None (absent) or an id below the
        vocabulary size (the token list's length and the file's vocab_size). One outside it is
        refused naming the key and the value: transformers' loader indexes the token list with
        it (an IndexError), llama.cpp warns and substitutes a default (token 11 as a byte-level
        BPE's BOS and EOS), which would let generation run past the model's end of text. So is
        0xFFFFFFFF, llama.cpp's "no token" (-1) as a uint32: a converter leaves out a key the model
        has no token for (gguf's SpecialVocab writes only ids of the vocabulary)."""
        sizes = {"tokenizer.ggml.tokens": self.num_tokens(),
                 f"{self.architecture}.vocab_size": self.meta_int(f"{self.architecture}.vocab_size", None)}
        known = sorted((n, where) for where, n in sizes.items() if n is not None)
        size, where = known[0] if known else (INT32_MAX + 1, "the engine's int32 token ids")
        ids = {}
        for name in SPECIAL_IDS:
            key = f"tokenizer.ggml.{name}_token_id"
            ids[name] = value = self._typed(key, None, is_int, "a token id (an integer)")
            if value is not None and not 0 <= value < size:
                null = " (0xFFFFFFFF: llama.cpp's 'no token' written as a uint32)" if value == 2**32 - 1 else ""
                raise GGUFFormatError(f"GGUF file {self.where!r}: {key} is {value}{null}, not a token id: the "
                                      f"vocabulary has {size:,} tokens ({where}), ids 0 to {size - 1:,}")
        return ids

    def hf_config(self) -> dict:
        """The `{architecture}.*` metadata as a Hugging Face config.json dict (transformers'
        GGUF_CONFIG_MAPPING), dtype float32: the weights dequantize to it."""
        arch = self.architecture

        def m(key, default=..., lo=1, hi=INT32_MAX):  # an integer field of the architecture
            return self.meta_int(f"{arch}.{key}", default, lo, hi)

        def x(key, default=..., **bounds):  # a number field of the architecture
            return self.meta_number(f"{arch}.{key}", default, **bounds)

        for key in ("attention.head_count", "attention.head_count_kv"):
            value = self.meta(f"{arch}.{key}", None)
            if isinstance(value, list):
                raise GGUFArchitectureError(f"GGUF file {self.where!r}: {arch}.{key} is per layer "
                                            f"({value[:4]}...); kvjax's models have one head count for all layers")
        heads, kv_heads = m("attention.head_count"), m("attention.head_count_kv", None)
        if "rope_freqs.weight" in self._tensors:
            raise GGUFArchitectureError(
                f"GGUF file {self.where!r} has rope_freqs.weight, llama.cpp's per-dimension rope frequency factors "
                "(Llama-3.1-style rope scaling), which kvjax does not read from GGUF files")
        # llama.cpp's default base; the domains are kvjax.config.model's, checked here to name the GGUF key
        rope = {"rope_type": "default", "rope_theta": x("rope.freq_base", 10000.0, lo=1, open_lo=True)}
        scaling = self.meta_str(f"{arch}.rope.scaling.type", "none")
        if scaling == "linear":
            rope.update(rope_type="linear", factor=x("rope.scaling.factor", lo=MIN_EPS))
        elif scaling != "none" and not (scaling == "yarn" and arch in gguf_moe.YARN):  # yarn: gguf_moe reads it
            raise GGUFArchitectureError(f"GGUF file {self.where!r}: {arch}.rope.scaling.type {scaling!r} is "
                                        "not supported (only none and linear; yarn on gpt-oss and deepseek2)")
        vocab = m("vocab_size", None)
        if vocab is None:
            vocab = self.num_tokens()  # transformers' fallback
        cfg = {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "hidden_size": m("embedding_length"), "intermediate_size": m("feed_forward_length"),
            "num_hidden_layers": m("block_count", hi=MAX_LAYERS), "num_attention_heads": heads,
            "num_key_value_heads": heads if kv_heads is None else kv_heads,
            "max_position_embeddings": m("context_length", 2048),  # LlamaConfig's default
            "rms_norm_eps": x("attention.layer_norm_rms_epsilon", 1e-5, lo=MIN_EPS, hi=1), "rope_parameters": rope,
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors, "dtype": "float32",
        }
        # transformers takes head_dim from rope.dimension_count; llama.cpp writes key_length when a
        # head is not hidden / heads wide, and a smaller rope.dimension_count for partial rotary.
        head_dim = m("attention.key_length", None) or m("rope.dimension_count", None)
        if head_dim is not None:
            cfg["head_dim"] = head_dim
            rotary = m("rope.dimension_count", head_dim)
            if rotary != head_dim:
                cfg["partial_rotary_factor"] = rotary / head_dim  # recorded; models.build_model refuses it
        ids = self.special_ids()
        for key in ("bos", "eos"):
            if ids[key] is not None:
                cfg[f"{key}_token_id"] = ids[key]
        cfg.update(self._gemma_config(m, cfg) if arch in GEMMA else gguf_moe.moe_config(self, arch, cfg))
        return cfg

    def _gemma_config(self, m, cfg: dict) -> dict:
        """The Gemma 2 / 3 fields, read or defaulted as llama.cpp's loader does (module docstring)."""
        arch, layers = self.architecture, cfg["num_hidden_layers"]
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        x = lambda key, default=..., **bounds: self.meta_number(f"{arch}.{key}", default, **bounds)  # noqa: E731
        window = m("attention.sliding_window", None)
        if window is None:
            raise GGUFArchitectureError(f"GGUF file {self.where!r} has no {arch}.attention.sliding_window: kvjax's "
                                        "Gemma needs its sliding layers' window")
        head_dim = cfg.setdefault("head_dim", hidden // heads)  # llama.cpp's n_embd_head_k default
        key = f"{arch}.attention.sliding_window_pattern"
        if isinstance(self.meta(key, None), list):  # one flag a layer (booleans; 0 / 1 read as them)
            pattern = self._typed(key, ..., lambda v: all(isinstance(p, bool) or p in (0, 1) for p in v),
                                  "an array of flags, one a layer")
            if len(pattern) != layers:
                raise GGUFFormatError(f"GGUF file {self.where!r}: {key} has {len(pattern)} flags for {layers} layers")
            slides = [bool(p) for p in pattern]
        else:  # llama.cpp's set_swa_pattern(n): the last layer of every n is full
            pattern = m("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
            slides = [i % pattern < pattern - 1 for i in range(layers)]
        scale = x("attention.scale", None)
        if scale is not None and not (scale > 0 and 1e-150 < scale < 1e150):  # its inverse square is finite
            raise self._bad(f"{arch}.attention.scale", "a positive softmax scale", scale)
        is_27b = layers == {"gemma2": 46, "gemma3": 62}[arch]  # llama.cpp's LLM_TYPE_27B
        out = {"model_type": ARCHITECTURES[arch], "architectures": [f"{arch.capitalize()}ForCausalLM"],
               "hidden_activation": "gelu_pytorch_tanh", "sliding_window": window,
               "layer_types": ["sliding_attention" if s else "full_attention" for s in slides],
               "query_pre_attn_scalar": scale ** -2 if scale else (hidden // heads if is_27b else head_dim)}
        final = x("final_logit_softcapping", 30.0 if arch == "gemma2" else None)
        out["final_logit_softcapping"] = final or None  # llama.cpp: 0 is off
        out["attn_logit_softcapping"] = (x("attn_logit_softcapping", 50.0) or None) if arch == "gemma2" else None
        if arch == "gemma3":
            local = {"rope_type": "default", "rope_theta": x("rope.freq_base_swa", 10000.0, lo=1, open_lo=True)}
            out["rope_parameters"] = {"full_attention": cfg["rope_parameters"], "sliding_attention": local}
        return out

    def config(self, dtype: str | None = None, hf_config: dict | None = None):
        """The kvjax ModelConfig (kvjax.config.hf.from_hf_config of `hf_config()`, or of the
        hf_config given: the file's with hf_overrides applied), named after the file; an error
        names the file (the fields by their config.json names, as transformers maps them)."""
        from kvjax.config.hf import from_hf_config

        cfg = self.hf_config() if hf_config is None else hf_config
        return from_hf_config(cfg, dtype=dtype, source=f"{self.where} (its metadata read as config.json)").replace(
            name=self.name)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.special_ids()["eos"]
        return () if eos is None else (eos,)

    @property
    def chat_template(self) -> ChatTemplate | None:
        """tokenizer.chat_template, as a ChatTemplate that names this file in its errors."""
        text = self.meta_str("tokenizer.chat_template", None)
        return None if text is None else ChatTemplate(text, f"{self.where} (tokenizer.chat_template)")

    # ------------------------------------------------------------------ tensors (TensorSource)
    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        if (shape := gguf_moe.torch_shape(self.architecture, name, self._tensors[name])) is None:
            raise GGUFFormatError(f"GGUF file {self.where!r}: {self.origin(name)} do not fit side by side as {name!r}")
        return shape

    def read(self, name: str) -> np.ndarray:
        """f32 values of one tensor in torch's layout (attn_q / attn_k un-permuted, see the module docstring)."""
        return gguf_moe.join(self.architecture, name, [self._read_one(t) for t in self._tensors[name]])

    def _read_one(self, t) -> np.ndarray:
        import gguf

        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))  # ggml's dims reversed
        arch = self.architecture
        if arch != "llama":  # llama.cpp permutes only a llama's q and k (LlamaModel); gemma's norms are 1 + w
            return values - 1 if arch in GEMMA and t.name.endswith("norm.weight") else values
        if ".attn_q." in t.name:
            values = unpermute_rotary(values, self.meta_int(f"{arch}.attention.head_count"))
        elif ".attn_k." in t.name:
            heads = self.meta_int(f"{arch}.attention.head_count")
            values = unpermute_rotary(values, self.meta_int(f"{arch}.attention.head_count_kv", heads))
        return values

    def origin(self, name: str) -> str:
        parts = " + ".join(f"{t.name}, {t.tensor_type.name}" for t in self._tensors[name])
        return f"{os.path.basename(self.where)} ({parts})"

    def close(self) -> None:
        self._tensors, self._reader = {}, None  # drops the memory map

    # ------------------------------------------------------------------ tokenizer
    def tokenizer(self):
        """A `tokenizers.Tokenizer` rebuilt from the metadata, as transformers' GGUF conversion
        builds it for `tokenizer.ggml.model = gpt2` (byte-level BPE)."""
        model = self.meta("tokenizer.ggml.model", None)
        if model != "gpt2":
            raise GGUFTokenizerError(f"GGUF file {self.where!r}: tokenizer.ggml.model {model!r} is not supported "
                                     "(kvjax rebuilds only 'gpt2', byte-level BPE)")
        pre = self.meta_str("tokenizer.ggml.pre", "gpt2")
        if pre not in PRE_SPLITS:
            raise GGUFTokenizerError(f"GGUF file {self.where!r}: tokenizer.ggml.pre {pre!r} is not one kvjax "
                                     f"reproduces ({', '.join(PRE_SPLITS)})")
        tokens = self.meta_list("tokenizer.ggml.tokens", str)
        vocab = self.meta_int(f"{self.architecture}.vocab_size", None)
        if vocab is not None and len(tokens) > vocab:
            raise GGUFFormatError(f"GGUF file {self.where!r}: tokenizer.ggml.tokens lists {len(tokens)} tokens, more "
                                  f"than the model's {self.architecture}.vocab_size {vocab}")
        merges = self.meta_list("tokenizer.ggml.merges", str)
        for i, merge in enumerate(merges):
            if len(merge.split(" ")) != 2:
                raise self._bad(f"tokenizer.ggml.merges[{i}]", "two tokens separated by one space", merge)
        types = self.meta_list("tokenizer.ggml.token_type", int, [1] * len(tokens))
        if len(types) != len(tokens):
            raise GGUFFormatError(f"GGUF file {self.where!r}: tokenizer.ggml.token_type has {len(types)} entries for "
                                  f"{len(tokens)} tokens")
        ids = self.special_ids()
        # transformers passes these four to the tokenizer as its bos/eos/unk/pad tokens, which makes them special.
        specials = sorted({i for i in ids.values() if i is not None})
        add_bos = self.meta_bool("tokenizer.ggml.add_bos_token", False)
        add_eos = self.meta_bool("tokenizer.ggml.add_eos_token", False)
        try:
            return byte_level_bpe(tokens, merges, types, PRE_SPLITS[pre], special_ids=specials,
                                  bos_id=ids["bos"] if add_bos else None, eos_id=ids["eos"] if add_eos else None)
        except Exception as e:  # the tokenizers library raises a plain Exception ("Token `x` out of vocabulary")
            raise GGUFTokenizerError(f"GGUF file {self.where!r}: its tokenizer cannot be built from "
                                     f"tokenizer.ggml.tokens and tokenizer.ggml.merges: {one_line(e)[:200]}") from None


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """A GGUF tensor name → its Hugging Face name; a name outside the table is kept as it is
    (models.loader then refuses it as a tensor the model does not use, by that name)."""
    base, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return gguf_name
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = GEMMA_BLOCK_NAMES if architecture in GEMMA else BLOCK_NAMES
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{suffix}"
    return (match and gguf_moe.block_name(match.group(1), f"{match.group(2)}.{suffix}", architecture)) or gguf_name


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` of a q or k projection f32[n_heads × H, ...].

    llama.cpp stores row i of each head's first half and row i of its second half next to
    each other (rows (h, 2, H/2) → (h, H/2, 2)); this swaps them back."""
    h = w.shape[0] // n_heads
    return w.reshape(n_heads, h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def _open_reader(path: str):
    """gguf.GGUFReader(path), with what can go wrong named: a missing file, wrong magic, a
    truncated or corrupt file, a tensor type the library does not know."""
    import gguf

    try:
        check_input_file(path, "GGUF file")  # a folder, FIFO or device is refused, never opened
    except KvjaxError as e:
        raise GGUFFormatError(str(e)) from None
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != MAGIC:
        raise GGUFFormatError(f"{path!r} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf library's reader raises whatever its parse hits: convert at this boundary
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(e))  # "np.uint32(99) is not ..."
        if unknown:
            raise GGUFTensorTypeError(f"GGUF file {path!r} has a tensor of ggml type {unknown.group(1)}, which gguf "
                                      f"{_version()} does not know") from None
        # The reader maps the file and slices it where the header says; past the end of a cut-off
        # file it gets short arrays, and a reshape or an index fails.
        raise GGUFFormatError(f"GGUF file {path!r} ({size:,} bytes) is truncated or corrupt: the reader failed "
                              f"with {type(e).__name__}: {e}") from None


def _field_value(field) -> Any:
    """A ReaderField's value, read from its parts, data indices and types as transformers'
    `_gguf_parse_value` does (`ReaderField.contents()` arrived only in gguf 0.16)."""
    from gguf import GGUFValueType

    def scalar(part, kind):
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        return bool(value) if kind == GGUFValueType.BOOL else value

    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def _dequantizable(qtype) -> bool:
    """Whether gguf.quants.dequantize implements `qtype`: asked of one zero block of it."""
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    is_float = qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    probe = np.zeros((1, block), {4: np.float32, 2: np.float16}[type_size]) if is_float else \
        np.zeros((1, type_size), np.uint8)
    try:
        gguf.quants.dequantize(probe, qtype)
    except NotImplementedError:
        return False
    return True


def _version() -> str:
    from importlib.metadata import version

    return version("gguf")
