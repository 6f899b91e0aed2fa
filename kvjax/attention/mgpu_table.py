"""Pallas kernel family per measured shape, read by kvjax.attention.mgpu_dispatch.

Written by experiments/kernel_bench.py on an NVIDIA H200 (jax 0.11.2, 2026-12-04, pages of 64
tokens; the decode target shapes only: the run's time budget ended before the rest); regenerate it
there rather than editing it.
"""

# (device kind, kind, q dtype, page dtype, head dim, group (MLA: heads), batch, context) -> winner
MEASURED = {
    ('NVIDIA H200', 'gqa', 'bfloat16', 'bfloat16', 128, 4, 32, 8192): 'mosaic',
    ('NVIDIA H200', 'gqa', 'bfloat16', 'bfloat16', 128, 4, 128, 8192): 'mosaic',
    ('NVIDIA H200', 'gqa', 'bfloat16', 'float8_e4m3fn', 128, 4, 32, 8192): 'mosaic',
    ('NVIDIA H200', 'gqa', 'bfloat16', 'float8_e4m3fn', 128, 4, 128, 8192): 'triton',
    ('NVIDIA H200', 'mla', 'bfloat16', 'bfloat16', 512, 16, 32, 8192): 'triton',
    ('NVIDIA H200', 'mla', 'bfloat16', 'float8_e4m3fn', 512, 16, 32, 8192): 'triton',
}
