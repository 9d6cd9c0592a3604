"""Sharded optimizer state's collectives and state moves under NCCL's semantics, without Ray or a
GPU: ranks are threads over ``tests/helpers/nccl_fake_group.py`` (the fake that today's ungrouped
ring deadlocks on), driven through ``CommGroup`` as the worker drives it."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from jobspec.recipe import OptimizerConfig
from policies.sharding import LostState, ShardingLayout
from tests.helpers.devices import DEVICES
from tests.helpers.gradients import finish_gradient
from tests.helpers.nccl_fake_group import FakeNcclWorld, FakeProcessGroupNCCL, fake_options, on_ranks
from workers.comm.comm_group import CommGroup
from workers.comm.gradient_reducer import GradientReducer
from workers.comm.ring import RingAllReduce
from workers.model.buffers import StepBuffers
from workers.model.flat_parameters import FlatParameters
from workers.optim.fused import FlatOptimizer
from workers.optim.loss_scaler import LossScaler
from workers.sharding.optimizer import ShardedOptimizer
from workers.sharding.reduce import ShardedSum, gather_slices, group_sum
from workers.sharding.slice_steppers import GenericSlice, shape_blind
from workers.state_layout import ShardedState

TIMEOUT_S = 8.0
EXTRA = 5  # census-like slots in front of the gradient
LAYOUTS = [(2, 2), (3, 3), (4, 2), (6, 3), (6, 2), (3, 1), (5, 5)]  # (world, group size)


def _groups(size: int) -> list[CommGroup]:
    world = FakeNcclWorld(size)
    return [
        CommGroup(FakeProcessGroupNCCL(world, r, size, fake_options(TIMEOUT_S)), r, size, TIMEOUT_S, threading.Event(), True)
        for r in range(size)
    ]


def _raise_first(outcomes: list[object]) -> None:
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    if errors:
        raise AssertionError(f"{len(errors)} rank(s) failed, first: {type(errors[0]).__name__}: {errors[0]}") from errors[0]


def _built() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Linear(9, 3))  # 72 + 30 = 102 values


MODEL = _built()


def _model() -> torch.nn.Module:
    """A copy of one model: built in the rank threads, its initialisation would interleave on
    torch's global generator and the replicas would differ."""
    return copy.deepcopy(MODEL)


def _config(name: str, kwargs: dict, **more: object) -> OptimizerConfig:
    return OptimizerConfig(name=name, kwargs=kwargs, **more)


def _gradient(rank: int, step: int, numel: int) -> torch.Tensor:
    # Small integers: every partial sum is exact in float32, whatever the order of summing.
    return torch.randint(-8, 9, (EXTRA + numel,), generator=torch.Generator().manual_seed(100 * step + rank)).float()


def _backward(flat: FlatParameters, gradient: torch.Tensor) -> None:
    """What a backward and the census leave: ``gradient`` (laid out as ``[extra | gradients]``)
    in the extra slots and as the parameters' own gradients (a slice kept)."""
    flat.extra.copy_(gradient[:EXTRA])
    for param, (a, b) in zip(flat.params, flat.ranges):
        param.grad = gradient[a:b].view_as(param).clone()


