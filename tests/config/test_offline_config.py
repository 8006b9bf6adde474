"""The offline trainers' configs and command lines (``python -m jaxrl.sft`` / ``jaxrl.dpo``), and the RL config's
online-DPO section: verl's SFT keys, one-line errors with the right exit status before jax loads, notes for verl
keys with no JAX meaning, the preference loss's declared options."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from jaxrl.config import ConfigError, load_config
from jaxrl.config.offline_loader import load_offline_config, load_offline_config_with_notes
from jaxrl.paths import REPO_ROOT

# verl's examples/sft/gsm8k/run_qwen_05_peft.sh overrides (LoRA aside: full fine-tuning only), verbatim
VERL_SFT = [
    "data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet",
    "data.prompt_key=extra_info", "data.response_key=extra_info", "optim.lr=1e-4",
    "data.prompt_dict_keys=['question']", "+data.response_dict_keys=['answer']", "data.micro_batch_size_per_gpu=4",
    "model.partial_pretrain=Qwen/Qwen2.5-0.5B-Instruct", "trainer.default_local_dir=/tmp/x",
    "trainer.project_name=gsm8k-sft", "trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct",
    "trainer.logger=console", "trainer.total_epochs=1", "ulysses_sequence_parallel_size=1", "use_remove_padding=true",
    "model.fsdp_config.cpu_offload=False", "model.strategy=fsdp2",
]


def test_verl_sft_command_line_loads_with_notes():
    loaded = load_offline_config_with_notes("sft", None, VERL_SFT)
    d = loaded.config.data
    assert (d.prompt_key, d.prompt_dict_keys, d.response_key, d.response_dict_keys) == (
        "extra_info", ["question"], "extra_info", ["answer"])
    assert loaded.config.optim.lr == 1e-4 and loaded.config.trainer.logger == ["console"]
    assert d.train_files == ["/data/gsm8k/train.parquet"] and d.seed == loaded.config.trainer.seed
    noted = {n.key for n in loaded.notes}
    assert noted == {"ulysses_sequence_parallel_size", "use_remove_padding", "model.fsdp_config.cpu_offload",
                     "model.strategy"}


@pytest.mark.parametrize("kind,overrides,message", [
    ("sft", ["data.respons_key=x"], "Unknown config key 'data.respons_key'; did you mean 'data.response_key'?"),
    ("sft", ["model.lora_rank=32"], "model.lora_rank=32 is not supported: LoRA is not supported yet"),
    ("sft", ["data.micro_batch_size_per_gpu=3"], "data.micro_batch_size_per_gpu=3 must divide each device's share "
                                                 "of data.train_batch_size=256"),
    ("sft", ["data.truncation=middle"], "data.truncation='middle' is invalid; expected one of 'error', 'left', "
                                        "'right'"),
    ("sft", ["optim.lr_scheduler=wsd"], "optim.lr_scheduler='wsd' is invalid; expected one of 'cosine', 'constant'"),
    ("dpo", ["model.recompute_granularity=block"],
     "model.recompute_granularity='block' is invalid; expected one of 'full', 'selective'"),
    ("sft", ["trainer.nnodes=2"], "trainer.nnodes=2 is invalid; expected 1: the offline trainers run in one process"),
    ("sft", ["algorithm.dpo.beta=0.1"], "Unknown config key 'algorithm.dpo.beta'"),
    ("dpo", ["algorithm.dpo.beta=0"], "algorithm.dpo.beta=0.0 is invalid; expected a finite number in (0.0, inf)"),
    ("dpo", ["algorithm.dpo.loss_type=kto"], "algorithm.dpo.loss_type='kto' is invalid; expected one of 'sigmoid', "
                                             "'ipo', 'hinge', 'robust'"),
    ("dpo", ["algorithm.dpo.loss_type=ipo", "algorithm.dpo.label_smoothing=0.1"],
     "algorithm.dpo.label_smoothing=0.1 is set, but algorithm.dpo.loss_type='ipo' does not take it"),
    ("dpo", ["algorithm.dpo.loss_type=robust", "algorithm.dpo.label_smoothing=0.5"],
     "algorithm.dpo.label_smoothing=0.5 is invalid; expected a finite number in [0.0, 0.5)"),
    ("dpo", ["data.response_key=x"], "Unknown config key 'data.response_key'"),
])
def test_bad_values_name_the_key(kind, overrides, message):
    with pytest.raises(ConfigError) as e:
        load_offline_config(kind, None, overrides)
    assert message in str(e.value)


def test_shipped_configs_load():
    cfg = load_offline_config("sft", REPO_ROOT / "configs/sft_gsm8k_smollm2_135m.yaml")
    assert cfg.data.response_dict_keys == ["answer"] and cfg.data.filter_overlong
    dpo = load_offline_config("dpo", REPO_ROOT / "configs/dpo_stories260k.yaml")
    assert dpo.algorithm.dpo.loss_type == "sigmoid" and dpo.data.chosen_key == "chosen"
    online = load_config(REPO_ROOT / "configs/online_dpo_quickstart.yaml")
    assert online.algorithm.dpo.enable and online.actor_rollout_ref.rollout.n >= 2


@pytest.mark.parametrize("overrides,message", [
    (["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n=1 must be >= 2"),
    (["actor_rollout_ref.actor.use_kl_loss=true"], "does not combine with actor_rollout_ref.actor.use_kl_loss=True"),
    (["algorithm.adv_estimator=gae"], "does not combine with algorithm.adv_estimator='gae'"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
     "ppo_micro_batch_size_per_gpu=3 counts pairs and must divide actor_rollout_ref.actor.ppo_mini_batch_size=16"),
    (["algorithm.dpo.loss_type=hinge", "algorithm.dpo.label_smoothing=0.2"],
     "algorithm.dpo.label_smoothing=0.2 is set, but algorithm.dpo.loss_type='hinge' does not take it"),
])
def test_online_dpo_refuses_what_it_cannot_run(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/online_dpo_quickstart.yaml", overrides)
    assert message in str(e.value)


def test_online_dpo_refuses_lora_naming_both_keys():
    """The preference role trains the full model: online DPO with actor LoRA is one config error naming both keys;
    either alone loads."""
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/online_dpo_quickstart.yaml", ["actor_rollout_ref.model.lora_rank=8"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("algorithm.dpo.enable=True does not combine with actor_rollout_ref.model.lora_rank=8")
    assert load_config(REPO_ROOT / "configs/online_dpo_quickstart.yaml",
                       ["actor_rollout_ref.model.lora_rank=0"]).algorithm.dpo.enable
    grpo = load_config(REPO_ROOT / "configs/online_dpo_quickstart.yaml",
                       ["algorithm.dpo.enable=false", "actor_rollout_ref.model.lora_rank=8"])
    assert grpo.actor_rollout_ref.model.lora_rank == 8


# ------------------------------------------------------------------------------------------------ the CLIs
def _cli(kind, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", f"jaxrl.{kind}", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_cli_config_errors_exit_2_on_one_line_without_jax(kind):
    proc = _cli(kind, "--config", "no/such.yaml")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["jaxrl: config error: config file 'no/such.yaml' does not exist "
                                                "(--config expects a YAML file)"]
    proc = _cli(kind, "data.train_batch_size=0")
    assert proc.returncode == 2 and proc.stderr.startswith("jaxrl: config error: data.train_batch_size=0 is invalid")
    proc = _cli(kind, "--bogus")
    assert proc.returncode == 2 and "jaxrl: error: unrecognized arguments: --bogus" in proc.stderr


def test_cli_print_config_round_trips(tmp_path):
    proc = _cli("sft", "--config", "configs/sft_gsm8k_smollm2_135m.yaml", "--print-config", "optim.lr=3e-5")
    assert proc.returncode == 0, proc.stderr
    dumped = tmp_path / "c.yaml"
    dumped.write_text(proc.stdout)
    assert yaml.safe_load(proc.stdout)["optim"]["lr"] == 3e-5
    again = load_offline_config("sft", dumped)
    assert again == load_offline_config("sft", "configs/sft_gsm8k_smollm2_135m.yaml", ["optim.lr=3e-5"])


def test_cli_missing_data_file_exits_1_naming_it(tmp_path):
    proc = _cli("sft", "model.partial_pretrain=stories260K", f"data.train_files={tmp_path}/nope.jsonl",
                "data.val_files=null", f"trainer.default_local_dir={tmp_path}/run", timeout=300)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxrl: error: data.train_files: data file") and "nope.jsonl" in last


def test_cli_malformed_row_exits_1_naming_file_and_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "a", "answer": "b"}\n{"question": "c"}\n')
    proc = _cli("sft", "model.partial_pretrain=stories260K", f"data.train_files={data}", "data.val_files=null",
                f"trainer.default_local_dir={tmp_path}/run", timeout=300)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{data}:2: malformed line 2: missing 'answer'" in last and last.startswith("jaxrl: error:")


@pytest.mark.parametrize("checkpointing, granularity, expected", [
    ("true", "selective", (True, "selective")), ("true", "full", (True, "full")),
    ("false", "selective", (False, "full"))])
def test_offline_model_is_built_with_the_recompute_granularity(shared, checkpointing, granularity, expected):
    """model.recompute_granularity reaches the decoder the SFT / DPO trainer loads (when checkpointing is on)."""
    from jaxrl.offline.build import _load_model

    cfg = load_offline_config("dpo", REPO_ROOT / "configs" / "dpo_stories260k.yaml", [
        f"model.enable_gradient_checkpointing={checkpointing}", f"model.recompute_granularity={granularity}"])
    pre, _ = _load_model(cfg)
    assert (pre.model.remat, pre.model.remat_policy) == expected
