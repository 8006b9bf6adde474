"""``python -m jaxrl.train`` config front, run as a subprocess: errors, --print-config, verl recipes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import yaml

from jaxrl.config import config_to_dict, load_config, load_config_with_notes
from jaxrl.paths import REPO_ROOT

# verl's GSM8K GRPO example for Qwen3-1.7B on one GPU, verbatim (shell quoting included)
VERL_RECIPE = (
    "algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet "
    "data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512 "
    "data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation='error' "
    "actor_rollout_ref.model.path=Qwen/Qwen3-1.7B actor_rollout_ref.actor.optim.lr=1e-6 "
    "actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=80 "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=20 actor_rollout_ref.actor.use_kl_loss=True "
    "actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl "
    "actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True "
    "actor_rollout_ref.actor.fsdp_config.param_offload=False "
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False "
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20 "
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.name=vllm "
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=3 "
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20 "
    "actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False "
    "trainer.critic_warmup=0 trainer.logger=['console'] trainer.project_name='verl_grpo_example_gsm8k' "
    "trainer.experiment_name='qwen3_1_7b_function_rm' trainer.n_gpus_per_node=1 trainer.nnodes=1 "
    "trainer.save_freq=-1 trainer.test_freq=5 trainer.total_epochs=15"
)
NO_JAX_MEANING = {
    "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.ref.fsdp_config.param_offload",
}

UNEVEN_MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size"


def _run(args: list[str], **kw) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, **kw)
    return proc, time.perf_counter() - t0


def _note_keys(stderr: str) -> list[str]:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("jaxrl: note: ")]
    return [ln[len("jaxrl: note: "):].split("=", 1)[0] for ln in lines]


def test_misspelled_key_fails_fast_naming_the_real_key():
    proc, wall = _run([sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml",
                       "actor_rollout_ref.actor.optim.lrr=1"])
    assert proc.returncode == 2
    assert wall < 10.0
    assert proc.stderr.startswith("jaxrl: config error: Unknown config key 'actor_rollout_ref.actor.optim.lrr'")
    assert "did you mean 'actor_rollout_ref.actor.optim.lr'?" in proc.stderr
    assert proc.stdout == ""


def test_print_config_exits_0_without_importing_jax():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['jaxrl.train', '--config', 'configs/quickstart.yaml', '--print-config',"
        " 'trainer.total_training_steps=7']\n"
        "try:\n"
        "    runpy.run_module('jaxrl.train', run_name='__main__', alter_sys=True)\n"
        "    rc = 0\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        "print(f'RC={rc} JAX={\"jax\" in sys.modules} JAXLIB={\"jaxlib\" in sys.modules}', file=sys.stderr)\n"
    )
    proc, _ = _run([sys.executable, "-c", code])
    assert "RC=0 JAX=False JAXLIB=False" in proc.stderr, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    expected = config_to_dict(load_config(REPO_ROOT / "configs/quickstart.yaml", ["trainer.total_training_steps=7"]))
    assert printed == expected
    assert printed["trainer"]["total_training_steps"] == 7


def test_verl_recipe_command_line_is_accepted(monkeypatch):
    env = dict(os.environ, HOME="/home/verl_user")
    proc, _ = _run(["bash", "-c", f'"{sys.executable}" -m jaxrl.train --print-config {VERL_RECIPE}'], env=env)
    assert proc.returncode == 0, proc.stderr
    keys = _note_keys(proc.stderr)
    # one note line per key with no JAX meaning, and one for verl's uneven mini-batches (1024 prompts / 80)
    assert sorted(keys) == sorted(NO_JAX_MEANING | {UNEVEN_MINI_BATCH})
    assert all(ln.startswith("jaxrl: note: ") for ln in proc.stderr.splitlines())
    cfg = yaml.safe_load(proc.stdout)
    arr = cfg["actor_rollout_ref"]
    assert cfg["data"]["train_files"] == ["/home/verl_user/data/gsm8k/train.parquet"]
    assert cfg["data"]["val_files"] == ["/home/verl_user/data/gsm8k/test.parquet"]
    assert (cfg["data"]["train_batch_size"], cfg["data"]["max_response_length"]) == (1024, 1024)
    assert (cfg["data"]["filter_overlong_prompts"], cfg["data"]["truncation"]) == (True, "error")
    assert arr["model"]["path"] == "Qwen/Qwen3-1.7B" and arr["model"]["use_remove_padding"] is True
    assert arr["actor"]["optim"]["lr"] == 1e-6 and arr["actor"]["entropy_coeff"] == 0.0
    assert (arr["actor"]["ppo_mini_batch_size"], arr["actor"]["ppo_micro_batch_size_per_gpu"]) == (80, 20)
    assert (arr["actor"]["use_kl_loss"], arr["actor"]["kl_loss_coef"], arr["actor"]["kl_loss_type"]) == (
        True, 0.001, "low_var_kl")
    assert (arr["rollout"]["name"], arr["rollout"]["n"], arr["rollout"]["gpu_memory_utilization"]) == ("vllm", 3, 0.6)
    assert arr["rollout"]["tensor_model_parallel_size"] == 1
    assert arr["rollout"]["log_prob_micro_batch_size_per_gpu"] == arr["ref"]["log_prob_micro_batch_size_per_gpu"] == 20
    assert cfg["algorithm"]["adv_estimator"] == "grpo" and cfg["algorithm"]["use_kl_in_reward"] is False
    t = cfg["trainer"]
    assert t["logger"] == ["console"] and t["project_name"] == "verl_grpo_example_gsm8k"
    assert t["experiment_name"] == "qwen3_1_7b_function_rm"
    assert (t["n_gpus_per_node"], t["nnodes"], t["save_freq"], t["test_freq"], t["total_epochs"]) == (1, 1, -1, 5, 15)
    assert t["default_local_dir"] == "checkpoints/verl_grpo_example_gsm8k/qwen3_1_7b_function_rm"

    # the shipped YAML recipe is the same config, with the same notes
    monkeypatch.setenv("HOME", "/home/verl_user")
    yaml_loaded = load_config_with_notes(REPO_ROOT / "configs/grpo_gsm8k_qwen3_1.7b.yaml")
    assert config_to_dict(yaml_loaded.config) == cfg
    assert sorted(n.key for n in yaml_loaded.notes) == sorted(NO_JAX_MEANING | {UNEVEN_MINI_BATCH})


# verl's LoRA GRPO example (examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh at verl b178a3c), verbatim but
# for the module: `python3 -m verl.trainer.main_ppo` -> `python -m jaxrl.train --print-config`
VERL_LORA_SCRIPT = r"""set -x

