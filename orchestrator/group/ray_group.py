"""The Ray implementation of the worker group (``orchestrator/group/interface.py``): worker actors in
slots of the job's placement groups (``orchestrator/group/slots.py``), driven through Ray calls whose
failures ``orchestrator/group/ray_calls.py`` classifies."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jobspec.job import JobConfig
from jobspec.runtime import ScalingConfig
from jobspec.stream import DataFeed
from jobspec.wire import JoinRequest, Progress, SnapshotOrder, SnapshotRequest, StepTelemetry, WorkerInfo
from orchestrator.group.interface import Call, Submitted, WorkerGroupError
from orchestrator.group.membership import Membership
from orchestrator.group.ray_calls import failure_of, ray_errors_as_group_errors
from orchestrator.group.slots import Slot, SlotPlacement
from orchestrator.group.start_wait import StartWait, start_timeout_message, start_wait_message
from orchestrator.store.rendezvous import RendezvousStore
from policies.collective_choice import CollectiveChoice
from policies.placement import unplaceable
from policies.work_stealing import StepPlan
from workers.actor import TrainWorker

RemoteTrainWorker = ray.remote(concurrency_groups={"compute": 1, "control": 1, "io": 1})(TrainWorker)


def actor_options(scaling: ScalingConfig) -> dict[str, Any]:
    """Ray actor options for one worker, from the job's resources per worker."""
    resources = dict(scaling.resources_per_worker)
    options: dict[str, Any] = {
        "num_cpus": resources.pop("CPU", 0),
        "num_gpus": resources.pop("GPU", 0),
        "resources": resources,
        "max_restarts": 0,
    }
    if scaling.accelerator_type:
        options["accelerator_type"] = scaling.accelerator_type
    return options


@dataclass
class Member:
    actor: Any
    info: WorkerInfo
    slot: Slot


@dataclass
class Joiner:
    """An actor started into a free slot, still loading; it joins at a step boundary."""

    actor: Any
    worker: int
    slot: Slot
    ready: ray.ObjectRef  # its describe()


