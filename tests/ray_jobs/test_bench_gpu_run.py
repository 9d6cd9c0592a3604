"""``bench gpu``'s tiny run on the CPU, through Ray: both contenders and their ratio printed."""

from __future__ import annotations

import json

import pytest

from ringleader.cli import main


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.cpu_bf16_attention
def test_a_tiny_run_on_the_cpu_prints_both_contenders_and_the_ratio(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--device", "cpu", "--tiny", "--steps", "6", "--warmup", "2", "--rounds", "1",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ringleader/plain tokens/s" in printed and "peak bf16 unknown" in printed
    table = json.loads(out.read_text())
    assert table["num_params"] > 0 and table["ratio"] > 0
    for contender in ("ringleader", "plain"):
        assert table[contender]["tokens_per_s"] == pytest.approx(table[contender]["samples_per_s"] * 64)
        assert table[contender]["mfu"] is None  # no peak for a CPU
