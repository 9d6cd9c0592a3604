"""Bring-your-own jobs on Ray: dict batches with a collate, a ``(loss_sum, weight)`` loss over
padded sequences, a generic torch.optim optimizer with parameter groups, clipping,
warmup-cosine, split passes and mixed precision keep the trajectory of a single worker through
a SIGKILL and a resume on another worker count; bad losses fail the job naming the field."""

from __future__ import annotations

import pytest
import torch

from jobspec.step_record import read_telemetry
from orchestrator.job.reading import load_job
from orchestrator.launch import run_job
from tests.helpers.jobs import assert_same_params, jsonl, params, run
from workers.data.sampler import ShardSampler

pytestmark = pytest.mark.usefixtures("ray_cluster")

H = "tests.helpers.losses"
OWN_JOB = (
    f"model={{factory: '{H}:make_model', kwargs: {{width: 32, max_batch: 5}}}}",
    f"dataset={{factory: '{H}:make_sequences', kwargs: {{n: 320}}, collate: '{H}:pad_collate'}}",
    f"loss={H}:token_loss",
    "optimizer={name: RAdam, kwargs: {lr: 0.01, weight_decay: 0.1}, decay_biases_and_norms: false, clip_grad_norm: 0.5}",
    # total_steps: the 12-step first part of a split run decays as the whole 25-step run does
    "schedule={name: warmup_cosine, warmup_steps: 3, min_lr_ratio: 0.1, total_steps: 25}",
    "worker.max_samples_per_pass=5",  # the model refuses larger passes
    "batch_size=40",
    "shards=8",
    "checkpoint.every_steps=6",
)
EVAL = (
    f"eval={{factory: '{H}:make_sequences', kwargs: {{n: 30, seed: 1}}, collate: '{H}:pad_collate', "
    f"metrics: '{H}:token_accuracy', batch_size: 5}}"
)


def _kill(at_step: int, worker: int) -> str:
    return f"chaos.kill=[{{at_step: {at_step}, worker: {worker}, how: sigkill}}]"


def _steps(run_dir) -> dict[int, dict]:
    return {e["step"]: e for e in jsonl(run_dir / "events.jsonl") if e["event"] == "step"}


def _split_run_with_kills(tmp_path, name: str, *job: str):
    """12 steps on 2 workers (one SIGKILLed at step 5), then resumed on 3 to step 25 (one
    SIGKILLed at step 18)."""
    first = run(tmp_path, name, "steps=12", "scaling.workers=2", _kill(5, 1), *job)
    assert first.summary["events"]["failures"] == 1
    second = run(tmp_path, name, "scaling.workers=3", _kill(18, 2), *job)
    assert second.summary["events"]["failures"] == 1
    assert [e["checkpoint"] for e in jsonl(second.run_dir / "events.jsonl") if e["event"] == "resume"] == ["step-00000012"]
    return second


def test_an_own_job_keeps_the_single_worker_trajectory_through_a_kill_and_a_resume(tmp_path, one_worker):
    reference = one_worker(*OWN_JOB, EVAL)
    steps = _steps(reference.run_dir)
    # Token counts differ from shard to shard (padding): the weight is the step's real tokens.
    assert len({e["weight"] for e in steps.values()}) > 5 and all(e["weight"] < 40 * 12 for e in steps.values())
    assert any(e["grad_norm"] > 0.5 for e in steps.values())  # clipping was active
    assert all(e["weight_per_s"] > 0 for e in steps.values())
    records = read_telemetry(reference.run_dir / "telemetry.jsonl")
    assert all(r["weight_per_s"] > 0 and r["lr"] == steps[r["step"]]["lr"] for r in records)
    assert steps[0]["lr"] == pytest.approx(0.01 / 3) and steps[2]["lr"] == pytest.approx(0.01)
    metrics = next(e for e in jsonl(reference.run_dir / "events.jsonl") if e["event"] == "eval")["metrics"]
    assert {"loss", "token_accuracy", "samples"} <= metrics.keys() and metrics["samples"] == 30
    split = _split_run_with_kills(tmp_path, "split", *OWN_JOB)
    assert_same_params(params(split.run_dir), reference, "own job: kill + resume")
    assert {s: e["lr"] for s, e in _steps(split.run_dir).items()} == pytest.approx({s: e["lr"] for s, e in steps.items()})


def test_one_worker_takes_the_steps_of_a_plain_pytorch_loop(one_worker):
    """The anchor for the invariance tests (which compare runs with each other): the token-mean
    gradient, clipped to the global norm, stepped by SGD, is what a plain loop over the same
    batches computes (to float noise: the loop sums the step's batch in one pass)."""
    from tests.helpers import losses

    job = (
        *[o for o in OWN_JOB if not o.startswith(("optimizer=", "schedule="))],
        "optimizer={name: sgd, kwargs: {lr: 0.5}, clip_grad_norm: 0.5}", "steps=4",
    )
    ours = one_worker(*job)
    torch.manual_seed(0)
    data = losses.make_sequences(n=320)
    model = losses.make_model(width=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler = ShardSampler(len(data), 40, 8, 0)
    for step in range(4):
        indices = [int(i) for shard in range(8) for i in sampler.shard_indices(step, shard)]
        total, weight = losses.token_loss(model, losses.pad_collate([data[i] for i in indices]))
        optimizer.zero_grad()
        (total / weight).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    assert_same_params({k: v.detach() for k, v in model.state_dict().items()}, ours, "plain PyTorch")


def test_bf16_autocast_keeps_the_trajectory_within_bf16_tolerance(tmp_path):
    """bf16 matmuls round each shard group differently, so parameters agree to ~1e-2, not
    1e-5 (the float32 tolerance): the tolerance here (and for fp16) is rtol 2e-2, atol 2e-3."""
    job = (*OWN_JOB, "precision=bf16")
    reference = run(tmp_path, "one", "scaling.workers=1", *job)
    split = _split_run_with_kills(tmp_path, "split", *job)
    _assert_close_in_half_precision(params(split.run_dir), params(reference.run_dir), "bf16")


def _assert_close_in_half_precision(got: dict, want: dict, name: str) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=2e-2, atol=2e-3, msg=f"{name}: {key}")