@pytest.mark.parametrize(("world", "group_size"), LAYOUTS)
def test_buckets_reduce_scatter_in_the_group_and_sum_across_replicas(world, group_size):
    """Every rank ends with the whole sum over its slice of every bucket, the extras summed
    whole apart; with buckets that cut across slices."""
    groups = _groups(world)
    numel = FlatParameters(_model().parameters()).numel

    def run(rank: int) -> torch.Tensor:
        try:
            flat = FlatParameters(_model().parameters(), extra=EXTRA)
            layout = ShardingLayout(world, group_size, flat.numel)
            flat.keep_gradient_slice(*layout.slice_of(rank))
            reducer = GradientReducer(
                flat, ShardedSum(groups[rank], layout, flat), bucket_bytes=4 * 40, overlap=False,
                extra_comm=RingAllReduce(groups[rank]), group=groups[rank],
            )
            assert len(reducer.buckets) >= 2  # buckets cut across slices
            _backward(flat, _gradient(rank, 0, flat.numel))
            reducer.finish()
            assert all(param.grad is None for param in flat.params)  # taken into the buckets, freed
            return flat.buffer.clone()
        finally:
            groups[rank].close()

    outcomes = on_ranks(world, run)
    _raise_first(outcomes)
    total = torch.stack([_gradient(r, 0, numel) for r in range(world)]).sum(0)
    layout = ShardingLayout(world, group_size, numel)
    for rank, got in enumerate(outcomes):
        lo, hi = layout.slice_of(rank)
        assert got.numel() == EXTRA + hi - lo  # only the slice is kept
        torch.testing.assert_close(got[:EXTRA], total[:EXTRA], rtol=0, atol=0)
        torch.testing.assert_close(got[EXTRA:], total[EXTRA + lo : EXTRA + hi], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_buckets_overlapped_with_backward_leave_the_slice_and_free_the_parameters_gradients(device):
    """Two passes (the first accumulated in the parameters' own gradients), the last
    overlapped: its hooks take each bucket out of the parameters as backward completes it, so
    none is left once backward returns; each rank keeps its slice of the summed gradient. On
    a GPU the buckets are handed over by CUDA events (the ranks share one device)."""
    world, group_size = 4, 2
    groups = _groups(world)
    inputs = [torch.randn(6, 7, generator=torch.Generator().manual_seed(r)).to(device) for r in range(world)]

    def loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).square().sum()

    def run(rank: int) -> torch.Tensor:
        try:
            model = _model().to(device)
            flat = FlatParameters(model.parameters(), extra=EXTRA)
            layout = ShardingLayout(world, group_size, flat.numel)
            flat.keep_gradient_slice(*layout.slice_of(rank))
            reducer = GradientReducer(
                flat, ShardedSum(groups[rank], layout, flat), bucket_bytes=4 * 40, overlap=True,
                extra_comm=RingAllReduce(groups[rank]), group=groups[rank],
            )
            loss(model, inputs[rank][:3]).backward()
            reducer.arm()
            loss(model, inputs[rank][3:]).backward()
            assert all(param.grad is None for param in model.parameters())  # every bucket out during backward
            reducer.finish()
            return flat.grads.cpu()
        finally:
            groups[rank].close()

    outcomes = on_ranks(world, run)
    _raise_first(outcomes)
    inputs = [x.cpu() for x in inputs]
    reference = _model()
    for x in inputs:
        loss(reference, x).backward()
    total = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    layout = ShardingLayout(world, group_size, total.numel())
    for rank, got in enumerate(outcomes):
        lo, hi = layout.slice_of(rank)
        torch.testing.assert_close(got, total[lo:hi], rtol=1e-5, atol=1e-5)


def _sharded_steps(world: int, group_size: int, steps: int, clip: float | None) -> list[object]:
    """``steps`` AdamW steps on every rank: reduce, finish the gradient (norm over the slices),
    step the slice, all-gather; returns each rank's parameters and gradient norms."""
    groups = _groups(world)

    def run(rank: int) -> tuple[torch.Tensor, list[float]]:
        try:
            group = groups[rank]
            flat = FlatParameters(_model().parameters(), extra=EXTRA)
            layout = ShardingLayout(world, group_size, flat.numel)
            optimizer = ShardedOptimizer(_config("adamw", {"lr": 0.05}, decay_biases_and_norms=False), flat)
            optimizer.reshard(group, layout, 0)
            reducer = GradientReducer(
                flat, ShardedSum(group, layout, flat), bucket_bytes=4 * 40, overlap=False,
                extra_comm=RingAllReduce(group), group=group,
            )
            lo, hi = layout.slice_of(rank)
            norms = []
            for step in range(steps):
                _backward(flat, _gradient(rank, step, flat.numel))
                reducer.finish()
                update = finish_gradient(flat.grad_slice(lo, hi), 4.0, 1.0, clip, lambda local: group_sum(group, layout, local))
                norms.append(update.grad_norm)
                optimizer.step()
                gather_slices(group, layout, flat.values)
            return flat.values.clone(), norms
        finally:
            groups[rank].close()

    outcomes = on_ranks(world, run)
    _raise_first(outcomes)
    return outcomes


