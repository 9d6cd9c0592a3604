"""Coordinated checkpoints, the driver's side: when, who writes what, the manifest.
Where a run resumes from is ``orchestrator/checkpoints/resume_point.py``.

The driver has every worker copy its slice of the state after a step to memory and write it
in the background while training goes on: inside a batch of steps (a ``SnapshotOrder`` riding
with the batch, taken right after the step that ends there, the copy's seconds coming back in
that step's report), or between two batches (a ``snapshot`` call queued behind the first:
the final checkpoint, one before failing, one due where a batch starts); when every part is written the driver
writes the manifest (sha256 of every file) last, atomically, and prunes to the last ``keep``.
A checkpoint whose writers fail (a death mid-write) never gets a manifest and is cleaned up.
All of it happens in the run's own namespace under the checkpoint root, which this driver holds
the lease of (``orchestrator/checkpoints/lease.py``).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from jobspec.job import JobConfig
from jobspec.redaction import redact_all
from jobspec.step_record import StepRecord
from jobspec.wire import FileEntry, PartWritten, SnapshotOrder
from orchestrator.checkpoints.lease import NamespaceLease
from orchestrator.checkpoints.namespace import namespace_root
from orchestrator.checkpoints.resume_point import ResumePoint, config_hash, trajectory_config
from orchestrator.errors import JobFailed
from orchestrator.group.interface import Call, CallFailed, WorkerGroup
from orchestrator.output.run_dir import RunDirectory
from policies.checkpoint_interval import CheckpointInterval
from policies.sharding import effective_group_size
from workers.checkpoint.manifest import MANIFEST, CheckpointCorrupt, prune, verify_checkpoint, write_manifest
from workers.checkpoint.storage import CheckpointStorage, checkpoint_name


@dataclass
class PendingCheckpoint:
    """A checkpoint being taken. ``copies``: the snapshot calls (between batches), each
    answering its copy's seconds; None inside a batch, where ``copy_s`` arrives with the
    reports of the step that ends at ``step`` (``CheckpointCoordinator.copied``)."""

    name: str
    tag: str
    step: int
    started: float
    copies: list[Call] | None
    writes: list[Call]
    meta: dict[str, Any]
    why: str
    copy_s: float | None = None


@dataclass
class CheckpointRecord:
    name: str
    step: int
    why: str
    copy_s: float  # the longest in-memory snapshot: what training was held up
    write_s: float  # from the snapshot to the manifest
    bytes: int
    write_cpu_s: float  # the parts' writes' CPU, all workers together


#: Tries of a checkpoint that is waited for (final, before failing) when storage fails it.
SAVE_ATTEMPTS = 3


class CheckpointCoordinator:
    """Takes a job's checkpoints (see the module doc) in ``run``'s namespace. ``counters`` gets
    ``checkpoints``; ``lease``: the namespace's, held by this driver (None: unchecked), asked
    before each manifest."""

    def __init__(self, job: JobConfig, run: RunDirectory, counters: dict[str, int], lease: NamespaceLease | None = None) -> None:
        self.job = job
        self.run = run
        self.counters = counters
        self.lease = lease
        self.written: list[CheckpointRecord] = []
        config = job.checkpoint
        self.enabled = config.enabled
        self.root = namespace_root(job, run.path, run.run_id)
        self.storage = CheckpointStorage(self.root)
        self.policy = CheckpointInterval(
            None if config.every_steps == "auto" else max(1, int(config.every_steps)),
            mtbf_prior_s=config.mtbf_prior_s,
            max_steps=config.max_every_steps,
        )
        self.last_step = 0  # the step of the newest checkpoint taken (pending or written)
        self.committed_step = 0  # ... of the newest written one (or resumed from)
        self.attempts = 0  # checkpoints started by this driver; tag their files
        # ... with this driver's token: a resumed run starts counting again, and must not write
        # over files an earlier driver's writers may still be busy with.
        self.driver = secrets.token_hex(3)
        self.pending: PendingCheckpoint | None = None
        self.group: WorkerGroup | None = None  # the group the pending checkpoint was queued on

    def resumed(self, point: ResumePoint) -> None:
        self.last_step = self.committed_step = point.step
        saved = point.meta.get("policy")
        if saved:
            self.policy.restore(saved)

    def due(self, step: int) -> bool:
        """Whether to checkpoint the state after ``step`` steps (asked before submitting it)."""
        return self.pending is None and self.would_be_due(step)

    def due_behind_pending(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` steps while the last is still being
        written (it waits for that write)."""
        return self.pending is not None and self.would_be_due(step)

    def would_be_due(self, step: int) -> bool:
        """Whether the interval calls for a checkpoint after ``step`` steps, counted from the
        newest one taken (pending or written): a batch of steps handed out at once ends in
        front of such a step. (A pending one that is abandoned makes the next due at once: it
        starts at the next batch's first step.)"""
        return self.enabled and step > self.last_step and self.policy.due(step - self.last_step)

    def start(self, group: WorkerGroup, step: int, meta: dict[str, Any], why: str = "periodic", ranks: int | None = None) -> None:
        """Queue the snapshot of the state after ``step`` steps, between two batches, on the
        first ``ranks`` members (all by default; with sharded optimizer state, the first
        sharding group, each rank writing the slice it owns), each writing a slice; ``meta``
        goes into the manifest."""
        order = self._order(group, step, ranks)
        copies, writes = group.snapshot(order.parts(), self.job.timeouts.checkpoint_s)
        self._pending(group, order, copies, writes, meta, why)

    def order(self, group: WorkerGroup, step: int, meta: dict[str, Any]) -> SnapshotOrder:
        """The periodic checkpoint of the state after ``step`` steps, taken inside the batch
        that runs the step ending there (``submit_steps``' ``snapshot``): its writes are
        awaited from now, its copy's seconds come with that step's reports (``copied``)."""
        order = self._order(group, step, None)
        writes = group.await_writes(order.parts(), self.job.timeouts.checkpoint_s)
        self._pending(group, order, None, writes, meta, "periodic")
        return order

    def copied(self, record: StepRecord) -> None:
        """Note the copy's seconds of a checkpoint taken inside a batch, from the reports of
        the step it follows (the longest of its writers'), once that step is committed."""
        pending = self.pending
        if pending is not None and pending.copies is None and record.step + 1 == pending.step:
            # A step committed without its reports (survivors finished it) tells no copy time.
            pending.copy_s = float(record.column("snapshot_s").max()) if len(record) else 0.0

    def _order(self, group: WorkerGroup, step: int, ranks: int | None) -> SnapshotOrder:
        """A new attempt at the checkpoint of the state after ``step`` steps on ``ranks`` parts
        (see ``start``)."""
        sharding = self.job.sharding
        count = ranks or (effective_group_size(group.size, sharding.group_size) if sharding.enabled else group.size)
        self.attempts += 1
        return SnapshotOrder(step, self.root, checkpoint_name(step), f"{self.driver}-a{self.attempts}", count)

    def _pending(
        self, group: WorkerGroup, order: SnapshotOrder, copies: list[Call] | None, writes: list[Call], meta: dict[str, Any],
        why: str,
    ) -> None:
        """``order`` is under way on ``group``: it is the pending checkpoint."""
        step, count = order.step, order.count
        self.group = group
        self.pending = PendingCheckpoint(
            name=order.name,
            tag=order.tag,
            step=step,
            started=time.perf_counter(),
            copies=copies,
            writes=writes,
            meta={
                **meta,
                # Shards are a function of (seed, step, shard): the next step is the whole cursor.
                "data_cursor": {"next_step": step, "seed": self.job.seed, "batch_size": self.job.batch_size},
                "config_hash": config_hash(self.job),
                # For the message when a resume is refused; the hash above decides. Masked:
                # a dataset URL may carry credentials.
                "config": redact_all(trajectory_config(self.job)),
                "policy": self.policy.state(),
                "workers": count,
            },
            why=why,
        )
        self.last_step = step

    def poll(self, elapsed_s: float | None = None, wait_s: float = 0.0) -> None:
        """Finish the pending checkpoint if every part is written (waiting up to ``wait_s``):
        manifest, prune, count. A part that failed abandons it. ``elapsed_s``, the training
        seconds so far, feeds the interval policy's failure rate."""
        if elapsed_s is not None:
            self.policy.observe_elapsed(elapsed_s)
        pending = self.pending
        if pending is None:
            return
        group = self.group
        assert group is not None, "a pending checkpoint has its group"
        copies = pending.copies or []
        calls = copies + pending.writes
        _, waiting = group.wait(calls, len(calls), wait_s)
        # Inside a batch, the copy's seconds come once its step is committed.
        if waiting or (pending.copies is None and pending.copy_s is None):
            copied, _ = group.wait(copies, len(copies), 0.0)
            try:
                for call in copied:
                    group.result(call)
            except CallFailed as err:
                self.abandon(f"a snapshot failed: {err}")
                return
            if time.perf_counter() - pending.started > self.job.timeouts.checkpoint_s:
                self.abandon(f"not written within timeouts.checkpoint_s ({self.job.timeouts.checkpoint_s:.0f}s)")
            return
        try:
            copy_s = pending.copy_s if pending.copy_s is not None else max(group.result(c) for c in copies)
            parts: list[PartWritten] = [group.result(c) for c in pending.writes]
        except CallFailed as err:
            self.abandon(f"a part failed: {err}")
            return
        files = [f for part in parts for f in part.files]
        problem = self._missing(pending.name, files) or self._not_held()
        if problem is not None:
            self.abandon(problem)
            if self.lease is not None and self.lease.lost is not None:
                # Both drivers writing (and pruning) one namespace would destroy its checkpoints.
                raise JobFailed(f"{self.lease.lost}; this run writes no more checkpoints there")
            return
        self.pending = None
        # Storage trouble (a full disk, a bucket error) must not end the training.
        try:
            write_manifest(self.storage, pending.step, files, pending.meta)
        except (OSError, ValueError) as err:
            self.run.event("checkpoint_abandoned", name=pending.name, reason=f"manifest: {type(err).__name__}: {err}")
            return
        try:
            deleted = prune(self.storage, self.job.checkpoint.keep, newest_good=pending.name)
        except OSError as err:
            deleted = []
            self.run.event("checkpoint_prune_failed", reason=f"{type(err).__name__}: {err}")
        record = CheckpointRecord(
            pending.name, pending.step, pending.why, copy_s, time.perf_counter() - pending.started,
            sum(f.bytes for f in files), sum(part.cpu_s for part in parts),
        )
        self.written.append(record)
        self.committed_step = pending.step
        self.counters["checkpoints"] += 1
        self.policy.observe_checkpoint(copy_s)
        self.run.event("checkpoint", **vars(record), location=self.storage.location(pending.name), pruned=deleted)

    def _not_held(self) -> str | None:
        """Why this driver may not write a manifest in the namespace (its lease taken by
        another, or unreadable), or None."""
        if self.lease is None:
            return None
        try:
            return self.lease.check()
        except (OSError, ValueError) as err:  # pyarrow: ArrowIOError is an OSError, ArrowInvalid a ValueError
            return f"cannot read the lease {self.lease.where}: {type(err).__name__}: {err}"

    def _missing(self, name: str, files: list[FileEntry]) -> str | None:
        """Why the files the workers reported are not all where the manifest will say (each
        must exist with its reported size, looked up through the same storage layer), or None.
        A worker that wrote to a disk the driver cannot see (a local path on a multi-node
        cluster) shows here, at the first checkpoint, not at resume."""
        for entry in files:
            relpath = f"{name}/{entry.path}"
            try:
                size = self.storage.size(relpath)
            except OSError as err:
                return f"cannot check {self.storage.location(relpath)}: {type(err).__name__}: {err}"
            if size != entry.bytes:
                found = "missing" if size is None else f"{size} bytes"
                return (
                    f"{self.storage.location(relpath)} is {found}, a worker reported {entry.bytes} bytes: "
                    "checkpoint.path must be storage that every worker and the driver share"
                )
        return None

    def save_now(
        self, group: WorkerGroup, step: int, meta: dict[str, Any], why: str, ranks: int | None = None, force: bool = False
    ) -> bool:
        """A checkpoint of the state after ``step`` steps, waited for (the final one, or one
        before failing), tried up to ``SAVE_ATTEMPTS`` times within ``timeouts.checkpoint_s``.
        Skipped when checkpoints are off, unless ``force``. Returns whether a checkpoint of
        ``step`` now holds the state (written now, or already there and verified). Never
        raises for storage trouble: a save that cannot be made is reported
        (``checkpoint_abandoned`` events) and the job goes on to its model and summary."""
        if not (self.enabled or force) or group.size == 0:
            return False
        if self._saved(step):
            return True  # already saved (e.g. a run resumed from its final checkpoint)
        self.abandon("superseded")
        deadline = time.perf_counter() + self.job.timeouts.checkpoint_s  # for all attempts together
        for _ in range(SAVE_ATTEMPTS):
            self.start(group, step, meta, why, ranks)
            self.poll(wait_s=max(0.0, deadline - time.perf_counter()))
            if self.written and self.written[-1].step == step:
                return True
            self.abandon(f"not written within timeouts.checkpoint_s ({self.job.timeouts.checkpoint_s:.0f}s)")
            if time.perf_counter() >= deadline:
                break
        return False

    def _saved(self, step: int) -> bool:
        """Whether this run's checkpoint of ``step`` exists in its namespace and verifies (a
        partial manifest, a corrupt file or one of another trajectory does not count)."""
        name = checkpoint_name(step)
        try:
            if not self.storage.exists(f"{name}/{MANIFEST}"):
                return False
            manifest = verify_checkpoint(self.storage, name)
        except (CheckpointCorrupt, OSError) as err:
            self.run.event("checkpoint_replaced", name=name, reason=str(err))
            return False
        return manifest["meta"].get("config_hash") == config_hash(self.job)

    def abandon(self, reason: str) -> None:
        """Drop the pending checkpoint (its files, without a manifest, are pruned later) and
        cancel it on its writers (``WorkerGroup.cancel_writes``). The interval counts again
        from the last checkpoint written, not from the abandoned one."""
        self.last_step = self.committed_step
        pending = self.pending
        if pending is not None:
            self.run.event("checkpoint_abandoned", name=pending.name, reason=reason)
            self.pending = None
            # Its writers' waits would otherwise hold their io thread, and the next attempt's.
            assert self.group is not None, "a pending checkpoint has its group"
            self.group.cancel_writes([call.worker for call in pending.writes], pending.name, pending.tag)

    def observe_step(self, step_s: float) -> None:
        if step_s > 0:
            self.policy.observe_step(step_s)

    def observe_failure(self) -> None:
        self.policy.observe_failure()

    def summary(self) -> dict[str, Any]:
        return {
            "written": len(self.written),
            "root": self.root if self.enabled or self.written else None,
            "interval_steps": self.policy.decide().every_steps if self.enabled else None,
            "copy_s": [r.copy_s for r in self.written],
            "write_s": [r.write_s for r in self.written],
            "write_cpu_s": [r.write_cpu_s for r in self.written],
            "last": self.written[-1].name if self.written else None,
        }
