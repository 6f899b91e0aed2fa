"""The bad-input contract: kvjax's own error types and the checks every reader and command shares.

Every rule a user's input can break raises a `KvjaxError` whose message names the value (flag,
file and line) and the rule. The command line (kvjax.commands.main.main) turns one into a single stderr
line `kvjax CMD: error: ...` and exit status 2; any other exception is a bug and keeps its
traceback. The library's specific errors (SpecError, LLMError, CheckpointError, ...) are
subclasses, and every `KvjaxError` is a ValueError, so Python callers can catch either.

What is checked before any work, so that a refused command has written nothing:
- numbers: finite, and within limits that follow from int32 indexing (token ids, positions,
  slots and block ids are int32 on the device) and from memory (`MAX_GIB`);
- files: exists, is a file, is UTF-8 (the error says which line is not), JSON nested at most
  `MAX_JSON_DEPTH` deep with finite numbers only;
- outputs: the file's folder exists and is writable, the path is not a folder (or, for an output
  folder, the nearest existing ancestor is a writable folder).

Every output is then written by `write_file` (`write_text`, `write_json`, `save_figure`): to a
temporary file beside the target, renamed into place only when complete, so that a failure while
writing (a full disk) is one line and leaves the old file, or none, and no partial one; a symlink
at the name is replaced, never followed. Several files are committed together (`output_folder`);
JSON is `dumps`'s (strict: NaN and ±Infinity as null); plots come from `pyplot()`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import numbers
import os
import shutil
import stat
import tempfile
from typing import IO, Any, Iterator

INT32_MAX = 2**31 - 1  # device indices (tokens, positions, slots, blocks) are int32
MAX_SEED = 2**32 - 1  # seeds are uint32: jax.random.key(seed) keeps 32 bits
MAX_GIB = 2**20  # 1 PiB: far above any device or host, far below float overflow
MAX_JSON_DEPTH = 32  # the deepest any kvjax file nests is 3 (a scales file's per-layer lists)
MAX_INPUT_BYTES = 2**30  # a prompts file, trace, config or scales file larger than 1 GiB is refused


class KvjaxError(ValueError):
    """Bad input: the message names the value and the rule it broke (exit status 2 on the CLI)."""


class UsageError(KvjaxError):
    """A command-line flag, or a combination of flags, that breaks a rule."""


class InputFileError(KvjaxError):
    """A file's content breaks a rule; the message starts with `path:line:` when a line is known."""

    def __init__(self, path: str | os.PathLike, message: str, line: int | None = None):
        self.path, self.line = os.fspath(path), line
        super().__init__(f"{self.path}:{line}: {message}" if line is not None else f"{self.path}: {message}")


class OutputPathError(UsageError):
    """An output path that cannot be written: checked before any work starts."""


def require(cond, msg: str) -> None:
    """An invariant check (a kvjax bug if it fails, never bad input): AssertionError(msg)
    unless cond. Not `assert`, so that the checks also run under python -O."""
    if not cond:
        raise AssertionError(msg)


def one_line(message: str) -> str:
    """The message on one line (the contract promises exactly one stderr line)."""
    return " ".join(str(message).split())


# --------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------
def is_int(value: Any) -> bool:
    """A Python or NumPy integer, not a bool: what check_int accepts."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value: Any, name: str, lo: int = 0, hi: int | None = INT32_MAX, error: type = None) -> int:
    """An integer (a Python or NumPy int; not a bool, not a float) in [lo, hi] (hi None: no upper
    bound) as a Python int, else a KvjaxError (or `error`, a subclass) naming `name`. The one
    integer guard: "n must be an integer in [1, 16384], got 0", "block_size must be a positive
    integer, got 0"."""
    error = error or KvjaxError
    ok = is_int(value)
    if hi is None:
        if not ok or value < lo:
            rule = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")
            raise error(f"{name} must be {rule}, got {_show(value)}")
    elif not ok or not lo <= value <= hi:
        raise error(f"{name} must be an integer in [{lo}, {hi}], got {_show(value)}")
    return int(value)


def int_arg(lo: int = 1, hi: int = INT32_MAX):
    """An argparse `type` for an integer flag in [lo, hi] (argparse names the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {_clip(text)}")
        return value
    return parse


def float_arg(lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False):
    """An argparse `type` for a finite float flag in [lo, hi] (or (lo, hi] with lo_open)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {_clip(text)}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"must be finite, got {_clip(text)}")
        if not (lo < x if lo_open else lo <= x) or not x <= hi:
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {_clip(text)}")
        return x
    return parse


