"""The scheduler (vLLM V1's `vllm/v1/core/sched/`): requests, admission, preemption and the step plan."""
