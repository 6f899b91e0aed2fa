"""The bad-input contract: kvjax's own error types.

Every rule a user's input can break raises a `KvjaxError` whose message names the value (flag,
file and line) and the rule. The command line (kvjax.commands.main.main) turns one into a single stderr
line `kvjax CMD: error: ...` and exit status 2; any other exception is a bug and keeps its
traceback. The library's specific errors (SpecError, LLMError, CheckpointError, ...) are
subclasses, and every `KvjaxError` is a ValueError, so Python callers can catch either.

What is checked before any work, so that a refused command has written nothing, and where:
- numbers: finite, and within limits that follow from int32 indexing and from memory
  (kvjax.utils.checks);
- files: exists, is a file, is UTF-8 (the error says which line is not) (kvjax.utils.input_files),
  JSON nested at most kvjax.utils.strict_json.MAX_JSON_DEPTH deep with finite numbers only;
- outputs: the file's folder exists and is writable, the path is not a folder (kvjax.utils.output_files)
  (or, for an output folder, the nearest existing ancestor is a writable folder: kvjax.utils.output_folders).

Outputs are then written atomically (kvjax.utils.output_files), several together through a staging
folder (kvjax.utils.output_folders), so that a failure while writing is one line too.
"""
from __future__ import annotations

import os


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
