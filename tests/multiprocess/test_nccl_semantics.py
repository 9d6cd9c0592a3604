"""Our collectives, point-to-point algorithms and group formation under NCCL's semantics, without
a GPU: ranks are threads over ``tests/helpers/nccl_fake_group.py`` (streams, posting-order
matching, lazy blocking communicators, non-blocking ``wait()``), driven through ``CommGroup``
exactly as a real ``ProcessGroupNCCL`` is."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from tests.helpers.devices import DEVICES
from tests.helpers.nccl_fake_group import FakeNcclWorld, FakeProcessGroupNCCL, fake_options, on_ranks
from workers.comm import process_group
from workers.comm.auto_allreduce import auto_communicator
from workers.comm.comm_group import CommGroup
from workers.comm.communicator import NativeAllReduce, make_communicator
from workers.comm.compression import compress
from workers.comm.process_group import form_process_group, new_process_group
from workers.comm.ring import RingAllReduce

# Long enough for a loaded 2-core machine, short enough that a deadlock fails in seconds.
TIMEOUT_S = 8.0
# The collective timeout of formations that a dead peer stalls: it becomes the communicator's
# creation bound (TORCH_NCCL_NONBLOCKING_TIMEOUT), after which their threads and aborts end.
STALLED_TIMEOUT_S = 2.0
# process_group.RELEASE_WAIT_S in these tests: how long a give-up or close waits for an abort.
RELEASE_WAIT_S = 0.3
# Slack for a loaded machine on top of a bound a test checks.
SLACK_S = 1.0


def _groups(size: int, timeout_s: float = TIMEOUT_S) -> tuple[FakeNcclWorld, list[CommGroup]]:
    world = FakeNcclWorld(size)
    return world, [
        CommGroup(FakeProcessGroupNCCL(world, r, size, fake_options(timeout_s)), r, size, timeout_s, threading.Event(), True)
        for r in range(size)
    ]


def _contribution(rank: int, length: int) -> torch.Tensor:
    # Small integers: every partial sum is exact in float32, so the ring must equal the sum.
    return torch.randint(-8, 9, (length,), generator=torch.Generator().manual_seed(rank)).float()


def _lengths(size: int) -> list[int]:
    # Odd; chunks of 65536 and 65537 floats (one and two 256 KiB segments: a step's send and
    # receive differ in segment count); below the world size (empty chunks). A first sum in
    # which some rank sends nothing would let lazily made pair communicators form in turn.
    return [1001, size * 65536 + 1, 1] + ([size - 1] if size > 2 else [])


def _nodes(algorithm: str, size: int) -> list[str]:
    if algorithm == "hierarchical":  # 2 simulated nodes (one rank per node at 2: the flat ring)
        return ["a"] * (size // 2) + ["b"] * (size - size // 2)
    return ["n"] * size


def _raise_first(outcomes: list[object]) -> None:
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    if errors:
        raise AssertionError(f"{len(errors)} rank(s) failed, first: {type(errors[0]).__name__}: {errors[0]}") from errors[0]


# The fake itself: what NCCL does that gloo does not.


def test_the_fake_deadlocks_two_ranks_that_send_before_they_receive_ungrouped():
    world = FakeNcclWorld(2)
    pgs = [FakeProcessGroupNCCL(world, r, 2, fake_options(2.0)) for r in range(2)]

    def post(rank: int) -> list:
        peer = 1 - rank
        return [pgs[rank].send([torch.ones(3)], peer, 0), pgs[rank].recv([torch.empty(3)], peer, 0)]

    works = on_ranks(2, post)
    time.sleep(0.2)
    assert not any(w.is_completed() for ws in works for w in ws)  # each send waits behind nothing it can reach
    for pg in pgs:
        pg.abort()
    assert all(w.is_completed() for ws in works for w in ws)
    with pytest.raises(RuntimeError, match="aborted"):
        works[0][0].wait()


def test_the_fake_starts_a_group_together_and_matches_in_posting_order_whatever_the_tags():
    world = FakeNcclWorld(2)
    pgs = [FakeProcessGroupNCCL(world, r, 2, fake_options(2.0)) for r in range(2)]
    received = [[torch.empty(2), torch.empty(2)] for _ in range(2)]

    def exchange(rank: int) -> object:
        pg, peer = pgs[rank], 1 - rank
        pg._start_coalescing()
        pg.send([torch.full((2,), 10.0 * rank + 1)], peer, 7)
        pg.send([torch.full((2,), 10.0 * rank + 2)], peer, 3)
        pg.recv([received[rank][0]], peer, 3)  # tags swapped on purpose: NCCL ignores them
        pg.recv([received[rank][1]], peer, 7)
        return pg._end_coalescing()

    works = on_ranks(2, exchange)
    assert all(w.is_completed() for w in works)
    assert [t[0].item() for t in received[0]] == [11.0, 12.0] and [t[0].item() for t in received[1]] == [1.0, 2.0]


def test_the_fake_blocks_a_pairs_first_exchange_until_the_peer_arrives():
    world = FakeNcclWorld(2)
    pg = FakeProcessGroupNCCL(world, 0, 2, fake_options(0.3))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="pair communicator with 1 timed out"):
        pg.send([torch.ones(1)], 1, 0)  # rank 1 never posts on the pair: the thread blocks
    assert 0.25 < time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    "received", [torch.empty(3, dtype=torch.float64), torch.empty(2), torch.empty(1)], ids=["dtype", "fewer", "one"]
)
def test_the_fake_fails_a_receive_that_does_not_match_its_send(received):
    """``copy_`` would convert a dtype or broadcast one element: the fake fails both sides instead."""
    world = FakeNcclWorld(2)
    pgs = [FakeProcessGroupNCCL(world, r, 2, fake_options(2.0)) for r in range(2)]

    def exchange(rank: int) -> object:
        pgs[rank]._start_coalescing()
        if rank == 0:
            pgs[0].send([torch.ones(3)], 1, 0)
        else:
            pgs[1].recv([received], 0, 0)
        return pgs[rank]._end_coalescing()

    works = on_ranks(2, exchange)
    for work in works:
        assert work.is_completed()
        with pytest.raises(RuntimeError, match=r"mismatched message: rank 0 sent 3 x torch.float32 to rank 1"):
            work.wait()


# Every algorithm, at 2 to 5 ranks: today's single sends and receives deadlock here.


@pytest.mark.parametrize("size", [2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_ring_and_hierarchical_sum_exactly_under_nccl_semantics(algorithm, size):
    _, groups = _groups(size)
    lengths = _lengths(size)

    def run(rank: int) -> dict[int, torch.Tensor]:
        try:
            communicator = make_communicator(algorithm, groups[rank], _nodes(algorithm, size))
            out = {}
            for length in lengths:
                tensor = _contribution(rank, length)
                communicator.start_sum(tensor).wait()
                out[length] = tensor
            return out
        finally:
            groups[rank].close()

    outcomes = on_ranks(size, run)
    _raise_first(outcomes)
    for length in lengths:
        expected = torch.stack([_contribution(r, length) for r in range(size)]).sum(0)
        for out in outcomes:
            torch.testing.assert_close(out[length], expected, rtol=0, atol=0)


@pytest.mark.parametrize("size", [2, 3, 4, 5])
@pytest.mark.parametrize(("compression", "tolerance"), [("int8", 0.1), ("topk", 1e-5)])
def test_int8_and_topk_sum_under_nccl_semantics(compression, tolerance, size):
    _, groups = _groups(size)
    length = size * 700 + 3

    def run(rank: int) -> torch.Tensor:
        try:
            communicator = compress(compression, RingAllReduce(groups[rank]), groups[rank], topk_ratio=1.0)
            tensor = torch.randn(length, generator=torch.Generator().manual_seed(rank))
            communicator.start_sum(tensor).wait()
            return tensor
        finally:
            groups[rank].close()

    outcomes = on_ranks(size, run)
    _raise_first(outcomes)
    expected = torch.stack([torch.randn(length, generator=torch.Generator().manual_seed(r)) for r in range(size)]).sum(0)
    for out in outcomes[1:]:
        torch.testing.assert_close(out, outcomes[0], rtol=0, atol=0)  # replicas stay identical
    assert (outcomes[0] - expected).abs().max() / expected.abs().max() < tolerance


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_the_link_probe_runs_and_every_rank_chooses_alike_under_nccl_semantics(size):
    """``auto``'s probe times native, ring, hierarchical (2 simulated nodes) and the int8 ring
    (``measure_links(int8=...)``), then agrees on the slowest rank's times with a MAX all-reduce."""
    _, groups = _groups(size)
    nodes = _nodes("hierarchical", size)

    def run(rank: int) -> tuple[object, torch.Tensor]:
        try:
            communicator, choice = auto_communicator(groups[rank], nodes, torch.zeros(5000), None)
            tensor = _contribution(rank, 5000)
            communicator.start_sum(tensor).wait()
            return choice, tensor
        finally:
            groups[rank].close()

    outcomes = on_ranks(size, run)
    _raise_first(outcomes)
    expected = torch.stack([_contribution(r, 5000) for r in range(size)]).sum(0)
    assert all(choice == outcomes[0][0] for choice, _ in outcomes)
    assert set(outcomes[0][0].bandwidth_mb_s) == ({"native", "ring"} if size == 2 else {"native", "ring", "hierarchical"})
    for _, tensor in outcomes:
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