@pytest.mark.parametrize(("world", "group_size"), [(2, 2), (3, 3), (4, 2), (6, 3)])
def test_sharded_steps_equal_the_whole_optimizer_on_the_summed_gradient(world, group_size):
    """AdamW with decay groups and clipping by the global norm: stepping slices and gathering
    them gives the parameters (and norms) the whole optimizer gives, on every rank."""
    steps, clip = 3, 10.0
    outcomes = _sharded_steps(world, group_size, steps, clip)
    flat = FlatParameters(_model().parameters(), extra=EXTRA)
    whole = FlatOptimizer("adamw", {"lr": 0.05}, flat.values, flat.grads, flat.no_decay_ranges())
    norms = []
    for step in range(steps):
        flat.buffer.copy_(torch.stack([_gradient(r, step, flat.numel) for r in range(world)]).sum(0))
        norms.append(finish_gradient(flat.grads, 4.0, 1.0, clip).grad_norm)
        whole.step()
    assert any(n > clip for n in norms)  # clipping is exercised
    for values, got_norms in outcomes:
        torch.testing.assert_close(values, flat.values, rtol=1e-6, atol=1e-6)
        assert got_norms == pytest.approx(norms, rel=1e-6)
    assert all(torch.equal(values, outcomes[0][0]) for values, _ in outcomes)  # every replica alike, bit for bit


def _held_state(layout: ShardingLayout, rank: int, numel: int) -> dict[str, torch.Tensor]:
    lo, hi = layout.slice_of(rank)
    marks = torch.arange(numel, dtype=torch.float32)
    return {"exp_avg": marks[lo:hi] + 0.25, "exp_avg_sq": marks[lo:hi] * 2}


@pytest.mark.parametrize(
    ("old", "new", "replaced"),
    [((4, 2), (4, 2), [1]), ((4, 2), (3, 3), []), ((2, 2), (4, 4), [2, 3]), ((4, 2), (2, 1), []), ((6, 3), (4, 2), [3])],
    ids=["replace-from-replica", "shrink-regroup", "grow", "shrink-unshard", "regroup-and-replace"],
)
def test_reshard_moves_each_entry_from_a_holder_to_its_owner(old, new, replaced):
    """Ranks holding slices under the old layout (those in ``replaced`` hold nothing: fresh
    replacements) re-form under the new one: every rank ends with exactly its new slice's
    state and the step count, all from the holders."""
    numel = FlatParameters(_model().parameters()).numel
    old_layout = ShardingLayout(old[0], old[1], numel)
    world = new[0]
    groups = _groups(world)
    new_layout = ShardingLayout(world, new[1], numel)
    expected = torch.arange(numel, dtype=torch.float32)

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        try:
            flat = FlatParameters(_model().parameters())
            optimizer = ShardedOptimizer(_config("adam", {"lr": 0.1}), flat)
            if rank < old[0] and rank not in replaced:
                held = old_layout.slice_of(rank)
                optimizer.inner = optimizer._over(*held, (_held_state(old_layout, rank, numel), {"step": 7.0}))
                optimizer.held, optimizer.state_step = held, 9
            optimizer.reshard(groups[rank], new_layout, 9)
            state = optimizer.state_tensors()
            return state["exp_avg"].clone(), state["exp_avg_sq"].clone(), float(state["step"])
        finally:
            groups[rank].close()

    outcomes = on_ranks(world, run)
    _raise_first(outcomes)
    for rank, (avg, avg_sq, steps_taken) in enumerate(outcomes):
        lo, hi = new_layout.slice_of(rank)
        torch.testing.assert_close(avg, expected[lo:hi] + 0.25, rtol=0, atol=0)
        torch.testing.assert_close(avg_sq, expected[lo:hi] * 2, rtol=0, atol=0)
        assert steps_taken == 7


def test_reshard_without_a_holder_names_the_lost_entries_and_state_of_another_step_is_no_holder():
    numel = FlatParameters(_model().parameters()).numel
    layout = ShardingLayout(2, 2, numel)
    groups = _groups(2)

    def run(rank: int) -> None:
        try:
            flat = FlatParameters(_model().parameters())
            optimizer = ShardedOptimizer(_config("adam", {"lr": 0.1}), flat)
            optimizer.inner, optimizer.held = optimizer._over(*layout.slice_of(rank)), layout.slice_of(rank)
            # Rank 1 applied step 9's update (its all-gather then failed): good for a group at 10, not at 9.
            optimizer.state_step = 9 if rank == 0 else 10
            try:
                optimizer.reshard(groups[rank], layout, 9)
            except LostState as err:
                # A failed reshard keeps what the rank held: still a holder for the next attempt.
                assert optimizer.holding() == ((*layout.slice_of(rank), numel, 9 if rank == 0 else 10),)
                raise err
        finally:
            groups[rank].close()

    outcomes = on_ranks(2, run)
    assert all(isinstance(o, LostState) for o in outcomes), outcomes
    assert f"[{layout.slice_of(1)[0]}, {numel})" in str(outcomes[0])


