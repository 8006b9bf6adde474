"""Give the C allocator's free memory back to the operating system (glibc's ``malloc_trim``) after each training step
and each checkpoint save.

Why: on Linux, host buffers (XLA's CPU device arrays and program temporaries, orbax's host copies of a checkpoint)
come from glibc ``malloc``. glibc raises its mmap threshold after large frees (up to 32 MiB), so the 1-30 MiB
buffers of a 135M-parameter model are then carved out of malloc arenas, and each thread that allocates gets an
arena of its own. Memory freed inside an arena stays mapped to the process unless it sits at the arena's top. So an
asynchronous checkpoint save, whose writer threads copy the whole training state to host memory and free it, left
its size behind in the resident set at every save. Measured on this project's CPU machine (a 1.5 GB state saved 8
times through orbax's asynchronous ``CheckpointManager``): RSS 1.8 -> 5.1 GB without trimming, flat at 1.8 GB with a
trim after each save. In the hour-long GSM8K run each save left 0.5-1 GB behind. ``malloc_trim(0)`` returns every
free page of every arena (``madvise(MADV_DONTNEED)``); it frees nothing in use, so numbers and results are
unchanged; it takes 0.1-0.2 s after a GSM8K SmolLM2 step on 2 cores (`bench/memory.py`'s ``step_end`` phase).

Where it runs: when a checkpoint save is finalized (:class:`jaxrl.checkpoint.CheckpointStore`: orbax's
post-finalization callback for an asynchronous save, ``wait`` for a synchronous one), and at the end of every training
step, before the step's ``perf/cpu_memory_used_gb`` is read (:meth:`jaxrl.trainer.Trainer.train_step`, the offline
trainers' step, and each hybrid worker group member when the driver asks for its metrics), so that metric is what the
process holds, not what glibc kept. Elsewhere than glibc (macOS, musl, Windows) there is no ``malloc_trim`` and
:func:`release_free_memory` does nothing.

The mmap threshold (:func:`use_mmap_for_large_buffers`): glibc's dynamic threshold puts every buffer under 32 MiB
(a layer's weight, an activation, a slice of the KV cache) into an arena, where freed memory stays mapped between
trims, so each phase's transient peak stacks on what earlier phases left. The trainers fix the threshold at 1 MiB
before building anything (``mallopt(M_MMAP_THRESHOLD)``, what the ``MALLOC_MMAP_THRESHOLD_`` environment variable
does at start-up): a buffer of 1 MiB or more is then its own mapping, returned to the OS when freed. Measured with
``bench/memory.py`` on the hour GSM8K config: the greedy validation's peak 4.0-4.4 -> 3.7 GB, the update's
4.4-4.7 -> 4.1-4.2 GB. A user's own ``MALLOC_MMAP_THRESHOLD_`` is left as it is.

Inside a phase (:func:`phase_heap`, which every timed phase of a trainer step enters through
:func:`jaxrl.metrics.timed`): a buffer freed by one op is reused by the next instead of being unmapped and faulted in
again. Under the 1 MiB threshold each of XLA:CPU's per-op buffers of 1 MiB or more (a decode step's logits, a
layer's activations) was a fresh mapping, zeroed page by page by the kernel at first touch: the GSM8K benchmark's
generation (32 rows, 128 new tokens, SmolLM2) took 6.9-7.0 M minor page faults and 27-33 s per call, against 0.12 M
and 15.5-17 s with buffers kept in the heap, at the same peak RSS (2.6 GB). So a phase turns per-buffer mappings off
(``mallopt(M_MMAP_MAX, 0)``) and lets the heap's free top stay (``M_TRIM_THRESHOLD`` 1 GiB); when the phase ends the
settings above come back and the free pages go back to the OS (:func:`release_free_memory`), so phases still do not
stack.

After compiles (:func:`trim_after_compiles`): XLA's compiler allocates and frees many small objects, which stay in
the arenas while the new program runs; a ``jax.monitoring`` listener trims after every backend compile, before the
program's first execution adds its temporaries on top (a new prompt width compiles a new gradient program in the
middle of the update phase).

Imports only the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD_BYTES = 1 << 20
TRIM_THRESHOLD_BYTES = 4 << 20
MMAP_MAX_DEFAULT = 65536  # glibc's DEFAULT_MMAP_MAX
PHASE_TRIM_THRESHOLD_BYTES = 1 << 30


class _Settings:
    """What :func:`use_mmap_for_large_buffers` set (``mallopt`` is None until it set anything) and the phases now
    open (:func:`phase_heap`)."""

    mallopt = None
    trim_threshold: int | None = None  # restored after a phase; None: the user's MALLOC_TRIM_THRESHOLD_ stands
    mmap_max = MMAP_MAX_DEFAULT  # restored after a phase: glibc's default or the user's MALLOC_MMAP_MAX_
    depth = 0
    lock = threading.Lock()


@functools.cache
def _malloc_trim():
    """glibc's ``int malloc_trim(size_t pad)``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # Windows: no "current process" handle through CDLL(None)
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the C allocator's free pages to the operating system (``malloc_trim(0)``; memory in use is untouched).

    Returns:
      True when glibc gave memory back, False when it had none to give or the C library has no ``malloc_trim``
      (then nothing happens). Never raises.
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def use_mmap_for_large_buffers(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of ``nbytes`` or more from its own mapping (glibc ``mallopt(M_MMAP_THRESHOLD,
    nbytes)``), so freeing it returns it to the OS at once; this also turns off glibc's dynamic threshold (which
    rises to 32 MiB after large frees). Call it once, before the model is built.

    Fixing the mmap threshold also fixes glibc's trim threshold at its static 128 KiB (the dynamic mode keeps it at
    twice the mmap threshold): the heap's top is then handed back with ``sbrk`` / ``madvise`` whenever more than
    128 KiB is free there and faulted in again at the next allocation, which XLA:CPU's kernels make with every op
    (decode steps, forward and backward passes). So the trim threshold is set to ``TRIM_THRESHOLD_BYTES``
    too (4 MiB: above the few MiB those kernels allocate and free again, below what would let phases stack),
    unless ``MALLOC_TRIM_THRESHOLD_`` is set; the explicit trims (:func:`release_free_memory`, after every step, save
    and compile) still hand everything free back. Measured on the 2-core Xeon VM, the GSM8K config's sampler in one
    process (16 rows, 128 new tokens, the settings interleaved call by call): 36.8 / 38.3 s per ``generate`` call with
    the 1 MiB mmap threshold and the 128 KiB trim threshold, **24.4 / 25.3 s** with a 64 MiB trim threshold, 23.6 /
    24.6 s with a 32 MiB mmap threshold and the same (the mmap threshold costs nothing here); in a second run 25.7 /
    27.5 / 24.9 s with trim thresholds of 4 / 16 / 64 MiB against 36.8 s at 128 KiB. With 64 MiB a synchronous
    checkpoint save left up to 45 MiB of a 378 MiB state resident (tests/test_host_memory.py).

    Args:
      nbytes: the threshold in bytes, 1 MiB by default.

    Returns:
      True when the mmap threshold was set; False when ``MALLOC_MMAP_THRESHOLD_`` is set in the environment (the
      user's setting stands, and the trim threshold is left to glibc too) or the C library has no ``mallopt`` (not
      glibc). Never raises.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, int(nbytes)):
        return False
    if not os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        _Settings.trim_threshold = TRIM_THRESHOLD_BYTES
    try:
        _Settings.mmap_max = int(os.environ.get("MALLOC_MMAP_MAX_", MMAP_MAX_DEFAULT))
    except ValueError:  # not a number: glibc ignores it too
        _Settings.mmap_max = MMAP_MAX_DEFAULT
    _Settings.mallopt = mallopt
    return True