# Aborts and timeouts of collectives whose peer is dead.


@pytest.mark.parametrize("make", [NativeAllReduce, RingAllReduce])
def test_an_abort_frees_a_collective_waiting_on_a_dead_peer_and_aborts_the_communicator(make):
    world, groups = _groups(2, timeout_s=30.0)
    world.connected.add(1)  # rank 1 formed the communicator, then died: it never posts anything
    group = groups[0]
    pending = make(group).start_sum(torch.ones(8))
    time.sleep(0.2)
    assert not pending.ended_within(0.0)  # polled, never trusting wait(): not "done" on a dead peer
    group.abort_flag.set()
    started = time.perf_counter()
    with pytest.raises(CollectiveAborted):
        pending.wait()
    assert time.perf_counter() - started < 1.0
    group.close()
    assert group.pg.aborted


def test_a_collective_on_a_dead_peer_times_out_without_an_abort():
    world, groups = _groups(2, timeout_s=0.5)
    world.connected.add(0)  # rank 0 formed the communicator, then died
    with pytest.raises(CollectiveTimeout):
        groups[1].broadcast(torch.ones(4), root=0)
    groups[1].close()
    assert groups[1].pg.aborted


class _FailedWork:
    """NCCL work that ended in an error: completed, and wait() raises it."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        raise RuntimeError("NCCL communicator was aborted")


def test_a_completed_op_that_failed_raises_instead_of_passing_half_reduced_values():
    _, groups = _groups(1)
    group = groups[0]
    with pytest.raises(RuntimeError, match="aborted"):
        group.complete(_FailedWork())  # type: ignore[arg-type]
    group.close()


def test_without_polling_wait_would_have_reported_a_dead_op_as_done():
    """Why polling is needed: trusting NCCL's wait() ends the op at once, and the caller would
    go on to read values that never arrived."""
    world = FakeNcclWorld(2)
    world.connected.add(1)  # rank 1 formed the communicator, then died
    pg = FakeProcessGroupNCCL(world, 0, 2, fake_options(5.0))
    group = CommGroup(pg, rank=0, size=2, timeout_s=5.0, abort_flag=threading.Event(), poll_completion=False)  # type: ignore[arg-type]
    tensor = torch.ones(4)
    NativeAllReduce(group).start_sum(tensor).wait()  # "succeeds"
    assert world.pending(0) == 1 and torch.equal(tensor, torch.ones(4))  # nothing was summed
    group.close()


# Formation: the communicator is made and proven inside the abortable, deadline-bounded wait.


@pytest.fixture
def fake_nccl(monkeypatch):
    """``dist.ProcessGroupNCCL`` is the fake (this build has none), the NCCL environment unset,
    releases waited for ``RELEASE_WAIT_S``."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeProcessGroupNCCL, raising=False)
    monkeypatch.setattr(process_group, "RELEASE_WAIT_S", RELEASE_WAIT_S)
    for name in (*process_group.NCCL_ENVIRONMENT, process_group.NONBLOCKING_TIMEOUT_VARIABLE):
        monkeypatch.setenv(name, "unset")  # recorded, so what the code under test sets is undone
        monkeypatch.delenv(name)