def test_a_generic_optimizer_shards_reshards_and_checkpoints_like_the_whole_one():
    """RAdam over 1-D pieces of each rank's slice: two steps give the whole optimizer's
    parameters; its checkpoint parts (each rank its slice, rank 0 the skeleton) restore into an
    unsharded ``GenericOptimizer`` with the whole one's state; and resharded from groups of 2
    to whole replicas (every rank needs every entry) each rank holds the whole state."""
    from workers.checkpoint.parts import part_range
    from workers.optim.generic import GenericOptimizer

    world, steps, config = 2, 2, _config("RAdam", {"lr": 0.01, "weight_decay": 0.1}, decay_biases_and_norms=False)
    groups = _groups(world)

    def run(rank: int) -> tuple[torch.Tensor, dict, dict, dict[str, torch.Tensor]]:
        try:
            group = groups[rank]
            flat = FlatParameters(_model().parameters(), extra=EXTRA)
            layout = ShardingLayout(world, 2, flat.numel)
            optimizer = ShardedOptimizer(config, flat)
            optimizer.reshard(group, layout, 0)
            reducer = GradientReducer(
                flat, ShardedSum(group, layout, flat), bucket_bytes=4 * 40, overlap=False,
                extra_comm=RingAllReduce(group), group=group,
            )
            lo, hi = layout.slice_of(rank)
            for step in range(steps):
                _backward(flat, _gradient(rank, step, flat.numel))
                reducer.finish()
                finish_gradient(flat.grad_slice(lo, hi), 4.0, 1.0, None, lambda local: group_sum(group, layout, local))
                optimizer.step()
                gather_slices(group, layout, flat.values)
            optimizer.state_step = steps
            part_flat, part_whole = optimizer.checkpoint_tensors(whole=rank == 0)
            a, b = part_range(flat.numel, rank, world)
            part = {k: v.cpu_range(a, b) for k, v in part_flat.items()}
            optimizer.reshard(group, ShardingLayout(world, 1, flat.numel), steps)
            return flat.values.clone(), part, part_whole, optimizer.state_tensors()
        finally:
            groups[rank].close()

    outcomes = on_ranks(world, run)
    _raise_first(outcomes)
    flat = FlatParameters(_model().parameters(), extra=EXTRA)
    whole = GenericOptimizer("RAdam", {"lr": 0.01, "weight_decay": 0.1}, flat.params, decay_biases_and_norms=False)
    for step in range(steps):
        flat.buffer.copy_(torch.stack([_gradient(r, step, flat.numel) for r in range(world)]).sum(0))
        finish_gradient(flat.grads, 4.0, 1.0, None)
        whole.step()
    want = {k: torch.cat([whole.optimizer.state[p][k].reshape(-1) for p in flat.params]) for k in ("exp_avg", "exp_avg_sq")}
    for values, _, _, state in outcomes:
        torch.testing.assert_close(values, flat.values, rtol=1e-6, atol=1e-6)
        assert sorted(state) == sorted(want)
        for key in want:  # resharded to whole replicas: every rank holds every entry
            torch.testing.assert_close(state[key], want[key], rtol=1e-6, atol=1e-7)
    # The parts, put together, restore into an unsharded optimizer.
    parts = {k: torch.cat([outcomes[r][1][k] for r in range(world)]) for k in outcomes[0][1]}
    params = FlatParameters(_model().parameters()).params
    restored = GenericOptimizer("RAdam", {"lr": 0.01, "weight_decay": 0.1}, params, decay_biases_and_norms=False)
    restored.restore(parts, outcomes[0][2])
    for mine, theirs in zip(params, flat.params):
        for key in want:
            torch.testing.assert_close(restored.optimizer.state[mine][key], whole.optimizer.state[theirs][key], rtol=1e-6, atol=1e-7)
        assert float(restored.optimizer.state[mine]["step"]) == steps
    # ... and into a sharded one, the slice a rank will own only (what a restore gives the next join).
    sharded = ShardedOptimizer(config, FlatParameters(_model().parameters()))
    sharded.restore(parts, outcomes[0][2], (30, 70))
    assert sharded.held == (30, 70)
    flat_state, template = sharded.inner.export()
    for key in want:
        torch.testing.assert_close(flat_state[key], want[key][30:70], rtol=1e-6, atol=1e-7)
    assert float(template["step"]) == steps


