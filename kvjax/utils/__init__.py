"""Helpers that vLLM keeps in `vllm/utils/` and user scripts import from there.

`argparse_utils.FlexibleArgumentParser` is vLLM's command-line parser (`from
kvjax.utils.argparse_utils import FlexibleArgumentParser`, as vLLM's examples import it from
`vllm.utils.argparse_utils`); it is also importable from `kvjax.utils`, as older vLLM scripts
import it from `vllm.utils`. Standard library only: importing it loads no JAX.
"""
from kvjax.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
