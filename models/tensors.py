"""What every checkpoint reader presents: `TensorSource`, tensors by Hugging Face name, and the checkpoint errors.

A Hugging Face folder (models.loader.SafetensorsSource) and a GGUF file (models.gguf.GGUFFile)
are both a `TensorSource`: tensor names, shapes without reading the data, the data in torch's
layout, and where each tensor lives, for messages. models.loader's `load_params` fills the Flax
tree from any of them.

`CheckpointError` (a KvjaxError, so a ValueError) is a checkpoint kvjax will not load; its
subclasses say why: pickled weights (`PickledWeightsError`), a tensor the model needs and the
checkpoint lacks (`MissingTensorError`), one of another shape (`ShapeMismatchError`), one the
model does not use (`UnexpectedTensorError`). models.gguf's GGUFError is another.
"""
from __future__ import annotations

import numpy as np

from kvjax.errors import KvjaxError


class CheckpointError(KvjaxError):
    """A checkpoint folder kvjax will not load; subclasses say why."""


class PickledWeightsError(CheckpointError):
    pass


class MissingTensorError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class TensorSource:
    """A checkpoint's tensors by Hugging Face name, in torch's layout (Linear weights [out, in]).

    `where` is the checkpoint's path, for messages. Use as a context manager (`close` releases
    open files)."""

    where: str

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading (or dequantizing) its data."""
        raise NotImplementedError

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def origin(self, name: str) -> str:
        """Where in the checkpoint the tensor lives (a shard's file name, a GGUF tensor), for messages."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
