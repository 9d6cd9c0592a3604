"""A ring whose peer stalls is aborted and the group re-formed while nobody died (a network
stall): the old ring's steps that complete late, once the stalled peer goes on, must write
nothing the caller can see. Gloo: real process groups in spawned processes; NCCL: the fake
group with NCCL's semantics (``tests/helpers/nccl_fake_group.py``), ranks as threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from jobspec.failures import CollectiveAborted
from tests.helpers.nccl_fake_group import FakeNcclWorld, FakeProcessGroupNCCL, FakeWork, fake_options
from tests.helpers.ranks import comm_group, run_ranks, tcp_store
from workers.comm.comm_group import CommGroup, PendingOp
from workers.comm.communicator import make_communicator
from workers.comm.process_group import new_process_group
from workers.comm.ring import RingAllReduce, chunk_bounds, ring_all_gather

# The stalled generation's gloo timeout: its abandoned waits end by then, so the test does too.
STALLED_GLOO_TIMEOUT_S = 6.0
# Short enough that a ring that deadlocks fails in seconds, long enough for a loaded machine.
TIMEOUT_S = 8.0
LENGTH = 3001


def _contribution(rank: int, generation: int) -> torch.Tensor:
    # Small nonzero integers: exact sums, and a stale partial sum added in changes them.
    generator = torch.Generator().manual_seed(10 * generation + rank)
    return torch.randint(1, 9, (LENGTH,), generator=generator).float()


def _leave(group: CommGroup) -> None:
    """What ``GroupLink.leave`` does with an aborted group: mark it broken, close it."""
    if group.abort_flag.is_set() and group.broken is None:
        group.broken = "aborted by the driver"
    group.close()


class _StallingSends:
    """A gloo process group whose ``stall_at``-th send (1-based) waits until ``go`` is set: a
    rank that stops posting part-way through a ring (its link stalled)."""

    def __init__(self, pg: dist.ProcessGroup, stall_at: int) -> None:
        self.pg = pg
        self.stall_at = stall_at
        self.sends = 0
        self.go = threading.Event()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        self.sends += 1
        if self.sends == self.stall_at:
            self.go.wait(60.0)
        return self.pg.send(tensors, dst, tag)

    def __getattr__(self, name: str) -> object:
        return getattr(self.pg, name)


def _stalled_gloo_worker(rank: int, world: int, port: int, results: dict, algorithm: str, nodes: list[str]) -> None:
    """Rank 0 stops posting at its second send (its ring's second step): the others' rings
    block part-way. Everyone is aborted and re-forms as gen2, whose backward writes the same
    buffer (the gradient buffer outlives generations). Then rank 0's stall ends: its gen1
    ring, and with it the others' late steps, may go on over the abandoned gen1 group, until
    they end; only then does gen2 sum."""
    store = tcp_store(rank, world, port)
    pg = new_process_group("gloo", dist.PrefixStore("gen1/", store), rank, world, STALLED_GLOO_TIMEOUT_S)
    stalling = _StallingSends(pg, stall_at=2)
    group = CommGroup(stalling if rank == 0 else pg, rank, world, STALLED_GLOO_TIMEOUT_S, threading.Event())
    buffer = _contribution(rank, 1)
    old = make_communicator(algorithm, group, nodes).start_sum(buffer)
    time.sleep(0.5)  # the ranks past rank 0 post and block part-way
    group.abort_flag.set()  # what the actor's abort() does when the driver calls it
    with pytest.raises(CollectiveAborted):
        old.wait()
    _leave(group)
    group.abort_flag.clear()  # join_group clears it for the next generation

    regroup = comm_group(rank, world, store, prefix="gen2/", timeout_s=30.0)
    buffer.copy_(_contribution(rank, 2))  # gen2's backward, into the same gradient buffer
    store.set(f"filled/{rank}", "1")
    store.wait([f"filled/{r}" for r in range(world)])
    stalling.go.set()  # the stalled link goes on with gen1's ring
    results[(rank, "old ended")] = old.ended_within(STALLED_GLOO_TIMEOUT_S + 5.0)
    results[(rank, "before")] = buffer.clone()
    make_communicator("ring", regroup, ["n"] * world).start_sum(buffer).wait()
    results[(rank, "gen2")] = buffer
    regroup.close()


@pytest.mark.parametrize(
    "algorithm, nodes", [("ring", ["n", "n", "n"]), ("hierarchical", ["a", "a", "b"])], ids=["ring", "hierarchical"]
)
def test_late_steps_of_an_aborted_gloo_ring_leave_the_next_generations_buffer_alone(algorithm, nodes):
    world = len(nodes)
    results = run_ranks(_stalled_gloo_worker, world, algorithm, nodes)
    expected = sum(_contribution(r, 2) for r in range(world))
    for rank in range(world):
        assert results[(rank, "old ended")], f"rank {rank}: gen1's abandoned ring still running"
        torch.testing.assert_close(
            results[(rank, "before")], _contribution(rank, 2), rtol=0, atol=0,
            msg=lambda m: f"rank {rank}: gen1's late ring steps wrote gen2's gradient: {m}",
        )
    for rank in range(world):
        torch.testing.assert_close(results[(rank, "gen2")], expected, rtol=0, atol=0)


class _StallingGroup(FakeProcessGroupNCCL):
    """A fake NCCL rank that stops posting before its ``stall_at``-th exchange (1-based) until
    ``go`` is set; ``stalled`` is set once it waits there."""

    def __init__(self, world: FakeNcclWorld, rank: int, size: int, stall_at: int) -> None:
        super().__init__(world, rank, size, fake_options(TIMEOUT_S))
        self.stall_at = stall_at
        self.exchanges = 0
        self.stalled = threading.Event()
        self.go = threading.Event()

    def _end_coalescing(self) -> FakeWork:
        self.exchanges += 1
        if self.exchanges == self.stall_at:
            self.stalled.set()
            self.go.wait(TIMEOUT_S)
        return super()._end_coalescing()


def _ring_sum(group: CommGroup, tensor: torch.Tensor) -> PendingOp:
    return RingAllReduce(group).start_sum(tensor)


def _all_gather(group: CommGroup, tensor: torch.Tensor) -> PendingOp:
    """The sharded all-gather of parameters: each rank's slice of ``tensor`` handed around."""
    pieces = [(tensor[lo:hi],) for lo, hi in chunk_bounds(tensor.numel(), group.size)]
    ranks = list(range(group.size))
    return group.submit(lambda: ring_all_gather(group, pieces, ranks, own=group.rank), "all-gather")


@pytest.mark.parametrize("start, exchanges", [(_ring_sum, 4), (_all_gather, 2)], ids=["ring", "all-gather"])
def test_late_steps_of_an_aborted_ring_write_nothing_after_the_abort_under_nccl_semantics(start, exchanges):
    """Rank 0 stalls before its last exchange (of the all-gather: ``exchanges`` of one segment
    each at 3 ranks): rank 1's receive of it is posted, and NCCL writes a receive when its send
    arrives. Once every rank's wait has raised, the stalled rank going on must change no
    caller's tensor (before the group is even closed)."""
    size = 3
    world = FakeNcclWorld(size)
    stalling = _StallingGroup(world, 0, size, stall_at=exchanges)
    pgs = [stalling] + [FakeProcessGroupNCCL(world, r, size, fake_options(TIMEOUT_S)) for r in range(1, size)]
    groups = [CommGroup(pg, r, size, TIMEOUT_S, threading.Event(), poll_completion=True) for r, pg in enumerate(pgs)]
    buffers = [_contribution(r, 1) for r in range(size)]
    pending = [start(groups[r], buffers[r]) for r in range(size)]
    assert stalling.stalled.wait(TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while len(world.receives[(0, 1)]) < exchanges:  # rank 1 has posted its receive from rank 0
        assert time.monotonic() < deadline, "rank 1 never reached its last exchange"
        time.sleep(0.01)
    for group in groups:
        group.abort_flag.set()
    for op in pending:
        with pytest.raises(CollectiveAborted):
            op.wait()
    seen = [buffer.clone() for buffer in buffers]
    stalling.go.set()
    for op in pending:
        assert op.ended_within(TIMEOUT_S)
    try:
        for rank in range(size):
            torch.testing.assert_close(
                buffers[rank], seen[rank], rtol=0, atol=0,
                msg=lambda m: f"rank {rank}: written after its abort returned: {m}",
            )
    finally:
        for group in groups:
            _leave(group)


def test_a_write_finishes_before_the_group_is_marked_broken_and_none_starts_after():
    group = CommGroup(object(), 0, 2, TIMEOUT_S, threading.Event())  # nothing here touches the backend
    with group.writing():
        marking = threading.Thread(target=lambda: setattr(group, "broken", "timed out during a test"))
        marking.start()
        marking.join(0.2)
        assert marking.is_alive() and group.broken is None  # waits for the write under way
    marking.join(TIMEOUT_S)
    assert group.broken == "timed out during a test"
    with pytest.raises(CollectiveAborted, match="broken"), group.writing():
        pytest.fail("a write of a broken group started")
    with pytest.raises(CollectiveAborted, match="broken"):
        group.exchange([(torch.ones(1), 1)])  # nor is anything posted

    flagged = CommGroup(object(), 0, 2, TIMEOUT_S, threading.Event())
    flagged.abort_flag.set()
    with pytest.raises(CollectiveAborted, match="aborted by the driver"), flagged.writing():
        pytest.fail("a write started with the abort flag up")
    for closing in (group, flagged):
        closing.close()
