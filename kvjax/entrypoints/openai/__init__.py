"""kvjax's OpenAI-compatible HTTP server (vLLM's `vllm/entrypoints/openai/`): `kvjax serve MODEL`."""