def test_a_checkpoint_restores_only_the_slice_a_rank_will_own():
    """Fused AdamW: the state checked as the unsharded optimizer checks it and only the span
    read (the rest is never held); the whole of it without a span; another optimizer's state
    refused."""
    flat = FlatParameters(_model().parameters(), extra=EXTRA)
    whole = FlatOptimizer("adamw", {"lr": 0.05}, flat.values, flat.grads, flat.no_decay_ranges())
    for step in range(2):
        flat.buffer.copy_(_gradient(0, step, flat.numel))
        whole.step()
    saved_flat, saved_whole = (dict(part) for part in whole.checkpoint_tensors())
    config = _config("adamw", {"lr": 0.05}, decay_biases_and_norms=False)
    sharded = ShardedOptimizer(config, FlatParameters(_model().parameters(), extra=EXTRA))
    sharded.restore(saved_flat, saved_whole, (40, 90))
    state = sharded.state_tensors()
    assert sharded.held == (40, 90) and sharded.flat.grads.numel() == 50
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(state[key], whole.state[key][40:90], rtol=0, atol=0)
    assert float(state["step"]) == 2
    sharded.restore(saved_flat, saved_whole)
    assert sharded.held == (0, flat.numel) and torch.equal(sharded.state_tensors()["exp_avg"], whole.state["exp_avg"])
    with pytest.raises(ValueError):
        sharded.restore({"momentum_buffer": saved_flat["exp_avg"]}, saved_whole, (40, 90))


@pytest.mark.parametrize(("name", "kwargs"), [("RAdam", {}), ("Adagrad", {}), ("NAdam", {}), ("SGD", {"lr": 0.1, "momentum": 0.9})])
def test_element_wise_optimizers_step_slices_as_whole_parameters(name, kwargs):
    assert shape_blind(getattr(torch.optim, name), kwargs) is None
    ShardedOptimizer(_config(name, kwargs), FlatParameters(_model().parameters()))


class _TensorNorm(torch.optim.Optimizer):
    """Scales each step by its parameter's gradient norm: not one rule per entry."""

    def __init__(self, params, lr: float = 0.1) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad / (p.grad.norm() + 1), alpha=-group["lr"])


@pytest.mark.parametrize("optimizer", [torch.optim.Adafactor, _TensorNorm], ids=["Adafactor", "tensor-norm"])
def test_an_optimizer_that_reads_a_parameters_shape_or_cut_is_refused(optimizer):
    """Adafactor factors a matrix's second moments; a per-tensor norm sees where a slice cuts a
    parameter. Over a rank's 1-D pieces both would step otherwise than unsharded."""
    assert shape_blind(optimizer, {}) is not None
    with pytest.raises(ValueError, match=r"field 'sharding.group_size': .* cannot step slices of parameters"):
        ShardedOptimizer(_config(optimizer, {}), FlatParameters(_model().parameters()))


def test_state_that_is_not_one_value_per_entry_is_refused_when_it_first_shows():
    class Kept(torch.optim.SGD):
        """Element-wise steps, but a state entry per parameter of another size."""

        def step(self, closure=None):  # noqa: ANN001, ANN201
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["seen"] = torch.full((2,), float(p.numel()))  # one per parameter, unlike the others

    flat = FlatParameters(_model().parameters())
    flat.grads.normal_()
    stepper = GenericSlice(Kept, {"lr": 0.1}, flat, True, 0, flat.numel)
    with pytest.raises(ValueError, match="sharding.group_size"):
        stepper.step(None)


