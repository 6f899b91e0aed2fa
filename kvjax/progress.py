"""The one progress bar kvjax draws for work in stages (a command's phases, loading a model): on
stderr, counting the stages done and naming the one running, with the time spent. tqdm draws
it; nothing here imports JAX.
"""
from __future__ import annotations

import sys


class Phases:
    """One progress bar over named stages. `start(name)` ends the running stage and begins the
    next; use it as a context manager, so that an error clears the bar before the error line is
    printed. leave: keep the finished bar on screen (filled to its total), as vLLM's loading bar
    stays; otherwise it is cleared. Disabled, it does nothing."""

    def __init__(self, name: str, total: int | None = None, enabled: bool = True, *, unit: str = "phase",
                 leave: bool = False):
        self.bar, self.leave = None, leave
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=name, unit=unit, file=sys.stderr, leave=leave, dynamic_ncols=True,
                            bar_format=f"{{desc}}: {{n_fmt}}/{{total_fmt}} {unit}s [{{elapsed}}]{{postfix}}"
                            if total else "{desc}: [{elapsed}]{postfix}")
        self.running = False

    def start(self, phase: str) -> None:
        if self.bar is None:
            return
        if self.running:
            self.bar.update(1)
        self.running = True
        self.bar.set_postfix_str(phase)

    def close(self, done: bool = False) -> None:
        if self.bar is not None:
            if done and self.leave and self.bar.total:
                self.bar.update(self.bar.total - self.bar.n)
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Phases":
        return self

    def __exit__(self, *exc) -> None:
        self.close(done=exc[0] is None)
