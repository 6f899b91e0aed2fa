"""A request as the scheduler keeps it (vLLM V1's `vllm/v1/request.py`): its tokens, output and status.

The host `Request` owns a request's tokens, output, status and batch row; the pool
(kvjax.core.kv_cache_manager) owns its block table and how many of its tokens are computed.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)  # one object per request: compared (list.remove, `in`) and hashed by identity
class Request:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    priority: int = 0
    salt: str | None = None
    stop_ids: frozenset[int] = frozenset()  # sampling one of these ends the request ("stop")
    arrival: int = 0  # order of add_request calls
    output: list[int] = field(default_factory=list)
    slot: int | None = None  # pool request slot; kept while preempted
    row: int | None = None  # batch row while running (vLLM's persistent batch), lowest free at admission
    num_preemptions: int = 0
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None  # "length" | "stop" once finished
    host_next: int = 0  # host tier: the next logical block to offer it (vLLM's next stored block)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_range(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without joining prompt and output first (a step reads a few tokens of
        a long request)."""
        p = len(self.prompt)
        return self.prompt[start:min(end, p)] + self.output[max(start - p, 0):max(end - p, 0)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)
