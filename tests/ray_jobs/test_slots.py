"""Slot placement (``orchestrator/group/slots.py``) on the session's local Ray: the starting
workers' slots are the bundles of one placement group, each further one a single-bundle group
of its own; free slots leave out the taken, those that failed a moment ago and those on dead
nodes; a retired single-bundle slot and a release give the resources back; within a placement
group reserved for the job, bundle 0 is the driver's and the job reserves none of its own.
Bundles of 0.1 CPU: the session cluster has 4."""

from __future__ import annotations

import time
from typing import Iterator

import pytest
import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from jobspec.runtime import ScalingConfig
from orchestrator.group.interface import WorkerGroupError
from orchestrator.group.slots import Slot, SlotPlacement

pytestmark = pytest.mark.usefixtures("ray_cluster")

BUNDLE = {"CPU": 0.1}


def scaling(workers: int = 2, max_workers: int = 4) -> ScalingConfig:
    return ScalingConfig(workers=workers, max_workers=max_workers, resources_per_worker={**BUNDLE, "GPU": 0})


def state(placement: PlacementGroup, becomes: str | None = None, within_s: float = 10.0) -> str:
    """The placement group's state, waiting up to ``within_s`` for it to become ``becomes``."""
    deadline = time.monotonic() + within_s
    while True:
        now = placement_group_table(placement)["state"]
        if becomes is None or now == becomes or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def placed(slots: list[Slot]) -> None:
    for placement in {slot.placement for slot in slots}:
        ray.get(placement.ready(), timeout=30)


@pytest.fixture
def placements() -> Iterator[list[SlotPlacement]]:
    """The slot placements a test makes, released after it."""
    made: list[SlotPlacement] = []
    yield made
    for placement in made:
        placement.release()


def test_the_starting_workers_slots_are_the_bundles_of_one_placement_group(placements: list[SlotPlacement]) -> None:
    slots = SlotPlacement(scaling())
    placements.append(slots)
    placement, reserved = slots.reserve(2)
    assert reserved == [Slot(placement, 0), Slot(placement, 1)] and slots.slots == reserved
    assert placement.bundle_specs == [BUNDLE, BUNDLE]  # a resource of 0 is asked for by no bundle
    assert slots.placements == [placement]
    placed(reserved)
    assert all(isinstance(slot.node(), str) for slot in reserved)


def test_slots_beyond_the_start_are_reserved_up_to_capacity_one_placement_group_each(
    placements: list[SlotPlacement]
) -> None:
    slots = SlotPlacement(scaling())
    placements.append(slots)
    placement, (first, second) = slots.reserve(2)
    free = slots.free(4, {first}, set())
    assert free[0] == second and len(free) == 3
    for extra in free[1:]:
        assert extra.index == 0 and extra.placement.bundle_specs == [BUNDLE] and extra.placement != placement
    assert len(slots.placements) == 3
    assert slots.free(4, {first}, set()) == free  # nothing more reserved at capacity


def test_a_slot_a_worker_failed_to_start_in_is_handed_out_again_only_after_a_while(
    placements: list[SlotPlacement]
) -> None:
    slots = SlotPlacement(scaling())
    placements.append(slots)
    slots.RETRY_S = 0.5
    _, (first, second) = slots.reserve(2)
    slots.failed(second)
    assert slots.free(2, set(), set()) == [first]
    time.sleep(0.6)
    assert slots.free(2, set(), set()) == [first, second]


def test_slots_on_a_dead_node_are_not_handed_out(placements: list[SlotPlacement]) -> None:
    slots = SlotPlacement(scaling())
    placements.append(slots)
    _, reserved = slots.reserve(2)
    placed(reserved)
    node = reserved[0].node()
    assert node is not None
    assert slots.free(2, set(), {"a-node-gone-since"}) == reserved
    assert slots.free(2, set(), {node}) == []  # the one node of this cluster


def test_retiring_a_slot_of_its_own_placement_group_gives_its_resources_back(placements: list[SlotPlacement]) -> None:
    slots = SlotPlacement(scaling())
    placements.append(slots)
    placement, (first, second) = slots.reserve(2)
    (extra,) = slots.free(3, {first, second}, set())
    placed([first, extra])
    slots.retire(extra)
    assert extra not in slots.slots and extra.placement not in slots.placements
    assert state(extra.placement, "REMOVED") == "REMOVED"
    slots.retire(second)  # a bundle of the starting group: the group stays, with its other slot
    assert slots.slots == [first] and slots.placements == [placement]
    assert state(placement) == "CREATED"


def test_release_removes_every_placement_group_of_the_job_and_is_safe_twice() -> None:
    slots = SlotPlacement(scaling())
    placement, reserved = slots.reserve(2)
    (extra,) = slots.free(3, set(), set())[2:]
    slots.release()
    assert slots.slots == [] and slots.placements == []
    assert state(placement, "REMOVED") == "REMOVED" and state(extra.placement, "REMOVED") == "REMOVED"
    slots.release()


def test_within_a_placement_group_reserved_for_the_job_bundle_0_is_the_drivers_and_nothing_more_is_reserved() -> None:
    outer = placement_group([BUNDLE] * 3)  # the driver's bundle and two workers'
    try:
        ray.get(outer.ready(), timeout=30)
        slots = SlotPlacement(scaling(workers=1, max_workers=2), within=outer)
        placement, (first,) = slots.reserve(1)
        assert placement is outer and first == Slot(outer, 1) and slots.placements == []
        assert slots.free(2, {first}, set()) == [Slot(outer, 2)]
        too_few = r"has 3 bundles: not enough for scaling.max_workers = 2 workers and the driver"
        with pytest.raises(WorkerGroupError, match=too_few):
            slots.free(3, set(), set())
        slots.release()  # someone else's: not the job's to remove
        assert state(outer) == "CREATED"
    finally:
        remove_placement_group(outer)
