"""Reading input files: a prompts file, trace, config, tokenizer or scales file is checked and read
here, so that every reader refuses the same things the same way.

A file must exist, be a regular file (a folder, a FIFO or a device is refused by stat, never
opened), be readable, be at most `MAX_INPUT_BYTES`, and be UTF-8 text where text is read (the error
says which line is not). Each refusal is a KvjaxError (or InputFileError, naming the file and line)
from kvjax.errors. JSON files are read by kvjax.utils.strict_json on top of these.
"""
from __future__ import annotations

import os
import stat

from kvjax.errors import InputFileError, KvjaxError

MAX_INPUT_BYTES = 2**30  # a prompts file, trace, config or scales file larger than 1 GiB is refused


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
