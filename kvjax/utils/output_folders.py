"""Output folders: checked before any work, and several outputs committed together through a
staging folder, so that a run that fails midway leaves the previous run's files whole.

Each file in the folder is written by kvjax.utils.output_files (atomically, a symlink at its name
replaced, never followed); a failure is an OutputPathError (kvjax.errors).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from kvjax.errors import OutputPathError
from kvjax.utils.output_files import nonempty_path, probe_folder, replaced_mode


def check_output_dir(path: str | os.PathLike, flag: str) -> str:
    """An output folder that exists and is writable, or can be created: its nearest existing
    ancestor is a folder (not a file) in which a file can be created (and is removed again)."""
    path = nonempty_path(path, flag)
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OutputPathError(f"{flag} {path!r}: {probe!r} is a file, not a folder")
    probe_folder(probe, f"{flag} {path!r}: {probe!r} is not writable")
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
        modes[rel] = replaced_mode(os.path.join(out, rel), flag)
    try:
        for src, rel in moves:
            os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
            if modes[rel] is not None:
                os.chmod(src, modes[rel])
            os.replace(src, os.path.join(out, rel))
    except OSError as e:
        raise OutputPathError(f"{flag} {out!r}: moving the outputs into place failed: {e.strerror or e}") from None
