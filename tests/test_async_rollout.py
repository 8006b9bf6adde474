"""The bounded-staleness pipeline (jaxrl.async_rollout) on a fake engine and data iterator: which weights generate
which batch, the data order, the checkpoint state and errors; the async_training config keys. The real runs (kill and
resume, learning on a split mesh) are in tests/e2e/test_async_slow.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from jaxrl.async_rollout import AsyncRollout, batch_from_json, batch_to_json
from jaxrl.batch import RLBatch
from jaxrl.config import ConfigError, load_config


class FakeData:
    """A prompt iterator whose position is a counter."""

    def __init__(self):
        self.pos = 0

    def draw(self) -> int:
        self.pos += 1
        return self.pos - 1

    def get_state(self) -> dict:
        return {"pos": self.pos}

    def set_state(self, state) -> None:
        self.pos = state["pos"]


class FakeRun:
    """A trainer loop around the pipeline: the 'engine' generates with the weights version it last received, the
    'actor' reaches version b at the end of step b. Generation takes ``gen_s`` and checks that nobody syncs meanwhile."""

    def __init__(self, k: int, total: int, *, gen_s: float = 0.01, fail_at: int | None = None):
        self.actor_version = 0
        self.engine_version = 0
        self.generating = threading.Event()
        self.data = FakeData()
        self.gen_s, self.fail_at = gen_s, fail_at
        self.pipeline = AsyncRollout(staleness=k, total_steps=total, produce=self.produce, sync_weights=self.sync,
                                     data=self.data)

    def produce(self, index: int):
        self.generating.set()
        try:
            time.sleep(self.gen_s)
            if index == self.fail_at:
                raise ValueError(f"reward failed on batch {index}")
            pos, version = self.data.draw(), self.engine_version
            n = 4
            batch = RLBatch(prompt_ids=np.full((n, 2), pos, np.int32), prompt_mask=np.ones((n, 2), np.int32),
                            response_ids=np.full((n, 3), version, np.int32), response_mask=np.ones((n, 3), np.int32),
                            group_ids=np.arange(n, dtype=np.int32) // 2,
                            rollout_log_probs=np.random.default_rng(index).normal(size=(n, 3)).astype(np.float32))
            return batch, {"reward/score": index * 10.0 + version}, {"gen": self.gen_s}, 0
        finally:
            self.generating.clear()

    def sync(self) -> int:
        assert not self.generating.is_set(), "weights synced while the engine was generating"
        self.engine_version = self.actor_version
        return 100

    def step(self, b: int) -> tuple:
        p = self.pipeline
        if not p.started:
            p.start(b - 1)
        ready = p.take(b)
        staleness = p.staleness_metrics(ready, trained_version=b - 1)
        self.actor_version = b  # the update
        end = p.advance(b, sync=True)
        return ready, staleness, end


@pytest.mark.parametrize("k", [1, 2, 3])
def test_each_batch_is_generated_by_the_weights_k_steps_back(k):
    run, total = FakeRun(k, total=8), 8
    for b in range(1, total + 1):
        ready, staleness, end = run.step(b)
        expected = max(0, b - 1 - k)
        assert ready.index == b and ready.version == expected
        assert (ready.batch.policy_version == expected).all()
        assert (ready.batch.response_ids == expected).all()  # the engine really held that version
        assert ready.batch.prompt_ids[0, 0] == b - 1  # batches drew the prompts in step order
        assert staleness["async/staleness/max"] == (b - 1) - expected <= k
        assert end["sync/bytes"] == 100
    run.pipeline.close()
    assert run.data.pos == total  # no batch generated beyond the run's last step


def test_the_generation_overlaps_the_step_and_the_end_of_step_waits_for_it():
    run = FakeRun(1, total=4, gen_s=0.2)
    run.step(1)
    ready = run.pipeline.take(2)  # batch 3 is generating now (launched at the end of step 1)
    time.sleep(0.1)  # "training" for half the generation
    end = run.pipeline.advance(2, sync=True)
    assert 0.05 < end["timing_s/wait_prev_gen"] < 0.25
    assert 0.05 < end["timing_s/gen_overlap"] <= 0.2
    assert ready.version == 0
    run.pipeline.close()


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("saved_after", [1, 3, 6])
def test_a_run_resumed_from_the_checkpoint_state_continues_as_the_uninterrupted_one(k, saved_after):
    total = 7
    whole = FakeRun(k, total)
    expected = [whole.step(b)[0] for b in range(1, total + 1)]

    first = FakeRun(k, total, gen_s=0.05)
    for b in range(1, saved_after + 1):
        first.step(b)
    state = first.pipeline.state()  # taken while the next batch is still generating
    data_state = state["data_state"]
    first.pipeline.close()  # the process dies

    second = FakeRun(k, total)
    second.data.set_state(data_state)  # RunCheckpoints restores the data position it saved
    second.actor_version = second.engine_version = saved_after  # the checkpoint's weights, synced at resume
    second.pipeline.load_state(state)
    got = [second.step(b)[0] for b in range(saved_after + 1, total + 1)]
    for a, b in zip(expected[saved_after:], got):
        assert (a.index, a.version, a.metrics) == (b.index, b.version, b.metrics)
        for name in ("prompt_ids", "response_ids", "rollout_log_probs", "policy_version"):
            np.testing.assert_array_equal(getattr(a.batch, name), getattr(b.batch, name))
    assert len(state["buffer"]) == min(k, total - saved_after)  # the finished batches ahead, no more


def test_a_generation_error_reaches_the_trainer_thread():
    run = FakeRun(1, total=5, fail_at=3)
    run.step(1)  # batch 3 is launched at the end of step 1 and fails on the thread
    with pytest.raises(ValueError, match="reward failed on batch 3"):
        run.step(2)
    run.pipeline.close()


def test_a_checkpoint_of_another_staleness_is_refused():
    run = FakeRun(2, total=4)
    run.step(1)
    state = run.pipeline.state()
    run.pipeline.close()
    with pytest.raises(ValueError, match="staleness=2 differs from this run's 1"):
        FakeRun(1, total=4).pipeline.load_state(state)


def test_batches_round_trip_through_json_bit_for_bit():
    rng = np.random.default_rng(0)
    b = RLBatch(prompt_ids=rng.integers(0, 100, (3, 5)).astype(np.int32), prompt_mask=np.ones((3, 5), np.int32),
                response_ids=rng.integers(0, 100, (3, 4)).astype(np.int32), response_mask=np.ones((3, 4), np.int32),
                group_ids=np.array([0, 0, 1], np.int32), rollout_log_probs=rng.normal(size=(3, 4)).astype(np.float32),
                token_level_scores=np.array([[np.nan, 1e-38, -0.0, 3.4e38]] * 3, np.float32),
                policy_version=np.array([4, 4, 4], np.int32))
    back = batch_from_json(batch_to_json(b))
    for name, v in vars(b).items():
        w = getattr(back, name)
        if v is None:
            assert w is None
        else:
            assert w.dtype == v.dtype and w.shape == v.shape and w.tobytes() == v.tobytes(), name


def test_staleness_zero_is_not_a_pipeline():
    with pytest.raises(ValueError, match="staleness=0"):
        AsyncRollout(staleness=0, total_steps=3, produce=None, sync_weights=None, data=None)


@pytest.mark.parametrize("overrides, message", [
    (["async_training.staleness=-1"], "async_training.staleness=-1 is invalid"),
    (["async_training.partial_rollout=true"], "async_training.partial_rollout=True is not supported"),
    (["async_training.staleness=1", "actor_rollout_ref.rollout.name=jetstream"], "needs actor_rollout_ref.rollout.name"),
    (["async_training.trigger_parameter_sync_step=4"], "only 1 is valid"),
])
def test_bad_async_settings_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config("configs/quickstart.yaml", overrides)
    assert "\n" not in str(e.value)


def test_verl_fully_async_keys_are_accepted_with_a_note():
    cfg = load_config("configs/quickstart.yaml", ["async_training.staleness=2",
                                                  "async_training.staleness_threshold=0.1",
                                                  "async_training.use_rollout_log_probs=true"])
    assert cfg.async_training.staleness == 2
