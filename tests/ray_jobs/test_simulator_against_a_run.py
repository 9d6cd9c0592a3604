"""The simulator against a real run: its policies make the real run's decisions from the real run's telemetry."""

from __future__ import annotations

import pytest

from simulator.replay import recorded_decisions, replayed_decisions


@pytest.mark.usefixtures("ray_cluster")
def test_the_simulators_policies_make_the_real_runs_decisions_from_its_telemetry(tmp_path):
    """A real job with slow spells and stalls; its telemetry.jsonl replayed through the policy
    step the simulator runs gives exactly the straggler and rebalance events its driver logged."""
    from tests.helpers.jobs import run

    result = run(
        tmp_path, "replay", "scaling.workers=4", "steps=30",
        "chaos={slow: [{worker: 1, factor: 4, from_step: 4}, {worker: 3, factor: 3, from_step: 12, to_step: 15}], "
        "stall: [{worker: 2, at_step: 20, seconds: 0.3}]}",
        "stragglers.persistent_steps=2", "stragglers.window=4", "stragglers.evict=false",
    )
    recorded = recorded_decisions(result.run_dir)
    kinds = {d[0] for d in recorded}
    assert {"straggler", "rebalance"} <= kinds, recorded  # the run gave the replay something to match
    assert replayed_decisions(result.run_dir) == recorded
