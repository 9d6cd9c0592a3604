"""A worker group's membership: who is in it, in rank order, and who waits to join.

``Membership`` is the bookkeeping every ``WorkerGroup`` implementation shares (the Ray one,
``orchestrator/group/ray_group.py``, and the in-process fake, ``tests/helpers/fake_group.py``), so
the two cannot drift. ``JoinerPool`` is the driver's side of joining: a freed or reserved slot
gets a new worker; it loads in the background and joins the group at a step boundary
(``Growing``) or when the group re-forms after a failure (``Recovering``)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Generic, Sequence, TypeVar

from jobspec.runtime import ScalingConfig
from jobspec.wire import Progress, WorkerInfo
from orchestrator.group.interface import Member, WorkerGroup, WorkerGroupError
from policies.elasticity import admit_count

M = TypeVar("M", bound=Member)  # a member of the group
J = TypeVar("J")  # a worker still loading


class Membership(ABC, Generic[M, J]):
    """The members of a group of at most ``scaling.max_workers`` workers, in rank order, the
    ``joiners`` still loading and the slots ``retired`` with evicted workers; worker ids never
    repeat. An implementation ends a member's process (``_kill``), may give up its slot
    (``_retire``) and asks the members' progress (``progress``)."""

    def __init__(self, scaling: ScalingConfig) -> None:
        assert scaling.max_workers is not None, "set by ScalingConfig's validation"
        self.max_workers = scaling.max_workers
        self.members: list[M] = []
        self.joiners: list[J] = []
        self.retired = 0
        self._next_worker = 0

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def workers(self) -> list[int]:
        """Worker ids in rank order."""
        return [m.info.worker for m in self.members]

    @property
    def info(self) -> list[WorkerInfo]:
        return [m.info for m in self.members]

    @property
    def capacity(self) -> int:
        """The most workers this group may have: ``scaling.max_workers`` less retired slots."""
        return self.max_workers - self.retired

    @property
    def loading(self) -> int:
        return len(self.joiners)

    def _new_worker_id(self) -> int:
        worker = self._next_worker
        self._next_worker += 1
        return worker

    @abstractmethod
    def progress(self, timeout_s: float) -> dict[int, Progress | None]:
        """Each member's progress by worker id; None for one that is dead or did not answer."""

    @abstractmethod
    def _kill(self, member: M) -> None:
        """End ``member``'s process."""

    def _retire(self, member: M) -> None:
        """Give up ``member``'s slot (an implementation with slots releases it)."""

    def probe(self, timeout_s: float) -> tuple[dict[int, Progress], list[int]]:
        """Which members are alive: their ``progress()`` by worker id, and the ids of those that
        are dead or did not answer within ``timeout_s`` (the control group answers even while a
        step is blocked, so silence means a dead process or node Ray has not noticed yet)."""
        alive: dict[int, Progress] = {}
        dead: list[int] = []
        for worker, report in self.progress(timeout_s).items():
            if report is None:
                dead.append(worker)
            else:
                alive[worker] = report
        return alive, dead

    def lead_with(self, worker: int) -> None:
        """Make ``worker`` rank 0 of the next generation (the state every rank takes)."""
        if worker not in self.workers:
            raise WorkerGroupError(f"worker {worker} is not a member (members: {self.workers}); it cannot lead")
        self.members.sort(key=lambda m: m.info.worker != worker)

    def admit(self, members: Sequence[M]) -> None:
        """Add ready joiners at the end of the rank order (they join at the next form_group)."""
        self.members.extend(members)

    def kill(self, worker: int) -> None:
        """End one member's process, leaving it in the group (chaos: the driver must notice)."""
        for member in self.members:
            if member.info.worker == worker:
                self._kill(member)

    def remove(self, workers: Sequence[int], retire: bool = False) -> None:
        """End these workers' processes and drop them from the group (ranks close up). Their
        slots are free for replacements, unless ``retire``: an evicted worker's slot is given
        up (a replacement there would likely be as slow), leaving room for one worker fewer."""
        for member in self.members:
            if member.info.worker in workers:
                self._kill(member)
                if retire:
                    self.retired += 1
                    self._retire(member)
        self.members = [m for m in self.members if m.info.worker not in workers]


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
