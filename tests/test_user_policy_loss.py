"""A policy loss the user registers in their own file (``algorithm.external_lib``) trains the quickstart.

``python -m jaxrl.train`` imports the file while it loads the config (so ``loss_mode`` accepts the new name), the
actor calls the loss with the option it declares, by name, and the metrics it returns are logged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

USER_LOSS = """
    import jax.numpy as jnp

    from jaxrl.algorithms.agg import agg_loss
    from jaxrl.algorithms.registry import register_policy_loss


    @register_policy_loss("reinforce_echo", options=("ppo_kl_coef",))
    def reinforce_echo(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                       num_tokens=None, num_seqs=None, ppo_kl_coef=0.1, **unused):
        '''REINFORCE (-A * log p), plus two metrics that prove it ran: a marker and the option it was given.'''
        loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
        zero = jnp.zeros((), jnp.float32)
        return loss, {"pg_clipfrac": zero, "ppo_kl": zero, "pg_clipfrac_lower": zero,
                      "user_loss_marker": jnp.ones((), jnp.float32), "echo_coef": jnp.asarray(ppo_kl_coef, jnp.float32)}
"""

OVERRIDES = [
    "data.train_batch_size=4", "data.max_response_length=10", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "trainer.logger=[jsonl]",
]


@pytest.mark.slow
def test_quickstart_trains_with_a_user_registered_policy_loss(shared, tmp_path):
    lib = tmp_path / "my_losses.py"
    lib.write_text(textwrap.dedent(USER_LOSS))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", *OVERRIDES,
           f"algorithm.external_lib={lib}", "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce_echo",
           "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.375", f"trainer.default_local_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, log[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["actor/user_loss_marker"] == pytest.approx(1.0)
        assert r["actor/echo_coef"] == pytest.approx(0.375, rel=1e-5)  # the declared option reached it by name
        assert r["actor/pg_clipfrac"] == 0.0 and r["actor/grad_norm"] > 0


def test_an_undeclared_option_of_the_user_loss_fails_at_load(tmp_path):
    """The same file and loss, with a policy_loss option the loss does not declare: exit 2 before jax loads."""
    lib = tmp_path / "my_losses.py"
    lib.write_text(textwrap.dedent(USER_LOSS))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml", f"algorithm.external_lib={lib}",
         "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce_echo",
         "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.01", f"trainer.default_local_dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert ("actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.01 is set, but "
            "actor_rollout_ref.actor.policy_loss.loss_mode='reinforce_echo' does not take it (the options of "
            "'reinforce_echo': ppo_kl_coef)") in proc.stderr
    assert not (tmp_path / "run").exists()
