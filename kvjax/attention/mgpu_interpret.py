"""What kvjax's Mosaic GPU kernels need from JAX's private API, pinned in one place, and the CPU interpreter.

The kernels (kvjax.attention.mgpu_decode, mgpu_mla, mgpu_ragged) are written with the public
`jax.experimental.pallas.mosaic_gpu` (`plgpu`): `plgpu.kernel`, SMEM scratch with tiling and
swizzle transforms, barriers, TMA copies and `wgmma`. Two things they need are private:

- **The CPU interpreter.** Mosaic GPU's interpret mode (`InterpretGPUParams` in
  `jax._src.pallas.mosaic_gpu.interpret`, a prototype since JAX 0.10) simulates GMEM, SMEM,
  warpgroup threads, barriers and TMA on the CPU. It is how every kernel runs in the default
  (CPU) tests. Two constructs the kernels use are missing from it in JAX 0.10.2 (and still in
  0.11.1's source), and `interpret_params()` adds them once, faithfully:
    * `plgpu.layout_cast` (a register-layout annotation, the identity on values) has no CPU
      lowering: it gets the identity;
    * `wgmma` on a transposed SMEM operand (`k_smem.transpose((1, 0))`, how Q·Kᵀ reads
      a K tile stored [tokens, H]) reads the untransposed buffer: the interpreter's `wgmma`
      callback is wrapped to apply the transposes its operands carry.
  What the interpreter cannot show: timing, register layouts, bank conflicts, whether a tile
  shape lowers (tests/attention/test_mgpu_lowering.py lowers every kernel for sm_90 on CPU).
  On a machine of few cores give XLA:CPU's client more threads than the interpreter blocks
  (`PJRT_NPROC=8`, set before JAX starts; tests/conftest.py does): the kernel's own callback waits
  for its warpgroups, whose barrier waits are host callbacks on the same pool, one thread per
  core by default, and two blocked callbacks on two cores stall the run for good.
- **Lowering semantics.** JAX 0.11 made `LoweringSemantics.Warpgroup` the default of
  `plgpu.CompilerParams` (0.10: `Lane`); JAX's own Mosaic GPU flash attention runs under both.
  `compiler_params()` keeps the version's default unless `KVJAX_MGPU_SEMANTICS` (lane or
  warpgroup) names one, so a GPU run can try the other without a code change.

`require_mgpu()` checks that all of this exists and raises one `MosaicUnavailable` line naming
the missing piece otherwise; the dispatcher (kvjax.attention) then keeps the Triton kernels.
"""
from __future__ import annotations

import functools
import os

from kvjax.errors import KvjaxError


class MosaicUnavailable(KvjaxError):
    """This JAX lacks a piece of the Mosaic GPU API the kernels need (the message names it)."""


@functools.cache
def require_mgpu():
    """The `plgpu` module, or MosaicUnavailable naming what is missing (one line)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:  # pragma: no cover - depends on the installed jax
        raise MosaicUnavailable(f"jax.experimental.pallas.mosaic_gpu does not import ({e}); kvjax's Mosaic GPU "
                                "kernels need jax >= 0.10.2") from None
    missing = [name for name in ("kernel", "SMEM", "Barrier", "ACC", "TilingTransform", "SwizzleTransform",
                                 "copy_gmem_to_smem", "copy_smem_to_gmem", "barrier_wait", "wait_smem_to_gmem",
                                 "commit_smem", "wgmma", "layout_cast", "Layout",
                                 "broadcasted_iota", "CompilerParams") if not hasattr(plgpu, name)]
    if missing:
        raise MosaicUnavailable(f"jax.experimental.pallas.mosaic_gpu lacks {', '.join(missing)}; kvjax's Mosaic GPU "
                                "kernels were written against jax 0.10.2 / 0.11.2")
    return plgpu


def compiler_params(**kw):
    """plgpu.CompilerParams with the lowering semantics of $KVJAX_MGPU_SEMANTICS (module docstring)."""
    plgpu = require_mgpu()
    name = os.environ.get("KVJAX_MGPU_SEMANTICS", "").strip().lower()
    if name:
        semantics = {"lane": "Lane", "warpgroup": "Warpgroup"}.get(name)
        if semantics is None:
            raise MosaicUnavailable(f"KVJAX_MGPU_SEMANTICS={name!r}: use 'lane' or 'warpgroup'")
        kw["lowering_semantics"] = getattr(plgpu.LoweringSemantics, semantics)
    return plgpu.CompilerParams(**kw)


def kernel_call(body, *, out_shapes, scratch, **kw):
    """plgpu.kernel(body, ...) with the output and scratch types under the argument names of
    this JAX (`out_type` / `scratch_types` since 0.10; `out_shape` / `scratch_shapes` before)."""
    import inspect

    plgpu = require_mgpu()
    params = inspect.signature(plgpu.kernel).parameters
    out_kw = "out_type" if "out_type" in params else "out_shape"
    scratch_kw = "scratch_types" if "scratch_types" in params else "scratch_shapes"
    return plgpu.kernel(body, **{out_kw: out_shapes, scratch_kw: scratch}, **kw)


@functools.cache
def interpret_params():
    """InterpretGPUParams for running the kernels on CPU (uninitialized SMEM reads as NaN, so a
    kernel that reads a slot it never wrote shows it), with the two backports installed."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        raise MosaicUnavailable(f"Mosaic GPU's CPU interpreter (jax._src.pallas.mosaic_gpu.interpret) is missing "
                                f"({e}); run the Mosaic GPU kernels on a GPU or use the Triton ones") from None
    _install_layout_cast_identity()
    _install_transposed_wgmma(gpu_callbacks)
    return InterpretGPUParams(uninitialized_memory="nan")


