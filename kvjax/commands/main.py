"""The `kvjax` command line.

    kvjax plan     KV bytes, memory budget → blocks → concurrency (SPEC "The simulator")
    kvjax tables   SPEC Tables 1 and 2 recomputed from the formulas
    kvjax replay   drive the functional block pool from a JSONL trace, one JSON state per op
    kvjax decode | calibrate | accuracy | memory | report   (kvjax.commands.*: these run models)
    kvjax serve    an OpenAI-compatible HTTP server over AsyncLLM (vLLM's `vllm serve`)
    kvjax bench serve   online serving latency and throughput (vLLM's `vllm bench serve`)

Flags take vLLM's engine-arg names wherever vLLM has the concept (--kv-cache-dtype,
--gpu-memory-utilization, --num-gpu-blocks-override, --kv-cache-memory-bytes,
--enable-prefix-caching, --max-num-seqs, --max-model-len, --tensor-parallel-size / -tp, ...),
one name per concept in every command; kvjax's own flags keep kvjax names (--scales,
--steps-per-call, --device-memory-gib, ...). A flag's old kvjax name is refused with one line
naming the new one (`RENAMED`). With --json every command prints JSON (replay: one object a line),
strict JSON from kvjax.utils.strict_json.dumps: a NaN or infinite number is null, never a NaN literal.

Bad input exits with status 2 and one line naming the bad value, never a traceback.
Subcommands that need JAX import it lazily, so `plan` and `tables` start instantly.
"""
from __future__ import annotations

import _thread
import argparse
import contextlib
import errno
import gc
import importlib
import os
import signal
import sys
import threading
from typing import Sequence

from kvjax.errors import KvjaxError, UsageError, one_line

# Subcommands, each in its own module with add_parser(sub) and run(args); a module is imported
# only when its command runs (most import JAX; plan and tables do not), the others show their
# help line.
_MODULE_COMMANDS = {
    "plan": ("kvjax.commands.plan", "KV bytes per token/block/request, budget, blocks and concurrency"),
    "tables": ("kvjax.commands.tables", "recompute SPEC Tables 1 and 2 from the formulas"),
    "replay": ("kvjax.commands.replay", "drive the functional block pool from a JSONL trace"),
    "decode": ("kvjax.commands.decode", "batched generation through scheduler, pool, paged cache and model"),
    "calibrate": ("kvjax.commands.calibrate", "fp8 KV scales from a model run over calibration text"),
    "accuracy": ("kvjax.commands.accuracy", "fp8 / int8 KV against bf16: perplexity, KL, agreement"),
    "memory": ("kvjax.commands.memory", "size the cache from a profiled budget; analytic vs measured bytes"),
    "report": ("kvjax.commands.report", "the end-to-end report on the built-in small models"),
    "serve": ("kvjax.commands.serve", "an OpenAI-compatible HTTP server (vLLM's `vllm serve`)"),
    "bench": ("kvjax.commands.bench", "benchmarks with vLLM's definitions: `kvjax bench serve`"),
    "simulate": ("kvjax.commands.simulate", "vLLM's scheduling on a cost model: serving latency without a model"),
}

_VLLM = "vLLM's name"
_OURS = "one name in plan, memory and decode"
# Old kvjax flag → (its new name, why). Consulted before argparse sees the command line, in
# every command, for `--flag value` and `--flag=value` alike.
RENAMED = {
    "--kv-dtype": ("--kv-cache-dtype", _VLLM),
    "--util": ("--gpu-memory-utilization", _VLLM),
    "--num-blocks": ("--num-gpu-blocks-override", _VLLM),
    "--no-prefix-caching": ("--no-enable-prefix-caching", _VLLM),
    "--no-chunked-prefill": ("--no-enable-chunked-prefill", _VLLM),
    "--kv-offload-gib": ("--kv-offloading-size", "vLLM's name, in GiB"),
    "--kv-offload-policy": ("--kv-transfer-config '{\"kv_connector_extra_config\": {\"eviction_policy\": \"arc\"}}'",
                            "vLLM's OffloadingConnector setting"),
    "--tp": ("--tensor-parallel-size (or -tp)", _VLLM),
    "--kv-cache-memory-gib": ("--kv-cache-memory-bytes", "vLLM's name, in bytes: 4G = 4 GiB, 4g = 4e9"),
    "--priority": ("--scheduling-policy priority", _VLLM),
    "--attn-impl": ("--attention-backend", _VLLM),
    "--context": ("--max-model-len", "vLLM's name for tokens per request"),
    "--gpu-gib": ("--device-memory-gib", _OURS),
    "--total-gib": ("--device-memory-gib", _OURS),
}


def refuse_renamed(argv: Sequence[str]) -> None:
    """A UsageError naming the new flag for the first old flag name in argv (up to a `--`)."""
    for arg in argv:
        if arg == "--":
            return
        name = arg.split("=", 1)[0]
        if name in RENAMED:
            new, why = RENAMED[name]
            raise UsageError(f"{name} is now {new} ({why})")