@contextlib.contextmanager
def phase_heap():
    """Run the ``with`` body (one phase of a step: generation, a log-prob pass, an update) with freed buffers kept
    in the heap for reuse, then hand the free pages back to the OS (see the module docstring).

    While any phase is open (phases nest: a step holds its generation; threads may overlap) every allocation comes
    from a malloc arena, not a mapping of its own (``mallopt(M_MMAP_MAX, 0)``; glibc still maps a block a thread's
    arena cannot hold), and the heap's free top is kept up to 1 GiB (``M_TRIM_THRESHOLD``, unless the user set
    ``MALLOC_TRIM_THRESHOLD_``). When the last open phase ends, :func:`use_mmap_for_large_buffers`'s settings come
    back (and a user's ``MALLOC_MMAP_MAX_``); every phase's end calls :func:`release_free_memory` (about 0.1 s).
    Does nothing but run the body where :func:`use_mmap_for_large_buffers` set nothing (a user's
    ``MALLOC_MMAP_THRESHOLD_``, not glibc, not called).
    Never raises of its own.
    """
    mallopt = _Settings.mallopt
    if mallopt is None:
        yield
        return
    with _Settings.lock:
        _Settings.depth += 1
        if _Settings.depth == 1:
            mallopt(M_MMAP_MAX, 0)
            if _Settings.trim_threshold is not None:
                mallopt(M_TRIM_THRESHOLD, PHASE_TRIM_THRESHOLD_BYTES)
    try:
        yield
    finally:
        with _Settings.lock:
            _Settings.depth -= 1
            if _Settings.depth == 0:
                mallopt(M_MMAP_MAX, _Settings.mmap_max)
                if _Settings.trim_threshold is not None:
                    mallopt(M_TRIM_THRESHOLD, _Settings.trim_threshold)
        release_free_memory()


def set_up_host_memory(register_duration_listener) -> None:
    """What a trainer process does before it builds anything: :func:`use_mmap_for_large_buffers` and
    :func:`trim_after_compiles` (``register_duration_listener``:
    ``jax.monitoring.register_event_duration_secs_listener``)."""
    use_mmap_for_large_buffers()
    trim_after_compiles(register_duration_listener)


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_listening = False


def trim_after_compiles(register_duration_listener) -> None:
    """Register, once per process, a listener that calls :func:`release_free_memory` after every XLA backend compile
    (also a persistent-cache load); it adds that trim's time (about 0.1 s) to a compile only.

    Args:
      register_duration_listener: ``jax.monitoring.register_event_duration_secs_listener`` (passed in: this module
        imports only the standard library).
    """
    global _listening
    if _listening:
        return

    def on_duration(event: str, duration: float, **_) -> None:
        if event == _BACKEND_COMPILE:
            release_free_memory()

    register_duration_listener(on_duration)
    _listening = True