def _form(
    world: FakeNcclWorld, rank: int, flag: threading.Event, deadline_s: float = TIMEOUT_S, timeout_s: float = TIMEOUT_S,
    device: torch.device = torch.device("cpu"),
) -> dist.ProcessGroup:
    return form_process_group(
        "nccl", world, rank, world.size, timeout_s=timeout_s, deadline_s=deadline_s, abort_flag=flag,  # type: ignore[arg-type]
        device=device,
    )


def test_formation_connects_eagerly_and_chooses_the_recovery_environment(fake_nccl, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "1")  # a user's own choice is kept
    world = FakeNcclWorld(3)
    pgs = on_ranks(3, lambda rank: _form(world, rank, threading.Event()))
    _raise_first(pgs)
    assert all(pg.main_connected and not pg.options.config.blocking for pg in pgs)  # type: ignore[attr-defined]
    assert pgs[0].options._timeout == timedelta(seconds=TIMEOUT_S)  # type: ignore[attr-defined]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # torch's default (3) kills survivors
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    # torch's wait for a non-blocking communicator (30 min by default) bounded by the timeout
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "8" and pgs[0].creation_wait_s == 8.0  # type: ignore[attr-defined]
    assert all(world.pending(r) == 0 for r in range(3))


def test_formation_turns_the_monitor_off_unless_the_user_chose(fake_nccl):
    new_process_group("nccl", FakeNcclWorld(1), 0, 1, 1.0)  # type: ignore[arg-type]
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"


