"""A sharded restore reads only the rank's share of a checkpoint: the parts, and the byte ranges
of parts, that overlap the span it will own, straight into its state (issue 40, item 6). No Ray.

Bytes read are the process's own count (``rchar`` of ``/proc/self/io``: every byte a read call
returned, whichever code read it). Host memory is the sum of two peaks above the level at entry,
an upper bound on the peak of their sum: torch's CPU allocator's (``PeakMemory``, as
``ringleader plan`` measures) and Python's (``tracemalloc``: the ``bytes`` a whole-file read
returns, the ``bytearray`` a tensor is decoded into, which torch's allocator never sees).
"""

from __future__ import annotations

import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from jobspec.recipe import OptimizerConfig
from orchestrator.commands.memory_probe import PeakMemory
from policies.sharding import ShardingLayout
from workers.checkpoint.manifest import CheckpointCorrupt, verify_checkpoint, write_manifest
from workers.checkpoint.parts import take_snapshot, write_snapshot
from workers.checkpoint.storage import CheckpointStorage
from workers.model.flat_parameters import FlatParameters
from workers.optim.fused import FlatOptimizer
from workers.optim.generic import GenericOptimizer
from workers.optim.loss_scaler import LossScaler
from workers.replica_checkpoint import checkpointed_tensors, restore_state
from workers.sharding.optimizer import ShardedOptimizer
from workers.state_layout import StateLayout, state_layout

NAME = "step-00000003"
GROUP = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 256))


@dataclass
class Replica:
    """What ``restore_state`` and ``checkpointed_tensors`` need of a worker, sharded or not."""

    config: OptimizerConfig
    sharded: bool
    model: torch.nn.Module = field(default_factory=_model)
    scaler: LossScaler = field(default_factory=lambda: LossScaler(False))
    device: torch.device = torch.device("cpu")
    next_step: int = 0
    flat: FlatParameters = field(init=False)
    optimizer: Any = field(init=False)
    state: StateLayout = field(init=False)

    def __post_init__(self) -> None:
        self.flat = FlatParameters(self.model.parameters(), extra=3)
        if self.sharded:
            self.optimizer = ShardedOptimizer(self.config, self.flat)
        elif self.config.is_fused:
            no_decay = None if self.config.decay_biases_and_norms else self.flat.no_decay_ranges()
            self.optimizer = FlatOptimizer(self.config.name, self.config.kwargs, self.flat.values, self.flat.grads, no_decay)
        else:
            self.optimizer = GenericOptimizer(self.config.name, self.config.kwargs, self.flat.params, self.config.decay_biases_and_norms)
        self.state = state_layout(self.optimizer, group_size=2)

    def train(self, steps: int) -> None:
        for step in range(steps):
            self.flat.zero()
            torch.manual_seed(100 + step)
            self.model(torch.randn(8, 256)).square().mean().backward()
            self.optimizer.step()
            self.next_step += 1


def _checkpoint(root: str, config: OptimizerConfig, count: int) -> tuple[CheckpointStorage, dict[str, Any], Replica]:
    """A checkpoint of an unsharded replica after 3 steps, written in ``count`` parts."""
    source = Replica(config, sharded=False)
    source.train(3)
    storage, files = CheckpointStorage(root), []
    for index in range(count):
        flat, whole = checkpointed_tensors(source, whole=index == 0)
        whole = {**whole, "rng/torch": torch.get_rng_state()} if index == 0 else whole
        files += write_snapshot(storage, NAME, "a1", index, take_snapshot(3, index, count, flat, whole, {}))
    write_manifest(storage, 3, files, {})
    return storage, verify_checkpoint(storage, NAME), source


def _bytes_read() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def _restore_measured(replica: Replica, storage: CheckpointStorage, manifest: dict[str, Any], span: tuple[int, int]) -> tuple[int, int]:
    """Restore ``span`` into ``replica``; returns (bytes read, peak host bytes above entry)."""
    with PeakMemory(torch.device("cpu")):
        pass  # the profiler's first start imports (Python memory that is not the restore's)
    with PeakMemory(torch.device("cpu")) as torch_peak:
        tracemalloc.start()
        try:
            before = _bytes_read()
            restore_state(replica, storage, NAME, manifest, span)
            read = _bytes_read() - before
            python_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    return read, torch_peak.peak + python_peak