def _clip(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------------------------
# Input files
# --------------------------------------------------------------------------------------------
def file_kind(mode: int) -> str:
    """What a stat mode names, for messages: "a folder", "a FIFO (named pipe)", "a device", ..."""
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _regular(path: str, what: str) -> None:
    """Refuse, by stat and without opening it, anything but a regular file: opening a FIFO blocks
    until a writer comes, and a device such as /dev/zero reads without end."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = file_kind(mode)
        raise KvjaxError(f"{what} {path!r} is {kind}, not a file" if kind == "a folder" else
                         f"{what} {path!r} is {kind}, not a regular file")


def read_bytes(path: str | os.PathLike, what: str) -> bytes:
    """A regular file's bytes, at most MAX_INPUT_BYTES (read with that bound, so it holds whatever
    the size says); a missing file, a folder, a FIFO or device, an unreadable or oversized file
    raise naming it."""
    path = os.fspath(path)
    try:
        _regular(path, what)
        with open(path, "rb") as fh:
            data = fh.read(MAX_INPUT_BYTES + 1)
        if len(data) > MAX_INPUT_BYTES:
            raise InputFileError(path, f"{what} is larger than {MAX_INPUT_BYTES // 2**20} MiB")
        return data
    except FileNotFoundError:
        raise KvjaxError(f"{what} {path!r} does not exist") from None
    except IsADirectoryError:
        raise KvjaxError(f"{what} {path!r} is a folder, not a file") from None
    except OSError as e:
        raise KvjaxError(f"{what} {path!r} cannot be read: {e.strerror or e}") from None


def check_input_file(path: str | os.PathLike, what: str) -> str:
    """An input file that exists and can be read, checked before any work (read later)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise KvjaxError(f"{what} {path!r} does not exist")
    _regular(path, what)
    if not os.access(path, os.R_OK):
        raise KvjaxError(f"{what} {path!r} cannot be read")
    return path


