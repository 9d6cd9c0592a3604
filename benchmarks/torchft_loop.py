"""The torchft contender's training loop: the job's recipe (``PeerRecipe``, as the DDP peers run
it) under torchft, as a torchft user writes it.

Every Ray Train worker is its own replica group (one rank; Ray Train's ``TorchftConfig`` runs
the lighthouse). torchft's ``Manager`` runs a quorum each step (started by the wrapped
optimizer's ``zero_grad``, overlapped with the forward pass), torchft's
``DistributedDataParallel`` averages gradients over the replicas taking part, and torchft's
``Optimizer`` steps only when the quorum agrees to commit. A replica that starts late (a
replacement) heals from a live peer over ``PGTransport`` and takes part from the step after.

Data: step ``t`` (the manager's committed step count, so a step that did not commit is tried
again on the same samples) feeds torchft's ``DistributedSampler`` the job's shards of step
``t`` (the same shards, and so samples, every contender trains on); replica group ``r`` of
``n`` gets shards ``r, r + n, ...``. The sampler is static, as torchft's docs say: the shards of
a replica that is down, or healing, are trained on by nobody in that step.

Loss: each replica's loss sum is scaled by ``participants / weight``, ``weight`` being the
step's loss weight summed over the participating replicas (one more allreduce through the
manager): the averaged gradient is then the step's mean gradient, as in the other contenders.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.distributed import ReduceOp

from benchmarks.ddp_loop import PeerRecipe
from jobspec.job import JobConfig
from workers.runtime.chaos import ChaosSchedule

#: torchft's collective, quorum and healing timeouts (Ray's example uses 30 s for the process
#: group and 60 s for the manager: generous enough to re-form gloo after a replica dies).
PG_TIMEOUT = timedelta(seconds=30)
MANAGER_TIMEOUT = timedelta(seconds=60)
#: Consecutive steps that may fail to commit before the replica gives up (raises).
MAX_RETRIES = 10
#: The lighthouse: a quorum of whoever is alive (Ray's example), waiting up to 10 s for
#: replicas that heartbeat but have not asked yet (torchft README's lighthouse command).
LIGHTHOUSE_KWARGS = {"min_replicas": 1, "join_timeout_ms": 10_000}


def check_torchft(job: JobConfig) -> None:
    """Before a benchmark starts: ImportError when torchft is missing (the ``bench`` extra),
    ValueError when the job's shards do not deal evenly over its workers or it trains in fp16
    (a step the scaler skips never asks the quorum to commit, which is where torchft applies a
    healed state, and the scaler's state is not healed)."""
    try:
        importlib.import_module("torchft")
    except ImportError as err:
        raise ImportError("the benchmarks' torchft contender needs torchft: pip install 'ringleader[bench]'") from err
    torchft_shards(job.shards, 0, job.scaling.workers)
    if job.precision == "fp16":
        raise ValueError("the torchft contender does not train in fp16 (precision: fp16); use bf16 or fp32")


def torchft_refusal(*jobs: JobConfig) -> str | None:
    """What ``check_torchft`` says of the first of ``jobs`` it refuses; None when all pass."""
    try:
        for job in jobs:
            check_torchft(job)
    except (ImportError, ValueError) as err:
        return str(err)
    return None


def _ddp_class() -> type:
    """torchft's ``DistributedDataParallel`` with its comm hook fixed for a failed step.

    In torchft 0.2.0 the hook assumes every allreduce returns a managed future; once an
    allreduce of the step has failed the manager hands back a plain one, and the hook's
    ``fut._fut`` raises ``AttributeError`` in the survivor's backward (meta-pytorch/torchft
    #304): any model with more than one gradient bucket crashes the survivors, instead of the
    step being skipped. The fix a user hitting it writes: take the plain future as it is."""
    from torchft import DistributedDataParallel

    class FailureSafeDistributedDataParallel(DistributedDataParallel):
        # No annotations: DDP checks them against the classes, and this module's are strings.
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
            work = state.allreduce(bucket.buffer())
            work.wait()
            future = work.get_future()
            return getattr(future, "_fut", None) or future

    return FailureSafeDistributedDataParallel


def _optimizer_class() -> type:
    """torchft's ``Optimizer`` wrapper that remembers whether its last ``step`` committed (the
    manager's own counters are overwritten when a replica heals)."""
    from torchft import Optimizer

    class CommitRecordingOptimizer(Optimizer):
        committed = False

        def step(self, closure: object = None) -> None:
            assert closure is None, "optimizers that use closures are not supported"
            self.committed = self.manager.should_commit()
            if self.committed:
                self.optim.step()

    return CommitRecordingOptimizer


def torchft_shards(shards: int, replica: int, replicas: int) -> list[int]:
    """The shard ids torchft's ``DistributedSampler`` gives replica group ``replica`` of
    ``replicas`` (one rank each) out of a step's ``shards``. ValueError when ``shards`` is not a
    multiple of ``replicas`` (the sampler would pad by repeating shards: a different batch)."""
    from torchft import DistributedSampler

    if shards % replicas:
        raise ValueError(f"job.shards ({shards}) must be a multiple of the workers ({replicas}) for torchft's sampler")
    sampler = DistributedSampler(
        range(shards), replica_rank=replica, num_replica_groups=replicas, group_rank=0, num_replicas=1, shuffle=False
    )
    return [int(s) for s in sampler]


@dataclass(frozen=True)
class StepAttempt:
    """One replica's try at a step. ``step``: the step it committed (or tried: the manager's
    step count at the start, or after healing); ``data_step``: the step whose samples it
    computed on; ``participants``: replicas whose gradients were averaged; ``participating``:
    this replica's among them (a healing replica's are zeroed); ``weight`` and ``samples``: the
    step's loss weight and samples summed over the participants; ``time``: epoch seconds after
    the optimizer step."""

    replica: int
    pid: int
    step: int
    data_step: int
    committed: bool
    participants: int
    participating: bool
    weight: float
    samples: int
    time: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def train_torchft(
    job: JobConfig,
    replica: int,
    replicas: int,
    *,
    ready: Callable[[], None] | None = None,
    before_backward: Callable[[int], None] | None = None,
    record: Callable[[StepAttempt], None] | None = None,
) -> dict[str, Any]:
    """Train until the manager has committed ``job.steps`` steps; this process is replica group
    ``replica`` of ``replicas``. ``ready()`` runs once all is built, just before the first
    step (the manager heartbeats to the lighthouse from its creation): a barrier there makes
    every replica take part from step 0. ``before_backward(step)`` runs after the step's quorum has started, before its
    forward; ``record`` gets every attempt. Returns this replica's committed steps' end times
    (epoch seconds), loss weights and samples trained (over the participants), its final model
    state and, on replica 0, the eval metrics."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    # The manager first: from its creation it heartbeats to the lighthouse, which then waits
    # (join_timeout_ms) for it before forming a quorum. A replica that is not heartbeating yet
    # when a peer asks for the first quorum is left out: its shards of step 0 are dropped.
    pg = ProcessGroupGloo(timeout=PG_TIMEOUT)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        world_size=1,
        rank=0,
        replica_id=f"ringleader_bench_{replica}",
        timeout=MANAGER_TIMEOUT,
        checkpoint_transport=PGTransport(pg, timeout=MANAGER_TIMEOUT, device=torch.device("cpu")),
        # Every replica builds the same model from the job's seed: no step-0 sync needed.
        init_sync=False,
        # A step that keeps failing (a peer that cannot heal, a broken group) ends the run.
        max_retries=MAX_RETRIES,
    )
    recipe = PeerRecipe(job)
    stock = recipe.optimizer(recipe.module)

    def load_state_dict(state: dict[str, Any]) -> None:
        recipe.module.load_state_dict(state["model"])
        stock.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": recipe.module.state_dict(), "optim": stock.state_dict()}

    manager.register_state_dict_fn("default", load_state_dict, state_dict)
    model = _ddp_class()(manager, recipe.module)
    optimizer = _optimizer_class()(manager, stock)
    my_shards = torchft_shards(job.shards, replica, replicas)
    # The job's injected slowness and stalls, as the DDP peers inject them (kills are not).
    chaos = ChaosSchedule.for_worker(job.chaos, replica, threading.Event())

    summed_samples = [0]

    def scale(weight: float) -> tuple[float, float]:
        totals = torch.tensor([weight, samples], dtype=torch.float64)
        manager.allreduce(totals, reduce_op=ReduceOp.SUM).wait()  # zeroed if not participating
        participants = manager.num_participants()
        summed, summed_samples[0] = float(totals[0]), int(totals[1])
        return participants / summed if summed > 0 else 0.0, summed

    step_ends: list[float] = []
    step_weights: list[float] = []
    step_samples: list[int] = []
    steps = job.steps or 0
    if ready is not None:
        ready()
    try:
        while manager.current_step() < steps:
            data_step = manager.current_step()
            batch, samples = recipe.batch(data_step, my_shards)
            chaos.stall(data_step)
            optimizer.zero_grad(set_to_none=True)  # starts the quorum
            chaos.slow_down(data_step, len(my_shards), lambda: False)
            if before_backward is not None:
                before_backward(data_step)
            started = time.perf_counter()
            optimizer.committed = False
            _, weight = recipe.backward(model, optimizer, data_step, batch, samples, scale)
            chaos.record(data_step, time.perf_counter() - started, len(my_shards))
            recipe.apply(model, optimizer)  # steps only if the quorum commits
            done = time.time()
            committed = optimizer.committed
            if committed:
                step_ends.append(done)
                step_weights.append(weight)
                step_samples.append(summed_samples[0])
            if record is not None:
                record(StepAttempt(
                    replica=replica, pid=os.getpid(), step=manager.current_step() - int(committed),
                    data_step=data_step, committed=committed, participants=manager.num_participants(),
                    participating=manager.is_participating(), weight=weight, samples=summed_samples[0], time=done,
                ))
    finally:
        # Ray's example: without it a replica that finished can leave a late peer stuck.
        manager.shutdown(wait=False)
    metrics = recipe.evaluate(model) if replica == 0 else {}
    return {
        "step_ends": step_ends, "step_weights": step_weights, "step_samples": step_samples, "eval": metrics,
        "model": recipe.module.state_dict(),
    }
