"""What a start says while it waits (``orchestrator/group/start_wait.py``, from
``orchestrator/group/ray_group.py``): the stage it waits on and what the cluster has free, in
words, never Ray's internal resources."""

from __future__ import annotations

import re

import pytest

#: Ray's ``available_resources()`` on a loaded machine, as in the report that asked for this
#: (issue 40, item 7): placement-group and per-node bookkeeping around the real capacity.
PG = "35092c0d9b2e4b6f1a7c8e9f0a1b2c3d4e5f"
LOADED = {
    f"bundle_group_{PG}": 3999.996,
    f"bundle_group_0_{PG}": 999.999,
    f"CPU_group_{PG}": 2.0,
    f"CPU_group_0_{PG}": 0.5,
    "node:__internal_head__": 1.0,
    "node:192.0.2.2": 1.0,
    "accelerator_type:A100": 1.0,
    "memory": 12.3 * 2**30,
    "object_store_memory": 6811675852.0,
    "CPU": 1.5,
}
INTERNAL = ("bundle_group", "_group_", "node:", "__internal_head__", "object_store", "accelerator_type", "{")


def _wait(**fields):
    from orchestrator.group.start_wait import StartWait

    base = dict(count=4, bundle={"CPU": 0.5}, placed=0, scheduling="NO_RESOURCES", ready=0, loading=0, free=LOADED, nodes=1)
    return StartWait(**{**base, **fields})


def test_a_waiting_start_names_its_stage_and_what_is_free_in_words():
    from orchestrator.group.start_wait import start_timeout_message, start_wait_message

    reserving = start_wait_message(_wait(), 180.0)
    assert "4 x 0.5 CPU" in reserving and "placement group: 0 of 4 bundles placed" in reserving
    assert "not enough free resources" in reserving
    assert "free now: 1.5 CPU, 0 GPU, 12.3 GiB memory on 1 node" in reserving
    assert "timeouts.start_s = 180s" in reserving
    infeasible = start_wait_message(_wait(scheduling="INFEASIBLE", free={"CPU": 4.0, "GPU": 1.0}, nodes=2), 60.0)
    assert "no node has room for one bundle" in infeasible and "free now: 4 CPU, 1 GPU on 2 nodes" in infeasible

    starting = start_wait_message(_wait(placed=4, scheduling="FINISHED", ready=1, loading=2), 180.0)
    assert "reserved" in starting and "1 of 4 ready" in starting
    assert "2 loading (importing torch and the job's code, building its dataset and model)" in starting
    assert "1 waiting for a worker process" in starting and "placement group" not in starting
    assert "Ray:" not in start_wait_message(_wait(scheduling=""), 180.0)
    unknown = start_wait_message(_wait(placed=4, scheduling="FINISHED", ready=1, loading=None), 180.0)
    assert "3 starting" in unknown and "loading" not in unknown

    for message in (reserving, infeasible, starting, unknown):
        assert "\n" not in message and not any(word in message for word in INTERNAL), message

    timed_out = start_timeout_message(_wait(), 180.0)
    assert timed_out.startswith("could not reserve 4 x 0.5 CPU within 180s") and "scaling.resources_per_worker" in timed_out
    slow = start_timeout_message(_wait(placed=4, scheduling="FINISHED", ready=3, loading=1), 180.0)
    assert slow.startswith("workers did not finish 'start' within 180s") and "1 loading" in slow
    for message in (timed_out, slow):
        assert not any(word in message for word in INTERNAL), message


def test_resources_in_words_leave_out_rays_bookkeeping():
    from orchestrator.group.start_wait import resources_in_words

    assert resources_in_words({"CPU": 1.0, "GPU": 1.0, "memory": 2 * 2**30}) == "1 CPU, 1 GPU, 2 GiB memory"
    assert resources_in_words({"TPU": 4.0, "CPU": 0.25}) == "0.25 CPU, 4 TPU"
    assert resources_in_words({"CPU": 3999.99999}) == "4000 CPU"
    assert resources_in_words(LOADED) == "1.5 CPU, 12.3 GiB memory"
    assert resources_in_words({}) == "nothing"


def test_a_start_waiting_for_resources_says_so_in_words(ray_cluster):
    """The session's 4-CPU Ray cannot reserve 2 x 3 CPU: the start says every report interval
    that the placement group waits, and what is free, without Ray's placement-group or node
    resources (another job's placed group is there to show up), then gives up after start_s."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from orchestrator.group.interface import WorkerGroupError
    from orchestrator.group.ray_group import RayWorkerGroup
    from orchestrator.job.reading import load_job

    other = placement_group([{"CPU": 0.5}])
    ray.get(other.ready(), timeout=30)
    job = load_job(None, ["scaling.workers=2", "scaling.resources_per_worker={CPU: 3}", "timeouts.start_s=2"], resolve=False)
    messages: list[str] = []
    group = RayWorkerGroup(job, on_wait=messages.append)
    group.WAIT_REPORT_S = 0.5
    try:
        with pytest.raises(WorkerGroupError) as failed:
            group.start(2)
    finally:
        group.shutdown()
        remove_placement_group(other)
    assert messages
    for message in messages + [str(failed.value)]:
        assert "2 x 3 CPU" in message and "placement group: 0 of 2 bundles placed" in message, message
        assert re.search(r"free now: [\d.]+ CPU, [\d.]+ GPU, [\d.]+ GiB memory on \d+ nodes?\)", message), message
        assert not any(word in message for word in INTERNAL), message
    assert str(failed.value).startswith("could not reserve 2 x 3 CPU within 2s")
