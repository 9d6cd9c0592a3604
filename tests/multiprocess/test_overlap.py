"""Gradient buckets and the reducer: pure plan tests, and real gloo process groups (no Ray)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import comm_group, run_ranks
from workers.comm.communicator import make_communicator
from workers.comm.gradient_reducer import GradientReducer, default_bucket_bytes, plan_buckets
from workers.model.flat_parameters import FlatParameters


def _ranges(sizes: list[int], start: int = 0) -> list[tuple[int, int]]:
    out, offset = [], start
    for size in sizes:
        out.append((offset, offset + size))
        offset += size
    return out


def test_buckets_go_in_reverse_order_and_tile_the_buffer():
    buckets = plan_buckets(_ranges([4, 4, 4, 4, 4], start=3), capacity=8, first_capacity=4)
    assert [b.params for b in buckets] == [(4,), (3, 2), (1, 0)]
    # Contiguous, back to front, the last one reaching element 0 (the extra slots).
    assert [(b.start, b.end) for b in buckets] == [(19, 23), (11, 19), (0, 11)]


def test_a_parameter_larger_than_a_bucket_gets_its_own():
    buckets = plan_buckets(_ranges([2, 50, 2]), capacity=8, first_capacity=8)
    assert [b.params for b in buckets] == [(2,), (1,), (0,)]


def test_one_bucket_when_everything_fits():
    buckets = plan_buckets(_ranges([3, 3]), capacity=100, first_capacity=100)
    assert [(b.start, b.end, b.params) for b in buckets] == [(0, 6, (1, 0))]


def test_rejects_empty_capacity():
    with pytest.raises(ValueError):
        plan_buckets(_ranges([1]), capacity=0, first_capacity=1)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 40)
        self.b = torch.nn.Linear(40, 40)
        self.unused = torch.nn.Linear(3, 3)  # never in the graph: its hook never fires
        self.c = torch.nn.Linear(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _grads_of(rank: int) -> torch.Tensor | None:
    """The gradient rank ``rank`` contributes (None: it has no shards this step)."""
    if rank == 1:
        return None
    torch.manual_seed(0)
    net = _Net()
    torch.manual_seed(100 + rank)
    net(torch.randn(7, 6)).pow(2).sum().backward()
    return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in net.parameters()])


def _worker(rank: int, world: int, port: int, results: dict, overlap: bool, algorithm: str) -> None:
    group = comm_group(rank, world, port)
    torch.manual_seed(0)
    net = _Net()
    grads = FlatParameters(net.parameters(), extra=2)
    # Tiny buckets: many collectives, launched from hooks while backward runs.
    communicator = make_communicator(algorithm, group, ["node-a", "node-a", "node-b"])
    reducer = GradientReducer(grads, communicator, bucket_bytes=400, overlap=overlap)
    for step in range(2):  # twice: the reducer must reset between steps
        grads.zero()
        grads.extra[0] = 1.0
        if rank != 1:
            torch.manual_seed(100 + rank)
            loss = net(torch.randn(7, 6)).pow(2).sum()
            reducer.arm()
            loss.backward()
        reducer.finish()
        results[(overlap, rank, step)] = grads.buffer.clone()
    group.close()


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "native"])
@pytest.mark.parametrize("overlap", [True, False])
def test_reducer_sums_gradients_across_ranks(overlap, algorithm):
    world = 3
    results = run_ranks(_worker, world, overlap, algorithm)
    contributions = [g for g in (_grads_of(r) for r in range(world)) if g is not None]
    expected = torch.cat([torch.tensor([float(world), 0.0]), torch.stack(contributions).sum(0)])
    for rank in range(world):
        for step in range(2):
            torch.testing.assert_close(results[(overlap, rank, step)], expected, rtol=1e-5, atol=1e-6)
    assert len(GradientReducer(FlatParameters(_Net().parameters(), extra=2), None, 400, False).buckets) > 3


class _Recorder:
    """A communicator that only records which ranges were started, and when."""

    def __init__(self) -> None:
        self.started: list[int] = []

    def start_sum(self, tensor: torch.Tensor):
        self.started.append(tensor.numel())
        return self

    def wait(self) -> None:
        pass


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("with_unused", [False, True])
def test_overlap_launches_buckets_during_backward(overlap, with_unused):
    torch.manual_seed(0)
    net = _Net()
    if not with_unused:
        del net.unused
    grads = FlatParameters(net.parameters(), extra=2)
    recorder = _Recorder()
    reducer = GradientReducer(grads, recorder, bucket_bytes=400, overlap=overlap)
    loss = net(torch.randn(4, 6)).sum()
    reducer.arm()
    loss.backward()
    during = len(recorder.started)
    reducer.finish()
    assert sum(recorder.started) == grads.buffer.numel()  # every element reduced exactly once
    assert len(recorder.started) == len(reducer.buckets) > 3
    if not overlap:
        assert during == 0
    elif not with_unused:
        assert during == len(reducer.buckets)  # all out before backward returned
    else:
        # In-order launching: the bucket holding the unused layer (params 4, 5) never becomes
        # ready, so it and every later bucket wait for finish().
        blocked = next(i for i, b in enumerate(reducer.buckets) if 4 in b.params)
        assert 0 < during == blocked


def test_a_hook_firing_twice_counts_once_and_one_after_the_launch_fails_the_step():
    params = [torch.nn.Parameter(torch.ones(10)) for _ in range(3)]
    grads = FlatParameters(params, extra=2)
    recorder = _Recorder()
    reducer = GradientReducer(grads, recorder, bucket_bytes=80, overlap=True)
    assert [b.params for b in reducer.buckets] == [(2, 1), (0,)]
    reducer.arm()
    # Separate backward calls, as reentrant activation checkpointing makes them: parameter 2
    # accumulates twice before parameter 1 once; its bucket waits for parameter 1.
    for _ in range(2):
        params[2].sum().backward()
    assert recorder.started == []
    params[1].sum().backward()
    assert recorder.started == [20]
    params[2].sum().backward()  # after its bucket went out: its sum is reading the gradient
    params[0].sum().backward()
    with pytest.raises(RuntimeError, match=r"parameters \[2\] got gradient after their bucket was reduced"):
        reducer.finish()
    reducer.arm()  # the next step starts clean
    for p in params:
        p.sum().backward()
    reducer.finish()


class _TwiceShared(torch.nn.Module):
    """One layer applied in two reentrant checkpointed segments, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.shared, x, use_reentrant=True)
        return self.head(checkpoint(self.shared, h, use_reentrant=True))


