"""vLLM's `vllm.sampling_params`: SamplingParams, RequestOutputKind, StructuredOutputsParams
(kvjax.engine.sampling_params) and BeamSearchParams (kvjax.engine.beam_search)."""
from kvjax.engine.beam_search import BeamSearchParams  # noqa: F401
from kvjax.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams  # noqa: F401

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
