"""The simulator: its baselines against their closed forms, its scenario files, and its policies
against a real run's decisions (the same classes fed the same telemetry)."""

from __future__ import annotations

import json

import pytest

from jobspec.fields import ConfigError
from ringleader.cli import main
from simulator.engine import Run, simulate
from simulator.scenario import Scenario, load_scenario
from tests.helpers.paths import REPO

# Nothing random, nothing slow, nothing failing: every contender computes the nominal step.
QUIET = {
    "workers": 16, "workers_per_node": 4, "steps": 200,
    "workload": {"compute_s": 1.0, "shards_per_worker": 4, "jitter": 0.0},
    "transient": {"fraction": 0.0}, "slow_nodes": {"count": 0},
    "snapshots": {"snapshot_s": 0.0}, "restart": {"checkpoint_s": 0.0, "restart_s": 100.0, "checkpoint_every_steps": 10},
    "recovery": {"detect_s": 2.0, "reform_s": 3.0, "replacement_s": 1e9, "join_s": 0.0},
    "collective": {"gradient_mb": 1.0},
}


def scenario(**changes: object) -> Scenario:
    raw = json.loads(json.dumps(QUIET))
    for key, value in changes.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return Scenario.model_validate(raw)


def test_without_failures_or_slowdowns_every_contender_has_the_ideal_goodput():
    outcomes = simulate(scenario())
    assert [o.contender for o in outcomes] == ["ringleader", "no_mitigation", "restart_world"]
    for outcome in outcomes:
        assert outcome.steps == 200 and outcome.failures == 0 and outcome.redone_steps == 0
        assert outcome.goodput == pytest.approx(1.0, rel=1e-9), outcome.contender
        assert outcome.wall_s == pytest.approx(200 * outcome.ideal_step_s)
    # The ideal step is the compute plus what overlap leaves of the all-reduce.
    assert 1.0 < outcomes[0].ideal_step_s < 1.01


def test_one_failure_costs_restart_the_steps_since_its_checkpoint_and_in_place_one_step():
    quiet = scenario()
    step_s = Run(quiet, "restart_world").ideal_step_s
    failure_s = 25.5 * step_s  # in step 25; the last checkpoint was taken before step 20
    restart, in_place = simulate(scenario(failures={"at_s": [failure_s]}, contenders=["restart_world", "no_mitigation"]))
    assert restart.failures == 1 and restart.redone_steps == 5
    assert restart.wall_s == pytest.approx(failure_s + 100.0 + (200 - 20) * step_s)
    # From the failure until step 25 commits again: the restart, then steps 20 to 25.
    assert restart.recovery_s == [pytest.approx(100.0 + 6 * step_s)]
    # In place: the survivors re-form (2 s + 3 s) and redo step 25 without the dead node's 4
    # workers: 64 shards over 12 workers, the fullest holding 6 (1.5 x the compute).
    assert in_place.failures == 1 and in_place.redone_steps == 0
    survivors = Run(quiet, "no_mitigation").costs.exposed_comm_s(12, 3)
    assert in_place.recovery_s == [pytest.approx(5.0 + 1.5 + survivors)]
    assert in_place.wall_s == pytest.approx(failure_s + 5.0 + (200 - 25) * (1.5 + survivors))


def test_a_replacement_node_joins_and_the_group_is_whole_again():
    quiet = scenario()
    step_s = Run(quiet, "no_mitigation").ideal_step_s
    (outcome,) = simulate(scenario(
        failures={"at_s": [10.5 * step_s]}, contenders=["no_mitigation"],
        recovery={"replacement_s": 50.0, "join_s": 1.0},
    ))
    # After the join every step is the nominal one again: the run is only the recovery, the
    # steps on 12 workers and the join longer than the clean run.
    assert outcome.failures == 1 and outcome.wall_s < 200 * step_s + 5.0 + 1.0 + 60 * 0.6


def test_stragglers_cost_the_synchronous_baselines_and_ringleader_rebalances_them_away():
    slow = scenario(slow_nodes={"count": 1, "factor": 3.0}, workers=32, steps=300)
    ringleader, no_mitigation, _ = simulate(slow)
    # A synchronous step waits for the slow node (3x); ringleader moves shards off it: of 128
    # shards the 4 slow workers keep 1 each (0.75 s), the 28 others share 124, at most 5 each
    # (1.25 s), the best split there is.
    assert no_mitigation.goodput == pytest.approx(1 / 3, rel=0.02)
    assert ringleader.rebalances >= 1 and ringleader.goodput == pytest.approx(1 / 1.25, rel=0.01)
    assert ringleader.policy_cpu_ms > 0


