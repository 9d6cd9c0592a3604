"""``ringleader bench overhead`` on the CPU, a short run (so the bench cannot rot): both
contenders train the 36-layer layout, the figures are there and the counts are exact."""

from __future__ import annotations

import torch

from benchmarks import overhead


def test_the_overhead_bench_times_both_contenders_and_counts_their_syncs():
    result = overhead.measure(torch.device("cpu"), steps=2, warmup=1, rounds=2)
    assert result["tensors"] == 4 + 12 * overhead.LAYERS  # gpt2-large's 436: embeddings, final norm, 12 a block
    assert set(result["ms_per_step"]) == {"plain", "ringleader"} and all(v > 0 for v in result["ms_per_step"].values())
    assert len(result["rounds_ms"]["ringleader"]) == 2
    assert result["syncs_per_step"] == {"plain": 0, "ringleader": 1}
    assert "ringleader's host overhead" in overhead.format_result(result)
