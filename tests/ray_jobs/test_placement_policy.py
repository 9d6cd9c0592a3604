"""Placement feasibility on a cluster that cannot grow (pure)."""

from __future__ import annotations

from policies.placement import unplaceable


def test_unplaceable_workers_are_named_with_what_the_cluster_has():
    one_node = [{"CPU": 2.0}]
    assert unplaceable({"CPU": 0.5}, 4, one_node) is None
    message = unplaceable({"CPU": 0.5}, 5, one_node)
    assert message is not None and "scaling.workers" in message and "2.5 needed, 2 in the cluster" in message
    assert "GPU" in (unplaceable({"CPU": 0.5, "GPU": 1}, 1, one_node) or "")
    # Totals suffice but a bundle cannot span nodes: 2 x 1.5 CPU on two 1-CPU... and 2-CPU nodes.
    assert unplaceable({"CPU": 1.5}, 2, [{"CPU": 2.0}, {"CPU": 1.0}]) is not None
    assert unplaceable({"CPU": 1.5}, 2, [{"CPU": 2.0}, {"CPU": 2.0}]) is None
    assert unplaceable({"CPU": 0.0}, 100, one_node) is None


def test_a_cluster_that_cannot_grow_refuses_impossible_workers_at_once(ray_cluster):
    """The test session's local Ray has 4 CPUs and no GPU: asking for more fails before anything
    is reserved, naming the fields and what the cluster has (not after timeouts.start_s)."""
    import time

    import pytest

    from orchestrator.group.interface import WorkerGroupError
    from orchestrator.group.ray_group import RayWorkerGroup
    from orchestrator.job.reading import load_job

    for resources in ("{CPU: 2}", "{CPU: 0.5, GPU: 1}"):
        job = load_job(None, ["scaling.workers=3", f"scaling.resources_per_worker={resources}"], resolve=False)
        group = RayWorkerGroup(job, fixed_cluster=True)
        started = time.perf_counter()
        with pytest.raises(WorkerGroupError, match="can never be placed.*scaling.resources_per_worker"):
            group.start(3)
        assert time.perf_counter() - started < 5 and group.placements == []