def _formation_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("ringleader-abortable")}


def _assert_nothing_left(
    world: FakeNcclWorld, ranks: list[int], before: set[threading.Thread], stalled_s: float = STALLED_TIMEOUT_S
) -> None:
    """Every formation thread ended, every communicator made aborted, no launch or wait left,
    once a stalled communicator's creation has given up (after ``stalled_s``)."""
    deadline = time.monotonic() + stalled_s + 5.0
    for thread in _formation_threads() - before:
        thread.join(max(0.0, deadline - time.monotonic()))
        assert not thread.is_alive(), f"{thread.name} was left behind"
    for rank in ranks:
        while not world.groups[rank].aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert world.groups[rank].aborted, f"rank {rank}'s communicator was not aborted"
        assert world.pending(rank) == 0, f"rank {rank} left work behind"


def _dead_rank(world: FakeNcclWorld, died_before: str) -> None:
    """The last rank dies before ``died_before``: it may have made its group and connected."""
    if died_before == "construction":
        return
    pg = FakeProcessGroupNCCL(world, world.size - 1, world.size, fake_options(TIMEOUT_S))
    if died_before == "first collective":  # it connected (blocking until all arrive), then died
        threading.Thread(target=pg.eager_connect_single_device, args=(None,), daemon=True).start()


