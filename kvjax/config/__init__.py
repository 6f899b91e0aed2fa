"""Model configs: ModelConfig, the named presets, and the Hugging Face config parser (vLLM's `vllm/config/`)."""
