"""``collective.algorithm: auto``'s decisions from link measurements (pure), and the probe on
real gloo groups in spawned processes: every rank agrees, sums stay exact, aborts still work."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from policies.collective_choice import (
    MIN_BUCKET_BYTES,
    LinkMeasurements,
    LinkModel,
    choose_collective,
)
from tests.helpers.ranks import comm_group, run_ranks
from workers.comm.auto_allreduce import auto_communicator, candidate_algorithms, measure_links, probe_sizes
from workers.comm.communicator import make_communicator

MB = 1 << 20
SIZES = (256 << 10, MB, 4 * MB, 16 * MB)


def _seconds(bandwidth_mb_s: list[float]) -> tuple[float, ...]:
    return tuple(size / (bw * 1e6) for size, bw in zip(SIZES, bandwidth_mb_s))


def _alpha_beta(latency_s: float, bytes_per_s: float, sizes: tuple[int, ...] = SIZES) -> tuple[float, ...]:
    return tuple(latency_s + size / bytes_per_s for size in sizes)


def test_the_fit_recovers_latency_and_bandwidth():
    model = LinkModel.fit(SIZES, _alpha_beta(5e-4, 1e9))
    assert model.alpha_s == pytest.approx(5e-4) and model.beta_bytes_s == pytest.approx(1e9)
    assert LinkModel.fit(SIZES, _alpha_beta(0.0, 2e9)).alpha_s == pytest.approx(0.0, abs=1e-9)
    flat = LinkModel.fit(SIZES, (1e-3,) * 4)  # no growth with size: all latency
    assert flat.alpha_s == pytest.approx(1e-3) and flat.seconds(SIZES[-1]) == pytest.approx(1e-3, rel=0.05)


def test_a_single_size_fits_through_the_origin():
    # A gradient of at most 256 KiB is probed at one size: no latency can be told apart, and
    # the model must reproduce the measurement (a near-zero determinant once turned noise into
    # a fit that preferred a ring measured slower than native).
    for size, native_s, ring_s in ((140032, 3.71e-4, 3.83e-4), (256 << 10, 1e-3, 1.1e-3), (4, 2e-5, 2.1e-5)):
        for seconds in (native_s, ring_s):
            assert LinkModel.fit((size,), (seconds,)).seconds(size) == pytest.approx(seconds, rel=1e-9)
        measured = LinkMeasurements((size,), {"native": (native_s,), "ring": (ring_s,)})
        assert choose_collective(measured, size, shares_cores=True).algorithms == ("native",)


def test_each_size_takes_the_fastest_but_ours_must_beat_native_clearly():
    # Native: high latency, high bandwidth; the ring the other way round: the ring wins small.
    native, ring = _alpha_beta(5e-4, 1e9), _alpha_beta(5e-5, 6e8)
    choice = choose_collective(LinkMeasurements(SIZES, {"native": native, "ring": ring}), 64 * MB, shares_cores=True)
    assert choice.by_size == ((256 << 10, "ring"), (MB, "native"), (4 * MB, "native"), (16 * MB, "native"))
    assert [choice.algorithm_for(n) for n in (1, 256 << 10, (256 << 10) + 1, 100 * MB)] == ["ring", "ring", "native", "native"]
    assert choice.algorithms == ("ring", "native")
    # A little faster is not enough: the probe cannot see our Python loop's cost in training.
    close = _alpha_beta(4.5e-4, 1.1e9)
    assert choose_collective(LinkMeasurements(SIZES, {"native": native, "ring": close}), 64 * MB, shares_cores=True).algorithms == ("native",)


def test_one_noisy_measurement_does_not_flip_the_choice():
    native, ring = list(_alpha_beta(2e-4, 1.5e9)), _alpha_beta(5e-4, 1.2e9)
    native[1] *= 2.5  # a descheduled moment at 1 MB: compared size by size, the ring would win there
    measured = LinkMeasurements(SIZES, {"native": tuple(native), "ring": ring})
    assert ring[1] < (1 - 0.25) * native[1]
    assert choose_collective(measured, 64 * MB, shares_cores=True).algorithms == ("native",)


def test_bucket_size_follows_where_the_collective_runs():
    measured = LinkMeasurements(SIZES, {"native": _alpha_beta(5e-4, 1e9), "ring": _alpha_beta(1e-3, 5e8)})
    on_cpu = choose_collective(measured, 64 * MB, shares_cores=True)
    on_gpu = choose_collective(measured, 64 * MB, shares_cores=False)
    assert on_cpu.bucket_bytes == 16 * MB  # fewest calls: every call's work is taken from backward
    # Latency a fifth of a call: alpha x beta x 4 = 2 MB; overlap starts early.
    assert on_gpu.bucket_bytes == pytest.approx(2e6, rel=1e-6)
    # Never below the floor, and the user's bucket size is kept.
    tiny = LinkMeasurements(SIZES, {"native": _alpha_beta(1e-5, 1e9)})
    assert choose_collective(tiny, 64 * MB, shares_cores=False).bucket_bytes == MIN_BUCKET_BYTES
    # ...and never past the largest size measured (a flat fit's huge bandwidth would say so).
    flat = LinkMeasurements(SIZES, {"native": (2e-3,) * 4})
    assert choose_collective(flat, 64 * MB, shares_cores=False).bucket_bytes == 16 * MB
    assert choose_collective(measured, 64 * MB, shares_cores=True, bucket_bytes=3 * MB).bucket_bytes == 3 * MB


def test_compression_is_advised_only_when_it_would_pay():
    native = _seconds([100, 100, 100, 100])  # a slow link: 16 MB in 168 ms
    slow_link = LinkMeasurements(SIZES, {"native": native}, int8_seconds=native[-1] / 3)
    advice = choose_collective(slow_link, 32 * MB, shares_cores=True).compression
    assert advice is not None and "int8" in advice and "collective.compression: int8" in advice
    fast_link = LinkMeasurements(SIZES, {"native": native}, int8_seconds=native[-1] * 0.9)
    assert choose_collective(fast_link, 32 * MB, shares_cores=True).compression is None


def test_bad_measurements_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        LinkMeasurements((MB, 256 << 10), {"native": (0.1, 0.1)})
    with pytest.raises(ValueError, match="native: need a positive time"):
        LinkMeasurements(SIZES, {"native": (0.1, 0.1)})
    with pytest.raises(ValueError, match="no algorithm"):
        LinkMeasurements(SIZES, {})


def test_choice_reports_itself():
    measured = LinkMeasurements(SIZES[:2], {"native": _alpha_beta(0.0, 5e7, SIZES[:2]), "ring": _alpha_beta(0.0, 1e8, SIZES[:2])})
    record = choose_collective(measured, MB, shares_cores=True).to_json()
    assert record["by_size"] == [{"up_to_bytes": 256 << 10, "algorithm": "ring"}, {"up_to_bytes": MB, "algorithm": "ring"}]
    assert record["bandwidth_mb_s"] == {"native": [50.0, 50.0], "ring": [100.0, 100.0]}
    assert record["fit"]["ring"] == {"latency_us": 0.0, "bandwidth_mb_s": 100.0}
    assert record["bucket_mb"] == 1.0 and record["compression"] is None


def test_candidates_and_probe_sizes():
    assert candidate_algorithms(["a", "a"]) == ("native", "ring")
    assert candidate_algorithms(["a", "b"]) == ("native", "ring")  # one rank per node: hierarchical is the ring
    assert candidate_algorithms(["a", "a", "b"]) == ("native", "ring", "hierarchical")
    assert probe_sizes(100_000, 4) == (100_000,)
    assert probe_sizes(5 * MB + 2, 4) == (256 << 10, MB, 4 * MB, 5 * MB)
    assert probe_sizes(64 * MB, 4) == SIZES


def _auto_worker(rank: int, world: int, port: int, results: dict, nodes: list[str], numel: int) -> None:
    group = comm_group(rank, world, port)
    grads = torch.zeros(numel)
    communicator, choice = auto_communicator(group, nodes, grads, None)
    results[(rank, "choice")] = choice
    results[(rank, "bytes_after_probe")] = group.bytes_sent
    for length in (7, 70_001, numel):  # sizes falling in different entries of the choice
        tensor = torch.arange(length, dtype=torch.float32) * (rank + 1)
        communicator.start_sum(tensor).wait()
        results[(rank, length)] = tensor
    group.close()


def test_probe_agrees_on_every_rank_and_sums_stay_exact():
    nodes = ["a", "a", "b"]  # hierarchical is a candidate
    numel = 600_000  # 2.4 MB: probe sizes 256K, 1M, 2.4M
    results = run_ranks(_auto_worker, len(nodes), nodes, numel)
    choices = [results[(r, "choice")] for r in range(len(nodes))]
    assert all(c == choices[0] for c in choices)  # identical decisions: identical sequences of collectives
    assert choices[0].sizes == (256 << 10, MB, numel * 4)
    assert set(choices[0].bandwidth_mb_s) == {"native", "ring", "hierarchical"}
    assert all(results[(r, "bytes_after_probe")] == 0 for r in range(len(nodes)))  # the probe's traffic is not the job's
    for length in (7, 70_001, numel):
        expected = torch.arange(length, dtype=torch.float32) * sum(r + 1 for r in range(len(nodes)))
        for rank in range(len(nodes)):
            torch.testing.assert_close(results[(rank, length)], expected, rtol=0, atol=0)


def _budget_worker(rank: int, world: int, port: int, results: dict) -> None:
    group = comm_group(rank, world, port)
    communicators = {"native": make_communicator("native", group, ["n"] * world)}
    if rank == 1:
        time.sleep(0.3)  # this rank alone is over budget: every rank must stop where it stops
    measured = measure_links(group, communicators, (1 << 10, 1 << 12, 1 << 14), torch.zeros(1), budget_s=0.2)
    results[rank] = measured.sizes
    group.close()


def test_a_probe_over_its_budget_stops_on_every_rank_alike():
    results = run_ranks(_budget_worker, 2)
    assert results[0] == results[1] == (1 << 10,)


def _abort_worker(rank: int, world: int, port: int, results: dict, abort_after: float | None) -> None:
    """Rank 1 never probes: rank 0's probe must end by the driver's abort, or by its timeout."""
    group = comm_group(rank, world, port, timeout_s=2.0)
    if rank == 1:
        time.sleep(4.0)
        group.close()
        return
    if abort_after is not None:
        threading.Timer(abort_after, group.abort_flag.set).start()  # what the actor's abort() does
    started = time.monotonic()
    try:
        auto_communicator(group, ["n"] * world, torch.zeros(100_000), None)
        results["error"] = "none"
    except (CollectiveAborted, CollectiveTimeout) as err:
        results["error"] = type(err).__name__
    results["seconds"] = time.monotonic() - started
    group.close()


@pytest.mark.parametrize("abort_after", [None, 0.3], ids=["timeout", "abort"])
def test_probe_keeps_the_abort_and_timeout_guarantees(abort_after):
    results = run_ranks(_abort_worker, 2, abort_after)
    assert results["error"] == ("CollectiveTimeout" if abort_after is None else "CollectiveAborted")
    assert results["seconds"] < (2.0 if abort_after is None else abort_after) + 1.0


def _single_worker(rank: int, world: int, port: int, results: dict) -> None:
    group = comm_group(rank, world, port)
    communicator, choice = auto_communicator(group, ["n"], torch.zeros(1000), None)
    tensor = torch.ones(1000)
    communicator.start_sum(tensor).wait()
    results["choice"], results["sum"] = choice, tensor
    group.close()


def test_a_single_rank_needs_no_probe():
    results = run_ranks(_single_worker, 1)
    assert results["choice"].sizes == () and results["choice"].algorithms == ("ring",)
    torch.testing.assert_close(results["sum"], torch.ones(1000))
