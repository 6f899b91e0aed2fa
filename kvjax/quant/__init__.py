"""Quantized KV formats (vLLM's `vllm/model_executor/layers/quantization/kv_cache.py`): fp8 and int8 formats, scales and calibration."""
