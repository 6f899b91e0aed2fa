"""A state-space layer's cache: vLLM 0.33's `MambaSpec` (`vllm/v1/kv_cache_interface.py`), the state
shapes and dtypes of `vllm/model_executor/layers/mamba/mamba_utils.py` (`MambaStateShapeCalculator`,
`MambaStateDtypeCalculator`), and the block size a hybrid model's attention layers grow to
(`Platform._align_hybrid_block_size`, `vllm/platforms/interface.py`). Plain Python, no JAX.

A Mamba layer keeps one fixed-size state per request, whatever its length: the causal convolution's
last conv_kernel − 1 inputs and the SSM state. Per tensor-parallel rank (tp ranks; `divide` refuses
sizes that do not split):

    Mamba2 (Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1)
        n_groups' = n_groups, or tp when n_groups does not divide tp ranks (`extra_groups_for_head_shards`:
                    every head's B/C group travels with it)
        conv state  (conv_kernel − 1, (intermediate_size + 2 × n_groups' × state_size) / tp)
        SSM state   (num_heads / tp, head_dim, state_size)
    Mamba1 (Jamba)
        conv state  (conv_kernel − 1, intermediate_size / tp)
        SSM state   (intermediate_size / tp, state_size)

The conv state is stored in `mamba_cache_dtype` and the SSM state in `mamba_ssm_cache_dtype`, each
"auto" by default: the model's dtype, and the SSM state the conv state's (`state_dtypes`; Nemotron-H's
config turns the SSM state's "auto" into float32, kvjax.config.mamba). The KV cache dtype (fp8 and the
like) is the attention layers' alone. A layer's page is the sum of its tensors' bytes (`MambaSpec.page_bytes`).

vLLM keeps every layer of a hybrid model in one block pool whose blocks are one page size, so it
grows the attention block size until an attention page holds at least a Mamba page and pads the
Mamba page to exactly the attention page (`hybrid_block_size`):

    Z' = a × cdiv(mamba page, a × attention page per token),  a = max(kernel block, block_size)

rounded up to a multiple of every attention backend's smallest kernel block, and the block size
becomes max(block_size, Z'). The kernel block is FlashAttention's on CUDA, `MultipleOf(16)`
(`KERNEL_BLOCK`). With `mamba_cache_mode="none"` (kvjax's; vLLM's without prefix caching) a request
holds one state block in each Mamba group for its whole life.
"""
from __future__ import annotations

import dataclasses

from kvjax.math_utils import cdiv
from kvjax.quant.kv_formats import SpecError, kv_format
from kvjax.utils.checks import check_int

KERNEL_BLOCK = 16  # FlashAttentionBackend.get_supported_kernel_block_sizes on CUDA: [MultipleOf(16)]
MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")  # vLLM's MambaDType
VERSIONS = (1, 2)


def _divide(value: int, tp: int, what: str) -> int:
    """vLLM's `divide`: value / tp, refused (SpecError naming both) unless it splits evenly."""
    if value % tp:
        raise SpecError(f"tensor parallel size {tp} does not divide the Mamba {what} ({value})")
    return value // tp


def extra_groups_for_head_shards(n_groups: int, tp: int) -> int:
    """Groups added so that every rank holds the B/C group of each of its heads (vLLM's rule):
    none when n_groups splits over tp ranks, else tp − n_groups (n_groups = 1 replicates it)."""
    return 0 if n_groups % tp == 0 else tp - n_groups


def mamba2_state_shapes(tp: int, intermediate_size: int, n_groups: int, num_heads: int, head_dim: int,
                        state_size: int, conv_kernel: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One rank's (conv state, SSM state) shapes of a Mamba2 layer (`MambaStateShapeCalculator.mamba2_state_shape`)."""
    groups = n_groups + extra_groups_for_head_shards(n_groups, tp)
    conv_dim = intermediate_size + 2 * groups * state_size
    return (conv_kernel - 1, _divide(conv_dim, tp, "conv dim")), (_divide(num_heads, tp, "heads"), head_dim, state_size)


def mamba1_state_shapes(tp: int, intermediate_size: int, state_size: int,
                        conv_kernel: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """One rank's (conv state, SSM state) shapes of a Mamba1 layer (`mamba1_state_shape`)."""
    inner = _divide(intermediate_size, tp, "intermediate size")
    return (conv_kernel - 1, inner), (inner, state_size)


def state_dtypes(model_dtype: str, mamba_cache_dtype: str = "auto",
                 mamba_ssm_cache_dtype: str = "auto") -> tuple[str, str]:
    """(conv state, SSM state) formats (`MambaStateDtypeCalculator._mamba_state_dtype`): the conv state's
    "auto" is the model's dtype, the SSM state's "auto" is the conv state's."""
    for name, value in (("mamba_cache_dtype", mamba_cache_dtype), ("mamba_ssm_cache_dtype", mamba_ssm_cache_dtype)):
        if value not in MAMBA_DTYPES:
            raise SpecError(f"{name} {value!r} is not one of {', '.join(MAMBA_DTYPES)}")
    conv = kv_format(model_dtype if mamba_cache_dtype == "auto" else mamba_cache_dtype).name
    return conv, conv if mamba_ssm_cache_dtype == "auto" else kv_format(mamba_ssm_cache_dtype).name


@dataclasses.dataclass(frozen=True)
class MambaSpec:
    """vLLM's MambaSpec: the state tensors one Mamba layer keeps per request on one rank."""

    shapes: tuple[tuple[int, ...], ...]  # (conv state, SSM state)
    dtypes: tuple[str, ...]  # each tensor's format (kvjax.quant.kv_formats names)

    def __post_init__(self):
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise SpecError(f"a Mamba state needs one dtype per tensor, got {self.shapes} and {self.dtypes}")
        for shape in self.shapes:
            for n in shape:
                check_int(n, "a Mamba state dimension", 1, None, SpecError)
        object.__setattr__(self, "dtypes", tuple(kv_format(d).name for d in self.dtypes))

    def tensor_bytes(self) -> tuple[int, ...]:
        """Each tensor's bytes: its elements × its dtype's width."""
        out = []
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = 1
            for d in shape:
                n *= d
            out.append(n * kv_format(dtype).bits // 8)
        return tuple(out)

    @property
    def page_bytes(self) -> int:
        """`MambaSpec.page_size_bytes` before padding: every state tensor's bytes."""
        return sum(self.tensor_bytes())


def hybrid_block_size(attention_page_per_token: int, mamba_page: int, block_size: int,
                      kernel_block: int = KERNEL_BLOCK) -> int:
    """The attention block size vLLM uses beside Mamba layers whose state is mamba_page bytes
    (`_align_hybrid_block_size`, module docstring): block_size, or the smallest multiple of
    max(kernel_block, block_size) whose attention page holds a Mamba page, if that is larger."""
    check_int(attention_page_per_token, "attention_page_per_token", 1, None, SpecError)
    check_int(mamba_page, "mamba_page", 1, None, SpecError)
    check_int(block_size, "block_size", 1, None, SpecError)
    align = max(kernel_block, block_size)
    grown = align * cdiv(mamba_page, align * attention_page_per_token)
    grown = kernel_block * cdiv(grown, kernel_block)  # a multiple of every backend's smallest kernel block
    return max(block_size, grown)