PYTHON -m jaxrl.train --print-config \
    algorithm.adv_estimator=grpo \
    trainer.val_before_train=False \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=16 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.shuffle=False \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.model.lora_rank=64 \
    actor_rollout_ref.model.lora_alpha=32 \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.load_format=safetensors \
    actor_rollout_ref.rollout.layered_summon=True \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2.5_3b_grpo_lora' \
    trainer.n_gpus_per_node=2 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@

    # actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    # data.train_batch_size=1024 \
    # trainer.n_gpus_per_node=8 \
    # actor_rollout_ref.model.use_shm=True \
"""


def test_verl_lora_example_script_is_accepted(tmp_path):
    """The script runs unchanged but for the module, with its commented-out use_shm=True passed through "$@": the
    LoRA keys are real (no note), the keys with no JAX meaning each get one note line."""
    script = tmp_path / "run_qwen2_5-3b_gsm8k_grpo_lora.sh"
    script.write_text(VERL_LORA_SCRIPT.replace("PYTHON", f'"{sys.executable}"', 1))
    env = dict(os.environ, HOME="/home/verl_user")
    proc, _ = _run(["bash", str(script), "actor_rollout_ref.model.use_shm=True"], env=env)
    assert proc.returncode == 0, proc.stderr
    notes = _note_keys("\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("+")))
    assert sorted(notes) == sorted(NO_JAX_MEANING | {
        "actor_rollout_ref.rollout.load_format", "actor_rollout_ref.rollout.layered_summon",
        "actor_rollout_ref.model.use_shm"})
    cfg = yaml.safe_load(proc.stdout)
    model = cfg["actor_rollout_ref"]["model"]
    assert (model["lora_rank"], model["lora_alpha"], model["target_modules"], model["exclude_modules"]) == (
        64, 32.0, "all-linear", None)
    assert model["path"] == "Qwen/Qwen2.5-3B-Instruct" and model["use_remove_padding"] is True
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == 3e-6
    assert cfg["trainer"]["default_local_dir"] == "checkpoints/verl_grpo_example_gsm8k/qwen2.5_3b_grpo_lora"


def test_unknown_flag_and_bad_value_exit_2():
    proc, _ = _run([sys.executable, "-m", "jaxrl.train", "--print-config", "--no-such-flag"])
    assert proc.returncode == 2 and "--no-such-flag" in proc.stderr
    proc, _ = _run([sys.executable, "-m", "jaxrl.train", "--print-config", "data.train_batch_size=abc"])
    assert proc.returncode == 2
    assert "jaxrl: config error: data.train_batch_size='abc'" in proc.stderr and "expected int" in proc.stderr
