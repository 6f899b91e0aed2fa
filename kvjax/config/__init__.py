"""Model configs (vLLM's `vllm/config/`): kvjax.config.model (ModelConfig, RopeConfig, their errors
and constants), kvjax.config.presets (the named presets) and kvjax.config.hf (the Hugging Face
config.json parser)."""
