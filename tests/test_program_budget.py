"""jaxrl.program_budget: past ``trainer.max_compiled_prompt_widths`` distinct prompt widths, every compiled program is
dropped (the process's live XLA executables go), later calls compile again with the same results; the config refuses
bad values and the asynchronous pipeline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import backend

from jaxrl.config import ConfigError, load_config
from jaxrl.program_budget import ProgramBudget


def _live() -> int:
    return len(backend.get_backend().live_executables())


@pytest.mark.parametrize("bad", [0, -1, True, "2", 1.5])
def test_bad_values_are_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match=r"trainer\.max_compiled_prompt_widths=.* expected null .* int >= 1"):
        ProgramBudget(bad)


def test_widths_past_the_bound_drop_every_program_and_results_stay():
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=1))
    xs = {w: jnp.arange(4 * w, dtype=jnp.float32).reshape(4, w) / (4 * w) for w in (32, 64, 96)}
    before = {w: np.asarray(f(x)) for w, x in xs.items()}  # one program per width
    budget = ProgramBudget(2)
    assert budget.enforce(32) is False and budget.enforce(64) is False and budget.enforce(32) is False
    assert budget.drops == 0 and budget.widths == {32, 64}
    live = _live()
    assert live >= 3
    budget.note(96)  # a validation call's width counts too
    assert budget.enforce(64) is True  # {32, 64, 96}: past 2
    assert budget.drops == 1 and budget.widths == {64}
    assert _live() < live - 2  # f's three programs (and every other one) are gone
    for w, x in xs.items():  # compiled again: the same numbers
        np.testing.assert_array_equal(np.asarray(f(x)), before[w])


def test_no_bound_keeps_every_program():
    budget = ProgramBudget(None)
    assert not any(budget.enforce(w) for w in range(32, 32 * 40, 32))
    assert budget.drops == 0


def test_config_refuses_bad_values_and_the_async_pipeline():
    assert load_config("configs/quickstart.yaml").trainer.max_compiled_prompt_widths is None
    assert load_config("configs/quickstart.yaml", ["trainer.max_compiled_prompt_widths=2"]) \
        .trainer.max_compiled_prompt_widths == 2
    with pytest.raises(ConfigError, match=r"trainer\.max_compiled_prompt_widths=0 is invalid; valid: null"):
        load_config("configs/quickstart.yaml", ["trainer.max_compiled_prompt_widths=0"])
    with pytest.raises(ConfigError, match=r"max_compiled_prompt_widths=2 does not work with async_training"):
        load_config("configs/quickstart.yaml", ["trainer.max_compiled_prompt_widths=2", "async_training.staleness=1"])
