"""The shared-memory weight block between the trainer and its vLLM worker process (split placement).

One host ``multiprocessing.shared_memory.SharedMemory`` block, sized for the complete set of Hugging Face
tensors of the policy's checkpoint: names, byte offsets (each aligned to 64 bytes), shapes and dtypes are fixed
once, from the initial checkpoint the parent writes, and every weight sync reuses the block. The parent
(:class:`WeightBlock.create`) validates a sync's tensors and copies them in; the child
(:class:`WeightBlock.attach`, same name and layout) copies them out before vLLM loads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.rollout.base import WeightSyncError

__all__ = ["WeightBlock"]

_ALIGN = 64  # byte alignment of every tensor in the block
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}

Layout = list[tuple[str, int, tuple[int, ...], str]]  # (hf name, byte offset, shape, dtype name)


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt.name in ("bfloat16",)


class WeightBlock:
    """A shared-memory block holding one complete set of HF tensors at fixed offsets.

    Build it with :meth:`create` (the owner: allocates; :meth:`unlink` frees it) or :meth:`attach` (another
    process: maps the owner's block by name).

    Attributes:
      name: the block's shared-memory name. layout: ``[(hf_name, offset, shape, dtype name), ...]``.
      nbytes: the block's size (at least 1).
    """

    def __init__(self, shm: SharedMemory, layout: Layout) -> None:
        self._shm = shm
        self.name = shm.name
        self.layout = layout
        self.nbytes = shm.size
        self._views: dict[str, np.ndarray] = {
            name: np.ndarray(shape, _np_dtype(dt), buffer=shm.buf, offset=off) for name, off, shape, dt in layout}

    @classmethod
    def layout_of(cls, checkpoint: str | Path) -> tuple[Layout, int]:
        """``(layout, size in bytes)`` of a ``model.safetensors`` file's tensors, in the file's order.

        Raises:
          ValueError: a tensor dtype the block does not support (names it and the supported ones).
        """
        from safetensors import safe_open

        layout, offset = [], 0
        with safe_open(str(checkpoint), framework="np") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                st = sl.get_dtype()
                if st not in _ST_DTYPES:
                    raise ValueError(f"tensor {name} has dtype {st}; the worker's weight block supports "
                                     f"{sorted(_ST_DTYPES)}")
                shape, dt = tuple(int(s) for s in sl.get_shape()), _ST_DTYPES[st]
                layout.append((name, offset, shape, dt))
                nbytes = int(np.prod(shape, dtype=np.int64)) * _np_dtype(dt).itemsize
                offset += -(-nbytes // _ALIGN) * _ALIGN
        return layout, max(offset, 1)

    @classmethod
    def create(cls, checkpoint: str | Path) -> "WeightBlock":
        """Allocate a block for the tensors of ``checkpoint`` (a ``model.safetensors`` file).

        Raises:
          ValueError: see :meth:`layout_of`.
        """
        layout, size = cls.layout_of(checkpoint)
        return cls(SharedMemory(create=True, size=size), layout)

    @classmethod
    def attach(cls, name: str, layout: Layout) -> "WeightBlock":
        """Map the block ``name`` that another process created with this ``layout``."""
        return cls(SharedMemory(name=name), layout)

    def check(self, tensors: Any, where: str) -> dict[str, np.ndarray]:
        """Validate a sync's tensors against the layout; returns ``{hf_name: np.ndarray}`` in layout order.

        Raises:
          WeightSyncError: a missing or unknown name, a wrong shape or a non-float dtype (the first 5 of each);
            nothing is written.
        """
        if not isinstance(tensors, Mapping):
            raise TypeError(f"tensors must be a mapping {{hf_name: array}}, got {type(tensors).__name__}")
        missing = sorted(set(self._views) - set(tensors))
        extra = sorted(str(k) for k in set(tensors) - set(self._views))
        wrong, kinds = [], []
        for name, view in self._views.items():
            if name not in tensors:
                continue
            a = tensors[name]
            shape = tuple(np.shape(a))
            if shape != view.shape:
                wrong.append(f"{name}: expected {view.shape}, got {shape}")
            dt = getattr(a, "dtype", None)
            dt = np.dtype(dt) if dt is not None else np.asarray(a).dtype
            if not _is_float(dt):
                kinds.append(f"{name}: {dt.name} (expected a float dtype; stored as {view.dtype.name})")
        if missing or extra or wrong or kinds:
            raise WeightSyncError(
                f"{where}: the tensors do not match the worker's checkpoint (missing {missing[:5]}, unexpected "
                f"{extra[:5]}, wrong shapes {wrong[:5]}, wrong dtypes {kinds[:5]}); nothing was sent, the worker "
                "keeps its previous weights")
        return {name: np.asarray(tensors[name]) for name in self._views}

    def write(self, tensors: Mapping[str, np.ndarray]) -> int:
        """Copy checked tensors (:meth:`check`) into the block, cast to its dtypes; returns the bytes written."""
        nbytes = 0
        for name, arr in tensors.items():
            view = self._views[name]
            np.copyto(view, arr, casting="unsafe")
            nbytes += view.nbytes
        return nbytes

    def read(self) -> dict[str, np.ndarray]:
        """Copies of every tensor (the writer may overwrite the block as soon as the reader answers)."""
        return {name: np.array(v, copy=True) for name, v in self._views.items()}

    def close(self) -> None:
        """Drop this process's views and mapping (the block lives on until :meth:`unlink`)."""
        self._views = {}
        try:
            self._shm.close()
        except BufferError:  # numpy views still alive (interpreter exit); the mapping dies with the process
            pass

    def unlink(self) -> None:
        """Free the block (owner only; idempotent)."""
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
