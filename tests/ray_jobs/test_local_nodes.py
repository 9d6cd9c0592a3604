"""``ringleader run --local-nodes N``: simulated Ray nodes on one machine, in a fresh process
(the test session's own Ray must not be reused)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest

from ringleader.cli import EXIT_BAD_INPUT, main
from tests.helpers.jobs import assert_same_params, params


@pytest.mark.usefixtures("private_ray_home")
def test_workers_spread_over_simulated_nodes_and_hierarchical_runs(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "ringleader", "run", "--local-nodes", "2", "--no-progress",
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


@pytest.mark.usefixtures("private_ray_home")
def test_a_removed_node_is_survived_and_a_new_node_grows_the_group_back(tmp_path, reference):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "ringleader", "run", "--local-nodes", "2", "--no-progress",
        "--run-dir", str(run_dir), "--set", "steps=25", "--set", "eval=null", "--set", "scaling.workers=4",
        "--set", "scaling.placement_strategy=SPREAD",
        "--set", "chaos.kill=[{at_step: 4, node: 1, how: remove_node}]",
        "--set", "chaos.add_node=[{at_step: 6}]",
        # Time for the replacements to load on the new node before the job ends (whichever
        # workers survive: they stall side by side, in compute, where no peer can take over).
        "--set", "chaos.stall=[" + ", ".join(f"{{worker: {r}, at_step: 10, seconds: 15, during: compute}}" for r in range(4)) + "]",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["events"]["failures"] == 2 and summary["events"]["joins"] == 2
    assert summary["workers"] == {"start": 4, "end": 4}
    assert summary["shards_committed"] == summary["shards_expected"] == 25 * 16
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    removed = next(e for e in events if e.get("action") == "remove_node")
    assert any(e.get("action") == "add_node" and e["at_step"] == 6 for e in events)
    ready = next(e for e in events if e["event"] == "workers_ready")["workers"]
    assert sorted(removed["workers"]) == sorted(w["worker"] for w in ready if w["node_id"] == removed["node"])
    grown = [e for e in events if e["event"] == "grow"]
    assert sorted(w for e in grown for w in e["joined"]) == [4, 5]
    assert_same_params(params(run_dir), reference, "node lost and added")