def _overflow_steps(job_steps: int, batch: int, shards: int, hot: int, shuffle: str = "index") -> list[int]:
    sampler = ShardSampler(256, batch, shards, 0, shuffle=shuffle)
    return [s for s in range(job_steps) if any(hot in sampler.shard_indices(s, k) for k in range(shards))]


def test_fp16_skips_an_overflowing_step_on_every_replica_alike(tmp_path):
    job = (
        f"model={{factory: '{H}:make_regressor'}}", f"dataset={{factory: '{H}:make_overflow_dataset'}}",
        "loss=mse", "precision=fp16", "loss_scaling={init: 1024, growth_interval: 1000}",
        "batch_size=32", "shards=4", "steps=20",
    )
    hot = _overflow_steps(20, 32, 4, hot=7)
    assert hot  # the huge sample is in some step of the run
    one = run(tmp_path, "one", "scaling.workers=1", *job)
    two = run(tmp_path, "two", "scaling.workers=2", *job)
    for result in (one, two):
        assert [s for s, e in _steps(result.run_dir).items() if e.get("skipped")] == hot
        records = read_telemetry(result.run_dir / "telemetry.jsonl")
        assert {r["step"] for r in records if r["skipped"]} == set(hot)
        assert all(r["skipped"] == (r["step"] in hot) for r in records)  # every rank alike
    _assert_close_in_half_precision(params(two.run_dir), params(one.run_dir), "fp16 with a skipped step")


def test_fp16_loss_scale_and_trajectory_survive_a_sigkill_and_a_resume(tmp_path):
    """Sample 0 (in steps 0, 10, 20 and 24) overflows at a loss scale of 2048 or more: from 8192
    the scale backs off in steps 0, 10 and 20, and step 24 (at 1024) is applied. Only if the
    loss scale goes with the state, to a replacement at its join and into the checkpoint and
    back, do the killed and resumed run skip those same steps and end where one worker does.
    The epochs are whole permutations (``dataset.shuffle: permutation``, a fixed order) so that
    sample 0 stays in the steps the kills (5, 18) and the resume (12) are placed around."""
    job = (
        f"model={{factory: '{H}:make_regressor'}}", f"dataset={{factory: '{H}:make_overflow_dataset', kwargs: {{hot: null, warm: 0}}}}",
        "loss=mse", "precision=fp16", "loss_scaling={init: 8192, growth_interval: 1000}",
        "batch_size=32", "shards=4", "checkpoint.every_steps=6", "dataset.shuffle=permutation",
    )
    assert _overflow_steps(25, 32, 4, hot=0, shuffle="permutation") == [0, 10, 20, 24]
    reference = run(tmp_path, "one", "scaling.workers=1", *job)
    split = _split_run_with_kills(tmp_path, "split", *job)
    for result in (reference, split):
        assert [s for s, e in _steps(result.run_dir).items() if e.get("skipped")] == [0, 10, 20]
        assert all(r["skipped"] == (r["step"] in (0, 10, 20)) for r in read_telemetry(result.run_dir / "telemetry.jsonl"))
    _assert_close_in_half_precision(params(split.run_dir), params(reference.run_dir), "fp16 through a kill and a resume")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ((f"loss={H}:wrong_shape_loss",), "field 'loss' (tests.helpers.losses:wrong_shape_loss) returned a tensor of shape (1,): expected per-sample losses of shape"),
        ((f"loss={H}:nan_weight_loss",), "field 'loss' (tests.helpers.losses:nan_weight_loss) returned weight nan"),
        (("schedule={name: 'json:loads'}",), "field 'schedule.name'"),
        ((f"loss={H}:exploding_loss",), "step 0: the reduced gradient is not finite"),
        ((f"model={{factory: '{H}:make_bf16_digits_model'}}",), "field 'model.factory': the model's parameters are torch.bfloat16"),
    ],
)
def test_a_bad_loss_schedule_or_model_fails_the_job_saying_why(tmp_path, overrides, expected):
    job = load_job(None, ["steps=3", "eval=null", "scaling.workers=2", *overrides])
    result = run_job(job, run_dir=tmp_path / "bad")
    assert result.summary["status"] == "failed"
    assert expected in result.summary["error"]


def test_a_function_schedule_gives_its_rates_on_any_worker_count(tmp_path, one_worker):
    schedule = (f"schedule={{name: '{H}:halving_schedule', warmup_steps: 2}}", "optimizer.kwargs={lr: 0.01}", "steps=12")
    one = one_worker(*schedule)
    three = run(tmp_path, "three", "scaling.workers=3", *schedule)
    rates = {s: e["lr"] for s, e in _steps(three.run_dir).items()}
    assert rates == pytest.approx({0: 0.005, 1: 0.01, **{s: 0.01 * 0.5 ** (s // 5) for s in range(2, 12)}})
    assert_same_params(params(three.run_dir), one, "function schedule")
