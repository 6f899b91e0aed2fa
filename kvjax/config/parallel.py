"""How an engine spreads past one device group (vLLM's `ParallelConfig`, `vllm/config/parallel.py`), checked once
with vLLM 0.33's rules and messages (`vllm/engine/arg_utils.py: create_engine_config`, `ParallelConfig`'s
validators):

    nnodes, node_rank           the processes of one multi-process job (one per host, or per device group),
                                rank 0 the one with the front end; 0 <= node_rank < nnodes, and nnodes divides the
                                world size (data_parallel_size x tensor_parallel_size)
    master_addr, master_port    rank 0's address: JAX's coordination service listens there
                                (kvjax.distributed.runtime)
    data_parallel_size          engine replicas behind one `kvjax serve` (kvjax.engine.data_parallel)
    decode_context_parallel_size  DCP: MLA's latent cache split over D ranks of the tensor-parallel group, by
                                token (kvjax.attention.dcp); D divides tensor_parallel_size
    distributed_timeout_seconds how long a rank waits for the others to join, and how long a silent rank is
                                given before every process ends (kvjax.distributed.runtime)

What kvjax adds to vLLM's rules, each refused by name: data parallelism is one process's replicas behind one
server (not across nnodes), so data_parallel_size > 1 takes nnodes 1. Plain Python, no JAX.
"""
from __future__ import annotations

import dataclasses

from kvjax.errors import KvjaxError
from kvjax.utils.checks import check_int

DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT = "127.0.0.1", 29501  # vLLM's ParallelConfig defaults
DEFAULT_TIMEOUT_S = 60  # kvjax's: a rank that never joins, or goes silent, ends every process within this


class ParallelConfigError(KvjaxError):
    """A parallel setting that breaks one of the rules in the module docstring; the message names it."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The parallel settings of one engine (module docstring). tensor_parallel_size stays EngineConfig's."""

    data_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    distributed_timeout_seconds: int | None = None  # None: DEFAULT_TIMEOUT_S

    @property
    def multi_process(self) -> bool:
        return self.nnodes > 1

    @property
    def timeout_s(self) -> int:
        return DEFAULT_TIMEOUT_S if self.distributed_timeout_seconds is None else self.distributed_timeout_seconds

    def check(self, tensor_parallel_size: int, error: type = ParallelConfigError) -> "ParallelConfig":
        """Every rule of the module docstring, in vLLM's words where vLLM has the rule; → self."""
        check_int(tensor_parallel_size, "tensor_parallel_size", 1, 256, error)
        check_int(self.data_parallel_size, "data_parallel_size", 1, 1024, error)
        check_int(self.decode_context_parallel_size, "decode_context_parallel_size", 1, 256, error)
        check_int(self.nnodes, "nnodes", 1, 4096, error)
        check_int(self.node_rank, "node_rank", 0, None, error)
        check_int(self.master_port, "master_port", 1, 65535, error)
        if self.distributed_timeout_seconds is not None:
            check_int(self.distributed_timeout_seconds, "distributed_timeout_seconds", 1, 86400, error)
        if not isinstance(self.master_addr, str) or not self.master_addr or ":" in self.master_addr.strip("[]"):
            raise error(f"master_addr must be a host name or IPv4 address (no port: that is master_port), got "
                        f"{self.master_addr!r:.60}")
        tp, dcp, dp = tensor_parallel_size, self.decode_context_parallel_size, self.data_parallel_size
        if tp % dcp:
            raise error(f"tp_size={tp} must be divisible by dcp_size={dcp}.")  # vLLM's ParallelConfig
        if self.nnodes > 1:
            world = dp * tp
            if world % self.nnodes:
                raise error(f"Invalid data-parallel launch options: `--nnodes {self.nnodes}` must evenly divide the "
                            f"total world size ({world}). Adjust `--nnodes`, `--data-parallel-size`, "
                            "`--pipeline-parallel-size`, `--tensor-parallel-size`, or "
                            "`--prefill-context-parallel-size`.")
            if not 0 <= self.node_rank < self.nnodes:
                raise error(f"Invalid data-parallel launch options: `--node-rank` must be between 0 and "
                            f"{self.nnodes - 1}; got `--node-rank {self.node_rank}`. Set it to this node's "
                            "zero-based index.")
            if dp > 1:
                raise error(f"data_parallel_size={dp} with nnodes={self.nnodes}: kvjax runs data-parallel replicas "
                            "in one process behind one server; spread tensor parallelism over the nodes instead")
        elif self.node_rank != 0:
            raise error(f"node_rank={self.node_rank} needs nnodes > 1 (one process has rank 0)")
        return self


__all__ = ["DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT", "DEFAULT_TIMEOUT_S", "ParallelConfig", "ParallelConfigError"]