@pytest.mark.parametrize("died_before", ["construction", "eager connect", "first collective"])
@pytest.mark.parametrize("ending", ["abort", "deadline"])
def test_a_peer_dying_during_formation_ends_it_in_bounded_time_leaving_nothing(fake_nccl, died_before, ending):
    size, before = 3, _formation_threads()
    world = FakeNcclWorld(size)
    flag = threading.Event()
    _dead_rank(world, died_before)
    deadline_s = 0.6 if ending == "deadline" else TIMEOUT_S
    if ending == "abort":
        threading.Timer(0.4, flag.set).start()
    started = time.monotonic()
    outcomes = on_ranks(size - 1, lambda rank: _form(world, rank, flag, deadline_s, STALLED_TIMEOUT_S))
    elapsed = time.monotonic() - started
    expected = CollectiveAborted if ending == "abort" else CollectiveTimeout
    assert all(isinstance(o, expected) for o in outcomes), outcomes
    assert elapsed < 0.6 + RELEASE_WAIT_S + SLACK_S  # the give-up never waits for a stalled abort
    _assert_nothing_left(world, list(range(size - 1)), before)


def test_an_abort_during_construction_aborts_the_group_made_after_it(fake_nccl):
    before = _formation_threads()
    world = FakeNcclWorld(2)
    world.construction_gate = threading.Event()  # construction is slow (a CUDA context, say)
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()
    with pytest.raises(CollectiveAborted):
        _form(world, 0, flag)
    assert 0 not in world.groups
    world.construction_gate.set()  # construction finishes after the formation was given up
    _assert_nothing_left(world, [0], before)


def test_giving_up_a_formation_returns_while_its_communicator_still_waits_for_a_dead_peer(fake_nccl):
    """torch's abort waits behind a non-blocking communicator's creation (both hold its mutex):
    the join must not. Its abort ends once the creation gives up, bounded by the timeout."""
    before, stalled_s = _formation_threads(), 4.0
    world = FakeNcclWorld(2)
    FakeProcessGroupNCCL(world, 1, 2, fake_options(TIMEOUT_S))  # rank 1 made its group, then died
    started = time.monotonic()
    [outcome] = on_ranks(1, lambda rank: _form(world, rank, threading.Event(), deadline_s=0.5, timeout_s=stalled_s), 30.0)
    assert isinstance(outcome, CollectiveTimeout) and "rendezvous did not finish" in str(outcome), outcome
    assert time.monotonic() - started < 0.5 + RELEASE_WAIT_S + SLACK_S
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "4"
    assert not world.groups[0].aborted  # its abort still waits for the creation...
    _assert_nothing_left(world, [0], before, stalled_s)  # ...which gives up after stalled_s


def test_closing_a_broken_group_returns_while_its_communicator_still_waits_for_a_dead_peer(monkeypatch):
    monkeypatch.setattr(process_group, "RELEASE_WAIT_S", RELEASE_WAIT_S)
    monkeypatch.setenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", "4")
    options = fake_options(0.5)
    options.config.blocking = False
    pg = FakeProcessGroupNCCL(FakeNcclWorld(2), 0, 2, options)
    pg.eager_connect_single_device(None)  # rank 1 never connects: it died
    group = CommGroup(pg, 0, 2, 0.5, threading.Event(), poll_completion=True)  # type: ignore[arg-type]
    with pytest.raises(CollectiveTimeout):
        group.broadcast(torch.ones(4), root=0)  # its thread waits in the communicator's creation
    started = time.monotonic()
    group.close()
    assert time.monotonic() - started < RELEASE_WAIT_S + SLACK_S
    assert not pg.aborted  # its abort waits for the creation, which gives up at 4 s
    deadline = time.monotonic() + 4.0 + 5.0
    while not pg.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pg.aborted and pg.world.pending(0) == 0


def test_closing_a_healthy_group_shuts_its_communicators_down():
    """Not left to the garbage collector after a re-form: shut down (flushed, then ended)."""
    _, groups = _groups(2)

    def run(rank: int) -> float:
        NativeAllReduce(groups[rank]).start_sum(torch.ones(4)).wait()
        started = time.monotonic()
        groups[rank].close()
        return time.monotonic() - started

    outcomes = on_ranks(2, run)
    _raise_first(outcomes)
    assert all(group.pg.shut_down and not group.pg.aborted for group in groups)
    assert all(elapsed < 2.0 for elapsed in outcomes)  # type: ignore[operator]


