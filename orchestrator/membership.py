"""Workers waiting to join: replacements for the dead and new workers when there is room.

A freed or reserved slot gets a new actor; it loads in the background and joins the group at a
step boundary (``Growing``) or when the group re-forms after a failure (``Recovering``)."""

from __future__ import annotations

import time
from typing import Any, Callable

from orchestrator.group import WorkerGroup
from policies.elasticity import admit_count

# At most this often the driver looks for free slots to start workers in (a GCS round trip).
FILL_EVERY_S = 1.0


class JoinerPool:
    """Starts workers in free slots of ``group`` and keeps those that have loaded (``ready``)
    until they are admitted, up to ``max_workers`` in the group. ``dead_nodes()`` names nodes
    whose slots must not be filled (chaos removed them; Ray moves their bundles later)."""

    def __init__(self, group: WorkerGroup, max_workers: int, dead_nodes: Callable[[], set[str]]) -> None:
        self.group = group
        self.max_workers = max_workers
        self.ready: list[Any] = []
        self._dead_nodes = dead_nodes
        self._filled_at = 0.0

    def fill(self, force: bool = False) -> None:
        """Start workers in free slots, at most every FILL_EVERY_S unless ``force``."""
        now = time.monotonic()
        if force or now - self._filled_at >= FILL_EVERY_S:
            self._filled_at = now
            self.group.fill_slots(self._dead_nodes())

    def collect(self, timeout_s: float = 0.0) -> None:
        """Move workers that have loaded (waiting up to ``timeout_s`` for one) to ``ready``.
        With nobody loading it still waits ``timeout_s``: callers loop on it while they wait
        for resources, and must not spin a core the workers need."""
        if timeout_s > 0 and not self.group.loading:
            time.sleep(timeout_s)
            return
        self.ready += self.group.ready_joiners(timeout_s=timeout_s)

    def want_to_join(self) -> bool:
        """Whether workers have loaded and there is room for them (asked at a step boundary);
        starts workers in free slots on the way."""
        group = self.group
        if group.size + group.loading + len(self.ready) < group.capacity:
            self.fill()
        if group.loading:
            self.collect()
        return admit_count(group.size, len(self.ready), self.max_workers) > 0

    def admit(self) -> list[int]:
        """Add the ready workers there is room for to the group (they join at its next
        forming); returns their worker ids."""
        count = admit_count(self.group.size, len(self.ready), self.max_workers)
        joining, self.ready = self.ready[:count], self.ready[count:]
        self.group.admit(joining)
        return [m.info.worker for m in joining]
