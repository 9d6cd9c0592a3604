"""Worker actors in a placement group, and the driver-hosted rendezvous store they meet at."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.config import ScalingConfig, TimeoutConfig
from policies.work_stealing import StepPlan
from workers.actor import TrainWorker, WorkerSpec

RemoteTrainWorker = ray.remote(concurrency_groups={"compute": 1, "control": 1})(TrainWorker)


class WorkerGroupError(RuntimeError):
    """Workers could not be placed, started or did not answer in time."""


class RendezvousStore:
    """A TCPStore in the driver process, so no worker is a single point of failure.

    Each process group formed through it uses a fresh key prefix (its generation).
    """

    #: The current generation's view of the store, where shard claims live (set by next_prefix).
    claims: dist.Store

    def __init__(self, timeout_s: float) -> None:
        self.host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(
            self.host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self.port = self._store.port
        self.generation = 0

    def next_prefix(self) -> str:
        self.generation += 1
        prefix = f"gen{self.generation}/"
        self.claims = dist.PrefixStore(prefix, self._store)
        return prefix


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


class WorkerGroup:
    """Starts, drives and tears down the worker actors of one job."""

    def __init__(self, spec: WorkerSpec, scaling: ScalingConfig, timeouts: TimeoutConfig) -> None:
        self.spec = spec
        self.scaling = scaling
        self.timeouts = timeouts
        self.actors: list[Any] = []
        self.placement: PlacementGroup | None = None
        self.info: list[dict[str, Any]] = []

    @property
    def size(self) -> int:
        return len(self.actors)

    def start(self, count: int) -> list[dict[str, Any]]:
        """Reserve ``count`` bundles, start one actor in each, wait until all have loaded.

        Actors are created at once and wait in Ray for their bundles, so reserving resources
        overlaps their start. Returns each actor's ``describe()``. Raises WorkerGroupError on
        a timeout (naming the resources if they could not be reserved) or a worker error.
        """
        bundle = {k: v for k, v in self.scaling.resources_per_worker.items() if v > 0}
        self.placement = placement_group([bundle] * count, strategy=self.scaling.placement_strategy)
        options = actor_options(self.scaling)
        self.actors = [
            RemoteTrainWorker.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=i
                ),
            ).remote(self.spec, i)
            for i in range(count)
        ]
        try:
            self.info = ray.get([a.describe.remote() for a in self.actors], timeout=self.timeouts.start_s)
        except ray.exceptions.GetTimeoutError:
            ready, _ = ray.wait([self.placement.ready()], timeout=0)
            if not ready:
                raise WorkerGroupError(
                    f"could not reserve {count} x {bundle} within {self.timeouts.start_s:.0f}s "
                    f"(cluster has {ray.cluster_resources()}); lower scaling.workers or "
                    "scaling.resources_per_worker"
                ) from None
            raise WorkerGroupError(f"workers did not finish 'start' within {self.timeouts.start_s:.0f}s") from None
        return self.info

    def form_group(self, store: RendezvousStore) -> None:
        """All actors join one torch.distributed group through the driver's store."""
        prefix = store.next_prefix()
        nodes = [info["node_id"] for info in self.info]  # topology for the hierarchical all-reduce
        self._get(
            [
                actor.join_group.remote(store.host, store.port, prefix, rank, nodes, self.timeouts.rendezvous_s)
                for rank, actor in enumerate(self.actors)
            ],
            self.timeouts.rendezvous_s,
            "rendezvous",
        )

    def submit_step(self, step: int, plan: StepPlan) -> list[ray.ObjectRef]:
        if len(plan.shards_by_rank) != self.size:
            raise ValueError(f"plan is for {len(plan.shards_by_rank)} ranks, group has {self.size}")
        # By value: a small plan inlined in the task beats a ray.put the workers must fetch.
        return [actor.train_step.remote(step, plan) for actor in self.actors]

    def progress(self, timeout_s: float) -> dict[int, dict[str, Any] | None]:
        """Each worker's ``progress()`` by worker id; None for one that did not answer in time."""
        refs = {info["worker"]: actor.progress.remote() for actor, info in zip(self.actors, self.info)}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out: dict[int, dict[str, Any] | None] = {}
        for worker, ref in refs.items():
            try:
                out[worker] = ray.get(ref, timeout=0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
                out[worker] = None
        return out

    def abort_all(self, pending: list[ray.ObjectRef], timeout_s: float) -> None:
        """Raise every worker's abort flag and wait (bounded) until ``pending`` steps end; they
        end in errors, which are expected and dropped."""
        aborts = [actor.abort.remote() for actor in self.actors]
        ray.wait(aborts + pending, num_returns=len(aborts) + len(pending), timeout=timeout_s)

    def remove(self, workers: list[int]) -> None:
        """Kill the actors of these worker ids and drop them from the group (ranks close up)."""
        keep = [(a, i) for a, i in zip(self.actors, self.info) if i["worker"] not in workers]
        for actor, info in zip(self.actors, self.info):
            if info["worker"] in workers:
                ray.kill(actor, no_restart=True)
        self.actors = [a for a, _ in keep]
        self.info = [i for _, i in keep]

    def call_rank(self, rank: int, method: str, timeout_s: float) -> Any:
        return self._get(getattr(self.actors[rank], method).remote(), timeout_s, method)

    def _get(self, refs: Any, timeout_s: float, what: str) -> Any:
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerGroupError(f"workers did not finish '{what}' within {timeout_s:.0f}s") from None

    def shutdown(self) -> None:
        """Kill every actor and release the placement group. Safe to call twice."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None