@pytest.mark.parametrize("overlap", [True, False])
def test_reentrant_checkpointing_over_a_shared_layer_is_refused_under_overlap(overlap):
    torch.manual_seed(0)
    net = _TwiceShared()
    grads = FlatParameters(net.parameters(), extra=2)
    reducer = GradientReducer(grads, _Recorder(), bucket_bytes=64, overlap=overlap)
    reducer.arm()
    net(torch.randn(3, 6, requires_grad=True)).sum().backward()
    if overlap:
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            reducer.finish()
    else:
        reducer.finish()  # every bucket goes after backward: nothing can arrive late


def test_closed_reducer_no_longer_launches_from_backward():
    net = _Net()
    grads = FlatParameters(net.parameters(), extra=2)
    recorder = _Recorder()
    reducer = GradientReducer(grads, recorder, bucket_bytes=400, overlap=True)
    reducer.arm()
    reducer.close()
    net(torch.randn(4, 6)).sum().backward()
    assert recorder.started == []


def test_buckets_default_to_4_mb_on_the_cpu_and_100_mb_on_a_gpu():
    # On a GPU each bucket costs the host a hand-off, a launch and a completion poll whatever
    # its size: 4 MB buckets ran a 710M-parameter GPT at 0.76x a plain loop, 100 MB at 0.91x.
    assert default_bucket_bytes(torch.device("cpu")) == 4 << 20
    assert default_bucket_bytes(torch.device("cuda", 0)) == 100 << 20
