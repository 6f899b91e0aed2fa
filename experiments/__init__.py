"""kvjax's experiments: one script per experiment, each writing JSON + markdown (+ PNG).

Installed as `kvjax.experiments` (`python -m kvjax.experiments.decode_bench`). They write their
results under `--out` (else `$OUT`, else `experiments/results/` in the current directory: the
repository's committed results when run from its root), never into the installed package.
"""
from __future__ import annotations

import importlib
import os
import pathlib
import sys

RESULTS = pathlib.Path("experiments") / "results"


def results_dir(out: str | os.PathLike | None) -> pathlib.Path:
    """The folder an experiment writes to: --out, else $OUT (the GPU machine's), else ./experiments/results."""
    return pathlib.Path(out or os.environ.get("OUT") or RESULTS)


def require(module: str, extra: str, prog: str):
    """Import `module`, or exit 2 with one line naming the pip extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        print(f"{prog}: error: this experiment needs {module}, which kvjax installs only with an extra: "
              f"pip install 'kvjax[{extra}]' (or -e '.[{extra}]' in a checkout)", file=sys.stderr)
        sys.exit(2)
