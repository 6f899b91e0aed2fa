"""The text the small models learn from: the Python standard library's own source, as bytes.

It is real text that every machine with Python has offline. Files: every `*.py` under the
running interpreter's stdlib folder, except `site-packages`, test suites (`test/`, `tests/`,
`idle_test/`) and files over 256 KiB, sorted by path. The held-out split is fixed by a hash
of each file's path relative to the stdlib folder (crc32 % 20 == 0, about 5% of files), so it
does not depend on the Python version's file list order. Tokens are bytes (vocab 256).

Because the stdlib differs between Python versions, the held-out text the accuracy experiment
reads and the calibration text are shipped in `kvjax/data/` (written by `write_data` from the
stdlib of the Python that trained the shipped models, then copied there), not read from the
local stdlib.
"""
from __future__ import annotations

import os
import sysconfig
import zlib

import numpy as np

from kvjax.data import CALIB, HELDOUT
from kvjax.utils.output_files import write_file

SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
MAX_FILE = 256 * 1024


def stdlib_files(root: str | None = None) -> list[str]:
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and os.path.getsize(path) <= MAX_FILE:
                out.append(os.path.relpath(path, root))
    return sorted(out)


def is_heldout(relpath: str) -> bool:
    return zlib.crc32(relpath.replace(os.sep, "/").encode()) % 20 == 0


def load_split(split: str, root: str | None = None) -> bytes:
    """All files of one split ("train" or "heldout"), each prefixed by a header line, as bytes."""
    root = root or sysconfig.get_paths()["stdlib"]
    parts = []
    for rel in stdlib_files(root):
        if is_heldout(rel) == (split == "heldout"):
            with open(os.path.join(root, rel), "rb") as fh:
                parts.append(b"# file: " + rel.encode() + b"\n" + fh.read())
    return b"\n".join(parts)


def tokens_of(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).astype(np.int32)


def read_tokens(path: str) -> np.ndarray:
    with open(path, "rb") as fh:
        return tokens_of(fh.read())


def write_data(out_dir: str, heldout_bytes: int = 256 * 1024, calib_bytes: int = 64 * 1024) -> tuple[str, str]:
    """Write the first heldout_bytes of the held-out split and calib_bytes of training text into
    out_dir, under the names kvjax/data/ ships them as; returns the two paths."""
    os.makedirs(out_dir, exist_ok=True)
    heldout, calib = (os.path.join(out_dir, os.path.basename(p)) for p in (HELDOUT, CALIB))
    with write_file(heldout, "--out", binary=True) as fh:
        fh.write(load_split("heldout")[:heldout_bytes])
    train = load_split("train")
    start = len(train) // 2  # from the middle of the training split, away from its first files
    with write_file(calib, "--out", binary=True) as fh:
        fh.write(train[start:start + calib_bytes])
    return heldout, calib
