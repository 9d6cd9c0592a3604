"""What a step's run records: pass results, this worker's work in a step, the step's claims
context and its rescue pass (``workers/step/runner.py`` runs them)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from policies.work_stealing import ClaimState, StepPlan
from workers.comm.gradient_reducer import GradientReducer
from workers.step.claims import ShardClaims


def _ready() -> bool:
    return True


@dataclass(frozen=True)
class PassResult:
    """A pass's loss sum, the weight normalising it and its sample count. The loss sum is a
    0-dim tensor on the worker's device once a pass ran (read after the step, from the
    census: reading it per pass would sync the host with the device); so is the weight of the
    built-in token losses (``BatchLoss.weight``)."""

    loss: float | torch.Tensor = 0.0
    weight: float | torch.Tensor = 0.0
    samples: int = 0

    def __add__(self, other: "PassResult") -> "PassResult":
        return PassResult(self.loss + other.loss, self.weight + other.weight, self.samples + other.samples)

    def __neg__(self) -> "PassResult":
        return PassResult(-self.loss, -self.weight, -self.samples)


@dataclass
class StepWork:
    """What this worker did in a step (or in its rescue pass): the shards whose gradient it
    contributes, and counts (``total``: their loss sum, weight and samples)."""

    committed: list[int] = field(default_factory=list)
    total: PassResult = PassResult()
    shards_run: int = 0  # passes' shards, including lost races and discarded backups
    compute_s: float = 0.0  # forward + backward, all passes
    slowed_s: float = 0.0  # injected slowness (chaos), part of the compute it stands for
    idle_s: float = 0.0  # waiting for other workers' shards before the all-reduce
    stalled_s: float = 0.0  # waiting for its data, and injected compute stalls (chaos)
    #: It brought nothing to the all-reduce: its block was taken before it sealed it (while
    #: it waited for its data, or when it came to seal); its shards went to the rescue pass.
    gave_up: bool = False
    #: Whether its data is there (False while a read it stopped waiting for goes on): it
    #: computes nothing in the rescue pass before.
    data_ready: Callable[[], bool] = field(default=_ready, repr=False)
    stolen: int = 0
    backups: int = 0
    backups_won: int = 0
    races_lost: int = 0
    #: Each shard's claim state as this worker last saw it, and since when (time.monotonic):
    #: how long a shard has sat in one state, as this worker observed it (no clock is shared).
    seen: dict[int, tuple[str, float]] = field(default_factory=dict, repr=False)

    def ages(self, states: dict[int, ClaimState], now: float) -> dict[int, float]:
        """Seconds each shard has been in its current state, as far as this worker has seen."""
        ages = {}
        for shard, state in states.items():
            code = state.encode()
            if self.seen.get(shard, ("", 0.0))[0] != code:
                self.seen[shard] = (code, now)
            ages[shard] = now - self.seen[shard][1]
        return ages

    def add(self, other: "StepWork") -> None:
        """Count ``other``'s passes (a rescue pass's) in this one's totals; its idle time is
        not this part's (it was spent after the all-reduce, not before)."""
        for name in ("shards_run", "compute_s", "slowed_s", "stolen", "backups", "backups_won", "races_lost"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class ClaimedStep:
    """One step run through the claims: its ``plan``, this rank's ``claims`` on it, the
    ``reducer`` its sealed pass overlaps with, how long any wait may last (``deadline_s``) and
    the driver's ``abort`` flag."""

    step: int
    plan: StepPlan
    claims: ShardClaims
    reducer: GradientReducer
    deadline_s: float
    abort: threading.Event


@dataclass(frozen=True)
class RescuePass:
    """A step's rescue pass: ``shards`` run in it (0: there was none), the ``seconds`` it took
    on this worker, ``comm_s`` of them in its all-reduce."""

    shards: int = 0
    seconds: float = 0.0
    comm_s: float = 0.0