def decode_utf8(data: bytes, path: str | os.PathLike, what: str) -> str:
    """UTF-8 text, or an InputFileError naming the line and column of the first bad byte. A leading
    byte-order mark (Windows editors write one) is no part of the text: dropped, as "utf-8-sig"
    reads, so that it becomes no prompt token and no JSON error."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise InputFileError(path, f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x} at column {col})",
                             line) from None


def read_text(path: str | os.PathLike, what: str) -> str:
    """A UTF-8 text file (see read_bytes and decode_utf8 for what is refused)."""
    return decode_utf8(read_bytes(path, what), path, what)


def loads(text: str) -> Any:
    """One JSON value: valid JSON, nested at most MAX_JSON_DEPTH deep, finite numbers only
    (NaN, Infinity and 1e400 are refused rather than read as floats no rule can check).
    A KvjaxError says what is wrong; parse_json adds the file and line."""
    def bad_number(token: str):
        raise KvjaxError(f"the number {_clip(token)} is not finite (JSON numbers must be)")

    def parse_float(token: str) -> float:
        x = float(token)
        return x if math.isfinite(x) else bad_number(token)

    def parse_int(token: str) -> int:
        if len(token) > 19:  # beyond int64: no kvjax value is that large (and Python caps int() at 4300 digits)
            raise KvjaxError(f"the integer {_clip(token, 20)} has more than 64 bits")
        return int(token)

    try:
        obj = json.loads(text, parse_constant=bad_number, parse_float=parse_float, parse_int=parse_int)
    except RecursionError:
        raise KvjaxError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise KvjaxError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if _depth(obj) > MAX_JSON_DEPTH:
        raise KvjaxError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return obj


def dumps(obj: Any, indent: int | None = None, default=None, **kw) -> str:
    """`obj` as strict JSON, the one JSON writer of every command and experiment (--json, write_json).
    JSON has no NaN or Infinity (Python's json writes literals that jq or JavaScript refuse): every
    non-finite float, Python's or NumPy's, becomes null. NumPy scalars and arrays become numbers and
    lists; any other object goes through `default` (its result mapped the same way), else TypeError.
    kw go to json.dumps (sort_keys, ...), always with allow_nan=False, so nothing slips past."""
    return json.dumps(_finite(obj, default), indent=indent, allow_nan=False, **kw)


def _finite(value: Any, default=None) -> Any:
    """`value` with non-finite floats as None and NumPy values as Python ones (see dumps)."""
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v, default) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, default) for v in value]
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":  # a NumPy scalar or array
        return _finite(value.tolist(), default)
    if default is not None:
        return _finite(default(value), default)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def parse_json(text: str, path: str | os.PathLike, what: str, line: int | None = None) -> Any:
    """loads(text), its error an InputFileError naming the file (and line, for JSON lines)."""
    try:
        return loads(text)
    except KvjaxError as e:
        raise InputFileError(path, f"{what}: {e}", line) from None


def _depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, d = stack.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def read_json(path: str | os.PathLike, what: str) -> Any:
    """A JSON file (see parse_json for what is refused)."""
    return parse_json(read_text(path, what), path, what)


def read_json_object(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """A JSON file that must hold an object."""
    obj = read_json(path, what)
    if not isinstance(obj, dict):
        raise InputFileError(path, f"{what} holds a JSON {json_type(obj)}, not an object")
    return obj


def read_jsonl(path: str | os.PathLike, what: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) for each non-blank line of a JSON-lines file."""
    for n, line in enumerate(read_text(path, what).split("\n"), 1):  # not splitlines: U+2028 is no line end
        if line.strip():
            yield n, parse_json(line, path, what, n)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages ("array", "null", ...)."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------------------------
# Output paths
# --------------------------------------------------------------------------------------------
def check_output_file(path: str | os.PathLike, flag: str) -> str:
    """An output file that `write_file` can write, checked before any work: the path is not a
    folder, a FIFO or a device (a symlink is fine: write_file replaces it), and its folder exists
    and takes a new file (a probe file, removed at once). Nothing is created at the path itself,
    so a command refused later leaves nothing behind."""
    path = _nonempty(path, flag)
    _old_mode(path, flag)
    folder = os.path.realpath(os.path.dirname(path) or ".")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise OutputPathError(f"{flag} {path!r}: {folder!r} is a file, not a folder")
    if not os.path.isdir(folder):
        raise OutputPathError(f"{flag} {path!r}: the folder {folder!r} does not exist")
    _probe(folder, f"{flag} {path!r} cannot be written")
    return path


def _old_mode(path: str, flag: str) -> int | None:
    """The permission bits of the regular file at `path`, which an output replaces; None when
    there is none, or a symlink (replaced itself, its target never touched). A folder, a FIFO
    (opening it would block) or a device is never replaced: OutputPathError."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # no such file, or a folder on the way that is none: the folder checks say which
        return None
    if stat.S_ISLNK(mode):
        return None
    if stat.S_ISDIR(mode):
        raise OutputPathError(f"{flag} {path!r} is a folder; give a file name")
    if not stat.S_ISREG(mode):
        raise OutputPathError(f"{flag} {path!r} is {file_kind(mode)}, not a regular file")
    return stat.S_IMODE(mode)


def _nonempty(path: str | os.PathLike, flag: str) -> str:
    path = os.fspath(path)
    if not path:
        raise OutputPathError(f"{flag} is an empty path")
    return path


def _probe(folder: str, refusal: str) -> None:
    """A file can be created in folder (a probe file, removed at once), else OutputPathError."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OutputPathError(f"{refusal}: {e.strerror or e}") from None


@contextlib.contextmanager
def write_file(path: str | os.PathLike, flag: str, binary: bool = False) -> Iterator[IO]:
    """Open an output for writing, atomically: the caller writes to a temporary file beside the
    target, which replaces the target (os.replace) only when everything was written and synced.
    A write that fails (a full disk, a quota, a file-size limit) or any exception leaves the
    target as it was and no temporary file behind; an OSError becomes one OutputPathError
    naming `flag` and the path. A symlink at the path is replaced by the new file, never
    followed: a link planted in an output folder cannot send a write outside it (the folders
    above the name are the caller's path, followed as given). A new file gets the usual mode
    (0666 less the umask), a replaced regular file keeps its mode."""
    path = os.fspath(path)
    mode = _old_mode(path, flag)
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.",
                                   suffix=".part")
    except OSError as e:
        raise OutputPathError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask() if mode is None else mode)
        os.replace(tmp, path)  # rename(2) replaces the name: a symlink there goes, its target stays
    except OSError as e:
        raise OutputPathError(f"{flag} {path!r}: writing failed: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: str | os.PathLike, text: str, flag: str) -> None:
    """`text` as the file at `path` (see write_file)."""
    with write_file(path, flag) as fh:
        fh.write(text)


def write_json(path: str | os.PathLike, obj: Any, flag: str, indent: int | None = 2, **kw) -> None:
    """`obj` as a JSON file at `path` (see write_file), written by `dumps` (strict JSON: NaN and
    ±Infinity as null); kw go to dumps."""
    write_text(path, dumps(obj, indent=indent, **kw) + "\n", flag)


def save_figure(fig, path: str | os.PathLike, flag: str, **kw) -> None:
    """A matplotlib figure at exactly `path`, its format from the extension (see write_file);
    kw go to savefig."""
    ext = os.path.splitext(os.fspath(path))[1].lower().lstrip(".") or "png"
    with write_file(path, flag, binary=True) as fh:
        fig.savefig(fh, format=ext, **kw)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output_dir(path: str | os.PathLike, flag: str) -> str:
    """An output folder that exists and is writable, or can be created: its nearest existing
    ancestor is a folder (not a file) in which a file can be created (and is removed again)."""
    path = _nonempty(path, flag)
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OutputPathError(f"{flag} {path!r}: {probe!r} is a file, not a folder")
    _probe(probe, f"{flag} {path!r}: {probe!r} is not writable")
    return path


@contextlib.contextmanager
def output_folder(out: str | os.PathLike, flag: str = "--out") -> Iterator[str]:
    """Several outputs committed together: yields a new staging folder for the command's files; when
    the block ends without an exception they are renamed into `out` (created if need be), else the
    staging folder goes and `out` keeps the previous run's files whole (no new plot beside an old
    REPORT.md). The staging folder (`.kvjax-staging-*`) lies inside `out`, so the renames never cross
    a filesystem. Every name is checked before the first move: a symlink at a file's name is replaced,
    never followed; a symlinked folder between `out` and a file is refused, naming it (it could lead
    outside `out`); `out` itself may be a symlink, the user's own path. Replaced files keep their mode."""
    out = os.fspath(out)
    created = not os.path.lexists(out)
    try:
        os.makedirs(out, exist_ok=True)
        stage = tempfile.mkdtemp(dir=out, prefix=".kvjax-staging-")
    except OSError as e:
        raise OutputPathError(f"{flag} {out!r} cannot be written: {e.strerror or e}") from None
    try:
        yield stage
        _commit(stage, out, flag)
    except BaseException as e:
        if created:
            shutil.rmtree(out, ignore_errors=True)  # made for this run, it holds nothing else
        if isinstance(e, OutputPathError):  # the file named as the user knows it, not its staging copy
            raise OutputPathError(str(e).replace(os.path.join(stage, ""), os.path.join(out, ""))) from None
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _commit(stage: str, out: str, flag: str) -> None:
    """Move every file under `stage` to the same relative name under `out` (see output_folder)."""
    moves = [(os.path.join(folder, name), os.path.relpath(os.path.join(folder, name), stage))
             for folder, _, names in os.walk(stage) for name in sorted(names)]
    modes = {}
    for _, rel in moves:  # every check before the first move: a refusal leaves `out` as it was
        parts = rel.split(os.sep)
        for i in range(1, len(parts)):
            above = os.path.join(out, *parts[:i])
            if os.path.islink(above):
                raise OutputPathError(f"{flag} {out!r}: {above!r} is a symlink; kvjax writes only inside {flag}")
        modes[rel] = _old_mode(os.path.join(out, rel), flag)
    try:
        for src, rel in moves:
            os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
            if modes[rel] is not None:
                os.chmod(src, modes[rel])
            os.replace(src, os.path.join(out, rel))
    except OSError as e:
        raise OutputPathError(f"{flag} {out!r}: moving the outputs into place failed: {e.strerror or e}") from None


# --------------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------------
def cache_dir() -> str:
    """kvjax's cache folder: $KVJAX_CACHE, else $XDG_CACHE_HOME/kvjax, else ~/.cache/kvjax."""
    return os.environ.get("KVJAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvjax")


def pyplot():
    """matplotlib.pyplot on the Agg backend, the one way kvjax imports matplotlib: its config and font
    cache go to cache_dir()/matplotlib (kvjax's one cache folder, ~/.cache/kvjax unless KVJAX_CACHE or
    XDG_CACHE_HOME says otherwise), not to matplotlib's own ~/.matplotlib or ~/.config/matplotlib,
    unless the user set MPLCONFIGDIR (read when matplotlib is first imported)."""
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(cache_dir(), "matplotlib"))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
