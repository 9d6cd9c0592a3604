"""An in-process worker group for driving the controller and the recovery core without Ray,
as Ray Train V2's tests swap in a dummy worker group and torchft's fail a given rank at a given
step with an event injector.

Fake workers apply steps in order (refusing any step that is not their next, as the real actor
does), and a ``Faults`` plan makes them die in a step (before or after its all-reduce), die
while the group re-forms or while a checkpoint is written, stall, run slow, or raise. Peers of a
worker that died mid-step block in the all-reduce until the driver aborts them, as survivors two
hops from a dead rank do in gloo. Checkpoint parts are real files with their real sha256.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from jobspec.job import JobConfig
from jobspec.step_record import StepRecord
from jobspec.wire import (
    FileEntry,
    PartWritten,
    Phase,
    Progress,
    SnapshotOrder,
    SnapshotRequest,
    StepTelemetry,
    WorkerInfo,
)
from orchestrator.group.interface import Call, CallFailed, FailureKind, Submitted
from orchestrator.group.membership import Membership
from orchestrator.store.rendezvous import RendezvousStore
from policies.work_stealing import StepPlan
from workers.checkpoint.storage import CheckpointStorage

BLOCKED = float("inf")  # a call that ends only when aborted


@dataclass
class Faults:
    """What goes wrong, by worker id. ``die_in_step[(w, s)]``: w dies in step s; True if after
    the all-reduce (its peers apply s). ``die_joining[w]``: w dies in the first re-forming at or
    after that step. ``die_writing[(w, s)]``: w dies writing the checkpoint of the state after
    s steps. ``stall[(w, s)]``: w stops that many seconds at the start of s. ``shard_s[w]``: w's
    measured seconds per shard (default 0.01). ``error_in_step[(w, s)]``: w raises.
    ``error_joining``: these workers' next rendezvous raises (e.g. a store error); they live.
    ``unwritten``: (w, s): w reports its part of the checkpoint after s steps written, but it is
    not where the driver looks (a disk of another node). ``miscount[s]``: the census of step s
    counts that many shards too many (a bug that lost the worker-side check).
    ``applied_only_by[s]``: after a death past step s's all-reduce, only these workers finish
    applying s (the others are aborted first). ``unavailable``: (w, s): w applies s but its call
    fails as if it died (Ray's ActorUnavailableError), while it still answers probes; the
    others never finish s."""

    die_in_step: dict[tuple[int, int], bool] = field(default_factory=dict)
    die_joining: dict[int, int] = field(default_factory=dict)
    die_writing: set[tuple[int, int]] = field(default_factory=set)
    stall: dict[tuple[int, int], float] = field(default_factory=dict)
    shard_s: dict[int, float] = field(default_factory=dict)
    error_in_step: dict[tuple[int, int], str] = field(default_factory=dict)
    error_joining: set[int] = field(default_factory=set)
    unwritten: set[tuple[int, int]] = field(default_factory=set)
    miscount: dict[int, int] = field(default_factory=dict)
    applied_only_by: dict[int, set[int]] = field(default_factory=dict)
    unavailable: set[tuple[int, int]] = field(default_factory=set)


@dataclass
class FakeWorker:
    info: WorkerInfo
    alive: bool = True
    next_step: int = 0
    joined_before: bool = False
    applied: list[int] = field(default_factory=list)

    @property
    def worker(self) -> int:
        return self.info.worker


@dataclass
class FakeCall:
    """A call's fate: it ends at ``ends_at`` (monotonic; BLOCKED: only an abort ends it) with
    ``value`` or ``error``; ``apply`` is the step the worker applies when it ends well."""

    worker: FakeWorker
    ends_at: float
    value: Any = None
    error: CallFailed | None = None
    apply: int | None = None
    step: int | None = None
    expect_step: int | None = None  # a snapshot: the worker must be at this step when it ends
    applies_on_error: bool = False  # the step is applied although the call reports a failure
    ended: bool = False
    before: FakeCall | None = None  # the batch's call of the step before: if it failed, this never runs


@dataclass
class FakeBatch:
    """A batch's call into one worker: its steps' calls in order. It ends when they all have
    or one failed (the steps after a failed one never run), answering their reports."""

    parts: list[FakeCall]

    @property
    def ended(self) -> bool:
        return all(p.ended for p in self.parts) or self.error is not None

    @property
    def ends_at(self) -> float:
        return min((p.ends_at for p in self.parts if not p.ended), default=0.0)

    @property
    def error(self) -> CallFailed | None:
        return next((p.error for p in self.parts if p.ended and p.error is not None), None)

    @property
    def value(self) -> list[StepTelemetry]:
        return [p.value for p in self.parts]


@dataclass
class FakeLeader:
    """Rank 0's call of a batch on published plans: every member's ``batches`` (by rank, its
    own first). It answers every rank's reports once all have ended; its own failure fails it;
    a follower's failure leaves it blocked in a collective until the driver aborts it."""

    worker: FakeWorker
    batches: list[FakeBatch]
    aborted: CallFailed | None = None

    @property
    def blocked(self) -> bool:
        return self.batches[0].error is None and any(b.error is not None for b in self.batches[1:])

    @property
    def ended(self) -> bool:
        return self.error is not None or (not self.blocked and all(b.ended for b in self.batches))

    @property
    def ends_at(self) -> float:
        return min((b.ends_at for b in self.batches if not b.ended), default=BLOCKED)

    @property
    def error(self) -> CallFailed | None:
        return self.aborted or self.batches[0].error

    @property
    def value(self) -> list[StepRecord]:
        steps = [part.step for part in self.batches[0].parts]
        return [StepRecord.of(step, [b.value[index] for b in self.batches]) for index, step in enumerate(steps)]


@dataclass
class FakeFollow:
    """A follower's run on published plans: its part of every batch submitted until released.
    It ends early in its first failure (or an abort: waiting for the next batch is a collective
    too); released, once its batches have ended, answering how many it ran."""

    worker: FakeWorker
    batches: list[FakeBatch] = field(default_factory=list)
    released: bool = False
    aborted: CallFailed | None = None

    @property
    def ended(self) -> bool:
        return self.error is not None or (self.released and all(b.ended for b in self.batches))

    @property
    def ends_at(self) -> float:
        return min((b.ends_at for b in self.batches if not b.ended), default=0.0 if self.released else BLOCKED)

    @property
    def error(self) -> CallFailed | None:
        return self.aborted or next((b.error for b in self.batches if b.error is not None), None)

    @property
    def value(self) -> int:
        return len(self.batches)


class FakeWorkerGroup(Membership[FakeWorker, tuple[FakeWorker, float]]):
    """Implements ``orchestrator.group.interface.WorkerGroup`` in-process, its membership bookkeeping
    ``Membership``'s as the Ray group's is. ``replacements``: whether free slots get new workers
    (each ready ``join_delay_s`` after it is started); a joiner is (worker, ready at).
    ``timed``: a step's calls last the ``step_s`` their reports claim, in real seconds (else
    they end at once), so what the driver's clocks measure can be checked against the steps'
    own times."""

    def __init__(
        self, job: JobConfig, faults: Faults | None = None, *, replacements: bool = True, join_delay_s: float = 0.0,
        timed: bool = False,
    ) -> None:
        super().__init__(job.scaling)
        self.job = job
        self.faults = faults or Faults()
        self.replacements = replacements
        self.join_delay_s = join_delay_s
        self.timed = timed
        self.calls: list[FakeCall] = []
        self.batches: list[tuple[int, int]] = []  # (first step, steps) of every submission
        self.at_shutdown: list[FakeWorker] = []
        self.generations = 0
        self._num_steps = job.steps or 0
        self.leaders: list[FakeLeader] = []  # every batch's leader call
        self.follows: list[FakeFollow] = []  # every run on published plans, of every follower
        self._following: tuple[Call, ...] | None = None  # the open run's calls (FakeFollow handles), shared as Ray's are
        # A checkpoint's writes awaited before its batch is submitted (by name and tag).
        self._awaited: dict[tuple[str, str], list[FakeCall]] = {}
        self.cancelled: list[tuple[tuple[int, ...], str, str]] = []  # (workers, name, tag) of each cancel_writes

    # Membership

    def _new_worker(self) -> FakeWorker:
        worker = self._new_worker_id()
        now = time.time()
        info = WorkerInfo(
            worker, 1000, self._num_steps, 10, "cpu", f"node{worker % 2}", "fake", 10_000 + worker,
            started_at=None, imported_at=now, built_at=now,
        )
        return FakeWorker(info)

    def start(self, count: int) -> list[WorkerInfo]:
        self.members = [self._new_worker() for _ in range(count)]
        return self.info

    def fill_slots(self, dead_nodes: set[str]) -> int:
        if not self.replacements:
            return 0
        started = 0
        while self.size + self.loading < self.capacity:
            self.joiners.append((self._new_worker(), time.monotonic() + self.join_delay_s))
            started += 1
        return started

    def ready_joiners(self, timeout_s: float = 0.0) -> list[FakeWorker]:
        if self.joiners and timeout_s > 0:
            first = min(at for _, at in self.joiners)
            time.sleep(max(0.0, min(timeout_s, first - time.monotonic())))
        now = time.monotonic()
        ready = [w for w, at in self.joiners if at <= now]
        self.joiners = [(w, at) for w, at in self.joiners if at > now]
        return ready

    def _kill(self, member: FakeWorker) -> None:
        """The worker dies: its pending calls fail at once; its peers' block in their collectives."""
        member.alive = False
        for call in self._pending():
            if call.worker is member:
                call.ends_at, call.error = time.monotonic(), CallFailed(member.worker, FailureKind.DIED, "ActorDiedError: killed")
            elif call.step is not None:
                call.ends_at = BLOCKED
        self._end_runs(member, FailureKind.DIED, "ActorDiedError: killed")

    def form_group(self, store: RendezvousStore, step: int = -1) -> float:
        self.release_followers()
        store.next_prefix()
        self.generations += 1
        for member in self.members:
            at = self.faults.die_joining.get(member.worker)
            if member.joined_before and at is not None and member.next_step >= at:
                del self.faults.die_joining[member.worker]
                member.alive = False
            if not member.alive:
                raise CallFailed(member.worker, FailureKind.DIED, "ActorDiedError: died during the rendezvous")
            if member.worker in self.faults.error_joining:
                self.faults.error_joining.discard(member.worker)
                raise CallFailed(member.worker, FailureKind.ERROR, "DistStoreError: connection reset")
        root = self.members[0].next_step if step < 0 else step
        for member in self.members:
            member.next_step, member.joined_before = root, True
        return 0.001

    def restore(self, root: str, name: str, manifest: dict[str, Any]) -> None:
        # As WorkerGroup.restore: rank 0 loads the state, or with sharded state every rank its slice.
        for member in self.members if self.job.sharding.enabled else self.members[:1]:
            member.next_step = int(manifest["step"])

    # Calls

    def _pending(self) -> list[FakeCall]:
        return [c for c in self.calls if not c.ended]

    def _call(self, call: FakeCall) -> Call:
        self.calls.append(call)
        return Call(call.worker.worker, call)

    def submit_steps(self, first: int, plans: Sequence[StepPlan], snapshot: SnapshotOrder | None = None) -> Submitted:
        self.batches.append((first, len(plans)))
        by_member: list[list[FakeCall]] = [[] for _ in self.members]
        for index, plan in enumerate(plans):
            for parts, call in zip(by_member, self._submit_step(first + index, plan)):
                call.before = parts[-1] if parts else None
                parts.append(call)
        if snapshot is not None:
            self._take_inside(first, snapshot, by_member)
        batches = [FakeBatch(parts) for parts in by_member]
        if self._following is None:
            runs = [FakeFollow(member) for member in self.members[1:]]
            self.follows += runs
            self._following = tuple(Call(run.worker.worker, run) for run in runs)
        for call, batch in zip(self._following, batches[1:]):
            call.handle.batches.append(batch)
        leader = FakeLeader(self.members[0], batches)
        self.leaders.append(leader)
        return Submitted((Call(self.members[0].worker, leader),), self._following)

    def _take_inside(self, first: int, order: SnapshotOrder, by_member: list[list[FakeCall]]) -> None:
        """``order`` taken inside the batch from ``first``: the step ending at ``order.step``
        reports its copy, and each awaited write ends with that step (never, if it failed)."""
        writes = self._awaited.pop((order.name, order.tag))
        for parts, write in zip(by_member, writes):
            call = parts[order.step - 1 - first]
            if call.value is not None:
                call.value = replace(call.value, snapshot_s=0.001)
            write.ends_at, write.before = call.ends_at, call

    def release_followers(self) -> None:
        for call in self._following or ():
            call.handle.released = True
        self._following = None

    def _end_runs(self, worker: FakeWorker | None, kind: FailureKind | None, reason: str) -> None:
        """Fail the open leader and follower calls (of ``worker`` only, if given) as aborted or dead."""
        for handle in [*self.leaders, *self.follows]:
            if not handle.ended and (worker is None or handle.worker is worker):
                failed = kind or (FailureKind.PEER_LOST if handle.worker.alive else FailureKind.DIED)
                handle.aborted = CallFailed(handle.worker.worker, failed, reason)

    def kept_reports(self, workers: Sequence[int], first: int, end: int, timeout_s: float) -> list[StepTelemetry]:
        self._settle_calls()
        return [
            c.value for c in self.calls
            if c.worker.worker in workers and c.worker.alive and c.step is not None and first <= c.step < end
            and c.ended and c.error is None and c.value is not None
        ]

    def _submit_step(self, step: int, plan: StepPlan) -> list[FakeCall]:
        if len(plan.shards_by_rank) != self.size:
            raise ValueError(f"plan is for {len(plan.shards_by_rank)} ranks, group has {self.size}")
        now = time.monotonic()
        # A step starts once every member's previous call has ended; blocked stays blocked.
        start = max([now] + [c.ends_at for c in self._pending() if c.step is not None])
        start += max((self.faults.stall.get((m.worker, step), 0.0) for m in self.members), default=0.0)
        dying = {m.worker: self.faults.die_in_step.pop((m.worker, step)) for m in self.members if (m.worker, step) in self.faults.die_in_step}
        unavailable = {m.worker for m in self.members if (m.worker, step) in self.faults.unavailable}
        self.faults.unavailable -= {(w, step) for w in unavailable}
        calls = []
        for rank, member in enumerate(self.members):
            call = FakeCall(member, start, step=step)
            error = self.faults.error_in_step.pop((member.worker, step), None)
            if member.worker in unavailable:
                call.error = CallFailed(member.worker, FailureKind.DIED, "ActorUnavailableError: may or may not have run")
                call.apply, call.applies_on_error, call.ends_at = step, True, now
            elif not member.alive or member.worker in dying:
                call.error = CallFailed(member.worker, FailureKind.DIED, "ActorDiedError: the actor died")
                call.ends_at, member.alive = now, False
            elif error is not None:
                call.error = CallFailed(member.worker, FailureKind.ERROR, f"ValueError: {error}")
            elif (
                dying and not all(dying.values())
                or any(not m.alive for m in self.members if m.worker not in dying)
                or dying and member.worker not in self.faults.applied_only_by.get(step, {member.worker})
                or unavailable
            ):
                call.ends_at = BLOCKED  # a peer died before the all-reduce finished (here)
            else:
                call.value, call.apply = self._report(step, rank, member, plan), step
                if self.timed:
                    call.ends_at = start + call.value.step_s
            self.calls.append(call)
            calls.append(call)
        return calls

    def _report(self, step: int, rank: int, member: FakeWorker, plan: StepPlan) -> StepTelemetry:
        shards = tuple(plan.shards_by_rank[rank])
        shard_s = self.faults.shard_s.get(member.worker, 0.01)
        samples = len(shards) * (self.job.batch_size // self.job.shards)
        return StepTelemetry(
            step=step, rank=rank, worker=member.worker, shards=shards, samples=samples,
            global_samples=self.job.batch_size, loss=1.0 / (step + 1), compute_s=shard_s * len(shards),
            comm_s=0.0, optim_s=0.0, step_s=shard_s * max(len(s) for s in plan.shards_by_rank),
            shards_counted=plan.num_shards + self.faults.miscount.get(step, 0), shards_run=len(shards), shard_s=shard_s,
        )

    def _settle_calls(self) -> None:
        """End the calls whose time has come, in order, applying their steps."""
        now = time.monotonic()
        for call in sorted(self._pending(), key=lambda c: c.ends_at):
            if call.ends_at > now:
                continue
            call.ended = True
            if call.before is not None and call.before.error is not None:
                call.error, call.apply, call.value = call.before.error, None, None  # never ran
                continue
            if call.error is None and call.expect_step is not None and call.worker.next_step != call.expect_step:
                call.error = CallFailed(call.worker.worker, FailureKind.ERROR, "RuntimeError: not at the step")
            if (call.error is None or call.applies_on_error) and call.apply is not None:
                if call.worker.next_step != call.apply:
                    call.error = CallFailed(
                        call.worker.worker, FailureKind.ERROR,
                        f"RuntimeError: asked for step {call.apply}, next is {call.worker.next_step}",
                    )
                else:
                    call.worker.next_step = call.apply + 1
                    call.worker.applied.append(call.apply)

    def wait(self, calls: Sequence[Call], num_returns: int, timeout_s: float) -> tuple[list[Call], list[Call]]:
        assert len({id(c.handle) for c in calls}) == len(calls), "ray.wait refuses a ref given twice"
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            self._settle_calls()
            # As ray.wait: at most num_returns of the calls that have ended.
            ended = [c for c in calls if c.handle.ended][: max(1, num_returns)]
            if len(ended) >= min(num_returns, len(calls)) or time.monotonic() >= deadline:
                return ended, [c for c in calls if c not in ended]
            soonest = min([c.handle.ends_at for c in calls if not c.handle.ended] + [deadline])
            time.sleep(max(0.0, min(soonest, deadline) - time.monotonic()) + 0.001)

    def result(self, call: Call) -> Any:
        fake: FakeCall = call.handle
        assert fake.ended, "result of a call that has not ended"
        if fake.error is not None:
            raise fake.error
        return fake.value

    def abort_all(self, generation: int, pending: Sequence[Call], timeout_s: float) -> None:
        self._settle_calls()
        for call in self._pending():
            if call.step is not None:
                call.ends_at, call.apply, call.value = time.monotonic(), None, None
                kind = FailureKind.PEER_LOST if call.worker.alive else FailureKind.DIED
                call.error = call.error or CallFailed(call.worker.worker, kind, "CollectiveAborted: aborted by the driver")
        self._settle_calls()
        self._end_runs(None, None, "CollectiveAborted: aborted by the driver")
        self._following = None

    def progress(self, timeout_s: float) -> dict[int, Progress | None]:
        self._settle_calls()
        now = time.monotonic()
        out: dict[int, Progress | None] = {}
        for member in self.members:
            mine = [c for c in self._pending() if c.worker is member and c.step is not None]
            if not member.alive:
                out[member.worker] = None
            elif not mine:
                out[member.worker] = Progress(member.next_step - 1, Phase.DONE, 0.0, member.next_step)
            else:
                stalled = (member.worker, mine[0].step) in self.faults.stall and mine[0].ends_at > now
                phase = Phase.STALL if stalled else Phase.REDUCE
                out[member.worker] = Progress(mine[0].step or 0, phase, 1.0, member.next_step)
        return out

    # Checkpoints, evaluation, shutdown

    def snapshot(self, requests: Sequence[SnapshotRequest], timeout_s: float) -> tuple[list[Call], list[Call]]:
        self.release_followers()  # as the Ray group: a snapshot runs off the published plans
        copies, writes = [], []
        for member, request in zip(self.members, requests):
            # Queued behind the member's steps in flight, as on the actor's compute thread.
            after = max([time.monotonic()] + [c.ends_at for c in self._pending() if c.worker is member and c.step is not None])
            copy = FakeCall(member, after, value=0.001, expect_step=request.step)
            write = FakeCall(member, after)
            if (member.worker, request.step) in self.faults.die_writing:
                self.faults.die_writing.discard((member.worker, request.step))
                self._kill(member)
                write.error = CallFailed(member.worker, FailureKind.DIED, "ActorDiedError: died writing")
            else:
                part = _write_part(request, written=(member.worker, request.step) not in self.faults.unwritten)
                write.value = PartWritten((part,), 0.001)
            copies.append(self._call(copy))
            writes.append(self._call(write))
        return copies, writes

    def await_writes(self, requests: Sequence[SnapshotRequest], timeout_s: float) -> list[Call]:
        """Writes of a checkpoint its batch takes (``submit_steps`` next): each ends with the
        step it follows. A worker set to die writing dies in the step after it."""
        writes = []
        for member, request in zip(self.members, requests):
            write = FakeCall(member, BLOCKED)
            if (member.worker, request.step) in self.faults.die_writing:
                self.faults.die_writing.discard((member.worker, request.step))
                self.faults.die_in_step[(member.worker, request.step)] = False
                write.error = CallFailed(member.worker, FailureKind.DIED, "ActorDiedError: died writing")
            else:
                part = _write_part(request, written=(member.worker, request.step) not in self.faults.unwritten)
                write.value = PartWritten((part,), 0.001)
            writes.append(write)
        self._awaited[(requests[0].name, requests[0].tag)] = writes
        return [self._call(write) for write in writes]

    def cancel_writes(self, workers: Sequence[int], name: str, tag: str) -> None:
        self.cancelled.append((tuple(w for w in workers if w in self.workers), name, tag))  # members only, as Ray's

    def evaluate(self, timeout_s: float) -> dict[str, float]:
        return {"loss": 0.0}

    def model_state(self, timeout_s: float) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        self.at_shutdown = list(self.members)  # for the tests' checks
        self.members, self.joiners = [], []


def _write_part(request: SnapshotRequest, written: bool = True) -> FileEntry:
    data = f"part {request.index} of {request.count} at step {request.step}".encode()
    relpath = f"part-{request.index}-of-{request.count}-{request.tag}.pt"
    if written:
        CheckpointStorage(request.root).write_bytes(f"{request.name}/{relpath}", data)
    return FileEntry(relpath, hashlib.sha256(data).hexdigest(), len(data))
