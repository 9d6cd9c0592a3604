"""The benchmarks' torchft contender (Ray Train + ``TorchftConfig``): it is fed the same shards,
survives a SIGKILLed replica (replaced alone, healed from a live peer), and the recovery figures
read from its step logs count what it dropped."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.recovery import param_diff
from benchmarks.recovery_baseline import run_torchft_recovery
from benchmarks.torchft_entry import ATTEMPTS, summarize
from benchmarks.torchft_loop import torchft_shards
from benchmarks.workloads import workload_job
from jobspec.job import JobConfig
from workers.data.sampler import ShardSampler


def _job(steps: int, **updates: object) -> JobConfig:
    job = workload_job("digits", workers=2, steps=steps)
    # A tiny model and half a CPU a worker: the test suite's machine has two cores for everything.
    data = job.model_dump(mode="json")
    data["model"]["kwargs"] = {"hidden": 16, "depth": 1}
    data["scaling"]["resources_per_worker"] = {"CPU": 0.5}
    return JobConfig.model_validate({**data, **updates})


def test_torchft_sampler_deals_the_same_shards_round_robin():
    assert torchft_shards(16, 1, 4) == [1, 5, 9, 13]
    dealt = sorted(s for r in range(4) for s in torchft_shards(16, r, 4))
    assert dealt == list(range(16))  # every shard of the step, once
    with pytest.raises(ValueError, match=r"job.shards \(16\) must be a multiple of the workers \(3\)"):
        torchft_shards(16, 0, 3)


def _write_attempts(scratch: Path, kill: dict, attempts: list[dict]) -> None:
    (scratch / "kill.json").write_text(json.dumps(kill) + "\n")
    for replica in (0, 1):
        lines = [json.dumps(a) for a in attempts if a["replica"] == replica]
        (scratch / ATTEMPTS.format(replica=replica)).write_text("\n".join(lines) + "\n")


def _attempt(replica: int, pid: int, step: int, time: float, *, committed: bool = True, participants: int = 2,
             participating: bool = True, data_step: int | None = None) -> dict:
    # pids 10 and 11 are the replicas' first lives; later pids are replacements.
    return {"replica": replica, "pid": pid, "step": step, "data_step": step if data_step is None else data_step,
            "committed": committed, "participants": participants, "participating": participating,
            "weight": 1.0, "samples": 0, "time": time, "first_life": pid in (10, 11)}


def _killed_in_step_3() -> list[dict]:
    # Replica 1 (pid 11) dies in step 3 at t=10, just as replica 0 commits step 2 (t=10.2);
    # replica 0 fails step 3 once, then commits 3, 4 alone; the replacement (pid 12) fails its
    # first try, heals in step 5 (its gradient zeroed), both take part from 6.
    attempts = [a for step in range(2) for a in (_attempt(0, 10, step, step), _attempt(1, 11, step, step))]
    attempts += [
        _attempt(1, 11, 2, 9.9), _attempt(0, 10, 2, 10.2),
        _attempt(0, 10, 3, 10.5, committed=False),
        _attempt(1, 12, 0, 24.0, committed=False, participants=1, participating=False),
        _attempt(0, 10, 3, 15.0, participants=1), _attempt(0, 10, 4, 15.1, participants=1),
        _attempt(0, 10, 5, 25.0, participants=1), _attempt(1, 12, 5, 25.0, participants=1, participating=False, data_step=0),
        _attempt(0, 10, 6, 25.1), _attempt(1, 12, 6, 25.1), _attempt(0, 10, 7, 25.2), _attempt(1, 12, 7, 25.2),
    ]
    return attempts


def test_summary_counts_the_dead_and_healing_replicas_shards_as_dropped(tmp_path):
    job = _job(8)
    _write_attempts(tmp_path, {"time": 10.0, "step": 3, "rank": 1}, _killed_in_step_3())
    result = summarize(tmp_path, job, kill_rank=1, wall_s=30.0)
    sampler = ShardSampler(1, job.batch_size, job.shards, job.seed)
    half = sum(b - a for a, b in (sampler.shard_bounds(3, s) for s in torchft_shards(job.shards, 1, 2)))
    assert result["recovery_s"] == pytest.approx(5.0) and result["full_size_s"] == pytest.approx(15.1)
    assert result["steps_dropped_from"] == [3, 4, 5] and result["samples_dropped"] == 3 * half == 3 * job.batch_size // 2
    assert result["steps_lost"] == 0 and result["split_brain"] == 0 and result["lives"] == 3
    assert result["failed_attempts"] == 2 and result["unaccounted_participants"] == 0


def test_summary_counts_a_step_committed_again_as_lost(tmp_path):
    # As if the survivor had rolled back: it commits step 4 a second time.
    attempts = [*_killed_in_step_3(), _attempt(0, 10, 4, 15.2, participants=1)]
    _write_attempts(tmp_path, {"time": 10.0, "step": 3, "rank": 1}, attempts)
    assert summarize(tmp_path, _job(8), kill_rank=1, wall_s=30.0)["steps_lost"] == 1


def test_summary_leaves_out_a_replacement_that_came_after_the_survivors_finished(tmp_path):
    job = _job(4)
    attempts = [a for step in range(2) for a in (_attempt(0, 10, step, step), _attempt(1, 11, step, step))]
    attempts += [_attempt(0, 10, 2, 16.0, participants=1), _attempt(0, 10, 3, 16.1, participants=1)]
    # Nobody left to heal from: the replacement trains alone from step 0.
    attempts += [_attempt(1, 12, step, 30.0 + step, participants=1) for step in range(4)]
    _write_attempts(tmp_path, {"time": 10.0, "step": 2, "rank": 1}, attempts)
    result = summarize(tmp_path, job, kill_rank=1, wall_s=40.0)
    assert result["split_brain"] == 1 and result["full_size_s"] is None
    assert result["steps_dropped_from"] == [2, 3] and result["samples_dropped"] == job.batch_size


@pytest.mark.usefixtures("private_ray_home")
def test_torchft_replaces_a_killed_replica_which_heals_while_the_survivor_trains_on(tmp_path):
    # Worker 1 is SIGKILLed in step 4. The survivor waits for a quorum until the lighthouse stops
    # counting the dead replica (5 s without heartbeats); Ray Train's replacement (detection, a
    # new actor, imports) takes about as long here. Should it take longer, the survivor stalls in
    # step 8 for 20 s, so that the replacement heals from it instead of finding it finished.
    job = _job(12, chaos={"stall": [{"worker": 0, "at_step": 8, "seconds": 20}]})
    result = run_torchft_recovery(job, tmp_path, kill_step=4, kill_rank=1, timeout_s=300)
    assert result["lives"] == 3 and result["split_brain"] == 0
    assert result["steps_lost"] == 0  # the survivor never rolls back
    assert 0 < result["recovery_s"] < result["full_size_s"] < result["wall_s"]
    # The dead replica's shards of every step from the kill until the replacement took part:
    # nobody trained on them (torchft's sampler is static).
    dropped = result["steps_dropped_from"]
    assert dropped[0] == 4 and dropped == list(range(4, dropped[-1] + 1))
    assert result["samples_dropped"] == len(dropped) * job.batch_size // 2
    assert math.isfinite(result["final_loss"])
    assert (tmp_path / "model.pt").exists()


def test_parameters_are_exact_within_float_summation_order_only(tmp_path):
    want = {"w": torch.full((3,), 0.5), "b": torch.zeros(2)}
    torch.save(want, tmp_path / "want.pt")
    for name, delta, exact in (("same", 0.0, True), ("order", 2e-7, True), ("dropped", 1e-3, False)):
        torch.save({"w": want["w"] + delta, "b": want["b"]}, tmp_path / f"{name}.pt")
        diff, equal = param_diff(tmp_path / f"{name}.pt", tmp_path / "want.pt")
        assert diff == pytest.approx(delta, abs=1e-7) and equal == exact, name  # float32 steps