class RayWorkerGroup(Membership[Member, Joiner]):
    """Starts, drives, grows and tears down the worker actors of one job.

    Workers live in slots (placement-group bundles, ``orchestrator/group/slots.py``). A slot freed by
    a death gets a replacement actor; slots beyond the starting count are reserved one
    placement group each, up to ``scaling.max_workers``, and fill when the cluster has room (a
    node joins). New actors load in the background (``joiners``) and join the process group at
    a step boundary. The membership bookkeeping is ``Membership``'s; ``members`` are in rank
    order; worker ids never repeat.
    """

    #: While a start waits (for its placement group, or its actors to load), ``on_wait`` is told
    #: what is pending this often.
    WAIT_REPORT_S = 10.0

    def __init__(
        self,
        job: JobConfig,
        fixed_cluster: bool = False,
        on_wait: Callable[[str], None] = lambda message: None,
        within: PlacementGroup | None = None,
        on_collective: Callable[[CollectiveChoice], None] = lambda choice: None,
        data: dict[str, DataFeed] | None = None,
    ) -> None:
        """``within``: a placement group reserved for the job by someone else (a Tune trial's;
        see ``SlotPlacement``). ``on_collective`` is told what ``collective.algorithm: auto``
        chose at each group formation. ``data``: the indexes of the job's file sources and the feeders of its streams, put in
        Ray's object store once for every actor to take."""
        super().__init__(job.scaling)
        self.job = job
        self._data = data or {}
        self._data_ref: Any = None  # put in the object store with the first actor (the constructor starts nothing)
        self.fixed_cluster = fixed_cluster  # its resources are all it will have: refuse the impossible at once
        self._on_wait = on_wait
        self._on_collective = on_collective
        self.scaling = job.scaling
        self.timeouts = job.timeouts
        self.placement = SlotPlacement(job.scaling, within)
        #: The followers' calls while they run on published plans (None: they are not).
        self._followers: tuple[Call, ...] | None = None

    @property
    def actors(self) -> list[Any]:
        return [m.actor for m in self.members]

    @property
    def placements(self) -> list[PlacementGroup]:
        """The placement groups the job reserved (released at shutdown)."""
        return self.placement.placements

    def start(self, count: int) -> list[WorkerInfo]:
        """Reserve ``count`` bundles, start one actor in each, wait until all have loaded.

        Actors are created at once and wait in Ray for their bundles, so reserving resources
        overlaps their start. Returns each actor's ``describe()``. Raises WorkerGroupError on
        a timeout (saying what was still pending) or a worker error; on a ``fixed_cluster`` at
        once if the workers can never fit. While the start waits, ``on_wait`` is told every
        WAIT_REPORT_S what it waits on, in one line (``start_wait_message``).
        """
        bundle = self.placement.bundle
        if self.fixed_cluster:
            nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
            problem = unplaceable(bundle, count, nodes)
            if problem is not None:
                raise WorkerGroupError(problem)
        _, slots = self.placement.reserve(count)
        actors = [self._new_actor(slot) for slot in slots]
        try:
            infos = self._await_start([a for a, _ in actors], slots)
        except ray.exceptions.RayError as err:
            raise WorkerGroupError(f"a worker failed to start: {failure_of(-1, err).reason}") from None
        self.members = [Member(actor, info, slot) for (actor, _), info, slot in zip(actors, infos, slots)]
        return self.info

    def _await_start(self, actors: list[Any], slots: list[Slot]) -> list[WorkerInfo]:
        """The ``actors``' describe() (one each in ``slots``) within ``timeouts.start_s``, telling
        ``on_wait`` what is pending every WAIT_REPORT_S meanwhile (``start_wait_message``);
        raises WorkerGroupError after it (``start_timeout_message``)."""
        refs = [actor.describe.remote() for actor in actors]
        start_s = self.timeouts.start_s
        deadline = time.monotonic() + start_s
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(self.WAIT_REPORT_S, left)))
            if len(ready) == len(refs):
                return ray.get(refs, timeout=0)
            wait = self._start_wait(actors, slots, refs)
            if left <= self.WAIT_REPORT_S:
                raise WorkerGroupError(start_timeout_message(wait, start_s))
            self._on_wait(start_wait_message(wait, start_s))

    def _start_wait(self, actors: list[Any], slots: list[Slot], refs: list[ray.ObjectRef]) -> StartWait:
        """Where the start of ``actors`` into ``slots`` (``refs``: their describe()) stands now."""
        table = placement_group_table(slots[0].placement)
        nodes_of = table.get("bundles_to_node_id", {})
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        waiting = [actor for actor, ref in zip(actors, refs) if ref not in ready]
        try:  # Ray's private actor table (a process id once the actor has a process): losing it costs the detail, not the start
            from ray._private import state

            loading: int | None = sum(state.actors(actor._actor_id.hex())["Pid"] > 0 for actor in waiting)
        except Exception:
            loading = None
        return StartWait(
            count=len(slots),
            bundle=self.placement.bundle,
            placed=sum(1 for slot in slots if nodes_of.get(slot.index)),
            scheduling=table.get("stats", {}).get("scheduling_state", ""),
            ready=len(ready),
            loading=loading,
            free=ray.available_resources(),
            nodes=sum(1 for node in ray.nodes() if node.get("Alive")),
        )

    def _new_actor(self, slot: Slot) -> tuple[Any, int]:
        worker = self._new_worker_id()
        actor = RemoteTrainWorker.options(
            **actor_options(self.scaling),
            scheduling_strategy=PlacementGroupSchedulingStrategy(slot.placement, placement_group_bundle_index=slot.index),
        ).remote(self.job, worker, None, self._shared_data())
        return actor, worker

    def _shared_data(self) -> Any:
        """The data indexes and feeders, put in Ray's object store once for every actor to take."""
        if self._data_ref is None:
            self._data_ref = ray.put(self._data)
        return self._data_ref

    @ray_errors_as_group_errors
    def form_group(self, store: RendezvousStore, step: int = -1) -> float:
        """All members join one torch.distributed group through the driver's store (a new
        generation) and take rank 0's training state. Returns the state transfer's seconds (the
        slowest rank's). Raises WorkerGroupError on a timeout and CallFailed if a member
        failed (died) meanwhile."""
        self.release_followers()
        prefix = store.next_prefix()
        nodes = tuple(info.node_id for info in self.info)  # topology for the hierarchical all-reduce
        claim_ports = store.claim_ports
        requests = [
            JoinRequest(
                store.host, store.port, prefix, store.generation, rank, nodes, self.timeouts.rendezvous_s, store.namespace,
                step, claim_ports,
            )
            for rank in range(self.size)
        ]
        calls = [Call(m.info.worker, m.actor.join_group.remote(r)) for m, r in zip(self.members, requests)]
        joined = self._gather(calls, self.timeouts.rendezvous_s, "rendezvous")
        if joined[0].collective is not None:
            self._on_collective(joined[0].collective)
        return max(j.transfer_s for j in joined)

    @ray_errors_as_group_errors
    def submit_steps(self, first: int, plans: Sequence[StepPlan], snapshot: SnapshotOrder | None = None) -> Submitted:
        """One call, into rank 0, per batch: it publishes the plans to the other ranks, which
        run on them (one ``follow`` call each until ``release_followers``), and answers every
        rank's reports (docs/architecture.md, "Published plans")."""
        for plan in plans:
            if len(plan.shards_by_rank) != self.size:
                raise ValueError(f"plan is for {len(plan.shards_by_rank)} ranks, group has {self.size}")
        leader, *followers = self.members
        if self._followers is None:
            self._followers = tuple(Call(m.info.worker, m.actor.follow.remote()) for m in followers)
        lead = Call(leader.info.worker, leader.actor.lead_steps.remote(first, list(plans), snapshot))
        return Submitted((lead,), self._followers)

    def release_followers(self) -> None:
        """Queue the end of the followers' run on rank 0, behind its batches (see ``submit_steps``)."""
        if self._followers and self.members:
            self.members[0].actor.release_followers.remote()
        self._followers = None

    def kept_reports(self, workers: Sequence[int], first: int, end: int, timeout_s: float) -> list[StepTelemetry]:
        asked = set(workers)
        members = [m for m in self.members if m.info.worker in asked]
        answers = self._ask(members, lambda actor: actor.kept_reports.remote(first, end), timeout_s)
        # A worker that died since has none: its steps' reports from the others suffice.
        return [report for kept in answers.values() if kept is not None for report in kept]

    def wait(self, calls: Sequence[Call], num_returns: int, timeout_s: float) -> tuple[list[Call], list[Call]]:
        if not calls:
            return [], []
        refs = [c.handle for c in calls]
        ready, _ = ray.wait(refs, num_returns=min(num_returns, len(refs)), timeout=max(0.0, timeout_s))
        ended = set(ready)
        return [c for c in calls if c.handle in ended], [c for c in calls if c.handle not in ended]

    def result(self, call: Call) -> Any:
        try:
            return ray.get(call.handle, timeout=0)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the call into worker {call.worker} has not ended") from None
        except ray.exceptions.RayError as err:
            raise failure_of(call.worker, err) from None

    def progress(self, timeout_s: float) -> dict[int, Progress | None]:
        """Each member's ``progress()`` by worker id; None for one that did not answer in time
        or is dead."""
        return self._ask(self.members, lambda actor: actor.progress.remote(), timeout_s)

    @staticmethod
    def _ask(members: Sequence[Member], call: Callable[[Any], ray.ObjectRef], timeout_s: float) -> dict[int, Any]:
        """Make ``call`` (a control-group method) on every one of ``members`` at once; their
        answers by worker id after at most ``timeout_s``, None for one that did not answer in
        time or is dead."""
        refs = {m.info.worker: call(m.actor) for m in members}
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out: dict[int, Any] = {}
        for worker, ref in refs.items():
            try:
                out[worker] = ray.get(ref, timeout=0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
                out[worker] = None
        return out

    def abort_all(self, generation: int, pending: Sequence[Call], timeout_s: float) -> None:
        """Raise every member's abort flag for ``generation`` and earlier and wait (bounded)
        until ``pending`` calls end; they end in errors, which are expected and dropped."""
        refs = [actor.abort.remote(generation) for actor in self.actors] + [c.handle for c in pending]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        self._followers = None  # aborted: the followers' run ends in an error

    def _kill(self, member: Member) -> None:
        ray.kill(member.actor, no_restart=True)

    def _retire(self, member: Member) -> None:
        self.placement.retire(member.slot)

    # Ray's errors killing an actor or releasing its placement group, as WorkerGroupErrors.
    kill = ray_errors_as_group_errors(Membership.kill)
    remove = ray_errors_as_group_errors(Membership.remove)

    @ray_errors_as_group_errors
    def fill_slots(self, dead_nodes: set[str]) -> int:
        """Start an actor in every free slot (up to ``capacity`` slots, reserved as needed; none
        on a node in ``dead_nodes`` or that failed lately: ``SlotPlacement.free``). Returns how
        many actors were started."""
        taken = {m.slot for m in self.members} | {j.slot for j in self.joiners}
        free = self.placement.free(self.capacity, taken, dead_nodes)
        for slot in free:
            actor, worker = self._new_actor(slot)
            self.joiners.append(Joiner(actor, worker, slot, actor.describe.remote()))
        return len(free)

    def ready_joiners(self, timeout_s: float = 0.0) -> list[Member]:
        """Joiners that finished loading (waiting up to ``timeout_s`` for at least one), removed
        from ``joiners``; joiners that died are dropped and their slot retried later."""
        if not self.joiners:
            return []
        refs = [j.ready for j in self.joiners]
        ray.wait(refs, num_returns=1, timeout=timeout_s)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out: list[Member] = []
        for joiner in [j for j in self.joiners if j.ready in ready]:
            self.joiners.remove(joiner)
            try:
                out.append(Member(joiner.actor, ray.get(joiner.ready, timeout=0), joiner.slot))
            except ray.exceptions.RayError:
                ray.kill(joiner.actor, no_restart=True)
                self.placement.failed(joiner.slot)
        return out

    @ray_errors_as_group_errors
    def restore(self, root: str, name: str, manifest: dict[str, Any]) -> None:
        """Load checkpoint ``name``: rank 0 the training state (the others take it from rank 0
        when the group forms), or with sharded state every rank the slice it will own, and
        every rank its saved top-k residuals."""
        self.release_followers()
        world, sharded = len(self.members), self.job.sharding.enabled
        self._gather(
            [
                Call(m.info.worker, m.actor.restore.remote(root, name, manifest, rank, rank == 0 or sharded, world))
                for rank, m in enumerate(self.members)
            ],
            self.timeouts.checkpoint_s,
            "restore",
        )

    @ray_errors_as_group_errors
    def snapshot(self, requests: Sequence[SnapshotRequest], timeout_s: float) -> tuple[list[Call], list[Call]]:
        self.release_followers()  # a snapshot runs between two steps, off the published plans
        members = self.members[: len(requests)]
        copies = [Call(m.info.worker, m.actor.snapshot.remote(r)) for m, r in zip(members, requests)]
        return copies, self.await_writes(requests, timeout_s)

    def await_writes(self, requests: Sequence[SnapshotRequest], timeout_s: float) -> list[Call]:
        members = self.members[: len(requests)]
        return [Call(m.info.worker, m.actor.checkpoint_written.remote(r.name, r.tag, timeout_s)) for m, r in zip(members, requests)]

    def cancel_writes(self, workers: Sequence[int], name: str, tag: str) -> None:
        for member in self.members:
            if member.info.worker in workers:
                try:  # best effort, never waited for: its error, if it died, is of no use
                    member.actor.cancel_checkpoint.remote(name, tag)
                except (ray.exceptions.RayError, RuntimeError):  # Ray itself gone (the job's end after a failure)
                    return

    def evaluate(self, timeout_s: float) -> dict[str, float]:
        """Rank 0's evaluation metrics ({} without an eval dataset)."""
        self.release_followers()
        return self._gather([Call(self.workers[0], self.actors[0].evaluate.remote())], timeout_s, "evaluate")[0]

    def model_state(self, timeout_s: float) -> dict[str, Any]:
        """Rank 0's parameters and buffers, on the CPU."""
        self.release_followers()
        return self._gather([Call(self.workers[0], self.actors[0].model_state.remote())], timeout_s, "model_state")[0]

    def _gather(self, calls: list[Call], timeout_s: float, what: str) -> list[Any]:
        """Results of ``calls`` in order, raising the first CallFailed as soon as any call fails
        (not after the others, which may be blocked waiting for the failed one), and
        WorkerGroupError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pending = list(calls)
        while pending:
            ended, pending = self.wait(pending, 1, deadline - time.monotonic())
            if not ended:
                raise WorkerGroupError(f"workers did not finish '{what}' within {timeout_s:.0f}s")
            self.result(ended[0])  # raises the call's error
        return [self.result(c) for c in calls]

    def shutdown(self) -> None:
        """Kill every actor and release the placement groups. Safe to call twice."""
        for actor in self.actors + [j.actor for j in self.joiners]:
            ray.kill(actor, no_restart=True)
        self.members, self.joiners = [], []
        self.placement.release()
