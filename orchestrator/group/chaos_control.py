"""The driver's half of chaos: faults a worker cannot inflict on itself.

``ray_kill`` and ``remove_node`` kills strike while the step runs (once the victim reports it is
computing it); nodes are added at a step boundary. Workers SIGKILL themselves (``sigkill``, see
``workers/runtime/chaos.py``) and leave their time of death in the driver's store, read here.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Callable

from jobspec.chaos import ChaosConfig, KillChaos
from jobspec.wire import Phase
from orchestrator.group.interface import WorkerGroup
from orchestrator.store.rendezvous import RendezvousStore
from workers.runtime.chaos import death_key

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

# How long a strike waits for its victim to start the step before striking anyway.
STRIKE_WAIT_S = 10.0
POLL_S = 0.01


class ChaosError(RuntimeError):
    """A chaos entry cannot be carried out (e.g. removing the head node)."""


class ChaosControl:
    """Carries out ``chaos.kill`` (ray_kill, remove_node) and ``chaos.add_node``.

    ``cluster`` is the local ``ray.cluster_utils.Cluster`` (``--local-nodes``), or None (then
    ``run_job`` has refused node chaos), and ``node_cpus`` the CPUs of each of its nodes (added
    nodes get as many); ``event`` records what was done. ``killed_at`` maps worker id to its
    time of death (``time.time()``) for kills the driver made or read back.
    """

    def __init__(
        self, chaos: ChaosConfig, cluster: Cluster | None, node_cpus: float, event: Callable[..., None]
    ) -> None:
        self.cluster = cluster
        self.node_cpus = node_cpus
        self.event = event
        self.killed_at: dict[int, float] = {}
        self.dead_nodes: set[str] = set()
        self._kills = [k for k in chaos.kill if k.how != "sigkill"]
        self._self_kills = [k for k in chaos.kill if k.how == "sigkill"]
        self._adds = list(chaos.add_node)

    def at_boundary(self, step: int) -> None:
        """Add the nodes due before ``step``. Blocking (a simulated node starts in seconds):
        ``ray.cluster_utils.Cluster`` sets signal handlers, so only the main thread may."""
        if self.cluster is None:
            return
        for add in [a for a in self._adds if a.at_step <= step]:
            self._adds.remove(add)
            node = self.cluster.add_node(num_cpus=self.node_cpus)
            self.event("chaos", action="add_node", at_step=step, node=node.node_id, num_cpus=self.node_cpus)

    def acts_at(self, step: int) -> bool:
        """Whether a batch of steps handed out at once must end in front of ``step`` for chaos
        to strike as written: a node added at that boundary; a kill in that step or the two
        after it (the kill's step and the next run alone, so the victim is in it or at most
        one step on when the driver strikes, as with one step per call)."""
        return any(a.at_step <= step for a in self._adds) or any(k.at_step <= step <= k.at_step + 2 for k in self._kills)

    def during_step(self, group: WorkerGroup, step: int) -> None:
        """Strike the ``ray_kill``/``remove_node`` kills due in ``step``, once the victim is in it."""
        for kill in [k for k in self._kills if k.at_step == step]:
            self._kills.remove(kill)
            victim = kill.worker
            if victim is not None and victim not in group.workers:
                self._skipped(kill, f"worker {victim} is not in the group at step {step} (dead, evicted or not started)")
                continue
            if victim is not None:
                self._wait_until_in_step(group, victim, step)
            if kill.how == "ray_kill":
                assert victim is not None  # validated: only remove_node may name a node instead
                self.killed_at[victim] = time.time()
                group.kill(victim)
                self.event("chaos", action="ray_kill", at_step=step, worker=victim)
            else:
                self._remove_node(group, kill, step)

    def _skipped(self, kill: KillChaos, reason: str) -> None:
        """A fault test must not pass by its fault not happening: say so."""
        self.event("chaos_skipped", kill=kill.model_dump(mode="json"), reason=reason)

    def finish(self, store: RendezvousStore) -> None:
        """At the job's end: report every kill that never struck (its step never ran; a worker
        that never reached its kill point, e.g. ``during: checkpoint`` with no checkpoint
        after ``at_step``)."""
        for kill in self._kills:
            self._skipped(kill, f"step {kill.at_step} never ran")
        for kill in self._self_kills:
            if kill.worker is not None and kill.worker not in self.killed_at and store.read(death_key(kill.worker)) is None:
                self._skipped(kill, f"worker {kill.worker} never reached its kill point ({kill.during} at or after step {kill.at_step})")
        self._kills, self._self_kills = [], []

    def _wait_until_in_step(self, group: WorkerGroup, worker: int, step: int) -> None:
        deadline = time.monotonic() + STRIKE_WAIT_S
        while time.monotonic() < deadline:
            report = group.progress(timeout_s=1.0).get(worker)
            if report is None or report.step > step or (report.step == step and report.phase is not Phase.STALL):
                return
            time.sleep(POLL_S)

    def _remove_node(self, group: WorkerGroup, kill: KillChaos, step: int) -> None:
        assert self.cluster is not None
        nodes = self.cluster.list_all_nodes()
        if kill.node is not None:
            if kill.node >= len(nodes):
                raise ChaosError(f"chaos.kill: node {kill.node} does not exist (the cluster has {len(nodes)} nodes)")
            node = nodes[kill.node]
        else:
            where = {info.worker: info.node_id for info in group.info}
            node = next(n for n in nodes if n.node_id == where[kill.worker])
        if node.head:
            raise ChaosError("chaos.kill: the head node holds the driver and cannot be removed; name another node")
        # A machine that dies takes its processes with it. A simulated node's raylet dies at once
        # but its workers would linger for seconds, still answering: kill them first.
        now = time.time()
        victims = [info for info in group.info if info.node_id == node.node_id]
        if not victims:
            self._skipped(kill, f"node {kill.node} holds no worker of this job at step {step}")
            return
        for info in victims:
            self.killed_at[info.worker] = now
            _kill_pid(info.pid)
        self.cluster.remove_node(node, allow_graceful=False)
        self.dead_nodes.add(node.node_id)
        self.event(
            "chaos", action="remove_node", at_step=step, node=node.node_id, workers=[i.worker for i in victims]
        )

    def death_time(self, store: RendezvousStore, worker: int) -> float | None:
        """When ``worker`` was killed by chaos (its own record, or the driver's), else None."""
        if worker in self.killed_at:
            return self.killed_at[worker]
        recorded = store.read(death_key(worker))
        return float(recorded) if recorded is not None else None


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

