"""Fault and slowness injection (``chaos``): slow and stalled workers, kills, nodes joining."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from jobspec.fields import StrictModel


class _WorkerChaos(StrictModel):
    """A chaos entry aimed at one worker by its ``worker`` id: its rank at job start (worker
    ids never repeat, so a replacement is never hit by chaos meant for the worker it replaces).

    The field used to be called ``rank``, which it is not once the group has re-formed; the old
    name is still accepted, with a FutureWarning (users of the CLI see it).
    """

    #: The entry's list in ``chaos`` (``slow``, ``stall``, ``kill``), for messages.
    _kind: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _rank_is_worker(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "rank" not in data:
            return data
        if "worker" in data:
            raise ValueError(
                f"chaos.{cls._kind}: set 'worker' only ('rank' is its deprecated old name), "
                f"got both: worker {data['worker']!r}, rank {data['rank']!r}"
            )
        warnings.warn(
            f"chaos.{cls._kind}: 'rank' is deprecated, use 'worker' (the worker id: its rank at job start)",
            FutureWarning,  # not DeprecationWarning: that one is hidden from the CLI's users
        )
        moved = {key: value for key, value in data.items() if key != "rank"}
        moved["worker"] = data["rank"]
        return moved


class SlowChaos(_WorkerChaos):
    """Worker ``worker`` (the worker id: its rank at job start) computes ``factor`` times
    slower in steps ``from_step`` up to, not including, ``to_step`` (null: to the end):
    before each pass it sleeps (factor - 1) x ``shard_s`` per shard, or, if that is null, x
    its own compute per shard measured before the slowdown began."""

    _kind = "slow"

    worker: int = Field(ge=0, description="the worker id: its rank at job start")
    factor: float = Field(gt=1)
    from_step: int = Field(0, ge=0)
    to_step: int | None = Field(None, ge=1)
    shard_s: float | None = Field(None, gt=0, description="seconds of compute per shard the slowdown multiplies")

    @model_validator(mode="after")
    def _ordered(self) -> "SlowChaos":
        if self.to_step is not None and self.to_step <= self.from_step:
            raise ValueError(f"to_step ({self.to_step}) must be after from_step ({self.from_step})")
        return self


#: What a stall holds up (docs/architecture.md, "Rescue"): ``fetch``, the worker's wait for
#: its step's data before it takes its shards (its peers can take them and the worker stops
#: waiting); ``compute``, the worker itself after it has sealed its shards (everyone waits).
StallPoint = Literal["fetch", "compute"]


class StallChaos(_WorkerChaos):
    """Worker ``worker`` (the worker id: its rank at job start) is held up for ``seconds`` in
    step ``at_step``, ``during`` its data fetch (before it takes its shards) or its compute
    (after it has sealed them)."""

    _kind = "stall"

    worker: int = Field(ge=0, description="the worker id: its rank at job start")
    at_step: int = Field(ge=0)
    seconds: float = Field(gt=0)
    during: StallPoint = "fetch"


class RandomStalls(StrictModel):
    """Transient stalls at random: each step of each worker stalls with ``probability`` for
    ``seconds``, ``during`` its fetch or compute (as in StallChaos). Drawn from ``seed``, the
    worker id and the step alone, so every run (and the benchmark's peers) sees the same ones."""

    probability: float = Field(gt=0, le=1)
    seconds: float = Field(gt=0)
    seed: int = 0
    during: StallPoint = "fetch"


#: Where a worker can SIGKILL itself (``KillChaos.during``).
KillPoint = Literal["step", "checkpoint", "rejoin", "reshard"]


class KillChaos(_WorkerChaos):
    """Kill a worker at step ``at_step``: worker ``worker`` (the worker id: its rank at job
    start), or for ``remove_node`` the simulated node ``node`` (1..N-1 of ``--local-nodes N``;
    0 is the head, which holds the driver) or the node that runs ``worker``.

    ``how``: ``sigkill`` (the worker SIGKILLs itself, like a crash or the OOM killer),
    ``ray_kill`` (the driver calls ``ray.kill`` while the step runs) or ``remove_node`` (the
    driver takes the whole simulated node away, with every worker on it; needs local nodes).
    ``during`` (``sigkill`` only): in the step's all-reduce (``step``), while writing the first
    checkpoint taken after ``at_step`` (``checkpoint``), or in the first re-forming of the
    group at or after ``at_step`` (``rejoin``: a failure during recovery), or inside the move of
    sharded optimizer state in the first re-forming from a step at or after ``at_step``
    (``reshard``: after every rank has planned the move, before this one sends or receives). A
    kill that never strikes (its worker gone, its point never reached) is reported as
    ``chaos_skipped``.
    """

    _kind = "kill"

    at_step: int = Field(ge=0)
    worker: int | None = Field(None, ge=0, description="the worker id: its rank at job start")
    node: int | None = Field(None, ge=1)
    how: Literal["sigkill", "ray_kill", "remove_node"] = "sigkill"
    during: KillPoint = "step"

    @model_validator(mode="after")
    def _target(self) -> "KillChaos":
        if (self.worker is None) == (self.node is None):
            raise ValueError("set exactly one of 'worker' and 'node'")
        if self.node is not None and self.how != "remove_node":
            raise ValueError(f"'node' needs how: remove_node (got how: {self.how})")
        if self.during != "step" and self.how != "sigkill":
            raise ValueError(f"during: {self.during} needs how: sigkill (got how: {self.how})")
        return self


class AddNodeChaos(StrictModel):
    """Add a simulated node (as big as the others) at the boundary before step ``at_step``;
    needs ``--local-nodes``."""

    at_step: int = Field(ge=0)


class ChaosConfig(StrictModel):
    """Fault and slowness injection, for tests and demos.

    ``shuffle_shards``: deal each step's shards to workers at random (seeded, uneven counts,
    some workers may get none) instead of by the rebalancer; the result must not change.
    ``slow``/``stall``: make a worker (by its worker id) really compute slower, or stop, in
    given steps; ``stalls``: random transient stalls of every worker (null: none).
    ``kill``/``add_node``: worker and node failures, and nodes joining (see KillChaos).
    """

    shuffle_shards: bool = False
    slow: list[SlowChaos] = Field(default_factory=list)
    stall: list[StallChaos] = Field(default_factory=list)
    stalls: RandomStalls | None = None
    kill: list[KillChaos] = Field(default_factory=list)
    add_node: list[AddNodeChaos] = Field(default_factory=list)

    @property
    def needs_local_nodes(self) -> bool:
        return bool(self.add_node) or any(k.how == "remove_node" for k in self.kill)
