"""The worker side (vLLM V1's `vllm/v1/worker/`): the paged cache pytree, the one model step (model_runner.py), and tensor-parallel placement."""
