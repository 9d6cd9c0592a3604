"""``ringleader bench sharding`` in miniature: tinylm on 2 workers at group sizes 1 and 2, a few
steps, one repeat, ours on the session's Ray (in process) and ZeRO + DDP under torchrun. Its
figures must be real ones: a sharded rank holds half the optimizer state, every contender
trained, and the tables and targets print."""

from __future__ import annotations

import pytest

from benchmarks.sharding import format_result, ours_in_process, run_benchmark
from benchmarks.sharding_memory import ratios

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_the_sharding_bench_reports_measured_figures():
    lines: list[str] = []
    result = run_benchmark(
        ["tinylm"], [1, 2], workers=2, steps=6, repeats=1, ours=ours_in_process, peers=("zero",), log=lines.append,
    )
    memory = result["memory"]["tinylm"]
    whole, half = memory["1"]["measured"], memory["2"]["measured"]
    # Read from the workers' tensors: the optimizer's state and the gradient kept halve, the
    # parameters do not.
    assert half["optimizer"] == pytest.approx(whole["optimizer"] / 2, rel=0.05)
    assert sum(memory["2"]["by_rank_optimizer"]) == pytest.approx(whole["optimizer"], rel=0.01)
    assert half["gradients"] == pytest.approx(whole["gradients"] / 2, rel=0.05)
    assert half["parameters"] == whole["parameters"] > 0
    assert whole["transient"] > 0 and half["peak"] < whole["peak"]
    # The plan counts the same bytes.
    for g in ("1", "2"):
        for part in ("parameters", "gradients", "optimizer"):
            assert memory[g]["measured"][part] == pytest.approx(memory[g]["plan"][part], rel=0.01), (g, part)
    assert ratios(memory)["2"]["optimizer"] == pytest.approx(0.5, rel=0.05)
    rates = result["samples_per_s"]["tinylm"]
    assert set(rates) == {"g=1", "g=2", "zero"} and all(rate > 0 for rate in rates.values())
    assert not result["failed"]
    (zero,) = result["peer_memory"]["tinylm"]["zero"]  # ZeRO ran, and its rank 0 holds about half the state
    assert 0 < zero["held"]["optimizer"] < whole["optimizer"] * 0.75
    assert "skipped" in result["recovery"]  # 2 workers in groups of 2 keep no replica
    text = format_result(result)
    assert "opt/g1" in text and "g=2/zero" in text and "step phases" in text and "targets:" in text
    ours = [row for row in result["rows"] if row["framework"].startswith("g=")]
    assert all(row["phases"]["compute_s"] > 0 for row in ours)  # from the workers' telemetry
    assert "optimizer bytes / g=1's = 1/g within 5%" in text
