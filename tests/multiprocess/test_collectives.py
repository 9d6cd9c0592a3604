"""Our ring and hierarchical all-reduce against the reference sum, and aborting a collective:
real gloo process groups in spawned processes (no Ray)."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from tests.helpers.ranks import comm_group, run_ranks, tcp_store
from workers.comm.communicator import make_communicator
from workers.comm.compression import compress
from workers.comm.ring import chunk_bounds, node_groups

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def test_chunk_bounds_tile_any_length():
    for length in (0, 1, 4, 7, 1000, 1001):
        for parts in (1, 2, 3, 5):
            bounds = chunk_bounds(length, parts)
            assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


def test_node_groups_keep_rank_order():
    assert node_groups(["b", "a", "b", "c", "a"]) == [[0, 2], [1, 4], [3]]


def _contribution(rank: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers: exact in every dtype, so the sum must match exactly.
    generator = torch.Generator().manual_seed(rank)
    return torch.randint(-8, 9, (length,), generator=generator).to(dtype)


def _sum_worker(rank: int, world: int, port: int, results: dict, algorithm: str, nodes: list[str], cases: list) -> None:
    group = comm_group(rank, world, port)
    communicator = make_communicator(algorithm, group, nodes)
    for length, dtype_name in cases:
        tensor = _contribution(rank, length, DTYPES[dtype_name])
        communicator.start_sum(tensor).wait()
        results[(rank, length, dtype_name)] = tensor
    group.close()


# Lengths below, at and above the world size, odd, and big enough for several segments.
CASES = [(1, "float32"), (5, "float32"), (1001, "float32"), (700_001, "float32"), (999, "bfloat16"), (998, "float16")]


@pytest.mark.parametrize(
    "algorithm, nodes",
    [
        ("ring", ["n"]),
        ("ring", ["n"] * 2),
        ("ring", ["n"] * 3),
        ("ring", ["n"] * 4),
        ("ring", ["n"] * 5),
        ("hierarchical", ["a", "a", "b", "b"]),
        ("hierarchical", ["a", "b", "a", "c", "b"]),
        ("hierarchical", ["a", "a", "a"]),  # one node: flat ring
        ("hierarchical", ["a", "b", "c"]),  # one rank per node: flat ring
    ],
    ids=lambda v: v if isinstance(v, str) else "".join(v),
)
def test_sum_equals_reference(algorithm, nodes):
    world = len(nodes)
    results = run_ranks(_sum_worker, world, algorithm, nodes, CASES)
    for length, dtype_name in CASES:
        dtype = DTYPES[dtype_name]
        expected = torch.stack([_contribution(r, length, dtype).float() for r in range(world)]).sum(0).to(dtype)
        for rank in range(world):
            torch.testing.assert_close(results[(rank, length, dtype_name)], expected, rtol=0, atol=0)


def _absent_rank_worker(rank: int, world: int, port: int, results: dict, algorithm: str, abort_after: float | None) -> None:
    """Rank 2 never joins the first sum; the others must come back with an error, then all
    form a new generation and sum correctly."""
    store = tcp_store(rank, world, port)
    group = comm_group(rank, world, store, prefix="gen1/", timeout_s=3.0)
    if rank != 2:
        communicator = make_communicator(algorithm, group, ["n"] * world)
        pending = communicator.start_sum(torch.ones(100_000))
        if abort_after is not None:
            time.sleep(abort_after)
            group.abort_flag.set()  # what the actor's abort() does when the driver calls it
        started = time.monotonic()
        try:
            pending.wait()
            results[(rank, "error")] = "none"
        except (CollectiveTimeout, CollectiveAborted) as err:
            results[(rank, "error")] = type(err).__name__
        results[(rank, "seconds")] = time.monotonic() - started
    group.close()
    regroup = comm_group(rank, world, store, prefix="gen2/", timeout_s=30.0)
    tensor = torch.full((1001,), float(rank))
    make_communicator(algorithm, regroup, ["n"] * world).start_sum(tensor).wait()
    results[(rank, "after")] = tensor
    regroup.close()


@pytest.mark.parametrize("algorithm", ["ring", "native"])
@pytest.mark.parametrize("abort_after", [None, 0.3], ids=["timeout", "abort"])
def test_absent_rank_gives_clear_error_and_group_reforms(algorithm, abort_after):
    world = 4
    results = run_ranks(_absent_rank_worker, world, algorithm, abort_after)
    expected_error = "CollectiveTimeout" if abort_after is None else "CollectiveAborted"
    for rank in (0, 1, 3):
        assert results[(rank, "error")] == expected_error
        limit = 3.0 if abort_after is None else abort_after
        assert results[(rank, "seconds")] < limit + 1.0  # back within its timeout: no hang
    for rank in range(world):
        torch.testing.assert_close(results[(rank, "after")], torch.full((1001,), float(sum(range(world)))))


def _compressed_worker(rank: int, world: int, port: int, results: dict, compression: str, ratio: float) -> None:
    group = comm_group(rank, world, port)
    communicator = compress(compression, make_communicator("ring", group, ["n"] * world), group, ratio)
    for step in range(2):
        torch.manual_seed(rank * 10 + step)
        tensor = torch.randn(10_001)
        results[(rank, step, "input")] = tensor.clone()
        communicator.start_sum(tensor).wait()
        results[(rank, step, "output")] = tensor
        if compression == "topk":
            communicator.commit()
    if compression == "topk":
        results[(rank, "residual")] = next(iter(communicator.residuals.values())).clone()
        communicator.start_sum(torch.randn(10_001)).wait()  # a step never committed (aborted)
        results[(rank, "kept")] = torch.equal(next(iter(communicator.residuals.values())), results[(rank, "residual")])
    group.close()


@pytest.mark.parametrize(
    "compression, ratio, tolerance",
    [("bf16", 0, 0.05), ("fp16", 0, 0.01), ("int8", 0, 0.1), ("topk", 1.0, 1e-5)],
)
def test_compressed_sum_is_close_and_identical_on_every_rank(compression, ratio, tolerance):
    world = 3
    results = run_ranks(_compressed_worker, world, compression, ratio)
    for step in range(2):
        expected = torch.stack([results[(r, step, "input")] for r in range(world)]).sum(0)
        outputs = [results[(r, step, "output")] for r in range(world)]
        for output in outputs[1:]:
            torch.testing.assert_close(output, outputs[0], rtol=0, atol=0)  # replicas stay identical
        error = (outputs[0] - expected).abs().max() / expected.abs().max()
        assert error < tolerance, f"{compression}: relative error {error:.4f}"


def test_topk_error_feedback_loses_nothing():
    """What a rank did not send is in its residual: over two steps, sent + residual = inputs."""
    world, ratio = 2, 0.05
    results = run_ranks(_compressed_worker, world, "topk", ratio)
    inputs = sum(results[(r, s, "input")] for r in range(world) for s in range(2))
    delivered = results[(0, 0, "output")] + results[(0, 1, "output")]
    kept = sum(results[(r, "residual")] for r in range(world))
    torch.testing.assert_close(delivered + kept, inputs, rtol=1e-5, atol=1e-5)
    assert all(results[(r, "kept")] for r in range(world)), "an uncommitted step changed the residuals"
    # And it really is sparse: one step delivers at most world * k nonzeros.
    assert int((results[(0, 0, "output")] != 0).sum()) <= world * math.ceil(ratio * 10_001)


def _native_threads(rank: int, world: int, port: int, results: dict) -> None:
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    store = tcp_store(rank, world, port)  # its server thread (rank 0) outlives the group
    results[(rank, "before")] = threads()
    group = comm_group(rank, world, store)
    for step in range(3):
        buffer = torch.full((64,), float(rank))
        make_communicator("native", group, ["n"] * world).start_sum(buffer[8:40]).wait()
        del buffer  # the slice gloo reduced is now referenced only from gloo's side
    results[(rank, "during")] = threads()
    group.close()
    deadline = time.monotonic() + 2.0  # a joined thread leaves /proc a moment after its join returns
    while threads() != results[(rank, "before")] and time.monotonic() < deadline:
        time.sleep(0.01)
    results[(rank, "after")] = threads()
    group.close()  # a second close does nothing
    with pytest.raises(CollectiveAborted, match="closed"):
        group.submit(lambda: None, "after close")


def test_closing_a_healthy_gloo_group_joins_its_threads():
    """Gloo's worker threads hold each collective's tensors after its wait returns; one freeing
    such a tensor while the interpreter finalizes kills the process with SIGABRT. A closed
    group has ended them (and the communication thread) while the interpreter is alive."""
    world = 2
    results = run_ranks(_native_threads, world)
    for rank in range(world):
        assert results[(rank, "during")] > results[(rank, "before")]  # gloo's threads, the comm thread
        assert results[(rank, "after")] == results[(rank, "before")]
