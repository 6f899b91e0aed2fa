"""Helpers that vLLM keeps in `vllm/utils/` and user scripts import from there, and kvjax's own
helpers for checking arguments, reading input and writing output, one concept per module:

    checks          integer and float argument checks, for the library and as argparse types
    input_files     reading an input file: a regular file, bounded in size, UTF-8 text
    strict_json     strict JSON, read (depth-bounded, finite numbers) and written (NaN as null)
    output_files    an output file checked before the work, then written atomically
    output_folders  an output folder checked before the work; several outputs committed together
    cache_folder    kvjax's one cache folder
    plotting        matplotlib, set up the one way kvjax uses it
    atomic          engine calls that complete or do not start (Ctrl-C held back, callers serialised)
    xla_flags       XLA flags for the decode loop on a GPU (KVJAX_XLA_FLAGS=1)

`argparse_utils.FlexibleArgumentParser` is vLLM's command-line parser (`from
kvjax.utils.argparse_utils import FlexibleArgumentParser`, as vLLM's examples import it from
`vllm.utils.argparse_utils`); it is also importable from `kvjax.utils`, as older vLLM scripts
import it from `vllm.utils`. Standard library only: importing it loads no JAX. The error types
these raise are kvjax.errors's.
"""
from kvjax.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