@pytest.mark.parametrize("count", [8, 3])  # parts aligned to the g=4 slices (2 each), and not
def test_a_sharded_restore_reads_and_holds_a_quarter_of_the_checkpoint_plus_one_part(tmp_path, count):
    config = OptimizerConfig(name="adamw", kwargs={"lr": 0.01}, decay_biases_and_norms=False)
    storage, manifest, source = _checkpoint(str(tmp_path), config, count)
    parts = [entry["bytes"] for entry in manifest["files"]]
    bound = sum(parts) // GROUP + max(parts)
    numel = source.flat.numel
    layout = ShardingLayout.plan(GROUP, GROUP, numel)
    saved = source.optimizer.state_tensors()
    for rank in range(GROUP):
        replica = Replica(config, sharded=True)
        lo, hi = layout.slice_of(rank)
        read, peak = _restore_measured(replica, storage, manifest, (lo, hi))
        assert read <= bound and peak <= bound, (
            f"rank {rank} of {GROUP}, checkpoint of {sum(parts)} bytes in {count} parts: read {read} bytes, "
            f"peaked {peak} bytes above entry; at most {bound} (a quarter plus one part)"
        )
        # What it holds is the checkpoint's: its span of the parameters and of the state, the step.
        assert replica.optimizer.held == (lo, hi) and replica.next_step == 3
        assert torch.equal(replica.flat.values[lo:hi], source.flat.values[lo:hi])
        state = replica.optimizer.state_tensors()
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], saved[key][lo:hi]), key
        assert float(state["step"]) == 3


def _flat_state(optimizer: GenericOptimizer, params: list[torch.nn.Parameter], key: str) -> torch.Tensor:
    return torch.cat([optimizer.optimizer.state[p][key].reshape(-1) for p in params])


def test_a_generic_optimizers_checkpoint_restores_each_ranks_slice_through_ranged_reads_of_a_uri():
    """RAdam, parts not aligned to the slices, on pyarrow's in-memory filesystem (the remote path:
    ranged reads of random-access files, as on s3://): each rank holds its slice of the state,
    as the unsharded optimizer holds it, and of the parameters; the step count as the template."""
    config = OptimizerConfig(name="RAdam", kwargs={"lr": 0.01, "weight_decay": 0.1}, decay_biases_and_norms=False)
    storage, manifest, source = _checkpoint("mock:///ckpt", config, 3)
    layout = ShardingLayout.plan(GROUP, GROUP, source.flat.numel)
    for rank in range(GROUP):
        replica = Replica(config, sharded=True)
        lo, hi = layout.slice_of(rank)
        restore_state(replica, storage, NAME, manifest, (lo, hi))
        assert torch.equal(replica.flat.values[lo:hi], source.flat.values[lo:hi])
        state, template = replica.optimizer.inner.export()
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], _flat_state(source.optimizer, source.flat.params, key)[lo:hi]), key
        assert float(template["step"]) == 3 and replica.optimizer.held == (lo, hi)


def test_a_generic_state_saved_whole_before_it_was_taken_apart_restores_a_slice():
    from workers.optim.generic import STATE_ENTRY
    from workers.optim.state_codec import encode

    config = OptimizerConfig(name="RAdam", kwargs={"lr": 0.01}, decay_biases_and_norms=False)
    source = Replica(config, sharded=False)
    source.train(2)
    sharded = Replica(config, sharded=True).optimizer
    sharded.restore({}, {STATE_ENTRY: encode(source.optimizer.optimizer.state_dict())}, (100, 5000))
    state, template = sharded.inner.export()
    assert torch.equal(state["exp_avg"], _flat_state(source.optimizer, source.flat.params, "exp_avg")[100:5000])
    assert float(template["step"]) == 2


def test_a_checkpoint_of_another_optimizer_or_model_is_refused_before_anything_changes(tmp_path):
    adamw = OptimizerConfig(name="adamw", kwargs={"lr": 0.01})
    storage, manifest, _ = _checkpoint(str(tmp_path), adamw, 2)
    sgd = Replica(OptimizerConfig(name="sgd", kwargs={"lr": 0.1, "momentum": 0.9}), sharded=True)
    with pytest.raises(ValueError, match=r"optimizer state \[.*'exp_avg'.*\] does not fit sgd's \[.*'momentum_buffer'"):
        restore_state(sgd, storage, NAME, manifest, (0, 10))
    adagrad = Replica(OptimizerConfig(name="Adagrad", kwargs={"lr": 0.1}), sharded=True)
    with pytest.raises(ValueError, match="optimizer state .* is not a Adagrad's"):
        restore_state(adagrad, storage, NAME, manifest, (0, 10))
    other = Replica(adamw, sharded=True, model=torch.nn.Linear(3, 2))
    with pytest.raises(ValueError, match=f"checkpoint {NAME} holds .*'params', \\(\\d+,\\).*this model needs .*'params', \\(8,\\)"):
        restore_state(other, storage, NAME, manifest, (0, 4))
    for replica in (sgd, adagrad, other):
        assert replica.next_step == 0 and replica.optimizer.held is None


def test_a_part_cut_short_after_verification_is_refused_naming_it(tmp_path):
    config = OptimizerConfig(name="adamw", kwargs={"lr": 0.01})
    storage, manifest, source = _checkpoint(str(tmp_path), config, 4)
    part = tmp_path / NAME / "part-00003-of-00004-a1.pt"
    part.write_bytes(part.read_bytes()[:-4096])
    replica = Replica(config, sharded=True)
    with pytest.raises(CheckpointCorrupt, match="part-00003-of-00004-a1.pt: changed since it was verified"):
        restore_state(replica, storage, NAME, manifest, (0, source.flat.numel // 4))
