"""Configs (vLLM's `vllm/config/`): kvjax.config.model (ModelConfig, RopeConfig: a model's
architecture), kvjax.config.presets (the named presets), kvjax.config.hf (the Hugging Face
config.json parser), kvjax.config.engine (the engine's resolved config, EngineArgs' result, and
ProfilerConfig) and kvjax.config.scheduler (the pool scheduler's). No JAX at import."""
from kvjax.config.engine import CacheConfig, EngineConfig, ProfilerConfig  # noqa: F401 (vLLM's `vllm.config` names)