def reset_interpreter() -> None:
    """After an exception inside an interpreted kernel the interpreter's global state stays
    dirty (JAX's note on InterpretGPUParams); this clears it."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    gpu_callbacks.reset_gpu_interpret_mode_state()


def _install_layout_cast_identity() -> None:
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu import core as gpu_core

    prim = gpu_core.layout_cast_p
    if getattr(prim, "_kvjax_identity", False):
        return
    mlir.register_lowering(prim, lambda ctx, x, *, new_layout: [x], platform="cpu")
    prim._kvjax_identity = True


def _install_transposed_wgmma(gpu_callbacks) -> None:
    """Wrap the interpreter's wgmma so that an operand ref ending in transposes is read, then
    transposed, as the hardware reads a transposed SMEM operand."""
    from jax._src.state.types import TransposeTransform

    original = gpu_callbacks.wgmma
    if getattr(original, "_kvjax_transposes", False):
        return
    for name in ("_get_shared_memory", "HostAllocationKey", "_remove_noop_transforms", "interpret_utils"):
        if not hasattr(gpu_callbacks, name):
            raise MosaicUnavailable(f"Mosaic GPU's interpreter changed: gpu_callbacks.{name} is gone; "
                                    "kvjax.attention.mgpu_interpret needs updating")

    def split(transforms):
        """(the transforms before the trailing transposes, their composed permutation or None)."""
        transforms, perm = list(transforms), None
        while transforms and isinstance(transforms[-1], TransposeTransform):
            p = tuple(transforms.pop().permutation)
            perm = p if perm is None else tuple(p[i] for i in perm)
        return tuple(transforms), perm

    def wgmma(*, a_transforms, b_transforms, **kw):
        a_transforms, a_perm = split(a_transforms)
        b_transforms, b_perm = split(b_transforms)
        if a_perm is None and b_perm is None:
            return original(a_transforms=a_transforms, b_transforms=b_transforms, **kw)
        return _wgmma_transposed(gpu_callbacks, a_transforms, a_perm, b_transforms, b_perm, **kw)

    wgmma._kvjax_transposes = True
    gpu_callbacks.wgmma = wgmma


def _wgmma_transposed(gc, a_transforms, a_perm, b_transforms, b_perm, *, token, device_id, grid_point_coords,
                      thread_id, acc_allocation_key_as_array, acc_transforms, acc_dtype, a_allocation_key_as_array,
                      b_allocation_key_as_array, source_info=None):
    """gpu_callbacks.wgmma (JAX 0.10.2) with transposed operands: acc += op(a) @ op(b)."""
    import jax
    import numpy as np

    utils = gc.interpret_utils
    shared_memory = gc._get_shared_memory()
    device_id, thread_id = int(device_id), int(thread_id)
    global_thread_id = shared_memory.get_global_thread_id(device_id, thread_id)
    logging_info = utils.GPULoggingInfo(device_id=device_id, grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                        thread_id=thread_id, source_info=source_info)

    def read(key, transforms, perm):
        value, _, _ = shared_memory.get_buffer_content(
            gc.HostAllocationKey.from_array(key), utils.to_range(jax.tree.map(int, gc._remove_noop_transforms(
                transforms))), global_thread_id, logging_info=logging_info)
        assert value is not None
        return value if perm is None else np.transpose(value, perm)

    a = read(a_allocation_key_as_array, a_transforms, a_perm)
    b = read(b_allocation_key_as_array, b_transforms, b_perm)
    acc_key = gc.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc_range = utils.to_range(jax.tree.map(int, gc._remove_noop_transforms(acc_transforms)))
    acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, global_thread_id, logging_info=logging_info)
    shared_memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), global_thread_id,
                                       logging_info=logging_info)
    return token


def resolve_interpret(interpret):
    """None → interpret on a CPU backend (Mosaic GPU compiles only for a GPU), else as given; an
    interpreted run gets `interpret_params()`; KVJAX_INTERPRET=0/1 is read by the tests, not here."""
    import jax

    run_interpreted = jax.default_backend() == "cpu" if interpret is None else bool(interpret)
    return interpret_params() if run_interpreted else False
