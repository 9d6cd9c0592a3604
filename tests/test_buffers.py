"""Model buffers under data parallelism (docs/architecture.md, "Model buffers"): a forward
never spans two shards, and the running statistics are updated once per step from all of
the step's shards, identical on every replica whoever ran which shard."""

from __future__ import annotations

import logging
import re

import pytest
import ray
import torch

from jobspec.step_record import read_telemetry
from orchestrator.group.ray_group import RayWorkerGroup
from tests.helpers.factories import make_norm_cnn
from tests.helpers.jobs import Reference, assert_same_params, jsonl, params, run
from workers.model.buffers import StepBuffers, find_batch_dependent

BN = "norm"


def _no_probe() -> None:
    raise AssertionError("the model's buffers are all known: no probe forward")


def _shard_batches(shards: int = 4, size: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.rand(size, 64, generator=generator) * (1 + s) for s in range(shards)]


def _step(model: torch.nn.Module, batches: list[torch.Tensor], ranks: list[list[int]]) -> None:
    """One step's buffers as ``ranks`` (each a list of shards) would run them: each rank's
    passes from the pre-step buffers, its slots written, the slots summed (the all-reduce)."""
    buffers = StepBuffers.of(model, _no_probe)
    reduced = torch.zeros(buffers.slots)
    buffers.begin()
    for shards in ranks:
        for shard in shards:
            buffers.reset()
            model(batches[shard])
            buffers.record(shard)
        slots = torch.zeros(buffers.slots)
        buffers.write(slots, shards)
        reduced += slots
    buffers.apply(reduced)


def test_the_steps_buffers_are_the_mean_over_its_shards_whoever_ran_them():
    batches = _shard_batches()
    torch.manual_seed(0)
    alone, spread = make_norm_cnn(), make_norm_cnn()
    spread.load_state_dict(alone.state_dict())
    _step(alone, batches, [[0, 1, 2, 3]])
    _step(spread, batches, [[2], [0, 3], [], [1]])
    for key, value in alone.state_dict().items():
        torch.testing.assert_close(spread.state_dict()[key], value, msg=key)
    # Exactly (1 - m) old + m mean_s(batch stat_s), and one step counted.
    m = alone.norm.momentum
    stats = [alone.conv(b.view(-1, 1, 8, 8)).detach() for b in batches]
    mean = torch.stack([s.mean((0, 2, 3)) for s in stats]).mean(0)
    var = torch.stack([s.var((0, 2, 3), unbiased=True) for s in stats]).mean(0)
    torch.testing.assert_close(alone.norm.running_mean, m * mean)
    torch.testing.assert_close(alone.norm.running_var, (1 - m) * torch.ones(4) + m * var)
    assert int(alone.norm.num_batches_tracked) == 1


def test_abandon_puts_the_pre_step_buffers_back_and_apply_leaves_nothing_to_abandon():
    model = make_norm_cnn()
    buffers = StepBuffers.of(model, _no_probe)
    before = {k: v.clone() for k, v in model.named_buffers()}
    buffers.begin()
    model(_shard_batches(1)[0])
    buffers.abandon()
    for key, value in model.named_buffers():
        assert torch.equal(value, before[key]), key
    buffers.begin()
    model(_shard_batches(1)[0])
    buffers.record(0)
    slots = torch.zeros(buffers.slots)
    buffers.write(slots, [0])
    buffers.apply(slots)
    applied = {k: v.clone() for k, v in model.named_buffers()}
    buffers.abandon()
    assert int(model.norm.num_batches_tracked) == 1
    for key, value in model.named_buffers():
        assert torch.equal(value, applied[key]), key


