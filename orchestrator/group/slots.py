"""Slot placement: where a job's Ray workers run. A slot is one bundle of one of the job's
placement groups; this reserves the slots (one placement group for the starting workers, one
single-bundle group each beyond them, or bundles of a placement group someone else reserved
for the job), hands out the free ones, retires and releases them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from jobspec.runtime import ScalingConfig
from orchestrator.group.interface import WorkerGroupError


@dataclass(frozen=True)
class Slot:
    """Where a worker runs: one bundle of one of the job's placement groups."""

    placement: PlacementGroup
    index: int

    def node(self) -> str | None:
        """The node this slot's bundle is placed on, or None while it is not placed."""
        return placement_group_table(self.placement).get("bundles_to_node_id", {}).get(self.index)


class SlotPlacement:
    """The slots of a job with ``scaling``: each a ``bundle`` of a worker's resources.
    ``within``: a placement group reserved for the job by someone else (a Tune trial's): its
    bundles 1..``max_workers`` are the slots (bundle 0 holds the driver), and no placement group
    of the job's own is reserved."""

    #: After a worker failed to start in a slot, wait this long before trying it again.
    RETRY_S = 5.0

    def __init__(self, scaling: ScalingConfig, within: PlacementGroup | None = None) -> None:
        self.scaling = scaling
        self.within = within
        self.bundle = {k: v for k, v in scaling.resources_per_worker.items() if v > 0}
        self.placements: list[PlacementGroup] = []  # the job's own, released at the end
        self.slots: list[Slot] = []
        self._within_used = 0  # bundles of ``within`` handed out as slots
        self._retry_at: dict[Slot, float] = {}

    def reserve(self, count: int) -> tuple[PlacementGroup, list[Slot]]:
        """The starting workers' ``count`` slots, in one placement group (reserved with
        ``scaling.placement_strategy``, or ``within``); returns the group and the slots."""
        if self.within is not None:
            placement = self.within
            slots = [self._within_slot() for _ in range(count)]
        else:
            placement = placement_group([self.bundle] * count, strategy=self.scaling.placement_strategy)
            self.placements.append(placement)
            slots = [Slot(placement, i) for i in range(count)]
        self.slots.extend(slots)
        return placement, slots

    def free(self, capacity: int, taken: set[Slot], dead_nodes: set[str]) -> list[Slot]:
        """Reserve slots up to ``capacity`` (single-bundle placement groups) and return those
        not ``taken``, except slots whose bundle sits on a node in ``dead_nodes`` (Ray moves
        those bundles once it declares the node dead) or that failed less than RETRY_S ago."""
        while len(self.slots) < capacity:
            if self.within is not None:
                self.slots.append(self._within_slot())
                continue
            placement = placement_group([self.bundle])
            self.placements.append(placement)
            self.slots.append(Slot(placement, 0))
        now = time.monotonic()
        return [
            slot for slot in self.slots
            if slot not in taken and self._retry_at.get(slot, 0.0) <= now and slot.node() not in dead_nodes
        ]

    def failed(self, slot: Slot) -> None:
        """A worker failed to start in ``slot``: try it again after RETRY_S."""
        self._retry_at[slot] = time.monotonic() + self.RETRY_S

    def retire(self, slot: Slot) -> None:
        """Give ``slot`` up: one slot fewer is reserved, and a single-bundle placement group is
        released (its resources given back)."""
        self.slots.remove(slot)
        placement = slot.placement
        if len(placement.bundle_specs) == 1:
            remove_placement_group(placement)
            self.placements.remove(placement)

    def release(self) -> None:
        """Release the job's placement groups and forget every slot. Safe to call twice."""
        for placement in self.placements:
            remove_placement_group(placement)
        self.placements, self.slots = [], []

    def _within_slot(self) -> Slot:
        assert self.within is not None
        self._within_used += 1
        if self._within_used >= len(self.within.bundle_specs):
            raise WorkerGroupError(
                f"the job's placement group has {len(self.within.bundle_specs)} bundles: not enough for "
                f"scaling.max_workers = {self.scaling.max_workers} workers and the driver"
            )
        return Slot(self.within, self._within_used)