def kvjax_version() -> str:
    """The installed distribution's version, else (a checkout run without installing) kvjax.__version__."""
    from importlib import metadata

    try:
        return metadata.version("kvjax")
    except metadata.PackageNotFoundError:
        import kvjax

        return getattr(kvjax, "__version__", "unknown")


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (no usage dump) so scripts can read them."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(message)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module (if it has one) is imported."""
    parser = _Parser(prog="kvjax", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"kvjax {kvjax_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module, help_line) in _MODULE_COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


@contextlib.contextmanager
def _interrupts_kept():
    """Ctrl-C must stop the command whenever it comes. Python drops an exception raised inside a
    garbage-collector callback ("Exception ignored in ..."), and JAX runs one at every collection
    (`_xla_gc_callback`, often while it loads): a KeyboardInterrupt raised there would be lost and
    the command would run on. So, while the command runs, SIGINT gets a handler (where Python's
    default one is in place) that raises KeyboardInterrupt as Python's does, except inside a gc
    callback, where it asks for the signal again a moment later, outside it. The same inside an
    import: jaxlib's native modules call Python while they load (nanobind), and a KeyboardInterrupt
    raised there aborts the process (std::terminate) instead of unwinding. On leaving, a request
    still on its way is cancelled and the old handler is back (main() may run in a host process)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return
    again: list[threading.Timer] = []

    def interrupt(signum, frame):
        callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
        f = frame
        while f is not None:  # inside a gc callback, or an import (a native module's init may call back)
            if f.f_code in callbacks or f.f_code.co_filename.startswith("<frozen importlib"):
                again.append(threading.Timer(0.01, _thread.interrupt_main))  # runs this handler again
                again[-1].daemon = True
                again[-1].start()
                return
            f = f.f_back
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, lambda signum, frame: None)  # a request already sent lands here
        for timer in again:
            timer.cancel()
            timer.join()
        signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. The bad-input contract lives here, once for every command: a KvjaxError
    (kvjax.errors; every reader and validator raises one) is printed as one line
    `kvjax CMD: error: ...` and the exit status is 2, as is a stdout that cannot take the output
    (a full disk: files kvjax writes report their own failures, kvjax.utils.output_files). Ctrl-C
    prints one line and exits 130; a closed stdout (a pipe whose reader left) exits 141 silently.
    Anything else is a bug and keeps its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    prog = f"kvjax{' ' + command if command in _MODULE_COMMANDS else ''}"
    said = []
    try:
        with _interrupts_kept():
            status = _main(argv, prog, said)
    except KeyboardInterrupt:
        # Ctrl-C (or the gc-deferred one, _interrupts_kept) landing after _main returned, before the
        # handlers are swapped back: still the one line and the shell's status, never a traceback.
        if not said:
            print(f"{prog}: interrupted", file=sys.stderr)
        status = 130
    if status == 130:
        _forget_escaped_interrupt()
    return status


def _forget_escaped_interrupt() -> None:
    """CPython notes a KeyboardInterrupt that escapes code run through its PyRun_* API (C
    extensions evaluate Python that way, JAX's among them) and, at exit, kills the process with
    SIGINT (status -2) even though kvjax caught the interrupt and returns 130. Running an empty
    string through that API resets the note (pythonrun.c run_eval_code_obj), so the status is
    ours. Other Pythons have no such note, or no pythonapi: nothing to do."""
    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleString(b"")
    except (ImportError, AttributeError, OSError):
        pass


def _main(argv: list[str], prog: str, said: list) -> int:
    """main's contract; `said` gets an entry once the interrupted line is printed."""
    try:
        refuse_renamed(argv)
        args = build_parser(prog.partition(" ")[2] or None).parse_args(argv)
        status = importlib.import_module(_MODULE_COMMANDS[args.command][0]).run(args)
        sys.stdout.flush()  # a write to stdout that fails (a full disk) fails here, inside the contract
        return status
    except KvjaxError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        print(f"{prog}: interrupted", file=sys.stderr)
        said.append(True)
        return 130
    except BrokenPipeError:  # `kvjax ... | head`: the reader left; stop quietly, as a Unix tool does
        _drop_stdout()
        return 141
    except OSError as e:
        if e.errno not in STDOUT_ERRNOS:
            raise
        _drop_stdout()
        print(f"{prog}: error: cannot write to standard output: {e.strerror}", file=sys.stderr)
        return 2


# What a write to stdout can fail with once every file kvjax writes goes through
# kvjax.utils.output_files.write_file (which reports its own failures): a full disk or quota, a file-size
# limit, an I/O error. Any other OSError is a bug and keeps its traceback.
STDOUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit cannot fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
