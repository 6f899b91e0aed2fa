"""`kvjax` subcommands that run models. Part of the command line: unlike the library core, these
modules import both `kvjax` and `models`. Each has add_parser(subparsers) and run(args) -> int.

What every command shares lives here, so that a flag reads and means the same everywhere:
- flag types with vLLM's engine-arg parsing (`human_int_arg`: vLLM's human_readable_int, so
  `--kv-cache-memory-bytes 4G` is 4 GiB and `4g` 4·10⁹; `kv_cache_dtype_arg`: "auto" = the
  model's dtype, or a kv dtype kvjax stores; --dtype: vLLM's names, `model_dtype` kvjax's dtype);
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

from kvjax.engine.cli_args import human_int_arg, kv_cache_dtype_arg  # noqa: F401 (the commands' flag types)
from kvjax.engine.arg_utils import MODEL_DTYPES
from kvjax.errors import UsageError, check_output_file

PLOT_EXTENSIONS = (".png", ".svg", ".pdf")


# --------------------------------------------------------------------------------------------
# Flag types (the engine's own: kvjax.engine.cli_args)
# --------------------------------------------------------------------------------------------
MODEL_HELP = "small-gqa | small-mla | smollm2-135m | a Hugging Face folder | PATH.gguf | preset:NAME (random weights)"


def add_model_flags(p) -> None:
    """--model (required) and --dtype, as every command that loads a model takes them."""
    p.add_argument("--model", required=True, help=MODEL_HELP)
    add_dtype_flag(p)


def add_dtype_flag(p) -> None:
    """vLLM's --dtype, from the engine's flag table: its value is vLLM's name ("auto", "half", ...);
    `model_dtype(args)` is kvjax's model dtype (None for auto)."""
    from kvjax.engine.cli_args import FLAGS

    flags, kwargs = FLAGS["dtype"]
    p.add_argument(*flags, dest="dtype", **kwargs)


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