@pytest.mark.parametrize(("new_world", "new_group"), [(4, 2), (3, 3)], ids=["same-groups", "regrouped"])
def test_parameters_come_with_the_state_from_each_slices_holders(new_world, new_group):
    """Every rank stepped its slice and the all-gather broke off in every group: each holds its
    own slice of the parameters at the new step and garbage elsewhere. A group starting after
    that step (one rank lost, regrouped or replaced) rebuilds the whole parameters from the
    slices' holders and the all-gather."""
    numel = FlatParameters(_model().parameters()).numel
    old = ShardingLayout(4, 2, numel)
    new = ShardingLayout(new_world, new_group, numel)
    groups = _groups(new_world)
    truth = torch.arange(numel, dtype=torch.float32) / 7
    survivors = [0, 2, 3] if new_world == 3 else [0, 2, 3, None]  # old rank 1 is gone; a replacement last

    def run(rank: int) -> torch.Tensor:
        try:
            flat = FlatParameters(_model().parameters())
            optimizer = ShardedOptimizer(_config("adam", {"lr": 0.1}), flat)
            was = survivors[rank]
            flat.values.fill_(-1.0)  # garbage: a broken all-gather, or a fresh replacement
            if was is not None:
                lo, hi = old.slice_of(was)
                flat.values[lo:hi] = truth[lo:hi]
                optimizer.inner = optimizer._over(lo, hi, (_held_state(old, was, numel), {"step": 5.0}))
                optimizer.held, optimizer.state_step = (lo, hi), 6
            optimizer.reshard(groups[rank], new, 6)
            gather_slices(groups[rank], new, flat.values)
            return flat.values.clone()
        finally:
            groups[rank].close()

    outcomes = on_ranks(new_world, run)
    _raise_first(outcomes)
    for values in outcomes:
        torch.testing.assert_close(values, truth, rtol=0, atol=0)


class _Replica:
    """What a join moves (``workers.replica.Replica``): a model with running statistics, its
    flat parameters, sharded optimizer state (groups of 2) and an fp16 loss scaler, all at job step ``at``;
    ``buffers`` keeps the statistics in step as a worker's step does."""

    # Ranks are threads sharing torch's global generator: seeding and drawing the weights
    # together, or one rank's draws would land in another's model.
    _BUILDING = threading.Lock()

    def __init__(self, at: int) -> None:
        with self._BUILDING:
            torch.manual_seed(0)
            self.model = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.BatchNorm1d(9), torch.nn.Linear(9, 3))
        self.flat = FlatParameters(self.model.parameters())
        self.optimizer = ShardedOptimizer(_config("adam", {"lr": 0.1}), self.flat)
        self.state = ShardedState(self.optimizer, group_size=2)
        self.scaler = LossScaler(enabled=True, init=1024.0, growth_interval=1)
        self.device = torch.device("cpu")
        self.next_step = at
        self.buffers = StepBuffers(self.model, [f"1.{n}" for n in ("running_mean", "running_var", "num_batches_tracked")], ["1"])

    def update(self, link: object | None, step: int) -> None:
        """Step ``step`` as ``TrainWorker.train_step`` runs it up to the all-gather: a shard's
        pass (moving the statistics), the update of the scale and the statistics."""
        self.buffers.begin()
        self.model(torch.randn(6, 7, generator=torch.Generator().manual_seed(step)))
        self.buffers.record(0)
        if link is not None:
            link.before_update(step, [(self.scaler.state, self.scaler.state.clone()), *self.buffers.pre_step()])
        self.scaler.update(1.0)
        slots = torch.zeros(self.buffers.slots, dtype=torch.float64)
        self.buffers.write(slots, [0])
        self.buffers.apply(slots)
        self.optimizer.stepped_to(step + 1)

    def extras(self) -> list[torch.Tensor]:
        return [self.scaler.state.clone(), *(b.clone() for b in self.model.buffers())]