def test_the_shipped_4096_scenario_loads_and_runs_from_the_cli(tmp_path, capsys):
    example = REPO / "examples" / "sim-4096.yaml"
    assert load_scenario(example).workers == 4096
    out_json, out_png = tmp_path / "sim.json", tmp_path / "sim.png"
    code = main(["simulate", str(example), "--set", "workers=256", "--set", "steps=300", "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ringleader's goodput over:" in printed and "restart_world" in printed
    report = json.loads(out_json.read_text())
    assert [c["contender"] for c in report["contenders"]] == ["ringleader", "no_mitigation", "restart_world"]
    assert report["scenario"]["workers"] == 256
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_16384_scenario_extends_the_4096_one_with_its_own_failure_rate():
    big, base = load_scenario(REPO / "examples" / "sim-16384.yaml"), load_scenario(REPO / "examples" / "sim-4096.yaml")
    assert big.workers == 16384 and big.nodes == 2048 and big.name == "sim-16384"
    assert big.failures.node_mtbf_h == 3700 and base.failures.node_mtbf_h == 2000
    # A section set in part keeps the base's other fields; sections not set are the base's.
    assert big.transient.factor == base.transient.factor and big.slow_nodes.count == 16
    assert big.collective == base.collective and big.workload == base.workload and big.restart == base.restart


def test_extends_refuses_a_loop_and_a_path_that_is_not_one(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nworkers: 16\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="field 'extends': a.yaml extends this file again"):
        load_scenario(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: [a.yaml]\n")
    with pytest.raises(ConfigError, match="field 'extends': expected the path of another scenario file"):
        load_scenario(tmp_path / "c.yaml")


@pytest.mark.parametrize("content, message", [
    ("workers: 4096\nworkrs_per_node: 8\n", "field 'workrs_per_node': unknown field"),
    ("workers: 100\nworkers_per_node: 8\n", "must be a multiple of workers_per_node"),
    ("node_types: [{fraction: 0.5, speed: 1}]\n", "node_types fractions must add up to 1"),
    ("transient: {fraction: 1.5}\n", "field 'transient.fraction'"),
    ("- a list\n", "expected a mapping at the top level"),
])
def test_a_bad_scenario_names_the_file_and_the_field(tmp_path, content, message, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match="bad.yaml") as err:
        load_scenario(path)
    assert message in str(err.value)
    assert main(["simulate", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_the_driver_is_a_floor_under_ringleaders_steps_only():
    """ringleader's driver submits every step (a step ahead): a step never takes less than its
    cost. Restart-the-world's workers run their own loop and have no such floor."""
    floor = scenario(control_plane={"fixed_ms": 2000.0, "per_worker_ms": 0.0}, steps=50)
    ringleader, no_mitigation, restart = simulate(floor)
    for driven in (ringleader, no_mitigation):
        assert driven.wall_s == pytest.approx(50 * 2.0) and driven.goodput == pytest.approx(restart.goodput / 2, rel=0.01)
    assert restart.goodput == pytest.approx(1.0)


def test_when_every_node_is_down_the_job_waits_for_a_replacement():
    tiny = scenario(workers=4, workers_per_node=4, steps=20, contenders=["no_mitigation"],
                    failures={"at_s": [5.5]}, recovery={"replacement_s": 100.0, "join_s": 0.0})
    (outcome,) = simulate(tiny)
    step_s = outcome.ideal_step_s
    # 5 steps, the failure, recovery (5 s), nobody until the node is back at 105.5 s, 15 steps.
    assert outcome.steps == 20 and outcome.wall_s == pytest.approx(105.5 + 15 * step_s)
    assert outcome.recovery_s == [pytest.approx(100.0 + step_s)]


def test_failures_that_come_while_nothing_runs_are_taken_in_time_order():
    # A node already down cannot fail again: one failure, not two (the review's case).
    down = scenario(workers=4, workers_per_node=4, steps=20, contenders=["no_mitigation"],
                    failures={"at_s": [5.5, 50.0]}, recovery={"replacement_s": 100.0, "join_s": 0.0})
    (outcome,) = simulate(down)
    assert outcome.failures == 1 and outcome.wall_s == pytest.approx(105.5 + 15 * outcome.ideal_step_s)
    # A failure during a checkpoint write: that checkpoint never completes, so the restart goes
    # back to the one before (step 0): 10 steps redone, and the clock never runs backwards.
    step_s = Run(scenario(), "restart_world").ideal_step_s
    failure_s = 10 * step_s + 30.0
    (restart,) = simulate(scenario(
        contenders=["restart_world"], failures={"at_s": [failure_s]}, restart={"checkpoint_s": 60.0},
    ))
    assert restart.redone_steps == 10 and restart.failures == 1
    checkpoints = 200 // 10 - 1  # every 10 steps from step 10, the first one lost
    assert restart.checkpoints == checkpoints
    assert restart.wall_s == pytest.approx(failure_s + 100.0 + 200 * step_s + checkpoints * 60.0)
