"""The communication thread's stream of its own, over the fake NCCL group with device streams
(``tests/helpers/fake_streams.py``): what it launches waits only for what it was handed (a
bucket's writers), never for the rest of backward on the compute stream; each operation's end
orders the caller's stream after it; and native collectives are launched back to back, each
polled by its waiter, not by the communication thread before the next launches (issue 42,
items 2 and 3)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable

import pytest
import torch

from jobspec.failures import CollectiveTimeout
from tests.helpers.fake_streams import FakeDeviceStreams, Gate, Mark
from tests.helpers.nccl_fake_group import FakeNcclWorld, FakeProcessGroupNCCL, fake_options, on_ranks
from workers.comm.comm_group import CommGroup
from workers.comm.communicator import NativeAllReduce
from workers.comm.gradient_reducer import GradientReducer
from workers.comm.ring import RingAllReduce
from workers.model.flat_parameters import FlatParameters

TIMEOUT_S = 10.0


def _group(world: FakeNcclWorld, rank: int, own_stream: bool) -> tuple[CommGroup, FakeDeviceStreams]:
    """Rank ``rank``'s group on a fake device; ``own_stream``: the communication thread gets a
    stream of its own (the worker's), else it runs on the device's default stream (as before)."""
    streams = FakeDeviceStreams()
    pg = FakeProcessGroupNCCL(world, rank, world.size, fake_options(TIMEOUT_S), streams=streams)
    pg.eager_connect_single_device(None)  # as the worker's formation does: both ranks here
    group = CommGroup(pg, rank, world.size, TIMEOUT_S, threading.Event(), True, marks=streams if own_stream else None)
    return group, streams


def _sum_while_backward_runs(own_stream: bool) -> list[tuple[bool, list[float], bool]]:
    """Each of 2 ranks hands a bucket to its communication thread, then queues the rest of its
    backward (a gate) on its compute stream before the thread launches the bucket's sum.
    Per rank: whether the sum ended while backward still ran, the sum, and whether the
    compute stream was then ordered after the sum's end."""
    world = FakeNcclWorld(2)

    def rank_step(rank: int) -> tuple[bool, list[float], bool]:
        group, streams = _group(world, rank, own_stream)
        busy = threading.Event()
        group.submit(lambda: busy.wait(TIMEOUT_S), "an earlier bucket")  # the thread launches the next later
        bucket = torch.ones(4)
        pending = NativeAllReduce(group).start_sum(bucket)
        rest_of_backward = Gate()
        rest_of_backward.on_open.append(world.nudge)
        streams.queue(rest_of_backward)
        busy.set()
        ended = pending.ended_within(1.0)
        rest_of_backward.open()
        pending.wait()
        # The compute stream now waits for the sum's end, a mark of the thread's own stream.
        ordered = any(isinstance(i, Mark) and i.stream is not streams.default for i in streams.default.items)
        ordered = ordered and streams.record().done()
        group.close()
        return ended, bucket.tolist(), ordered

    return on_ranks(2, rank_step)  # type: ignore[return-value]


def test_a_bucket_sum_runs_while_the_rest_of_backward_is_still_queued_on_the_compute_stream():
    for ended, total, ordered in _sum_while_backward_runs(own_stream=True):
        assert ended, "the sum waited for backward: no overlap"
        assert total == [2.0] * 4
        assert ordered, "the compute stream was not ordered after the sum's end"


def test_without_a_stream_of_its_own_the_launch_waits_for_everything_backward_queued():
    """The control: the communication thread on the default stream (as before) cannot overlap."""
    for ended, total, _ in _sum_while_backward_runs(own_stream=False):
        assert not ended and total == [2.0] * 4


def test_native_sums_are_launched_back_to_back_not_each_after_the_last_completed():
    """Rank 0 hands three buckets over while rank 1 has launched nothing: all three are
    launched (NCCL orders them on its stream) before any completes; the waits then end in
    order once rank 1 launches its own."""
    world = FakeNcclWorld(2)
    launched = threading.Event()

    def rank_step(rank: int) -> list[float]:
        group, _ = _group(world, rank, own_stream=True)
        buckets = [torch.full((3,), float(rank + i)) for i in range(3)]
        if rank == 1:
            assert launched.wait(TIMEOUT_S), "rank 0's communication thread launched one sum at a time"
        pending = [NativeAllReduce(group).start_sum(b) for b in buckets]
        if rank == 0:
            deadline = time.monotonic() + TIMEOUT_S
            while len(world.collectives[0]) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            if len(world.collectives[0]) == 3:
                launched.set()
        for p in pending:
            p.wait()
        group.close()
        return [b[0].item() for b in buckets]

    assert on_ranks(2, rank_step) == [[1.0, 3.0, 5.0]] * 2


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_buckets_reduced_during_backward_on_a_stream_of_their_own_hold_the_summed_gradient(algorithm):
    """The worker's configuration end to end: hooks hand buckets over with marks, the thread
    on its own stream sums them (ring or native), ``finish`` waits; every rank holds the sum."""
    world = FakeNcclWorld(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    # Each rank's batch from a generator of its own: ranks are threads sharing torch's global one.
    batches = [torch.randn(5, 8, generator=torch.Generator().manual_seed(10 + rank)) for rank in range(2)]

    def gradient(rank: int, reduced_by: Callable[[CommGroup, FakeDeviceStreams, FlatParameters], GradientReducer] | None) -> torch.Tensor:
        net = copy.deepcopy(model)
        flat = FlatParameters(net.parameters(), extra=2)
        flat.zero()
        if reduced_by is None:
            net(batches[rank]).square().sum().backward()
            return flat.buffer.clone()
        group, streams = _group(world, rank, own_stream=True)
        reducer = reduced_by(group, streams, flat)
        assert len(reducer.buckets) > 2
        reducer.arm()
        net(batches[rank]).square().sum().backward()
        reducer.finish()
        reducer.close()
        group.close()
        return flat.buffer.clone()

    def reducer(group: CommGroup, streams: FakeDeviceStreams, flat: FlatParameters) -> GradientReducer:
        comm = NativeAllReduce(group) if algorithm == "native" else RingAllReduce(group)
        return GradientReducer(flat, comm, 256, overlap=True, group=group, marks=streams)

    want = gradient(0, None) + gradient(1, None)
    for got in on_ranks(2, lambda rank: gradient(rank, reducer)):
        torch.testing.assert_close(got, want)


def test_a_collective_that_ends_in_an_error_after_its_launch_breaks_the_group():
    """NCCL's watchdog aborts a communicator whose collective failed or timed out (a stalled
    peer, no abort from the driver): the kernels exit and the mark after them completes. The
    waiter must raise and mark the group broken, not hand on a half-reduced buffer."""
    world = FakeNcclWorld(2)
    done = threading.Event()

    def rank_step(rank: int) -> tuple[str, bool, list[float]] | None:
        group, _ = _group(world, rank, own_stream=True)
        if rank == 1:  # connected, but never launches its sum
            done.wait(TIMEOUT_S)
            group.close()
            return None
        bucket = torch.ones(4)
        pending = NativeAllReduce(group).start_sum(bucket)
        deadline = time.monotonic() + TIMEOUT_S
        while not world.collectives[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        group.pg.abort()  # the watchdog's abort
        try:
            pending.wait()
            raised = "nothing"
        except CollectiveTimeout as err:
            raised = str(err)
        finally:
            done.set()
        broken = group.broken is not None
        group.close()
        return raised, broken, bucket.tolist()

    raised, broken, bucket = on_ranks(2, rank_step)[0]  # type: ignore[misc]
    assert "failed on rank 0" in raised and broken and bucket == [1.0] * 4
