"""The vLLM engine's weight hand-over without vLLM installed: jax arrays reach torch by DLPack, without a copy.

(The engine itself is tested in tests/vllm_rollout, inside the vLLM venv.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxrl.rollout.vllm_engine import VllmEngine  # noqa: E402  (imports vLLM lazily, in the constructor)


def test_jax_array_is_shared_with_torch_not_copied():
    a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4).T  # a transposed result, as the hf plan makes them
    t = VllmEngine._as_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()  # the same buffer: no host round trip, no copy
    assert tuple(t.shape) == (4, 3) and t.dtype == torch.float32
    np.testing.assert_array_equal(t.numpy(), np.asarray(a))


def test_numpy_arrays_are_wrapped_and_read_only_ones_copied():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert VllmEngine._as_torch(w).data_ptr() == w.ctypes.data  # writable: wrapped as is
    ro = w.copy()
    ro.flags.writeable = False
    t = VllmEngine._as_torch(ro)
    assert t.data_ptr() != ro.ctypes.data  # torch must not alias memory it may not write
    np.testing.assert_array_equal(t.numpy(), ro)
