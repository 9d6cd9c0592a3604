"""Model buffers under data parallelism (docs/architecture.md, "Model buffers"): a forward
never spans two shards, and the running statistics are updated once per step from all of
the step's shards, identical on every replica whoever ran which shard."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from tests.helpers.factories import make_norm_cnn
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
