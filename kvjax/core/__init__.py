"""The KV cache's core, as vLLM V1's `vllm/v1/core/`: the block pool, the KV cache manager, block hashing, the KV spec's bytes, and the scheduler (`sched/`)."""