def test_closing_a_healthy_group_whose_flush_stalls_returns_and_aborts_it_later(monkeypatch):
    """A send its peer never receives: the shutdown's flush fails at its bound, then the abort."""
    monkeypatch.setattr(process_group, "RELEASE_WAIT_S", RELEASE_WAIT_S)
    world, groups = _groups(2, timeout_s=2.0)
    group = groups[0]
    world.connected.add(1)
    group.submit(lambda: group.exchange([(torch.ones(4), 1)]), "a send left in flight").wait()
    started = time.monotonic()
    group.close()
    assert time.monotonic() - started < RELEASE_WAIT_S + SLACK_S
    deadline = time.monotonic() + 2.0 + 5.0
    while not group.pg.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert group.pg.aborted and not group.pg.shut_down and world.pending(0) == 0


def test_formation_on_a_cuda_device_without_an_index_connects_the_current_one(fake_nccl, monkeypatch):
    """torch keys the eager communicator by the device's index: ``cuda`` alone would connect
    nothing then, and lazily ``cuda:0`` later, whatever the current device."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    seen: list[torch.device | None] = []

    def connect(pg: FakeProcessGroupNCCL, device: torch.device | None) -> None:
        seen.append(device)
        raise RuntimeError("no CUDA device here")  # before the first collective's CUDA tensor

    monkeypatch.setattr(FakeProcessGroupNCCL, "eager_connect_single_device", connect)
    with pytest.raises(RuntimeError, match="no CUDA device here"):
        _form(FakeNcclWorld(1), 0, threading.Event(), device=torch.device("cuda"))
    assert seen == [torch.device("cuda", 3)]


def test_a_ring_that_posts_its_send_and_receive_apart_deadlocks_under_the_fake():
    """The proof has teeth: the ring as it was before every exchange became one group (each
    rank's send to the right posted alone, then its receive from the left) never completes
    under the fake's NCCL semantics: it ends in a timeout, on every rank."""
    size, timeout_s = 3, 1.5
    _, groups = _groups(size, timeout_s)

    def run(rank: int) -> object:
        group = groups[rank]
        outgoing, incoming = torch.ones(4), torch.empty(4)

        def ungrouped() -> None:
            group.exchange(sends=[(outgoing, (rank + 1) % size)]).complete()
            group.exchange(receives=[(incoming, (rank - 1) % size)]).complete()

        try:
            group.submit(ungrouped, "ungrouped ring step").wait()
            return "completed"
        finally:
            group.close()

    outcomes = on_ranks(size, run, limit_s=30.0)
    assert all(isinstance(o, (CollectiveTimeout, CollectiveAborted)) for o in outcomes), outcomes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compression", ["none", "int8"])
def test_the_ring_sums_device_tensors_under_nccl_semantics(device, compression):
    """The ring's segment kernels and int8's quantizing on the device (a group of one returns at
    once: this runs them), over the fake group at 3 ranks."""
    size, length = 3, 3 * 70_000 + 5
    _, groups = _groups(size)

    def run(rank: int) -> torch.Tensor:
        try:
            ring = RingAllReduce(groups[rank])
            communicator = ring if compression == "none" else compress(compression, ring, groups[rank], topk_ratio=1.0)
            tensor = _contribution(rank, length).to(device)
            communicator.start_sum(tensor).wait()
            return tensor.cpu()
        finally:
            groups[rank].close()

    outcomes = on_ranks(size, run)
    _raise_first(outcomes)
    expected = torch.stack([_contribution(r, length) for r in range(size)]).sum(0)
    for out in outcomes:
        torch.testing.assert_close(out, outcomes[0], rtol=0, atol=0)  # replicas identical
    error = (outcomes[0] - expected).abs().max() / expected.abs().max()
    assert error == 0 if compression == "none" else error < 0.1
