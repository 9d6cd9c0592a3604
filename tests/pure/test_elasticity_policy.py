"""The elasticity policy (pure) and the chaos fault settings' validation."""

from __future__ import annotations

import pytest

from jobspec.fields import ConfigError
from orchestrator.job.reading import load_job
from policies.elasticity import admit_count, after_failure, pick_root


def test_after_failure_goes_on_waits_then_fails():
    assert after_failure(survivors=3, ready=0, min_workers=2, waited_s=0, wait_limit_s=60).action == "continue"
    assert after_failure(survivors=1, ready=1, min_workers=2, waited_s=0, wait_limit_s=60).action == "continue"
    assert after_failure(survivors=1, ready=0, min_workers=2, waited_s=10, wait_limit_s=60).action == "wait"
    failed = after_failure(survivors=1, ready=0, min_workers=2, waited_s=60, wait_limit_s=60)
    assert failed.action == "fail" and "min_workers (2)" in failed.reason
    nobody = after_failure(survivors=0, ready=4, min_workers=1, waited_s=0, wait_limit_s=60)
    assert nobody.action == "fail" and "no worker survived" in nobody.reason


def test_the_root_is_the_survivor_that_applied_the_most_steps():
    assert pick_root({3: 7, 1: 8, 2: 8}) == (1, 8)
    assert pick_root({5: 0}) == (5, 0)
    with pytest.raises(ValueError):
        pick_root({})


def test_admit_count_stops_at_max_workers():
    assert admit_count(size=2, ready=3, max_workers=4) == 2
    assert admit_count(size=4, ready=1, max_workers=4) == 0
    assert admit_count(size=1, ready=1, max_workers=4) == 1


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{at_step: 1}", "exactly one of 'worker' and 'node'"),
        ("{at_step: 1, worker: 0, node: 1, how: remove_node}", "exactly one of 'worker' and 'node'"),
        ("{at_step: 1, node: 1}", "'node' needs how: remove_node"),
        ("{at_step: 1, worker: 0, how: ray_kill, during: checkpoint}", "during: checkpoint needs how: sigkill"),
        ("{at_step: 1, worker: 9}", "chaos.kill.0.worker: 9 is not a worker"),
        ("{at_step: 1, worker: 0, how: shoot}", "field 'chaos.kill.0.how'"),
    ],
)
def test_bad_kill_entries_name_the_field(entry, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_job(None, [f"chaos.kill=[{entry}]"], resolve=False)


def test_node_chaos_needs_local_nodes(tmp_path):
    from orchestrator.launch import run_job

    job = load_job(None, ["chaos.add_node=[{at_step: 2}]"], resolve=False)
    with pytest.raises(ConfigError, match="--local-nodes"):
        run_job(job, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_checkpoint_interval_setting():
    assert load_job(None, ["checkpoint.every_steps=auto"], resolve=False).checkpoint.enabled
    assert not load_job(None, [], resolve=False).checkpoint.enabled
    with pytest.raises(ConfigError, match="checkpoint.every_steps"):
        load_job(None, ["checkpoint.every_steps=-1"], resolve=False)
