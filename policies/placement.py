"""Whether a job's workers can ever be placed on a cluster that cannot grow. Pure: no Ray.

A local Ray that ringleader started (or ``--local-nodes``) has fixed totals; a job asking for
more would wait its whole start timeout for resources that never come. Asked once, before
anything is reserved; a real cluster (which may autoscale) is never judged this way.
"""

from __future__ import annotations

from typing import Mapping


def unplaceable(bundle: Mapping[str, float], count: int, nodes: list[Mapping[str, float]]) -> str | None:
    """Why ``count`` bundles of ``bundle`` (resource -> amount) can never fit on ``nodes`` (each
    node's total resources), or None if they might. Checks that one bundle fits on some node
    and that the bundles fit in the nodes' totals, resource by resource, counting whole bundles
    per node (a bundle cannot span nodes)."""
    needed = {name: amount for name, amount in bundle.items() if amount > 0}
    if not needed:
        return None
    fits_per_node = [
        min(int(node.get(name, 0.0) / amount + 1e-9) for name, amount in needed.items()) for node in nodes
    ]
    have = {name: sum(node.get(name, 0.0) for node in nodes) for name in needed}
    if sum(fits_per_node) >= count:
        return None
    short = {name: f"{count * amount:g} needed, {have[name]:g} in the cluster" for name, amount in needed.items()}
    return (
        f"{count} worker(s) x {dict(needed)} can never be placed: the cluster has {len(nodes)} node(s) with "
        f"{[{k: node.get(k, 0.0) for k in needed} for node in nodes]} ({short}), and at most "
        f"{sum(fits_per_node)} such worker(s) fit; lower scaling.workers or scaling.resources_per_worker"
    )
