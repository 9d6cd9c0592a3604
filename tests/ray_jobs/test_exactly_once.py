"""Every sample exactly once, proven by the ledger the trained parameters hold
(``tests/helpers/ledger.py``): through a SIGKILL, stragglers with stealing, backups and the
in-step rescue, epoch boundaries, a node's loss (shrink) and its return (growth), and a resume
on another worker count mid-epoch, each committed step consumed exactly the ids the source puts
in it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.jobs import jsonl, params, run
from tests.helpers.ledger import LEDGER_JOB, assert_exactly_once, consumed, expected, write_id_tokens
from workers.data.shuffle import epoch_order


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> str:
    return write_id_tokens(tmp_path_factory.mktemp("ids"))


def test_the_checker_fails_a_dropped_or_repeated_shard():
    """The control: the clean ledger with one shard of step 5 dropped, or run twice, fails."""
    want = expected(12)
    shard = np.zeros_like(want)
    # Shard 3 of 8 of step 5: stream positions 86 and 87, ids from epoch 2's order.
    np.add.at(shard, epoch_order("index", 40, 0, 2).at(np.array([6, 7])), 2**5)
    for mutated, how in ((want - shard, "dropped"), (want + shard, "repeated")):
        with pytest.raises(AssertionError, match=r"id \d+ consumed in steps"):
            assert_exactly_once(mutated, want, f"shard {how}")


@pytest.mark.usefixtures("ray_cluster")
def test_every_sample_once_through_a_kill_stragglers_and_epoch_boundaries(tmp_path, ids):
    result = run(
        tmp_path, "faults", *LEDGER_JOB, ids, "steps=12", "scaling.workers=3",
        "collective.algorithm=ring", "chaos.kill=[{at_step: 3, worker: 1, how: sigkill}]",
        # Slow spells for stealing and backups, a stall nobody predicted for the rescue, and
        # time for the replacement to join before the end.
        "chaos.slow=[{worker: 0, factor: 8, from_step: 5, to_step: 7}, {worker: 2, factor: 8, from_step: 6, to_step: 9}]",
        "chaos.stall=[{worker: 2, at_step: 10, seconds: 6}]",
        "stragglers.late_factor=1.2", "stragglers.min_ratio=1.2", "stragglers.persistent_steps=1",
        "stragglers.window=2", "stragglers.evict=false",
    )
    events = result.summary["events"]
    assert events["failures"] == 1 and events["recoveries"] == 1 and events["steps_redone"] >= 1, events
    assert events["stolen_shards"] + events["speculative_shards"] + events["rescued_shards"] > 0, events
    assert_exactly_once(consumed(params(result.run_dir)), expected(12), "a kill and stragglers")


@pytest.mark.usefixtures("ray_cluster")
def test_every_sample_once_across_a_resume_on_another_worker_count_mid_epoch(tmp_path, ids):
    # 4 steps are 64 samples: the checkpoint is 24 samples into epoch 1.
    run(tmp_path, "run", *LEDGER_JOB, ids, "steps=4", "scaling.workers=2", "checkpoint.every_steps=4")
    resumed = run(tmp_path, "run", *LEDGER_JOB, ids, "steps=12", "scaling.workers=3")
    assert [e["checkpoint"] for e in jsonl(resumed.run_dir / "events.jsonl") if e["event"] == "resume"] == ["step-00000004"]
    assert_exactly_once(consumed(params(resumed.run_dir)), expected(12), "a resume from 2 workers on 3")


@pytest.mark.usefixtures("private_ray_home")
def test_every_sample_once_through_a_lost_node_and_a_new_one(tmp_path, ids):
    """Shrink and growth: a simulated node's workers are lost with it, the survivors go on, and
    replacements on a new node grow the group back."""
    run_dir = tmp_path / "run"
    job = [*LEDGER_JOB, ids, "steps=12", "scaling.workers=4", "scaling.placement_strategy=SPREAD",
           "chaos.kill=[{at_step: 3, node: 1, how: remove_node}]", "chaos.add_node=[{at_step: 5}]",
           # The driver starts workers in free slots at step boundaries: one step a call, and the
           # survivors pause at step 6 while the new node registers and at step 8 while they load.
           "worker.max_steps_per_call=1",
           "chaos.stall=[" + ", ".join(f"{{worker: {r}, at_step: {at}, seconds: {s}, during: compute}}"
                                       for r in range(4) for at, s in ((6, 3), (8, 15))) + "]"]
    command = [sys.executable, "-m", "ringleader", "run", "--local-nodes", "2", "--no-progress", "--run-dir", str(run_dir)]
    proc = subprocess.run([*command, *(arg for item in job for arg in ("--set", item))], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["events"]["failures"] == 2 and summary["events"]["joins"] == 2, summary["events"]
    assert_exactly_once(consumed(params(run_dir)), expected(12), "a node lost and a new one")
