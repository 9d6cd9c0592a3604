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

import os
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.distributed import ReduceOp

from benchmarks.ddp_loop import PeerRecipe
from orchestrator.config import JobConfig
from workers.chaos import ChaosSchedule

#: torchft's collective, quorum and healing timeouts (Ray's example uses 30 s for the process
#: group and 60 s for the manager: generous enough to re-form gloo after a replica dies).
PG_TIMEOUT = timedelta(seconds=30)
MANAGER_TIMEOUT = timedelta(seconds=60)


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
    this replica's among them (a healing replica's are zeroed); ``time``: epoch seconds after
    the optimizer step."""

    replica: int
    pid: int
    step: int
    data_step: int
    committed: bool
    participants: int
    participating: bool
    weight: float
    time: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def train_torchft(
    job: JobConfig,
    replica: int,
    replicas: int,
    *,
    before_backward: Callable[[int], None] | None = None,
    record: Callable[[StepAttempt], None] | None = None,
) -> dict[str, Any]:
    """Train until the manager has committed ``job.steps`` steps; this process is replica group
    ``replica`` of ``replicas``. ``before_backward(step)`` runs after the step's quorum has
    started, before its forward; ``record`` gets every attempt. Returns this replica's committed
    steps' end times (epoch seconds) and loss weights, its final model state and, on replica 0,
    the eval metrics."""
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    # The manager first: from its creation it heartbeats to the lighthouse, which then waits
    # for it before forming a quorum. Built after the model, a replica slower to start than
    # its peers found them already training without it (its shards of step 0 dropped).
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
    optimizer = Optimizer(manager, stock)
    my_shards = torchft_shards(job.shards, replica, replicas)
    # The job's injected slowness and stalls, as the DDP peers inject them (kills are not).
    chaos = ChaosSchedule.for_worker(job.chaos, replica, threading.Event())

    def scale(weight: float) -> tuple[float, float]:
        total = torch.tensor([weight], dtype=torch.float64)
        manager.allreduce(total, reduce_op=ReduceOp.SUM).wait()  # zeroed if not participating
        participants = manager.num_participants()
        summed = float(total.item())
        return participants / summed if summed > 0 else 0.0, summed

    step_ends: list[float] = []
    step_weights: list[float] = []
    steps = job.steps or 0
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
            committed_before = manager.batches_committed()
            _, weight = recipe.backward(model, optimizer, data_step, batch, samples, scale)
            chaos.record(data_step, time.perf_counter() - started, len(my_shards))
            recipe.apply(model, optimizer)  # steps only if the quorum commits
            done = time.time()
            committed = manager.batches_committed() > committed_before
            if committed:
                step_ends.append(done)
                step_weights.append(weight)
            if record is not None:
                record(StepAttempt(
                    replica=replica, pid=os.getpid(), step=manager.current_step() - int(committed),
                    data_step=data_step, committed=committed, participants=manager.num_participants(),
                    participating=manager.is_participating(), weight=weight, time=done,
                ))
    finally:
        # Ray's example: without it a replica that finished can leave a late peer stuck.
        manager.shutdown(wait=False)
    metrics = recipe.evaluate(model) if replica == 0 else {}
    return {"step_ends": step_ends, "step_weights": step_weights, "eval": metrics, "model": recipe.module.state_dict()}
