"""Writing an output file: the path checked before any work, the file written atomically.

Before any work (`check_output_file`): the file's folder exists and is writable, the path is not a
folder, a FIFO or a device, so that a refused command has written nothing.

Every output is then written by `write_file` (`write_text`, `write_json`, `save_figure`): to a
temporary file beside the target, renamed into place only when complete, so that a failure while
writing (a full disk) is one line and leaves the old file, or none, and no partial one; a symlink
at the name is replaced, never followed. JSON is kvjax.utils.strict_json's `dumps` (strict: NaN and
±Infinity as null); figures come from kvjax.utils.plotting's `pyplot()`. Several files committed
together: kvjax.utils.output_folders. A failure is an OutputPathError (kvjax.errors).
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import IO, Any, Iterator

from kvjax.errors import OutputPathError
from kvjax.utils.input_files import file_kind
from kvjax.utils.strict_json import dumps


def check_output_file(path: str | os.PathLike, flag: str) -> str:
    """An output file that `write_file` can write, checked before any work: the path is not a
    folder, a FIFO or a device (a symlink is fine: write_file replaces it), and its folder exists
    and takes a new file (a probe file, removed at once). Nothing is created at the path itself,
    so a command refused later leaves nothing behind."""
    path = nonempty_path(path, flag)
    replaced_mode(path, flag)
    folder = os.path.realpath(os.path.dirname(path) or ".")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise OutputPathError(f"{flag} {path!r}: {folder!r} is a file, not a folder")
    if not os.path.isdir(folder):
        raise OutputPathError(f"{flag} {path!r}: the folder {folder!r} does not exist")
    probe_folder(folder, f"{flag} {path!r} cannot be written")
    return path


def replaced_mode(path: str, flag: str) -> int | None:
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


def nonempty_path(path: str | os.PathLike, flag: str) -> str:
    """The path as a string; an empty one is an OutputPathError naming `flag`."""
    path = os.fspath(path)
    if not path:
        raise OutputPathError(f"{flag} is an empty path")
    return path


def probe_folder(folder: str, refusal: str) -> None:
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
    mode = replaced_mode(path, flag)
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