@pytest.mark.parametrize("ahead", [False, True], ids=["redo-the-step", "start-after-it"])
def test_a_rank_that_updated_before_its_all_gather_broke_hands_out_the_scale_and_buffers_of_the_start_step(ahead):
    """Step 3's gradient-norm all-reduce completed on some ranks and was aborted on others (the
    abort reaches ranks at different times): rank 0 ran its pass, stepped its slice and moved
    its loss scale and BatchNorm statistics to step 4, then lost the all-gather; its replica
    (rank 2) never stepped. The group starts again at step 3, led by rank 0 (next step 3,
    lowest id): every rank must get step 3's scale and statistics, not rank 0's step-4 ones
    nor what its pass left in them (fp16's scale and the statistics would otherwise advance
    twice). Control: where every rank stepped, the group starts after step 3 and the step-4
    ones are right."""
    from jobspec.runtime import CollectiveConfig
    from workers.group_link import GroupLink

    world, step = 4, 3
    numel = _Replica(step).flat.numel
    layout = ShardingLayout(world, 2, numel)
    groups = _groups(world)
    stepped = range(world) if ahead else [0]

    def run(rank: int) -> list[torch.Tensor]:
        try:
            replica = _Replica(step)
            lo, hi = layout.slice_of(rank)
            replica.optimizer.inner = replica.optimizer._over(lo, hi, (_held_state(layout, rank, numel), {"step": 3.0}))
            replica.optimizer.held, replica.optimizer.state_step = (lo, hi), step
            link = GroupLink(CollectiveConfig(), TIMEOUT_S, threading.Event())
            link.layout = layout
            if rank in stepped:
                replica.update(link, step)  # ... and the all-gather then breaks off
            link._take_root_state(groups[rank], replica, None, step + 1 if ahead else step)
            return replica.extras()
        finally:
            groups[rank].close()

    outcomes = on_ranks(world, run)
    _raise_first(outcomes)
    start = _Replica(step)
    if ahead:
        start.update(None, step)
    for rank, got in enumerate(outcomes):
        for name, value, want in zip(["loss scale", "mean", "var", "batches"], got, start.extras()):
            torch.testing.assert_close(value, want, rtol=0, atol=0, msg=f"rank {rank}: {name}")


def test_a_regroup_never_confirmed_keeps_the_slices_stepped_past_it_for_a_group_after_it():
    """Step 5's all-gather broke off after ranks 0 and 3 stepped their slices (A and B, held for
    step 6) and before ranks 1 and 2 did (B and A, held for step 5). A group of 4 in one sharding
    group forms at step 5 from ranks 1 and 2 and completes its move and all-gather, but not its
    confirmation (a rank dies): ranks 0 and 3 still hold A and B for step 6, parameters
    included, though the move and the all-gather wrote their parameters, so the next group
    can start after step 5 from them."""
    numel = FlatParameters(_model().parameters()).numel
    old, regrouped = ShardingLayout(4, 2, numel), ShardingLayout(4, 4, numel)
    first, second = _groups(4), _groups(4)
    truth = {5: torch.arange(numel, dtype=torch.float32) / 7, 6: torch.arange(numel, dtype=torch.float32) / 3}
    was = {0: 6, 1: 5, 2: 5, 3: 6}  # the step each old rank's slice is held for

    def run(rank: int) -> tuple[tuple, torch.Tensor, torch.Tensor]:
        flat = FlatParameters(_model().parameters())
        optimizer = ShardedOptimizer(_config("adam", {"lr": 0.1}), flat)
        lo, hi = old.slice_of(rank)
        flat.values.fill_(-1.0)
        flat.values[lo:hi] = truth[was[rank]][lo:hi]
        marks = {k: v + was[rank] for k, v in _held_state(old, rank, numel).items()}
        optimizer.inner = optimizer._over(lo, hi, (marks, {"step": float(was[rank] - 1)}))
        optimizer.held, optimizer.state_step = (lo, hi), was[rank]
        try:
            optimizer.reshard(first[rank], regrouped, 5)
            gather_slices(first[rank], regrouped, flat.values)
        finally:
            first[rank].close()
        holding = optimizer.holding()  # not confirmed
        try:
            optimizer.reshard(second[rank], old, 6)
            gather_slices(second[rank], old, flat.values)
        finally:
            second[rank].close()
        return holding, flat.values.clone(), optimizer.state_tensors()["exp_avg"].clone()

    outcomes = on_ranks(4, run)
    _raise_first(outcomes)
    for rank, (holding, values, exp_avg) in enumerate(outcomes):
        if was[rank] == 6:
            assert (*old.slice_of(rank), numel, 6) in holding, (rank, holding)
        torch.testing.assert_close(values, truth[6], rtol=0, atol=0, msg=f"rank {rank}: parameters")
        lo, hi = old.slice_of(rank)
        torch.testing.assert_close(exp_avg, torch.arange(numel, dtype=torch.float32)[lo:hi] + 0.25 + 6, rtol=0, atol=0)
