"""One kvjax job over several processes: JAX's multi-controller runtime, joined once per process.

vLLM starts multi-node tensor parallelism with `--nnodes N --node-rank R --master-addr A --master-port P` on
every node (`vllm/config/parallel.py`: torch.distributed over NCCL, its CPU groups over gloo). kvjax uses JAX's
own distributed runtime instead and writes no transport: `jax.distributed.initialize(A:P, N, R)` connects the
process to the coordination service that rank 0 hosts at A:P; then `jax.devices()` lists every process's
devices, one `Mesh` spans them, and each jitted step runs SPMD on all processes, XLA's collectives carrying the
all-reduces (NCCL between GPUs; between CPU processes gloo, chosen here with
`jax_cpu_collectives_implementation='gloo'`, which must be set before JAX starts its CPU backend).

Failure, within `ParallelConfig.timeout_s` (`--distributed-timeout-seconds`, default 60 s):
- a rank that never joins: `initialize` waits that long for every rank, then this process ends with one error
  naming the missing ranks' job (JAX's own wait is set longer, so that its abort with a C++ stack trace never
  comes first);
- a rank > 0 that dies: its peers' next collective fails at once (the TCP connection closes), and
  `lost_peers` ends each of them with one error; kvjax's lockstep keeps a collective running at least
  every `TICK_S` while the job is idle, so an idle job notices too (kvjax.engine.lockstep);
- rank 0 dying takes JAX's coordination service with it, and JAX's own client ends every other process at once
  with its fatal error ("Terminating process because the JAX distributed service detected fatal errors", then
  a C++ stack trace, exit by SIGABRT) before a collective could fail: jaxlib's client takes a callback for that
  error (`missed_heartbeat_callback`), but JAX 0.10's binding cannot hand it the status (std::bad_cast,
  measured 2026-12-04), so kvjax cannot put its one error there;
- a rank that hangs without dying (stopped, cut off): its heartbeats stop, and JAX's coordination service
  ends every process `timeout_s` later (its own message: "Terminating process because the JAX distributed
  service detected fatal errors").
A process that lost a peer cannot shut the runtime down (JAX's shutdown waits for every rank at a barrier),
so `abort` writes the one error to stderr and ends the process with status 1 at once, the way a fatal
signal would; it is the only place kvjax's library writes to a stream, because no caller is left to raise to.

`finish` is the orderly end (registered with atexit by `initialize`): callbacks run first (rank 0's lockstep
tells the other ranks to stop), then `jax.distributed.shutdown()`, a barrier every rank reaches.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable

from kvjax.config.parallel import ParallelConfig
from kvjax.errors import KvjaxError

TICK_S = 1.0  # the longest an idle job goes without a collective (kvjax.engine.lockstep)
_JAX_WAIT_MARGIN_S = 30  # JAX's own join timeout: ours plus this, so that ours reports first

_state: dict = {}  # "config", "tp": what this process joined with; "at_exit": callbacks for finish()


class DistributedError(KvjaxError):
    """A multi-process job started in a way that cannot work; the message names the setting."""


def initialize(config: ParallelConfig, tensor_parallel_size: int) -> None:
    """Join the job `config` describes (nnodes > 1), once per process; a second call with the same settings is a
    no-op and with others a DistributedError. Raises DistributedError if JAX already started its backends (the
    runtime must come first) or if the job's devices are not tensor_parallel_size in all."""
    import jax

    key = (config.nnodes, config.node_rank, config.master_addr, config.master_port)
    if "config" in _state:
        joined = _state["config"]
        if (joined.nnodes, joined.node_rank, joined.master_addr, joined.master_port) != key:
            raise DistributedError(f"this process already joined the job at {joined.master_addr}:{joined.master_port} "
                                   f"as rank {joined.node_rank} of {joined.nnodes}; one job per process")
        _check_devices(tensor_parallel_size)
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise DistributedError("JAX's backends already started in this process: a multi-process job (nnodes > 1) "
                               "must join its runtime before anything runs on a device (build the engine first)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes' collectives
    where, rank, n, timeout = f"{config.master_addr}:{config.master_port}", config.node_rank, config.nnodes, \
        config.timeout_s
    watchdog = threading.Timer(timeout, abort, (f"rank {rank} of {n}: not every rank joined the job at {where} within "
                                                f"{timeout} s (--distributed-timeout-seconds); start every rank with "
                                                f"--nnodes {n}, its own --node-rank and the same --master-addr/port",))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(where, n, rank, initialization_timeout=timeout + _JAX_WAIT_MARGIN_S,
                                   heartbeat_timeout_seconds=timeout, shutdown_timeout_seconds=timeout)
    finally:
        watchdog.cancel()
    _state.update(config=config, at_exit=[])
    atexit.register(finish)
    _check_devices(tensor_parallel_size)


def _check_devices(tp: int) -> None:
    import jax

    if jax.device_count() != tp:
        raise DistributedError(f"tensor_parallel_size={tp}, but the job's {jax.process_count()} processes hold "
                               f"{jax.device_count()} devices in all ({jax.local_device_count()} here): a "
                               "multi-process engine spans every device of the job")


def is_multi_process() -> bool:
    return "config" in _state


def rank() -> int:
    return _state["config"].node_rank if "config" in _state else 0


def world() -> int:
    return _state["config"].nnodes if "config" in _state else 1


def at_exit(callback: Callable[[], None]) -> None:
    """Run callback in `finish`, before the runtime shuts down (last registered, first run)."""
    _state["at_exit"].append(callback)


def finish() -> None:
    """The orderly end (module docstring): the callbacks, then JAX's shutdown barrier. Idempotent."""
    import jax

    callbacks = _state.pop("at_exit", None)
    if callbacks is None:
        return
    for callback in reversed(callbacks):
        callback()
    jax.distributed.shutdown()


def lost_peers(what: str, error: BaseException) -> None:
    """A collective failed: another rank is gone. Ends this process (`abort`) with one error naming the step."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    abort(f"rank {rank()} of {world()}: lost the other ranks during {what} ({first[:300]}); every rank of the job "
          "ends")


def abort(message: str) -> None:
    """Write `kvjax: error: message` to stderr and end the process with status 1 (module docstring: why not raise)."""
    sys.stderr.write(f"kvjax: error: {message}\n")
    sys.stderr.flush()
    os._exit(1)


__all__ = ["DistributedError", "TICK_S", "abort", "at_exit", "finish", "initialize", "is_multi_process",
           "lost_peers", "rank", "world"]
