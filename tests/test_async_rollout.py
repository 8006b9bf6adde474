"""The bounded-staleness pipeline (jaxrl.async_rollout) on a fake engine and data iterator: which weights generate
which batch, the data order, the checkpoint state and errors; the async_training config keys. The real runs (kill and
resume, learning on a split mesh) are in tests/e2e/test_async_slow.py."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from jaxrl.async_rollout import AsyncRollout, WholeBatches, batch_from_json, batch_to_json
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
        self.pipeline = AsyncRollout(staleness=k, total_steps=total, generator=WholeBatches(self.produce),
                                     sync_weights=self.sync, data=self.data)

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
        AsyncRollout(staleness=0, total_steps=3, generator=None, sync_weights=None, data=None)


@pytest.mark.parametrize("overrides, message", [
    (["async_training.staleness=-1"], "async_training.staleness=-1 is invalid"),
    (["async_training.partial_rollout=true", "async_training.staleness=1"], "needs staleness >= 2"),
    (["async_training.partial_rollout=true", "async_training.staleness=2", "algorithm.filter_groups.enable=true"],
     "does not combine with algorithm.filter_groups.enable=True"),
    (["async_training.staleness=1", "actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=2"],
     "needs an in-process JAX engine"),
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


# -- partial rollouts (jaxrl.partial_rollout) ------------------------------------------------------------------------

class FakeEngine:
    """Generates token ``100 * version + position`` at each position (the response's length so far counted from the
    prompt's end), so a test can read which weights made each token; rows listed in ``stop_at`` emit the stop token
    (7) once their response reaches that many tokens. Records every call's prompts."""

    STOP = 7

    def __init__(self, prompt_len: int, stop_at: dict[int, int]):
        self.version, self.prompt_len, self.stop_at, self.calls = 0, prompt_len, stop_at, []

    def generate(self, prompts, sp):
        from jaxrl.rollout.base import RolloutOutput

        self.calls.append([list(p) for p in prompts])
        rows = [p for p in prompts for _ in range(sp.n)]
        n, r = len(rows), sp.max_new_tokens
        ids, mask = np.zeros((n, r), np.int32), np.zeros((n, r), np.int32)
        for i, p in enumerate(rows):
            row, done = p[0], len(p) - self.prompt_len  # the first prompt token names the row; tokens so far
            for j in range(r):
                pos = done + j
                tok = self.STOP if self.stop_at.get(row) == pos + 1 else 100 * self.version + 10 + pos
                ids[i, j], mask[i, j] = tok, 1
                if tok == self.STOP:
                    break
        return RolloutOutput(prompt_ids=np.zeros((n, 1), np.int32), prompt_mask=np.ones((n, 1), np.int32),
                             response_ids=ids, response_mask=mask, rollout_log_probs=-mask.astype(np.float32) * 0.5,
                             prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int32), sp.n))


class FakePrompts:
    def __init__(self, rows):
        self.prompt_ids, self.indices, self.epoch = [[r, 1, 2] for r in rows], list(rows), 0


def _staged(engine, k=3, width=7, batches=None):
    from jaxrl.partial_rollout import StagedRollout
    from jaxrl.rollout.base import SamplingParams

    batches = batches if batches is not None else iter([[0, 1], [2, 3], [4, 5], [6, 7]])

    def finish(index, prompts, out, timings):
        b = RLBatch(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, response_ids=out.response_ids.copy(),
                    response_mask=out.response_mask.copy(), group_ids=out.prompt_index,
                    rollout_log_probs=out.rollout_log_probs.copy())
        return b, {"rows": float(len(prompts.indices))}, 0

    return StagedRollout(
        stages=k, response_width=width, generate=engine.generate,
        sampling=lambda index, stage, m, n: SamplingParams(n=1 if n is None else n, max_new_tokens=m, seed=index),
        draw=lambda: FakePrompts(next(batches)), prompts_of=lambda rows, epoch: FakePrompts(rows), finish=finish,
        stop_ids=(FakeEngine.STOP,))


def test_stage_lengths_cover_the_response():
    from jaxrl.partial_rollout import stage_lengths

    assert stage_lengths(7, 3) == [3, 3, 1]
    assert stage_lengths(48, 2) == [24, 24]
    with pytest.raises(ValueError, match="cannot cut 2 response tokens into 3 stages"):
        stage_lengths(2, 3)


