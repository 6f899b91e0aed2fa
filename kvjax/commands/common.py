"""`kvjax` subcommands that run models. Part of the command line: unlike the library core, these
modules import both `kvjax` and `models`. Each has add_parser(subparsers) and run(args) -> int.

What every command shares lives here, so that a flag reads and means the same everywhere:
- the engine's flags come from its one table (kvjax.engine.cli_args.add_engine_flags: vLLM's
  names and parsing, e.g. `--kv-cache-memory-bytes 4G` is 4 GiB and `4g` 4·10⁹); `add_model_flags`
  adds --model and --dtype as every command that loads a model takes them, and `model_dtype` is
  kvjax's dtype for vLLM's --dtype name;
- `check_plot_file`: a --plot path matplotlib writes as given (.png, .svg, .pdf), checked
  before any work;
- `progress_enabled`: whether a command draws its progress bar (kvjax.progress.Phases) on
  stderr: when stderr is a terminal (as git draws its progress) and never with --no-progress, so
  that a script reading stderr sees exactly the one error line of the bad-input contract.

Nothing here imports JAX: `kvjax plan` and `kvjax tables` import this module and start at once.
"""
from __future__ import annotations

import os
import sys

from kvjax.engine.arg_utils import MODEL_DTYPES
from kvjax.engine.cli_args import add_engine_flags
from kvjax.errors import UsageError
from kvjax.utils.output_files import check_output_file

PLOT_EXTENSIONS = (".png", ".svg", ".pdf")


# --------------------------------------------------------------------------------------------
# Model flags (the engine's own: kvjax.engine.cli_args)
# --------------------------------------------------------------------------------------------
def add_model_flags(p) -> None:
    """--model (required) and vLLM's --dtype, from the engine's flag table, as every command that
    loads a model takes them: --dtype's value is vLLM's name ("auto", "half", ...),
    `model_dtype(args)` kvjax's model dtype (None for auto)."""
    add_engine_flags(p, ("model", "dtype"), None, required=("model",))


def model_dtype(args) -> str | None:
    """The model dtype a command's --dtype names (None: the checkpoint's)."""
    return MODEL_DTYPES[args.dtype.lower()]


def check_plot_file(path: str, flag: str = "--plot") -> str:
    """A plot path that matplotlib writes as named: its extension picks the format (.png, .svg,
    .pdf; matplotlib would append .png to a name without one), and its folder is writable.
    Checked before any work."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in PLOT_EXTENSIONS:
        raise UsageError(f"{flag} {path!r}: the file name must end in {', '.join(PLOT_EXTENSIONS)} "
                         "(its extension picks the plot's format)")
    return check_output_file(path, flag)


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------
def add_progress_flag(p) -> None:
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr (bars are drawn only when stderr is a terminal)")


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def progress_enabled(args) -> bool:
    """Whether the command draws progress bars: not --no-progress, and stderr is a terminal."""
    return not getattr(args, "no_progress", False) and stderr_is_terminal()
