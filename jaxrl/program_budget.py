"""A bound on the prompt widths whose compiled XLA programs stay in memory (``trainer.max_compiled_prompt_widths``).

Why: the rollout engine and the update compile their programs once per prompt width (the embedded sampler pads
prompts to a multiple of 32 tokens, and every later program of the step takes that width), and JAX keeps every
compiled program, with its lowering, for the life of the process. On a CPU those live in host memory beside the
training state. Measured on SmolLM2-135M (the hour GSM8K config, 2 cores): each new width added about 75 MB that
stayed (the sampler's prefill about 38 MB, its decode loop about 25 MB, JAX's lowering caches the rest), on top of the
update's own programs, and ``jax.clear_caches()`` handed all of it back. A long run that meets a rare long prompt keeps
that width's programs to the end.

What it does: the trainer tells :meth:`ProgramBudget.enforce` the width of each batch just before its update (the
step's memory peak), and :meth:`ProgramBudget.note` each validation call's width. When more than ``max_widths``
distinct widths were met since the last drop, every compiled program of the process is dropped
(``jax.clear_caches()``) and the freed memory handed back to the OS, before the update allocates its temporaries.
Programs needed again are compiled again, or loaded from JAX's persistent compilation cache
(``trainer.jax_compilation_cache_dir``, on by default), which is what a drop costs: the next call of each program
traces and loads it (seconds for the sampler and the update on SmolLM2). Results are unchanged: the same program is
built again. ``None`` (the default) keeps every program, as JAX does.

Imports jax only inside :meth:`ProgramBudget.enforce`.
"""

from __future__ import annotations

import logging

log = logging.getLogger("jaxrl")


class ProgramBudget:
    """Drops every compiled program when more than ``max_widths`` prompt widths were met since the last drop.

    Args:
      max_widths: the most distinct prompt widths (tokens) whose programs stay compiled; None = no bound.

    Raises:
      ValueError: ``max_widths`` is not None or an int >= 1.
    """

    def __init__(self, max_widths: int | None):
        if max_widths is not None and (isinstance(max_widths, bool) or not isinstance(max_widths, int)
                                       or max_widths < 1):
            raise ValueError(f"trainer.max_compiled_prompt_widths={max_widths!r} is invalid; expected null (keep every "
                             "compiled program) or an int >= 1")
        self.max_widths = max_widths
        self.widths: set[int] = set()  # met since the last drop
        self.drops = 0

    def note(self, width: int) -> None:
        """Record that programs for prompt width ``width`` were compiled or used (e.g. by a validation call)."""
        self.widths.add(int(width))

    def enforce(self, width: int) -> bool:
        """Record ``width`` (the batch about to be updated on); when more than ``max_widths`` widths were met since
        the last drop, drop every compiled program and hand the memory back. Returns True when it dropped."""
        self.note(width)
        if self.max_widths is None or len(self.widths) <= self.max_widths:
            return False
        import jax

        from jaxrl.host_memory import release_free_memory

        log.info("dropping the compiled programs of prompt widths %s (trainer.max_compiled_prompt_widths=%d); "
                 "they are compiled or loaded again when met", sorted(self.widths), self.max_widths)
        jax.clear_caches()
        release_free_memory()
        self.widths = {int(width)}
        self.drops += 1
        return True