def test_a_partial_rollout_continues_unfinished_rows_under_the_newer_weights():
    engine = FakeEngine(prompt_len=3, stop_at={1: 2})  # row 1 stops at its 2nd token, inside the first stage
    staged = _staged(engine)
    done = []
    for version in range(3):  # one stage per training step, each with that step's weights
        engine.version = version
        done += staged.work(1 if version == 0 else None, version)
    assert len(done) == 1 and done[0].index == 1
    b = done[0].batch
    # row 0: stage 0 (3 tokens, version 0), stage 1 (3 tokens, version 1), stage 2 (1 token, version 2)
    assert b.response_ids[0].tolist() == [10, 11, 12, 113, 114, 115, 216]
    assert b.policy_version[0].tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert b.response_mask[0].tolist() == [1] * 7
    # row 1 ended at its stop token in stage 0 and took no part in later stages
    assert b.response_ids[1, :2].tolist() == [10, FakeEngine.STOP] and b.response_mask[1].tolist() == [1, 1] + [0] * 5
    assert b.policy_version[1].tolist() == [0, 0] + [-1] * 5
    # stage 1 prompted the engine with row 0's prompt and its response so far, and nothing for row 1
    assert engine.calls[1] == [[0, 1, 2, 10, 11, 12]]
    assert engine.calls[2] == [[0, 1, 2, 10, 11, 12, 113, 114, 115]]
    assert done[0].timings["gen"] > 0 and done[0].metrics == {"rows": 2.0}


def test_partial_rollouts_in_the_pipeline_bound_every_token_by_the_staleness():
    from jaxrl.async_rollout import AsyncRollout

    k, total = 3, 6
    engine = FakeEngine(prompt_len=3, stop_at={})
    staged = _staged(engine, k=k, width=7, batches=iter([[2 * i, 2 * i + 1] for i in range(total)]))
    state = {"actor": 0}

    def sync():
        engine.version = state["actor"]
        return 1

    data = FakeData()
    p = AsyncRollout(staleness=k, total_steps=total, generator=staged, sync_weights=sync, data=data)
    for b in range(1, total + 1):
        if not p.started:
            p.start(b - 1)
        ready = p.take(b)
        lag = (b - 1) - ready.batch.policy_version[ready.batch.response_mask.astype(bool)]
        assert lag.max() <= k and lag.min() >= 1 if b > k else lag.max() <= b - 1, (b, lag)
        # stage s of batch b ran during step b - k + s with the weights of step b - k + s - 1 (>= 0)
        expected = [max(0, b - k + s - 1) for s in (0, 0, 0, 1, 1, 1, 2)]
        assert ready.batch.policy_version[0].tolist() == expected, b
        state["actor"] = b
        p.advance(b, sync=True)
    p.close()


def test_partial_rollout_state_resumes_the_batches_in_flight():
    def run(stop_after=None, resume=None):
        engine = FakeEngine(prompt_len=3, stop_at={3: 5})
        batches = iter([[2 * i, 2 * i + 1] for i in range(6)])
        staged = _staged(engine, k=2, width=7, batches=batches)
        out = []
        if resume is not None:
            staged.load_state(resume["state"])
            for _ in range(resume["drawn"]):
                next(batches)
        for version in range(resume["version"] if resume else 0, 5):
            engine.version = version
            index = version + 1 if version + 1 <= 4 else None
            out += staged.work(index, version)
            if version == stop_after:
                return out, {"state": json.loads(json.dumps(staged.state())), "version": version + 1,
                             "drawn": version + 1}
        return out, None

    whole, _ = run()
    first, saved = run(stop_after=1)
    rest, _ = run(resume=saved)
    got = first + rest
    assert [r.index for r in got] == [r.index for r in whole] == [1, 2, 3, 4]
    for a, b in zip(whole, got):
        for name in ("response_ids", "response_mask", "rollout_log_probs", "policy_version"):
            np.testing.assert_array_equal(getattr(a.batch, name), getattr(b.batch, name))


@pytest.mark.parametrize("engine", ["jax", "jetstream"])
def test_a_real_run_with_partial_rollouts_tags_every_token(shared, tmp_path, engine):
    """The quickstart model, 4 tiny steps, staleness 2 with partial rollouts on the embedded sampler and on the
    continuous-batching JetStream engine: batch b's first 6 tokens come from the weights of step b - 3, the last 6 from
    those of step b - 2 (clipped at 0), so the staleness is 0, 1, then 1.5 on average and 2 at most."""
    from jaxrl.trainer import run_training
    from tests.test_trainer import tiny_run_overrides

    cfg = load_config("configs/quickstart.yaml", tiny_run_overrides(tmp_path, [
        "trainer.total_training_steps=4", "trainer.test_freq=-1", "async_training.staleness=2",
        "async_training.partial_rollout=true", f"actor_rollout_ref.rollout.name={engine}"]))
    run_training(cfg)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["async/staleness/max"] for r in records] == [0, 1, 2, 2]
    assert [r["async/staleness/mean"] for r in records][:2] == [0, 1]
    assert all(1 < r["async/staleness/mean"] < 2 for r in records[2:])  # rows that stop early have no late tokens
    assert all(r["sync/bytes"] == 0 and r["timing_s/wait_prev_gen"] >= 0 for r in records)
    assert records[0]["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-3)  # batch 1: the trained weights
