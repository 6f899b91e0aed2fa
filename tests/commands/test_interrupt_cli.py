"""Ctrl-C stops a kvjax command whenever it comes (kvjax.commands.main._keep_interrupts): one line
"interrupted" and exit 130, also while JAX loads, where a KeyboardInterrupt raised inside JAX's
garbage-collector callback used to be dropped by Python and the command ran to the end (exit 0)."""
from __future__ import annotations

import gc
import importlib
import os
import signal
import subprocess
import sys
import time

import pytest

from kvjax.commands import main as cli


def test_a_sigint_inside_a_gc_callback_is_raised_after_it():
    before = signal.getsignal(signal.SIGINT)
    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the callback

    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a test runner may differ)
        with cli._interrupts_kept():
            gc.callbacks.append(callback)
            with pytest.raises(KeyboardInterrupt):
                gc.collect()
                time.sleep(2)  # the interrupt comes again a moment later, outside the callback
            assert fired
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the old handler is back
    finally:
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("delay", [0.5, 1.0, 2.0])
def test_ctrl_c_while_the_command_starts(delay):
    cmd = [sys.executable, "-m", "kvjax.commands.main", "decode", "--model", "small-gqa", "--synthetic", "2",
           "--num-gpu-blocks-override", "32", "--max-tokens", "4", "--greedy", "--json", "--max-model-len", "256"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not ignored, as in a shell
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "kvjax decode: interrupted", (p.returncode, err)
    assert out == ""


@pytest.mark.parametrize("when", ["during", "after"])
def test_an_interrupt_while_the_handlers_are_swapped_back_is_one_line_and_130(monkeypatch, capsys, when):
    """A Ctrl-C processed after the command returned but before _interrupts_kept put Python's
    handler back (the gc-deferred one, landing late) must not escape main as a traceback (exit -2):
    main prints the one line (once, also when the command itself was interrupted) and returns 130."""
    import contextlib

    @contextlib.contextmanager
    def late():
        yield
        raise KeyboardInterrupt  # as a pending SIGINT would, on leaving

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_interrupts_kept", late)
    if when == "during":
        monkeypatch.setattr(importlib.import_module("kvjax.commands.plan"), "run", interrupted)
    assert cli.main(["plan", "--model", "llama-3-8b"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err.count("kvjax plan: interrupted") == 1 and err[-1] == "kvjax plan: interrupted", err
