"""``ringleader run --local-nodes N``: simulated Ray nodes on one machine, in a fresh process
(the test session's own Ray must not be reused)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest

from orchestrator.cli import EXIT_BAD_INPUT, main


@pytest.mark.usefixtures("private_ray_home")
def test_workers_spread_over_simulated_nodes_and_hierarchical_runs(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "orchestrator.cli", "run", "--local-nodes", "2", "--no-progress",
        "--run-dir", str(run_dir), "--set", "steps=5", "--set", "eval=null",
        "--set", "scaling.placement_strategy=SPREAD", "--set", "collective.algorithm=hierarchical",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    workers = next(e for e in events if e["event"] == "workers_ready")["workers"]
    per_node = collections.Counter(w["node_id"] for w in workers)
    assert sorted(per_node.values()) == [2, 2], per_node  # two nodes, two ranks each


def test_local_nodes_cannot_join_a_cluster(tmp_path, capsys):
    assert main(["run", "--local-nodes", "2", "--address", "auto", "--run-dir", str(tmp_path / "r")]) == EXIT_BAD_INPUT
    assert "--local-nodes" in capsys.readouterr().err
