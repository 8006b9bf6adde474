"""Metrics: names (verl's), phase timers, sinks (console / jsonl / TensorBoard / W&B), and the reward plot.

Metric names follow verl's ``metric_utils.compute_data_metrics`` so dashboards carry over:
``critic/score/mean``, ``critic/rewards/mean``, ``critic/advantages/mean``, ``response_length/mean``,
``actor/pg_loss``, ``timing_s/<phase>``, ``val-core/<data_source>/reward/mean@1`` ...
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from jaxrl.host_memory import phase_heap

VALID_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


@contextmanager
def timed(name: str, timings: dict[str, float]):
    """Add the wall time (seconds) of the ``with`` body to ``timings[name]``; the body's peak resident memory goes
    to :data:`phase_peaks` under the same name. The body runs as one phase of the host allocator
    (:func:`jaxrl.host_memory.phase_heap`: freed buffers reused inside it, handed back to the OS at its end, after
    the time is taken; an enclosing phase, such as the whole ``step``, counts it)."""
    t0 = time.perf_counter()
    with phase_peaks.phase(name), phase_heap():
        try:
            yield
        finally:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


def _vmhwm_bytes() -> int | None:
    """``VmHWM`` of ``/proc/self/status`` in bytes (this process image's resident high-water mark), None without it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    return None


class PhasePeaks:
    """The process's peak resident memory while each timed phase ran (``gen``, ``update_actor``, ``testing``, the
    whole ``step`` ...), from Linux's ``VmHWM``, which writing ``5`` to ``/proc/self/clear_refs`` resets to the
    current RSS (proc(5)).

    At every phase start the high-water mark so far is read into every phase now running (any thread: the memory is
    the process's) and into the process's peak, then reset; at a phase end it is read again into the running
    phases. A phase's peak is therefore the largest RSS between its start and end, nested phases included, whatever
    ran concurrently. :func:`peak_rss_bytes` keeps the whole-process peak across the resets.

    Where ``clear_refs`` cannot be written (not Linux, a restricted kernel) nothing is reset and :meth:`take`
    returns nothing, so no per-phase value is ever the process's peak mislabelled.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._running: list[list] = []  # [name, peak bytes] of the phases now running
        self._done: dict[str, int] = {}
        self._process_peak = 0
        self._resettable: bool | None = None  # unknown until the first reset

    def _fold(self) -> bool:
        """Read VmHWM into the process's peak and every running phase; False where it cannot be read."""
        high = _vmhwm_bytes()
        if high is None:
            return False
        self._process_peak = max(self._process_peak, high)
        for frame in self._running:
            frame[1] = max(frame[1], high)
        return True

    def _reset(self) -> None:
        if self._resettable is False:
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._resettable = True
        except OSError:
            self._resettable = False

    @contextmanager
    def phase(self, name: str):
        """Track the peak RSS of the ``with`` body as phase ``name`` (a repeated name keeps the largest)."""
        frame = [name, 0]
        with self._lock:
            if self._fold():
                self._reset()
            self._running.append(frame)
        try:
            yield
        finally:
            with self._lock:
                self._fold()
                self._running.remove(frame)
                if self._resettable:
                    self._done[name] = max(self._done.get(name, 0), frame[1])

    def process_peak(self) -> int:
        """The largest ``VmHWM`` read before any reset, in bytes (0 before the first phase)."""
        with self._lock:
            self._fold()
            return self._process_peak

    def take(self) -> dict[str, float]:
        """``perf/cpu_memory_peak_gb/<phase>`` (GiB) of the phases that ended since the last call, then forgets
        them; a phase that ran between two metric rows (a checkpoint save after step s) lands in row s + 1."""
        with self._lock:
            done, self._done = self._done, {}
        return {f"perf/cpu_memory_peak_gb/{name}": peak / _GIB for name, peak in done.items()}


phase_peaks = PhasePeaks()  # the process's one tracker: every timed() phase reports to it


class CompileClock:
    """Seconds this process spends making XLA programs, from ``jax.monitoring``'s compile events: tracing to a jaxpr,
    lowering to StableHLO and XLA's compilation (``/jax/core/compile/*_duration``). Each fires only when ``jax.jit``
    misses its in-memory cache (a first call, a new shape such as a new prompt-width bucket), so a step that compiles
    nothing adds 0. With JAX's persistent compilation cache (:mod:`jaxrl.compilation_cache`) a hit replaces XLA's
    compilation by loading the executable: the load's seconds count, and it is not counted as a compile
    (``/jax/compilation_cache/cache_hits``).

    One pair of listeners per process, registered by the first :meth:`take`; they are cheap (a lock and two
    additions per event) and count every thread (the asynchronous rollout's too).
    """

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")
    BACKEND = "/jax/core/compile/backend_compile_duration"  # also fires, with the load's time, on a cache hit
    CACHE_HIT = "/jax/compilation_cache/cache_hits"

    def __init__(self):
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._compiles = 0
        self._hits = 0  # cache hits whose backend duration event has not come yet (JAX reports the hit first)
        self._registered = False

    def _on_duration(self, event: str, seconds: float, **_) -> None:
        if event in self.EVENTS:
            with self._lock:
                self._seconds += seconds
                if event == self.BACKEND:
                    if self._hits:  # that duration was a load from the persistent cache
                        self._hits -= 1
                    else:
                        self._compiles += 1

    def _on_event(self, event: str, **_) -> None:
        if event == self.CACHE_HIT:
            with self._lock:
                self._hits += 1

    def take(self) -> dict[str, float]:
        """What accumulated since the last call (or since the listener was registered), then start over.

        Returns:
          ``perf/compile_time_s`` (seconds, float) and ``perf/num_compiles`` (XLA programs compiled, not loaded from
          the persistent cache; int).
        """
        with self._lock:
            if not self._registered:
                import jax

                jax.monitoring.register_event_duration_secs_listener(self._on_duration)
                jax.monitoring.register_event_listener(self._on_event)
                self._registered = True
            out = {"perf/compile_time_s": self._seconds, "perf/num_compiles": self._compiles}
            self._seconds, self._compiles = 0.0, 0
        return out


compile_clock = CompileClock()  # the process's one listener (jax.monitoring's listeners are process-global)


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {}
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/max": float(x.max()), f"{prefix}/min": float(x.min())}


def batch_metrics(batch) -> dict[str, float]:
    """verl's data metrics of one RL step.

    Args:
      batch: an :class:`jaxrl.batch.RLBatch` with scores, rewards and (but for online DPO) advantages filled.

    Returns:
      ``critic/score/*`` (sequence score), ``critic/rewards/*`` (sequence reward after in-reward KL),
      ``critic/advantages/*`` and ``critic/returns/*`` (over valid tokens), ``response_length/*`` (tokens),
      ``response_length/clip_ratio`` (share of responses as long as the horizon R), ``prompt_length/*``, and
      with a critic ``critic/values/*`` and ``critic/vf_explained_var`` = 1 - Var(returns - values) / Var(returns)
      over valid tokens (verl ``compute_data_metrics``).
    """
    mask = batch.response_mask.astype(bool)
    resp_len = mask.sum(-1).astype(np.float32)
    out: dict[str, float] = {}
    out.update(_stats("critic/score", batch.token_level_scores.sum(-1)))
    out.update(_stats("critic/rewards", batch.token_level_rewards.sum(-1)))
    if batch.advantages is not None:  # online DPO computes none
        out.update(_stats("critic/advantages", batch.advantages[mask]))
        out.update(_stats("critic/returns", batch.returns[mask]))
    out.update(_stats("response_length", resp_len))
    out["response_length/clip_ratio"] = float(np.mean(resp_len >= batch.response_width))
    out.update(_stats("prompt_length", batch.prompt_mask.sum(-1).astype(np.float32)))
    if batch.values is not None:
        values, returns = batch.values[mask], batch.returns[mask]
        out.update(_stats("critic/values", values))
        var = np.var(returns)
        out["critic/vf_explained_var"] = float(1.0 - np.var(returns - values) / (var + 1e-8)) if values.size else 0.0
    return out


_GIB = float(1024**3)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes: ``VmHWM`` of ``/proc/self/status`` on Linux (the high-water
    mark of this process image; ``getrusage``'s ``ru_maxrss`` would also carry the RSS of the process it was forked
    from, which survives ``execve``), else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    import resource

    high = _vmhwm_bytes()
    if high is not None:
        return max(high, phase_peaks.process_peak())  # phase_peaks resets VmHWM at phase starts
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_metrics(devices=None) -> dict[str, float]:
    """verl's per-step memory metrics, in GiB (``fsdp_workers.py``: ``perf/max_memory_allocated_gb``,
    ``perf/max_memory_reserved_gb``, ``perf/cpu_memory_used_gb``).

    * ``perf/max_memory_allocated_gb``: the peak bytes in use over this process's devices since start (XLA's
      ``peak_bytes_in_use``, the counterpart of ``torch.cuda.max_memory_allocated``), the max over devices.
    * ``perf/max_memory_reserved_gb``: the peak bytes the device allocator held (``peak_pool_bytes``, else
      ``peak_bytes_reserved``, else ``bytes_limit``: XLA's GPU allocator preallocates its pool), the max over devices.
    * ``perf/cpu_memory_used_gb``: this process's resident set size (``psutil``; verl logs the machine's used
      memory, which on a shared host says little about the run).
    * ``perf/cpu_memory_peak_gb``: this process's peak resident set size since it started (``VmHWM``, else
      ``getrusage``'s ``ru_maxrss``; not a verl key). On the CPU backend the device arrays are host memory, so this
      is the run's memory high-water mark, which a step-end RSS misses (a step frees its temporaries before then).

    Both device keys are omitted where the backend keeps no memory statistics (``Device.memory_stats()`` is None:
    the CPU backend), rather than logged as a misleading 0.

    Args:
      devices: the devices to read (default ``jax.local_devices()``).
    """
    import jax
    import psutil

    out = {"perf/cpu_memory_used_gb": psutil.Process().memory_info().rss / _GIB,
           "perf/cpu_memory_peak_gb": peak_rss_bytes() / _GIB}
    allocated, reserved = [], []
    for d in jax.local_devices() if devices is None else devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 -- a backend without the call: no statistics, as None
            stats = None
        if not stats:
            continue
        if "peak_bytes_in_use" in stats:
            allocated.append(stats["peak_bytes_in_use"])
        for key in ("peak_pool_bytes", "peak_bytes_reserved", "bytes_limit"):
            if key in stats:
                reserved.append(stats[key])
                break
    if allocated:
        out["perf/max_memory_allocated_gb"] = max(allocated) / _GIB
    if reserved:
        out["perf/max_memory_reserved_gb"] = max(reserved) / _GIB
    return out


def rollout_mismatch_metrics(batch, entropy: np.ndarray) -> dict[str, float]:
    """How far the rollout engine's token probabilities are from the trainer's recompute (same weights).

    ``batch`` is an :class:`jaxrl.batch.RLBatch` with ``old_log_probs`` and ``rollout_log_probs`` ``[N, R]`` set;
    ``entropy`` ``[N, R]`` the old-log-prob pass's token entropy (nats).

    ``training/rollout_probs_diff_{mean,max}`` = |p_trainer - p_rollout| over valid tokens; nonzero gaps come
    from numerics (bf16 kernels, another engine) or, with the async pipeline, from older weights. The importance
    ratio of the trainer's policy to the rollout's, ``pi_old / pi_rollout`` per valid token (what
    ``actor.tis_imp_ratio_cap`` truncates), is summarised as verl's rollout-correction metrics
    ``rollout_corr/rollout_is_{mean,max,min}`` and ``rollout_corr/kl`` (the k1 estimate of KL(rollout || trainer),
    token mean of ``log pi_rollout - log pi_old``). ``actor/entropy_old`` is the pre-update token entropy (token
    mean); it is also ``actor/entropy`` unless the update computes its own (``entropy_coeff != 0``), as verl
    logs the old-log-prob pass's entropy.
    """
    mask = batch.response_mask.astype(bool)
    if not mask.any():
        return {"training/rollout_probs_diff_mean": 0.0, "training/rollout_probs_diff_max": 0.0, "actor/entropy": 0.0}
    gap = np.abs(np.exp(batch.old_log_probs) - np.exp(batch.rollout_log_probs))[mask]
    log_ratio = (batch.old_log_probs.astype(np.float64) - batch.rollout_log_probs.astype(np.float64))[mask]
    ratio = np.exp(log_ratio)
    token_entropy = float(entropy[mask].mean())
    return {
        "training/rollout_probs_diff_mean": float(gap.mean()),
        "training/rollout_probs_diff_max": float(gap.max()),
        "rollout_corr/rollout_is_mean": float(ratio.mean()),
        "rollout_corr/rollout_is_max": float(ratio.max()),
        "rollout_corr/rollout_is_min": float(ratio.min()),
        "rollout_corr/kl": float(-log_ratio.mean()),
        "actor/entropy_old": token_entropy,
        "actor/entropy": token_entropy,
    }


CORE_VALIDATION_VALUES = ("reward", "acc")


def validation_metrics(
    data_sources: list[str], prompt_ids: np.ndarray, values: dict[str, np.ndarray], preds: list | None, n: int
) -> dict[str, float]:
    """verl's validation summary (``process_validation_metrics``), per data source and value name.

    Args:
      data_sources: ``[M]`` data source of each response.
      prompt_ids: ``[M]`` int, which prompt each response answers (``n`` responses per prompt).
      values: name -> ``[M]`` float (e.g. ``reward``, ``acc``, and the reward function's other numeric outputs such
        as GSM8K's ``format``); NaN marks a response without that value (a failed call), left out of its stats.
      preds: ``[M]`` extracted answers for majority voting, or None.
      n: responses per prompt.

    Returns:
      ``val-core/<ds>/<name>/mean@n`` for ``reward`` and ``acc`` (:data:`CORE_VALIDATION_VALUES`) and
      ``val-aux/<ds>/<name>/mean@n`` for every other value (verl logs a reward function's extra outputs under
      ``val-aux``) (mean over all responses) and, when ``n > 1``, ``best@n`` / ``worst@n`` (mean over prompts of
      the max / min over its ``n`` responses) and, with ``preds``, ``maj@n`` (mean over prompts of the value of a
      response carrying the most frequent answer; ties -> first seen). verl estimates best/maj with bootstrap
      resampling; with all ``n`` samples these are their exact ``k = n`` values. A name whose values are all NaN
      for a data source is not logged for it.
    """
    data_sources = np.asarray(data_sources)
    prompt_ids = np.asarray(prompt_ids)
    out: dict[str, float] = {}
    for ds in sorted(set(data_sources.tolist())):
        rows = np.flatnonzero(data_sources == ds)
        for name, vals in values.items():
            vals = np.asarray(vals, np.float64)
            has = rows[np.isfinite(vals[rows])]
            if has.size == 0:
                continue
            section = "val-core" if name in CORE_VALIDATION_VALUES else "val-aux"
            out[f"{section}/{ds}/{name}/mean@{n}"] = float(vals[has].mean())
            if n > 1:
                groups = [has[prompt_ids[has] == p] for p in np.unique(prompt_ids[has])]
                out[f"{section}/{ds}/{name}/best@{n}"] = float(np.mean([vals[g].max() for g in groups]))
                out[f"{section}/{ds}/{name}/worst@{n}"] = float(np.mean([vals[g].min() for g in groups]))
                if preds is not None:
                    maj = []
                    for g in groups:
                        answers = [preds[i] for i in g]
                        top = max(answers, key=answers.count)  # first seen among the most frequent
                        maj.append(vals[g[answers.index(top)]])
                    out[f"{section}/{ds}/{name}/maj@{n}"] = float(np.mean(maj))
    return out


class MetricsLogger:
    """Fans metrics out to the configured sinks.

    Args:
      loggers: any of ``console``, ``jsonl``, ``tensorboard`` (needs ``tensorboardX``), ``wandb``.
      out_dir: run folder; ``metrics.jsonl`` and TensorBoard events go there.
      project_name, experiment_name: for W&B.
      config: the resolved config (a dict) recorded by W&B.
      writer: False for a process that must not write (one writer per run: a multi-process run's non-primary
        processes): no sink is opened, :meth:`log` and :meth:`truncate_after` do nothing (``loggers`` are still
        checked).

    Attributes:
      writes: ``writer``: whether this logger writes (the plot follows ``metrics.jsonl`` only where it does).

    Raises:
      ValueError: an unknown logger name (valid: console, jsonl, tensorboard, wandb).
      ImportError: a sink whose package is not installed (names the pip extra).
    """

    def __init__(self, loggers, out_dir: Path, *, project_name: str = "", experiment_name: str = "", config=None,
                 writer: bool = True):
        loggers = [loggers] if isinstance(loggers, str) else list(loggers)
        for name in loggers:
            if name not in VALID_LOGGERS:
                raise ValueError(f"trainer.logger entry {name!r} is unknown; valid: {', '.join(VALID_LOGGERS)}")
        self.writes = bool(writer)
        self.loggers = loggers if self.writes else []
        loggers = self.loggers
        self.out_dir = Path(out_dir)
        if self.writes:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if "tensorboard" in loggers:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:  # pragma: no cover - depends on the extra
                raise ImportError("trainer.logger=tensorboard needs tensorboardX: pip install 'jaxrl[tensorboard]'") from e
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError as e:  # pragma: no cover - depends on the extra
                raise ImportError("trainer.logger=wandb needs wandb: pip install 'jaxrl[wandb]'") from e
            self._wandb = wandb.init(project=project_name, name=experiment_name, config=config, dir=str(self.out_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        if "jsonl" in self.loggers:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if "console" in self.loggers:
            from tqdm import tqdm

            tqdm.write(format_console(step, metrics), file=sys.stderr)  # keeps the progress bar intact
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop ``metrics.jsonl`` records of steps after ``step`` (a resumed run logs them again)."""
        if not self.writes or not self.jsonl_path.exists():
            return
        keep = [r for r in read_metrics(self.jsonl_path) if r.get("step", 0) <= step]
        tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.jsonl_path)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/kl_loss", "kl"),
    ("actor/entropy", "entropy"),
    ("response_length/mean", "len"),
    ("timing_s/step", "step_s"),
    ("perf/compile_time_s", "compile_s"),
)


def format_console(step: int, metrics: dict[str, float]) -> str:
    """One compact console line: the headline metrics of a step, plus any validation scores."""
    parts = [f"step {step}"]
    for key, short in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{short}={metrics[key]:.4g}")
    parts += [f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("val-core/")]
    return " | ".join(parts)


def _jsonable(v):
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(jsonl_path: Path) -> list[dict]:
    """All records of a ``metrics.jsonl`` file, in order."""
    with open(jsonl_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_rewards(jsonl_path: Path, out_png: Path, *, score_key: str = "critic/score/mean") -> Path:
    """Plot the training score, every ``val-core/`` metric and every ``val-aux/.../mean@k`` metric against step into
    ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r[score_key]) for r in records if score_key in r]
    if train:
        ax.plot(*zip(*train), label=f"train {score_key}", marker=".")
    val_keys = sorted({k for r in records for k in r
                       if k.startswith("val-core/") or (k.startswith("val-aux/") and "/mean@" in k)})
    for key in val_keys:
        pts = [(r["step"], r[key]) for r in records if key in r]
        ax.plot(*zip(*pts), label=key, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
