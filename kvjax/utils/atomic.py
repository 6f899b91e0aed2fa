"""Engine calls that complete or do not start: Ctrl-C held back, concurrent callers serialised.

An engine step changes the block pool, the scheduler's queues and the KV pages together, and the
device call in the middle of it donates the pool and the pages (their old buffers are gone once
the call starts). A KeyboardInterrupt that lands between two of those changes (Python raises it
between any two bytecodes of the main thread) would leave them disagreeing: a request the
scheduler admitted whose blocks the pool never gave, a deleted buffer that nothing replaced.
Two threads stepping one engine at once interleave the same changes.

`atomic(method)` makes a public engine method one unit:
- it takes the object's lock (`threading.RLock`, created on first use and kept in the object's
  `_atomic_lock`): a second thread waits until the first one's call returns, and the same
  thread may call in again (an engine method calling another);
- while the outermost such call runs in the main thread, SIGINT is held back: the handler in
  place is swapped for one that only notes the signal, and when the call returns (or raises) the
  old handler is put back and, if a signal came, called as Python would have called it, so Ctrl-C
  raises KeyboardInterrupt right after the unit, with every change of it made. A second Ctrl-C
  during the same unit is kept as the first (one KeyboardInterrupt).

A unit is one engine step or one request's bookkeeping, milliseconds on a GPU; a long prefill on a
CPU keeps Ctrl-C waiting for that step. Outside the main thread, Python delivers no signal, so the
lock is all there is to do. A handler that is not Python's (SIG_IGN, SIG_DFL, or None where
Python does not own SIGINT) is left alone.
"""
from __future__ import annotations

import functools
import signal
import threading
from typing import Callable, TypeVar

try:  # the C module under `signal`: its calls skip the enum conversions (~10 µs a pair, per engine step)
    import _signal as _sig
except ImportError:  # another Python
    _sig = signal

F = TypeVar("F", bound=Callable)

_held = threading.local()  # the main thread's depth of atomic units, and the signal they hold back
_CREATE = threading.Lock()


def lock_of(obj) -> threading.RLock:
    """obj's lock, the one its atomic methods take (a caller that must keep others out across
    several calls takes it too: `with lock_of(engine): ...`)."""
    lock = obj.__dict__.get("_atomic_lock")
    if lock is None:
        with _CREATE:
            lock = obj.__dict__.setdefault("_atomic_lock", threading.RLock())
    return lock


def atomic(method: F) -> F:
    """Run method as one unit of its object (the module docstring): serialised with the object's
    other atomic calls, with SIGINT held back until it returns."""

    @functools.wraps(method)
    def unit(self, *args, **kwargs):
        with lock_of(self), interrupts_held():
            return method(self, *args, **kwargs)

    return unit  # type: ignore[return-value]


class interrupts_held:
    """Context manager: SIGINT noted, not raised, inside it (main thread, Python's handler only);
    on leaving, the old handler is back and a noted signal calls it. Nests: only the outermost
    one swaps handlers."""

    def __enter__(self):
        self.swapped = False
        if threading.current_thread() is not threading.main_thread():
            return self
        depth = getattr(_held, "depth", 0)
        _held.depth = depth + 1
        if depth:
            return self
        old = _sig.getsignal(signal.SIGINT.value)
        if not callable(old):  # SIG_IGN / SIG_DFL / not installed by Python: nothing to hold back
            return self
        _held.noted, _held.old = None, old
        _sig.signal(signal.SIGINT.value, _note)
        self.swapped = True
        return self

    def __exit__(self, *exc):
        if threading.current_thread() is not threading.main_thread():
            return False
        _held.depth -= 1
        if not self.swapped:
            return False
        old, noted = _held.old, _held.noted
        _sig.signal(signal.SIGINT.value, old)
        _held.noted = _held.old = None
        if noted is not None:
            old(*noted)  # Python's default handler raises KeyboardInterrupt here, after the unit
        return False


def _note(signum, frame) -> None:
    if _held.noted is None:
        _held.noted = (signum, frame)


class BatchCall:
    """The bookkeeping of a call that runs a batch of requests to the end (`generate`), made under
    its engine's lock: whether one is running (a call from inside it, e.g. its progress callback,
    is refused), and the running call's request ids until it ends cleanly. A call whose clean-up
    was itself interrupted (a second Ctrl-C before it aborted its requests) leaves them in the
    engine; the next call aborts them first (`begin`)."""

    def __init__(self):
        self.running, self.request_ids = False, []

    def begin(self, abort: Callable, num_unfinished: Callable[[], int], error: type[Exception]) -> None:
        """Before a batch call adds anything: refuse a nested call, abort what an interrupted call
        left, and refuse while requests added one by one (add_request) are unfinished."""
        if self.running:
            raise error("generate is already running: it cannot be called from its own progress callback")
        abort(self.request_ids)
        self.request_ids = []
        if num_unfinished():
            raise error(f"{num_unfinished()} requests added with add_request are unfinished: step them to the end "
                        "or abort them before generate")
