"""The one weight-sync boundary between the trainer and a rollout engine.

A :class:`WeightSync` owns a rollout engine and the translator that turns the trainer's params into the weight
format the engine declares (:class:`~jaxrl.rollout.weight_format.WeightFormat`):

=============================================  =================  =============================================
engine                                         declared format    translator (:func:`make_translator`)
=============================================  =================  =============================================
``JaxSampler`` without a mesh (one device)     ``jax``            none: the params are taken as they are
``JaxSampler(mesh=...)``                       ``jax`` on mesh    ``"jax"`` plan onto the mesh by its rules
``VllmEngine`` (in-process vLLM)               ``hf_device``      ``"hf"`` plan, tensors on ``jax.devices()[0]``
``VllmWorkerEngine`` (vLLM worker process)     ``hf_host``        ``"hf"`` plan, tensors on the host CPU device
=============================================  =================  =============================================

:meth:`WeightSync.sync` is the only caller of ``engine.update_weights`` in the package: the initial weights of
an engine that starts on its own format (:meth:`WeightSync.start`), every post-update sync and the sync after a
resume all pass here, and every failure (a params tree the engine was not built for, a translator error, an
engine that refuses or fails, a timeout) surfaces as one :class:`~jaxrl.rollout.base.WeightSyncError` naming the
sync and the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jaxrl.models.scan_layout import unstacked_copy
from jaxrl.rollout.base import WeightSyncError
from jaxrl.rollout.weight_format import WeightFormat
from sharding import ModelInfo, TargetSpec, Translator, build_plan

__all__ = ["WeightSync", "WeightSyncReport", "make_translator"]

log = logging.getLogger(__name__)


class WeightSyncReport(NamedTuple):
    """What one :meth:`WeightSync.sync` did.

    Attributes:
      bytes_moved: bytes the translator moved between devices (its ``SyncReport.bytes_moved``: the shard bytes that
        landed on a device that did not hold them; 0 without a translator). The ``sync/bytes`` metric.
      seconds: wall time of the whole sync: translation plus the engine's load.
      num_tensors: tensors handed to the engine.
    """

    bytes_moved: int
    seconds: float
    num_tensors: int


def make_translator(fmt: WeightFormat, params: Any, *, model_cfg=None) -> Translator | None:
    """The translator from ``params``' layout (the trainer's, any mesh) to the weight format ``fmt``.

    Args:
      fmt: the engine's declared format.
      params: the trainer's ``nnx.State`` as placed for training (its layout selects the compiled program).
      model_cfg: the policy's :class:`jaxrl.models.ModelConfig` (head counts, tied embeddings); needed by the HF
        formats.

    Returns:
      None for ``"jax"`` without a mesh (the params are taken as they are); a ``"jax"`` target plan on
      ``fmt.mesh`` by ``fmt.rules``; an ``"hf"`` target plan (whole checkpoint tensors) on ``fmt.device``.

    Raises:
      ValueError: an HF format without ``model_cfg``, or an invalid plan (:func:`sharding.validate_plan`).
    """
    if fmt.kind == "jax":
        if fmt.mesh is None:
            return None
        return Translator(build_plan(params, TargetSpec("jax", mesh=fmt.mesh, rules=fmt.rules)))
    if model_cfg is None:
        raise ValueError(f"the {fmt.kind!r} weight format needs model_cfg (head counts, tied embeddings)")
    return Translator(build_plan(params, TargetSpec("hf", devices=[fmt.device]), ModelInfo.from_config(model_cfg)))


class WeightSync:
    """The trainer's params -> one rollout engine, through the translator its declared format needs.

    Args:
      engine: a rollout engine with a ``weight_format`` attribute (:class:`WeightFormat`).
      translator: from :func:`make_translator` for that format (None only for ``"jax"`` without a mesh).

    Attributes:
      engine, translator, format: as given (``format`` is ``engine.weight_format``).
      num_syncs: successful :meth:`sync` calls.
      initial_report: the initial sync's :class:`WeightSyncReport` when :meth:`start` ran one (the ``"jax"``
        format on a mesh), else None.

    Raises:
      TypeError: the engine declares no :class:`WeightFormat`.
      ValueError: the translator does not produce the engine's format.
    """

    def __init__(self, engine: Any, translator: Translator | None = None) -> None:
        fmt = getattr(engine, "weight_format", None)
        if not isinstance(fmt, WeightFormat):
            raise TypeError(f"{type(engine).__name__} declares no weight_format (a jaxrl.rollout.WeightFormat)")
        problem = _translator_problem(fmt, translator)
        if problem:
            raise ValueError(f"{_name(engine)} takes {fmt.describe()}, but {problem}")
        self.engine, self.translator, self.format = engine, translator, fmt
        # the trainer's scan layout (stacked layers) goes to the engine as it is only when it unstacks per call itself
        self.takes_scan_layout = translator is None and bool(getattr(engine, "takes_scan_layout", False))
        self.num_syncs = 0
        self.initial_report: WeightSyncReport | None = None
        self._expected = None if translator is None else {
            n: (tuple(p.shape), np.dtype(p.dtype).name) for n, p in translator.plan.source.items()}

    @classmethod
    def for_engine(cls, engine: Any, params: Any, *, model_cfg=None) -> "WeightSync":
        """A WeightSync for a running engine, its translator built from ``params``' layout (see
        :func:`make_translator`)."""
        return cls(engine, make_translator(engine.weight_format, params, model_cfg=model_cfg))

    @classmethod
    def start(cls, fmt: WeightFormat, params: Any, make_engine: Callable[[Any], Any], *,
              model_cfg=None, engine_takes_scan_layout: bool = False) -> "WeightSync":
        """Build the translator for ``fmt``, start the engine, and return the WeightSync over both.

        An engine in the ``"jax"`` format on a mesh starts on the initial sync's output (``params`` translated
        onto its mesh: the same program every later sync runs; the report is logged); the JAX sampler without a
        mesh starts on ``params`` as they are; the vLLM engines start from ``params`` written as a Hugging Face
        directory (through the same HF table) and get weights through :meth:`sync` from then on.

        Args:
          fmt: the format the engine will declare.
          params: the trainer's initial ``nnx.State`` (as placed for training).
          make_engine: ``make_engine(initial_weights) -> engine``.
          model_cfg: the policy's ``ModelConfig`` (HF formats).
          engine_takes_scan_layout: the engine ``make_engine`` builds accepts weights in the scan layout
            (:mod:`jaxrl.models.scan_layout`; the JAX sampler without a mesh); otherwise such ``params`` are
            unstacked first.

        Raises:
          ValueError: the engine declares another format than ``fmt``; the errors of :func:`make_translator` and of
            ``make_engine``.
        """
        # the scan layout (a trained role's stacked layers) only to an engine without a translator that takes it:
        # then it holds the trainer's own arrays and no per-layer copy is made
        takes_scan_layout = engine_takes_scan_layout and fmt.kind == "jax" and fmt.mesh is None
        initial, report = (params if takes_scan_layout else per_layer_params(params)), None
        translator = make_translator(fmt, initial, model_cfg=model_cfg)
        if fmt.kind == "jax" and translator is not None:
            initial, tr = translator.sync(initial)
            report = WeightSyncReport(tr.bytes_moved, tr.seconds, tr.num_tensors)
            log.info("initial weight sync: %d tensors, %.1f MB moved in %.2f s", report.num_tensors,
                     report.bytes_moved / 1e6, report.seconds)
        engine = make_engine(initial)
        if getattr(engine, "weight_format", None) != fmt:
            raise ValueError(f"{_name(engine)} declares the weight format {getattr(engine, 'weight_format', None)}; "
                             f"expected {fmt}")
        sync = cls(engine, translator)
        sync.initial_report = report
        return sync

    def sync(self, params: Any) -> WeightSyncReport:
        """Give the engine ``params`` (the trainer's current ``nnx.State``, in its training layout).

        Translates them to the engine's format (colocated: one jitted reshard; split: device-to-device copies; HF:
        whole checkpoint tensors on the engine's device or the host) and calls ``engine.update_weights``.

        Returns:
          a :class:`WeightSyncReport`.

        Raises:
          WeightSyncError: naming ``weight sync #<n> into <engine>``: the params tree differs from the one the
            translator was built for (nothing sent), the translation failed (nothing sent), or the engine refused
            or failed to load them (its own :class:`WeightSyncError` unchanged; any other error wrapped, its type
            and text kept, the original chained).
        """
        where = f"weight sync #{self.num_syncs + 1} into {_name(self.engine)}"
        t0 = time.perf_counter()
        if not self.takes_scan_layout:
            params = per_layer_params(params)
        if self.translator is None:
            weights, moved, tensors = params, 0, len(jax.tree.leaves(params))
        else:
            mismatch = _tree_mismatch(self._expected, params)
            if mismatch:
                raise WeightSyncError(f"{where}: parameter tree differs from the engine's ({mismatch}); nothing was "
                                      "sent, the engine keeps its previous weights")
            try:
                weights, report = self.translator.sync(params)
            except Exception as e:  # noqa: BLE001 - every sync failure is a WeightSyncError
                raise WeightSyncError(f"{where}: translating the weights failed: {type(e).__name__}: {e}; nothing "
                                      "was sent, the engine keeps its previous weights") from e
            moved, tensors = report.bytes_moved, report.num_tensors
        try:
            self.engine.update_weights(weights)
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 - every sync failure is a WeightSyncError
            raise WeightSyncError(f"{where} failed: {type(e).__name__}: {e}") from e
        self.num_syncs += 1
        return WeightSyncReport(int(moved), time.perf_counter() - t0, int(tensors))


def per_layer_params(params: Any) -> Any:
    """``params`` in the per-layer layout every engine and translator reads: a trained role's scan layout
    (:mod:`jaxrl.models.scan_layout`) with its stacked layers copied apart (one jitted program); other params
    unchanged."""
    return unstacked_copy(params)


def _name(engine: Any) -> str:
    return str(getattr(engine, "engine_name", None) or type(engine).__name__)


def _translator_problem(fmt: WeightFormat, translator: Translator | None) -> str | None:
    """Why ``translator`` does not produce ``fmt`` (None when it does)."""
    if fmt.kind == "jax" and fmt.mesh is None:
        return None if translator is None else "a translator was given for params taken as they are"
    if translator is None:
        return "no translator was given"
    plan = translator.plan
    if fmt.kind == "jax":
        if plan.kind != "jax" or plan.mesh != fmt.mesh:
            return f"the translator makes a {plan.kind!r} plan on mesh {dict(plan.mesh.shape)}"
        return None
    devices = list(plan.mesh.devices.flat)
    if plan.kind != "hf" or devices != [fmt.device]:
        return f"the translator makes a {plan.kind!r} plan on devices {devices}"
    return None


def _signature(params: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{dotted name: (shape, dtype name)}`` of an ``nnx.State`` (the names the translator's plans use)."""
    if not isinstance(params, nnx.State):
        raise TypeError(f"expected the policy's nnx.State; got {type(params).__name__}")
    return {".".join(str(getattr(k, "key", k)) for k in path): (tuple(leaf.shape), np.dtype(leaf.dtype).name)
            for path, leaf in nnx.to_flat_state(params)}


def _tree_mismatch(expected: dict, params: Any) -> str | None:
    """How ``params`` differs from ``expected`` (missing, unexpected, (shape, dtype) mismatches; the first 5 of
    each), or None when they match."""
    try:
        sig = _signature(params)
    except TypeError as e:
        return str(e)
    missing, extra = sorted(set(expected) - set(sig)), sorted(set(sig) - set(expected))
    diffs = [f"{p}: expected {expected[p]}, got {sig[p]}" for p in sorted(sig) if p in expected and sig[p] != expected[p]]
    if missing or extra or diffs:
        return f"missing {missing[:5]}, unexpected {extra[:5]}, (shape, dtype) mismatches {diffs[:5]}"
    return None
