"""The worker group as the controller sees it: an interface, so the controller and the
recovery core run the same against Ray actors (``orchestrator/group/ray_group.py``) and against
an in-process fake (``tests/helpers/fake_group.py``), as Ray Train V2's controller runs
against its worker group or a dummy one. Both keep their members with ``Membership``
(``orchestrator/group/membership.py``).

Calls into workers are ``Call`` handles; the group waits on them and turns what came back into
a value or a ``CallFailed`` that says what kind of failure it was. Nothing outside a group
implementation touches Ray's object refs or exceptions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from jobspec.wire import Progress, SnapshotOrder, SnapshotRequest, StepTelemetry, WorkerInfo
from orchestrator.store.rendezvous import RendezvousStore
from policies.work_stealing import StepPlan


class WorkerGroupError(RuntimeError):
    """Workers could not be placed, started or did not answer in time."""


class FailureKind(str, enum.Enum):
    """Why a call into a worker failed: the worker ``DIED`` (its process or node is gone), the
    call failed because a ``PEER_LOST`` (a collective was aborted or timed out: someone else
    died or hung), or it raised an ``ERROR`` of its own (a bug, bad data: not recoverable by
    re-forming)."""

    DIED = "died"
    PEER_LOST = "peer_lost"
    ERROR = "error"


class CallFailed(Exception):
    """A call into worker ``worker`` failed; ``reason`` is the one-line cause."""

    def __init__(self, worker: int, kind: FailureKind, reason: str) -> None:
        super().__init__(f"worker {worker}: {reason}")
        self.worker = worker
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True, eq=False)
class Call:
    """One pending call into worker ``worker``; ``handle`` belongs to the group that made it.
    Compared by identity: two calls are never the same call."""

    worker: int
    handle: Any


@dataclass(frozen=True)
class Submitted:
    """A batch's calls: ``reporting`` answer its reports (the leader of published plans: a
    ``jobspec.step_record.StepRecord`` per step, every rank's row in it);
    ``watched`` answer no report and end early only if their worker fails: the followers'
    runs on published plans (docs/architecture.md, "Published plans"), shared by the batches
    of one run."""

    reporting: tuple[Call, ...]
    watched: tuple[Call, ...] = ()


class Member(Protocol):
    """A worker in the group (or ready to join it)."""

    @property
    def info(self) -> WorkerInfo: ...


class WorkerGroup(Protocol):
    """Starts, drives, grows and tears down a job's workers. ``members`` are in rank order;
    worker ids never repeat. Every wait is bounded by a timeout given in seconds.
    See ``orchestrator/group/ray_group.py`` for the Ray implementation's contract in full."""

    @property
    def size(self) -> int: ...

    @property
    def workers(self) -> list[int]:
        """Worker ids in rank order."""
        ...

    @property
    def info(self) -> list[WorkerInfo]: ...

    @property
    def capacity(self) -> int:
        """The most workers this group may have (``scaling.max_workers`` less retired slots)."""
        ...

    @property
    def loading(self) -> int:
        """Workers started into free slots that have not finished loading."""
        ...

    def start(self, count: int) -> list[WorkerInfo]: ...

    def form_group(self, store: RendezvousStore, step: int = -1) -> float:
        """Every member joins the store's next generation's process group and takes rank 0's
        state (at job step ``step``: -1, rank 0's next step; see ``JoinRequest.step``); returns
        the transfer's seconds (the slowest rank's). Raises CallFailed if a member failed
        (died) and WorkerGroupError if it timed out."""
        ...

    def submit_steps(self, first: int, plans: Sequence[StepPlan], snapshot: SnapshotOrder | None = None) -> Submitted:
        """Queue steps ``first``, ``first + 1``... (``plans[i]`` for step ``first + i``) on every
        member, with ``snapshot`` taken inside the batch (``SnapshotOrder``; its writes are
        waited for with ``await_writes``). Rank 0 leads: it publishes the plans to the others
        (running on published plans until ``release_followers``) and answers every rank's
        reports."""
        ...

    def release_followers(self) -> None:
        """End the followers' run on published plans after the batches queued (the driver
        stops submitting for a while); the next ``submit_steps`` starts another. Every other
        call into the members that runs between steps ends it first by itself."""
        ...

    def kept_reports(self, workers: Sequence[int], first: int, end: int, timeout_s: float) -> list[StepTelemetry]:
        """The reports ``workers`` kept of the steps from ``first`` to ``end`` (exclusive) they
        applied (after a batch's call failed part-way); none from a worker that does not answer
        within ``timeout_s``."""
        ...

    def wait(self, calls: Sequence[Call], num_returns: int, timeout_s: float) -> tuple[list[Call], list[Call]]:
        """Wait until ``num_returns`` of ``calls`` have ended or ``timeout_s`` passed; returns
        (ended, pending), each in the order of ``calls``."""
        ...

    def result(self, call: Call) -> Any:
        """The value of an ended call; raises CallFailed."""
        ...

    def progress(self, timeout_s: float) -> dict[int, Progress | None]:
        """Each member's progress by worker id; None for one that is dead or did not answer."""
        ...

    def probe(self, timeout_s: float) -> tuple[dict[int, Progress], list[int]]:
        """(the living members' progress by worker id, the ids of the dead or silent)."""
        ...

    def abort_all(self, generation: int, pending: Sequence[Call], timeout_s: float) -> None:
        """Abort every member's collectives of ``generation`` and earlier; wait (bounded) until
        ``pending`` calls have ended."""
        ...

    def kill(self, worker: int) -> None: ...

    def remove(self, workers: Sequence[int], retire: bool = False) -> None: ...

    def lead_with(self, worker: int) -> None: ...

    def fill_slots(self, dead_nodes: set[str]) -> int: ...

    def ready_joiners(self, timeout_s: float = 0.0) -> list[Any]: ...

    def admit(self, members: Sequence[Any]) -> None: ...

    def snapshot(self, requests: Sequence[SnapshotRequest], timeout_s: float) -> tuple[list[Call], list[Call]]:
        """Queue ``requests[i]`` on rank i, between two batches; returns (the copies' calls,
        each answering the seconds training was held up; ``await_writes``'s calls)."""
        ...

    def await_writes(self, requests: Sequence[SnapshotRequest], timeout_s: float) -> list[Call]:
        """Calls into rank i, each answering once ``requests[i]``'s part is written (a
        ``jobspec.wire.PartWritten``: the files written and the write's CPU) or raising why
        not; ``timeout_s`` bounds each."""
        ...

    def cancel_writes(self, workers: Sequence[int], name: str, tag: str) -> None:
        """Tell ``workers`` (those still members; not waited for) that attempt ``tag`` of
        checkpoint ``name`` is abandoned: their waits for it end at once, and a snapshot of it
        not yet taken is not taken."""
        ...

    def restore(self, root: str, name: str, manifest: dict[str, Any]) -> None: ...

    def evaluate(self, timeout_s: float) -> dict[str, float]: ...

    def model_state(self, timeout_s: float) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


