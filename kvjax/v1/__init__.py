"""vLLM's `vllm.v1.*` module paths, for scripts written against vLLM: each module here re-exports
the kvjax names vLLM's examples and docs import from the same path (no logic of its own), so that
`from vllm.v1.engine.async_llm import AsyncLLM` becomes `from kvjax.v1.engine.async_llm import
AsyncLLM`. docs/vllm_paths.md lists every vLLM path kvjax provides and where the names live."""
