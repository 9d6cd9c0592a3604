"""The simulation: N workers training step by step, failures arriving as events in wall time,
and each contender's response, on the policy classes the real jobs run.

Per step, every live worker's seconds per shard is its node's steady speed times this step's
slowdowns (``simulator/cluster.py``). How long the step's compute takes depends on the
contender:

* ``restart_world`` and ``no_mitigation``: shards dealt evenly, the step waits for the slowest
  worker (synchronous data parallelism as DDP runs it);
* ``ringleader``: shards dealt by the ``Rebalancer``; idle workers steal unstarted shards and
  back up late ones, which the simulation takes as fluid: the step ends when the shards' total
  work is done at the workers' combined speed, plus one median shard for the last pieces, and
  never later than the plan without stealing. The ``StragglerDetector`` and ``SlowEviction``
  see the step's telemetry (seconds per shard, arrival) and evict as they would for real.

Then the exposed all-reduce (``policies/collective_cost.py``: the buckets of the gradient,
reduced as backward produces them) and, for the contenders ringleader drives, the driver's
floor (``control_plane``: it works ahead of the workers, so a step is never shorter than its cost;
restart-the-world's workers run their own loop and have none). Failures (node MTBF) cost the in-place
contenders the interrupted step, ``detect_s`` and ``reform_s``; the node's workers are gone
until a replacement joins ``replacement_s`` later (``join_s`` at a step boundary), and until
then the others carry the whole batch. ``restart_world`` loses every step since its last
checkpoint and ``restart_s``. Checkpoints hold training up ``snapshot_s`` (ringleader's
interval: its ``CheckpointInterval`` policy, Young/Daly on what it measures) or
``checkpoint_s`` (restart_world: Young/Daly for the true MTBF unless fixed).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from policies.checkpoint_interval import CheckpointInterval
from policies.collective_cost import Fabric, Link, allreduce_s, bucket_sizes, exposed_s
from policies.straggler_policies import StepColumns, StragglerPolicies
from simulator.cluster import HOUR_S, Slowdowns, base_shard_s, failure_times
from simulator.scenario import Scenario

# Failures are drawn up to this many times the failure-free run's length (a run that needs
# longer than that is one the model cannot describe anyway).
HORIZON_FACTOR = 20.0
# Steps between points of the progress timeline (the plot).
TIMELINE_POINTS = 400


@dataclass
class Outcome:
    """One contender's run: ``steps`` committed in ``wall_s``; ``goodput`` = steps x the ideal
    step (every worker at nominal speed, nothing failing) / wall; ``idle_fraction`` of the
    workers' capacity (N x wall) spent not computing; ``recovery_s`` per failure, from the
    failure until the step it interrupted is committed; ``redone_steps`` (restart: lost since
    the checkpoint); ``policy_cpu_ms`` per step spent in the straggler policies; ``timeline``:
    (hours, steps) points."""

    contender: str
    steps: int
    wall_s: float
    ideal_step_s: float
    idle_fraction: float
    failures: int
    recovery_s: list[float]
    redone_steps: int
    checkpoints: int
    evictions: int
    rebalances: int
    policy_cpu_ms: float
    timeline: list[tuple[float, int]] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.steps * self.ideal_step_s / self.wall_s if self.wall_s else 0.0

    def recovery_percentiles(self) -> dict[str, float]:
        """Count, p50, p90, p99 and max of ``recovery_s`` (count and a max of 0 when none)."""
        if not self.recovery_s:
            return {"count": 0, "max": 0.0}
        recovery = np.array(self.recovery_s)
        return {
            "count": len(self.recovery_s), **{f"p{q}": float(np.percentile(recovery, q)) for q in (50, 90, 99)},
            "max": float(recovery.max()),
        }

    def to_json(self) -> dict[str, object]:
        return {
            "contender": self.contender, "steps": self.steps, "wall_h": self.wall_s / HOUR_S,
            "goodput": self.goodput, "idle_fraction": self.idle_fraction, "failures": self.failures,
            "recovery_s": self.recovery_percentiles(),
            "redone_steps": self.redone_steps, "checkpoints": self.checkpoints, "evictions": self.evictions,
            "rebalances": self.rebalances, "policy_cpu_ms_per_step": self.policy_cpu_ms,
            "timeline": [[round(h, 5), s] for h, s in self.timeline],
        }


class StepCosts:
    """What a step costs beside compute, by live worker and node count (cached)."""

    def __init__(self, scenario: Scenario) -> None:
        cost = scenario.collective
        self.fabric = Fabric(
            intra=Link(cost.intra.latency_us * 1e-6, cost.intra.bandwidth_gb_s * 1e9),
            inter=Link(cost.inter.latency_us * 1e-6, cost.inter.bandwidth_gb_s * 1e9),
        )
        self.buckets = bucket_sizes(cost.gradient_mb * 1e6, cost.bucket_mb * 1e6)
        self.algorithm = cost.algorithm
        self.backward_s = scenario.workload.compute_s * scenario.workload.backward_share
        self.control = scenario.control_plane

    @lru_cache(maxsize=None)
    def exposed_comm_s(self, workers: int, nodes: int) -> float:
        per_bucket = [allreduce_s(self.algorithm, b, workers, nodes, self.fabric) for b in self.buckets]
        return exposed_s(per_bucket, self.backward_s)

    def driver_s(self, workers: int) -> float:
        return (self.control.fixed_ms + self.control.per_worker_ms * workers) / 1e3


class Run:
    """One contender through the scenario (``simulate`` makes and runs them)."""

    def __init__(self, scenario: Scenario, contender: str) -> None:
        self.scenario = scenario
        self.contender = contender
        self.in_place = contender != "restart_world"
        stragglers = scenario.stragglers
        self.mitigating = contender == "ringleader" and stragglers.mitigation
        self.rebalancing = self.mitigating and stragglers.rebalance
        self.stealing = self.mitigating and (stragglers.steal or stragglers.speculate)
        self.evicting = self.mitigating and stragglers.evict
        self.n = scenario.workers
        self.per_node = scenario.workers_per_node
        self.total_shards = scenario.workload.shards_per_worker * self.n
        self.base = base_shard_s(scenario)
        self.slowdowns = Slowdowns(scenario)
        self.costs = StepCosts(scenario)
        self.alive = np.ones(self.n, bool)
        self.retired = np.zeros(self.n, bool)  # evicted: their slots are not refilled
        # The ideal step: every worker at nominal speed, the all-reduce's exposed tail, no
        # driver (torchrun and Ray Train have none per step: their workers run the loop).
        self.ideal_step_s = scenario.workload.compute_s + self.costs.exposed_comm_s(self.n, scenario.nodes)
        horizon = HORIZON_FACTOR * scenario.steps * self.ideal_step_s + 10 * HOUR_S
        self.failures = failure_times(scenario, horizon)
        self.joins: list[tuple[float, int]] = []  # (when, node) replacements due
        self.policies = StragglerPolicies(self.total_shards, **scenario.stragglers.policy_kwargs())
        self.checkpoints = self._checkpoint_policy()
        self.clock = 0.0
        self.idle_s = 0.0  # worker-seconds
        self.step = 0
        self.last_checkpoint = 0
        self.outcome = Outcome(contender, 0, 0.0, self.ideal_step_s, 0.0, 0, [], 0, 0, 0, 0, 0.0)
        self._regroup()

    def _checkpoint_policy(self) -> CheckpointInterval:
        restart = self.scenario.restart
        if self.in_place:
            policy = CheckpointInterval(None)  # the job's default: Young/Daly on what it measures
            policy.observe_checkpoint(self.scenario.snapshots.snapshot_s)
            return policy
        if restart.checkpoint_every_steps is not None:
            return CheckpointInterval(restart.checkpoint_every_steps)
        mtbf_h = self.scenario.failures.node_mtbf_h
        mtbf_s = mtbf_h * HOUR_S / self.scenario.nodes if mtbf_h else 1e12
        return CheckpointInterval(max(1, round(math.sqrt(2.0 * restart.checkpoint_s * mtbf_s) / self.ideal_step_s)))

    def _regroup(self) -> None:
        """The group changed: the policies start over on the live workers, as the driver's do."""
        self.ids = np.flatnonzero(self.alive)
        if len(self.ids):  # (nobody left: they start over when a replacement joins)
            self.policies.regroup(self.ids.tolist(), np.flatnonzero(~self.alive).tolist())

    def _node(self, node: int) -> slice:
        """The workers of ``node`` (ranks are dealt node by node)."""
        return slice(node * self.per_node, (node + 1) * self.per_node)

    def _charge(self, seconds: float) -> None:
        """Everyone waits ``seconds`` (recovery, checkpoint, restart)."""
        self.clock += seconds
        self.idle_s += self.n * seconds

    def _compute(self, shard_s: np.ndarray) -> tuple[float, float, np.ndarray, np.ndarray]:
        """(step compute seconds, busy worker-seconds, shards per live worker, arrival)."""
        if self.rebalancing:
            counts = self.policies.rebalancer.count_array
        else:
            share, extra = divmod(self.total_shards, len(shard_s))
            counts = np.full(len(shard_s), share)
            counts[:extra] += 1
        planned = counts * shard_s
        if not self.stealing:
            return float(planned.max()), float(planned.sum()), counts, planned
        fluid = self.total_shards / float(np.sum(1.0 / shard_s))
        seconds = min(float(planned.max()), fluid + float(np.median(shard_s)))
        return seconds, min(fluid, seconds) * len(shard_s), counts, np.minimum(planned, seconds)

    def _observe(self, shard_s: np.ndarray, counts: np.ndarray, arrival: np.ndarray) -> None:
        started = time.process_time()
        decided = self.policies.observe(
            self.step, StepColumns(self.ids, counts, shard_s, arrival), rebalance=self.rebalancing, evict=self.evicting
        )
        self._policy_s += time.process_time() - started
        self.outcome.rebalances += decided.rebalance is not None
        evict = decided.evict
        if evict and len(self.ids) - len(evict) >= 1:
            for e in evict:
                self.alive[e.worker] = False
                self.retired[e.worker] = True
            self.outcome.evictions += len(evict)
            self._charge(self.scenario.recovery.reform_s)  # drained, re-formed without them
            self._regroup()

    def _failing_within(self, seconds: float) -> bool:
        """Whether a failure comes before ``seconds`` from now."""
        return self._next_failure is not None and self._next_failure[0] < self.clock + seconds

    def _past_events(self) -> bool:
        """Handle the failures and joins due by now, in time order (those that came while a
        recovery, restart, join or checkpoint was being charged, or that cut a step or a
        checkpoint short); True if there was any."""
        handled = False
        while True:
            fail_at = self._next_failure[0] if self._next_failure is not None else math.inf
            join_at = min((when for when, _ in self.joins), default=math.inf)
            if min(fail_at, join_at) > self.clock:
                return handled
            handled = True
            if join_at <= fail_at:
                self._join(join_at)
            else:
                when, node = self._next_failure  # type: ignore[misc]
                self._next_failure = next(self._failures, None)
                self._fail(when, node)

    def _fail(self, when: float, node: int) -> None:
        """A node failed at ``when`` (<= now); a node already down, waiting for its
        replacement, cannot: nothing happens."""
        workers = self._node(node)
        if not self.alive[workers].any():
            return
        self.outcome.failures += 1
        # Overlapping recoveries (a failure before the last one is over) count as one, from the first.
        started, target = self._recovering or (when, self.step)
        self._recovering = (started, max(target, self.step))
        if self.in_place:
            recovery = self.scenario.recovery
            self._charge(recovery.detect_s + recovery.reform_s)
            self.alive[workers] = False
            self.joins.append((when + recovery.replacement_s, node))
            self._regroup()
            self.checkpoints.observe_failure()
        else:
            self.outcome.redone_steps += self.step - self.last_checkpoint
            self.step = self.last_checkpoint
            self._charge(self.scenario.restart.restart_s)

    def _join(self, until: float) -> None:
        """The replacements due by ``until`` join at this step boundary."""
        due = [node for when, node in self.joins if when <= until]
        self.joins = [(when, node) for when, node in self.joins if when > until]
        for node in due:
            workers = self._node(node)
            self.alive[workers] = ~self.retired[workers]
        self._charge(self.scenario.recovery.join_s)
        self._regroup()

    def run(self) -> Outcome:
        scenario = self.scenario
        self._policy_s = 0.0
        self._recovering: tuple[float, int] | None = None
        self._failures = iter(self.failures)
        self._next_failure = next(self._failures, None)
        every = max(1, scenario.steps // TIMELINE_POINTS)
        timeline = [(0.0, 0)]
        while self.step < scenario.steps:
            if self._past_events():
                continue
            if not len(self.ids):  # every node down: nothing runs until a replacement joins
                if not self.joins:
                    raise RuntimeError(f"{self.contender}: no worker left and none coming (every slot evicted)")
                self._charge(min(when for when, _ in self.joins) - self.clock)
                continue
            self.checkpoints.observe_elapsed(self.clock)
            if self.step > self.last_checkpoint and self.checkpoints.due(self.step - self.last_checkpoint):
                cost = scenario.snapshots.snapshot_s if self.in_place else scenario.restart.checkpoint_s
                if self._failing_within(cost):  # the checkpoint never completes
                    self._charge(self._next_failure[0] - self.clock)
                    continue
                self._charge(cost)
                self.last_checkpoint = self.step
                self.outcome.checkpoints += 1
            factors = self.slowdowns.factors()
            shard_s = self.base[self.ids] * factors[self.ids]
            compute_s, busy_s, counts, arrival = self._compute(shard_s)
            workers, nodes = len(self.ids), len(np.unique(self.ids // self.per_node))
            step_s = compute_s + self.costs.exposed_comm_s(workers, nodes)
            if self.in_place:  # ringleader's driver submits every step: never faster than it
                step_s = max(step_s, self.costs.driver_s(workers))
            if self._failing_within(step_s):
                self._charge(self._next_failure[0] - self.clock)  # the step's work is lost
                continue
            self.clock += step_s
            self.idle_s += self.n * step_s - busy_s
            self.step += 1
            self.checkpoints.observe_step(step_s)
            if self._recovering is not None and self.step > self._recovering[1]:
                self.outcome.recovery_s.append(self.clock - self._recovering[0])
                self._recovering = None
            if self.mitigating:
                self._observe(shard_s, counts, arrival)
            if self.step % every == 0:
                timeline.append((self.clock / HOUR_S, self.step))
        outcome = self.outcome
        outcome.steps, outcome.wall_s = self.step, self.clock
        outcome.idle_fraction = self.idle_s / (self.n * self.clock) if self.clock else 0.0
        outcome.policy_cpu_ms = 1e3 * self._policy_s / max(1, self.step)
        outcome.timeline = timeline
        return outcome


def simulate(scenario: Scenario) -> list[Outcome]:
    """Every contender of ``scenario`` through it, in its order."""
    return [Run(scenario, contender).run() for contender in scenario.contenders]