class _Counter(torch.nn.Module):
    """Counts its forwards in a buffer (as an observer or an EMA would keep state)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("scale", torch.ones(10))  # constant: never changes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seen is not None:
            self.seen += 1
        return self.linear(x) * self.scale


def test_batch_dependent_layers_are_found_by_type_or_by_a_probe_forward(caplog):
    layers, names = find_batch_dependent(make_norm_cnn(), _no_probe)
    assert layers == ["'norm' (BatchNorm2d)"]
    assert names == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    plain = torch.nn.Sequential(torch.nn.Linear(64, 10), torch.nn.LayerNorm(10))
    assert find_batch_dependent(plain, _no_probe) == ([], [])  # no buffers: no probe
    counter = _Counter()
    counter.eval()
    layers, names = find_batch_dependent(counter, lambda: counter(torch.rand(2, 64)))
    assert layers == ["'<model>' (_Counter)"] and names == ["seen", "scale"]
    assert float(counter.seen) == 0 and not counter.training  # the probe left no trace
    constant = torch.nn.Sequential(_Counter())
    constant[0].seen = None  # its remaining buffer never changes
    assert find_batch_dependent(constant, lambda: constant(torch.rand(2, 64))) == ([], [])
    with caplog.at_level(logging.WARNING, logger="workers.model.buffers"):
        assert StepBuffers.of(make_norm_cnn(), _no_probe).per_shard
    assert "'norm' (BatchNorm2d)" in caplog.text and "pass of its own" in caplog.text


class _Cache(torch.nn.Module):
    """Counts its forwards (state to keep in step) and keeps a cache that a forward over more
    samples than it holds rebuilds, as ``how`` says: ``resize`` (as older Hugging Face rotary
    embeddings re-register cos_cached for a longer input), ``retype`` or ``drop``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.linear = torch.nn.Linear(64, 10)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("cached", torch.zeros(2, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        if len(x) > 2:
            if self.how == "resize":
                self.register_buffer("cached", torch.zeros(len(x), 64))
            else:
                self.cached = self.cached.double() if self.how == "retype" else None
        return self.linear(x)


CACHE_CHANGES = [("resize", "made it float32[4, 64]"), ("retype", "made it float64[2, 64]"), ("drop", "dropped it")]


def _refusal(change: str) -> str:
    return "^" + re.escape(f"field 'model.factory': buffer 'cached' of layer '<model>' (_Cache) held float32[2, 64] and a forward {change};")


@pytest.mark.parametrize("how,change", CACHE_CHANGES)
def test_a_buffer_the_probe_resizes_retypes_or_drops_is_refused_naming_it_and_put_back(how, change):
    model = _Cache(how)
    with pytest.raises(ValueError, match=_refusal(change)):
        find_batch_dependent(model, lambda: model(torch.rand(4, 64)))
    assert model.cached.shape == (2, 64) and model.cached.dtype == torch.float32 and float(model.seen) == 0


@pytest.mark.parametrize("how,change", CACHE_CHANGES)
def test_a_kept_buffer_a_later_forward_resizes_retypes_or_drops_is_refused_and_the_step_undone(how, change):
    model = _Cache(how)
    buffers = StepBuffers.of(model, lambda: model(torch.rand(2, 64)))  # short: the cache holds
    assert buffers.names == ["seen", "cached"]
    buffers.begin()
    buffers.reset()
    model(torch.rand(4, 64))
    with pytest.raises(ValueError, match=_refusal(change)):
        buffers.record(0)
    buffers.abandon()  # the failed step's: puts the buffers back without raising
    assert model.cached.shape == (2, 64) and model.cached.dtype == torch.float32 and float(model.seen) == 0
    buffers.begin()  # and the next step starts as usual


def test_a_sync_batchnorm_is_refused_naming_the_layer():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.SyncBatchNorm(4))
    with pytest.raises(ValueError, match=r"field 'model.factory': layer '1' \(SyncBatchNorm\)"):
        find_batch_dependent(model, _no_probe)


STEPS = 12
NORM_JOB = (f"steps={STEPS}", "model.factory=tests.helpers.factories:make_norm_cnn", "model.kwargs={channels: 4}")


@pytest.fixture(scope="module")
def norm_alone(one_worker) -> Reference:
    """The BatchNorm CNN's state after a clean single-worker run (fuse_shards on, the default),
    with its yardstick: the shards' passes (one per shard, the layer forces it) in another order."""
    return one_worker(*NORM_JOB)


@pytest.fixture
def replicas(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Every replica's state when the run ends, rank 0's first: the driver, about to save rank
    0's as model.pt, asks every member of the group for its own (the actors' ``model_state``)."""
    states: list[dict[str, torch.Tensor]] = []

    def every_replica(group: RayWorkerGroup, timeout_s: float) -> dict[str, torch.Tensor]:
        states[:] = ray.get([actor.model_state.remote() for actor in group.actors], timeout=timeout_s)
        return states[0]

    monkeypatch.setattr(RayWorkerGroup, "model_state", every_replica)
    return states


def _assert_same_state(run_dir, alone: Reference, name: str, replicas: list[dict[str, torch.Tensor]], workers: int) -> None:
    """Parameters and buffers as the single worker's, the statistics counted once per step, and
    every replica (at least ``workers``) left with exactly rank 0's, saved as model.pt."""
    spread = params(run_dir)
    assert {f"{BN}.running_mean", f"{BN}.running_var", f"{BN}.num_batches_tracked"} <= spread.keys()
    assert_same_params(spread, alone, name)
    assert int(spread[f"{BN}.num_batches_tracked"]) == STEPS  # once per step, a redone one too
    assert len(replicas) >= workers, f"{name}: {len(replicas)} replicas at the end"
    for rank, state in enumerate(replicas):
        assert state.keys() == spread.keys()
        for key, value in spread.items():
            assert torch.equal(state[key], value), f"{name}: rank {rank}'s {key} is not rank 0's"


def test_batchnorm_parameters_and_buffers_match_on_one_and_three_workers_across_a_sigkill(tmp_path, norm_alone, replicas):
    """The batch-dependent layer forces a pass per shard although fuse_shards is on. Worker 0
    dies late, so the group re-forms around a replica that was never rank 0 and takes its state."""
    killed = run(tmp_path, "w3", *NORM_JOB, "scaling.workers=3", "chaos.kill=[{at_step: 9, worker: 0, how: sigkill}]")
    assert killed.summary["events"]["failures"] == 1 and killed.summary["events"]["recoveries"] == 1
    _assert_same_state(killed.run_dir, norm_alone, "1 vs 3 workers, worker 0 SIGKILLed", replicas, 2)


def test_batchnorm_buffers_count_each_shard_once_through_steals_backups_and_a_rescue(tmp_path, norm_alone, replicas):
    result = run(
        tmp_path, "w3-chaos", *NORM_JOB, "scaling.workers=3", "stragglers.evict=false",
        "chaos={slow: [{worker: 2, factor: 8, from_step: 1, to_step: 3}], stall: [{worker: 1, at_step: 10, seconds: 5}]}",
        # Quick to suspect and quick to call a shard late, so stealing and backups race a lot.
        "stragglers.late_factor=1.2", "stragglers.min_ratio=1.2", "stragglers.persistent_steps=1", "stragglers.window=2",
    )
    events = result.summary["events"]
    # Work moved between replicas (steals always; backups in most runs, but on a loaded machine
    # the slow worker may finish before any shard is called late: not required).
    assert events["stolen_shards"] > 0, events
    # Worker 1 stopped waiting for its data: its shards went to the rescue pass (or, were it
    # suspected by then on a busy machine, were stolen within the step).
    assert any(r["gave_up"] for r in read_telemetry(result.run_dir / "telemetry.jsonl") if r["step"] == 10)
    _assert_same_state(result.run_dir, norm_alone, "1 vs 3 workers, steals, backups and a rescue", replicas, 3)


def test_batchnorm_buffers_resume_from_a_checkpoint_on_another_worker_count(tmp_path, norm_alone, replicas):
    model = NORM_JOB[1:]
    run(tmp_path, "run", *model, "steps=6", "scaling.workers=2", "checkpoint.every_steps=3")
    resumed = run(tmp_path, "run", *model, f"steps={STEPS}", "scaling.workers=3", "checkpoint.every_steps=3")
    assert [e["checkpoint"] for e in jsonl(resumed.run_dir / "events.jsonl") if e["event"] == "resume"] == ["step-00000006"]
    _assert_same_state(resumed.run_dir, norm_alone, "2 workers, resumed on 3", replicas, 3)
