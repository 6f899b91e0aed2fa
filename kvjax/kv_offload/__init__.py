"""The host offload tier (vLLM V1's `vllm/v1/kv_offload/`): the index with its LRU/ARC policies, and the host pages that hold the bytes."""
