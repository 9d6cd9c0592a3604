"""The simulated cluster's randomness: each worker's speed from step to step and the failures.
Every contender draws from its own generator seeded alike, so they see the same fleet, the
same failure times and statistically the same slowdowns."""

from __future__ import annotations

import numpy as np

from simulator.scenario import Scenario

HOUR_S = 3600.0


def base_shard_s(scenario: Scenario) -> np.ndarray:
    """Seconds per shard of each worker at its node's steady speed: node types dealt over the
    nodes in order of their fractions, then ``slow_nodes.count`` nodes (the last ones) slower."""
    nodes = scenario.nodes
    speed = np.empty(nodes)
    start = 0
    for i, kind in enumerate(scenario.node_types):
        end = nodes if i == len(scenario.node_types) - 1 else start + round(kind.fraction * nodes)
        speed[start:end] = kind.speed
        start = end
    if scenario.slow_nodes.count:
        speed[nodes - scenario.slow_nodes.count :] /= scenario.slow_nodes.factor
    nominal = scenario.workload.compute_s / scenario.workload.shards_per_worker
    return np.repeat(nominal / speed, scenario.workers_per_node)


def failure_times(scenario: Scenario, horizon_s: float) -> list[tuple[float, int]]:
    """``(seconds, node)`` of every failure up to ``horizon_s``: the fixed ``failures.at_s``, or
    a Poisson process at ``nodes / node_mtbf`` per second (a failed node's replacement is
    another node, so the rate stays), each hitting a node drawn uniformly."""
    rng = np.random.default_rng([scenario.seed, 1])
    failures = scenario.failures
    if failures.at_s:
        times = sorted(failures.at_s)
    elif failures.node_mtbf_h is None:
        times = []
    else:
        rate = scenario.nodes / (failures.node_mtbf_h * HOUR_S)
        times, now = [], 0.0
        while (now := now + rng.exponential(1.0 / rate)) < horizon_s:
            times.append(now)
    return [(t, int(rng.integers(scenario.nodes))) for t in times]


class Slowdowns:
    """Transient slowdown episodes and step-to-step jitter, drawn per step for every worker."""

    def __init__(self, scenario: Scenario) -> None:
        self.transient = scenario.transient
        self.jitter = scenario.workload.jitter
        self.rng = np.random.default_rng([scenario.seed, 2])
        self.left = np.zeros(scenario.workers, np.int64)  # steps left in each worker's episode
        # Starting an episode with this chance per step keeps ``fraction`` of the workers in one.
        fraction, mean = self.transient.fraction, self.transient.mean_steps
        self.start_p = fraction / (mean * (1 - fraction) + fraction) if fraction else 0.0

    def factors(self) -> np.ndarray:
        """This step's compute-time multiplier per worker (>= 1 in an episode, jittered)."""
        if self.start_p:
            starting = (self.left == 0) & (self.rng.random(self.left.size) < self.start_p)
            self.left[starting] = self.rng.geometric(1.0 / self.transient.mean_steps, int(starting.sum()))
        factor = np.where(self.left > 0, self.transient.factor, 1.0)
        np.maximum(self.left - 1, 0, out=self.left)
        if self.jitter:
            factor = factor * self.rng.lognormal(0.0, self.jitter, self.left.size)
        return factor
