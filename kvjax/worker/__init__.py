"""The worker side (vLLM V1's `vllm/v1/worker/`): the paged cache pytree, and tensor-parallel placement."""
