"""The byte-level BPE of a GGUF file's `tokenizer.ggml.model = gpt2`, rebuilt with the `tokenizers` library.

models.gguf.GGUFFile.tokenizer reads the file's tokens, merges, token types, special ids and
`tokenizer.ggml.pre`, and `byte_level_bpe` builds from them the tokenizer transformers' GGUF
conversion builds (`integrations/gguf/gguf_tokenizer_mapping.py`: `byte_level_tokenizer`,
`add_gguf_special_tokens`, `set_split_regex`), so that ids equal
`AutoTokenizer.from_pretrained(folder, gguf_file=name)`'s. `PRE_SPLITS` holds the pre-tokenizer
splits reproduced here, by `tokenizer.ggml.pre` name.
"""
from __future__ import annotations

# Pre-tokenizer splits of `tokenizer.ggml.pre`, as transformers' GGUF_PRE_TOKENIZER_SPLITS has
# them. A name transformers does not list gets GPT-2's ByteLevel regex there; of those, kvjax
# accepts only the two checked against transformers. (llama.cpp itself splits "smollm" text
# with `\p{N}` first — each digit alone —, which transformers' conversion does not.)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS: dict[str, str | None] = {
    "gpt2": None, "smollm": None,  # None: GPT-2's ByteLevel regex
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)


def byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int], split: str | None, *,
                   special_ids: list[int] = (), bos_id: int | None = None, eos_id: int | None = None):
    """transformers' GGUF byte-level BPE (`byte_level_tokenizer`, `add_gguf_special_tokens`,
    `set_split_regex`, GPT2Tokenizer's pre-tokenizer and decoder) on the `tokenizers` library.

    Tokens outside the byte alphabet are respelled byte by byte; control tokens (type 3) and the
    bos/eos/unk/pad tokens are special added tokens, user-defined ones (type 4) plain added
    tokens; split None is GPT-2's ByteLevel regex, else that regex, then ByteLevel without one."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips it.
    special = [i for i, t in enumerate(token_types) if t == CONTROL and set(tokens[i]) <= alphabet]
    special += [i for i in special_ids if i not in special]
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in special])
    user = [t for t, kind in zip(tokens, token_types) if kind == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    if bos_id is not None or eos_id is not None:  # tokenizer.ggml.add_bos_token / add_eos_token
        pre = [] if bos_id is None else [(tokens[bos_id], bos_id)]
        post = [] if eos_id is None else [(tokens[eos_id], eos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=[t for t, _ in pre] + ["$A"] + [t for t, _ in post], special_tokens=pre + post)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (every byte-level BPE vocabulary is spelled in it)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:  # unprintable bytes and space take the code points from 256 on
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
