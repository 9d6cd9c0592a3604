"""A worker's link to one generation's process group: joining the group and leaving it.

Joining connects to the driver's store (where the step's shard claims live), forms the process
group (``form_process_group``: abortable and deadline-bounded, NCCL's communicator included),
has the replica's state layout (``workers/state_layout.py``: whole or sharded) build the
gradient reduction over it and take the group's training state (rank 0's, or each slice from
its holders), so that every replica starts the generation identical. Top-k residuals carry
over. Leaving closes the reducer and the group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from jobspec.chaos import KillPoint
from jobspec.runtime import CollectiveConfig
from jobspec.wire import Joined, JoinRequest
from policies.sharding import ShardingLayout
from workers.comm.comm_group import CommGroup
from workers.comm.communicator import Communicator, pick_backend
from workers.comm.compression import TopKAllReduce
from workers.comm.gradient_reducer import GradientReducer
from workers.comm.process_group import form_process_group
from workers.model.flat_parameters import FlatParameters
from workers.replica import Replica
from workers.runtime.devices import stream_marks
from workers.sharding.reduce import group_sum
from workers.step.claims import ClaimStores, CountingStore


@dataclass
class StepUndo:
    """With sharded state, what a rank's update of ``step`` moved besides its slice, until that
    step's all-gather completes: each changed tensor (the loss scaler's state, the step's
    running statistics) live, with its value ``before`` the step and (taken at the next join,
    if the step failed) ``after`` it. A rank may apply the update and then fail in the
    all-gather while others never stepped (the abort reaches ranks at different times): the
    next group starts at ``step`` or ``step + 1``, and every rank's copy must be the one for
    that step before rank 0's is sent (``for_step``)."""

    step: int
    live: list[torch.Tensor]
    before: list[torch.Tensor]
    after: list[torch.Tensor] | None = None

    def for_step(self, step: int) -> None:
        """Make the live tensors the copy for job step ``step`` (the update's step or the
        next); nothing for another step."""
        if self.after is None:
            self.after = [tensor.clone() for tensor in self.live]
        chosen = {self.step: self.before, self.step + 1: self.after}.get(step)
        for tensor, value in zip(self.live, chosen or ()):
            tensor.copy_(value)


class GroupLink:
    """This worker's place in the current generation's group: the driver's ``store`` and the
    ``claims_store`` on it, its ``rank`` in the comm ``group``, and the gradient ``reducer``
    with its communicator ``reducer_comm``. ``join`` forms them, ``leave`` closes them; only
    the top-k residuals outlive a generation.

    ``collective`` are the job's all-reduce settings, ``timeout_s`` one collective's limit and
    ``abort_flag`` the driver's abort, which fails a pending rendezvous or collective at once.
    ``chaos_point(point, step)`` is called where the job's chaos may kill this worker (the
    ``reshard`` point, with the step the group starts from).
    """

    def __init__(
        self,
        collective: CollectiveConfig,
        timeout_s: float,
        abort_flag: threading.Event,
        chaos_point: Callable[[KillPoint, int], None] = lambda point, step: None,
    ) -> None:
        self.collective = collective
        self.chaos_point = chaos_point
        #: Who owns which slice of the state in this generation (None: not sharded).
        self.layout: ShardingLayout | None = None
        self.timeout_s = timeout_s
        self.abort_flag = abort_flag
        self.rank = -1
        self.world_size = 0
        self.store: dist.Store | None = None
        self.claims_store: ClaimStores | None = None
        self.group: CommGroup | None = None
        self.reducer: GradientReducer | None = None
        self.reducer_comm: Communicator | None = None  # the reducer's (top-k keeps residuals)
        #: The step whose reduction last started (top-k stages its residuals).
        self.reducing_step = -1
        #: With sharded state, the scale and buffers around the last update until its all-gather completes.
        self.undo: StepUndo | None = None
        #: Top-k residuals read from a checkpoint (``TrainWorker.restore``): the next join hands them to top-k.
        self.restored_residuals: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def residuals(self) -> dict[tuple[int, int], torch.Tensor]:
        """This worker's committed top-k residuals (its unsent gradient) by bucket; {} without top-k."""
        return getattr(self.reducer_comm, "residuals", None) or {}

    def commit_residuals(self) -> None:
        """The step's reduction counted every shard: top-k's unsent remainder becomes the residuals."""
        if isinstance(self.reducer_comm, TopKAllReduce):
            self.reducer_comm.commit()

    def join(self, request: JoinRequest, replica: Replica) -> Joined:
        """Form generation ``request.generation``'s process group through the driver's TCPStore,
        then take rank 0's training state into ``replica``. Raises CollectiveAborted or
        CollectiveTimeout if the rendezvous or the transfer cannot finish."""
        def connect(port: int) -> dist.Store:
            store: dist.Store = dist.TCPStore(
                request.store_host, port, is_master=False, timeout=timedelta(seconds=request.timeout_s)
            )
            return dist.PrefixStore(request.namespace, store) if request.namespace else store

        store = connect(request.store_port)
        self.store = store
        self.claims_store = ClaimStores([
            CountingStore(dist.PrefixStore(request.prefix, s))
            for s in [store, *(connect(port) for port in request.claim_ports)]
        ])
        backend = pick_backend(replica.device, self.collective.backend)
        pg = form_process_group(
            backend, dist.PrefixStore(request.prefix, store), request.rank, request.world_size,
            timeout_s=self.timeout_s, deadline_s=request.timeout_s, abort_flag=self.abort_flag, device=replica.device,
        )
        previous = self.reducer_comm
        residuals = self.residuals or self.restored_residuals
        self.group = CommGroup(
            pg, request.rank, request.world_size, self.timeout_s, self.abort_flag, poll_completion=backend == "nccl",
            marks=stream_marks(replica.device),
        )
        self.rank, self.world_size = request.rank, request.world_size
        self.layout = replica.state.plan(request.world_size, replica.flat.numel)
        reduction = replica.state.reduction(self.group, self.layout, replica.flat, self.collective, request.nodes, residuals)
        self.reducer, self.reducer_comm = reduction.reducer, reduction.comm
        self.restored_residuals = {}  # only now: a join that failed before keeps them for the next
        started = time.perf_counter()
        self._take_root_state(self.group, replica, previous, request.step)
        return Joined(transfer_s=time.perf_counter() - started, next_step=replica.next_step, collective=reduction.choice)

    def owned_gradient(
        self, flat: FlatParameters
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None]:
        """The part of ``flat``'s reduced gradient this rank steps, and what turns its sum of
        squares into the whole gradient's (``finish_gradient``'s ``sum_squares``): with
        sharded state its slice and the sum over the slices, else all of it and None."""
        layout, group = self.layout, self.group
        if layout is None or group is None:
            return flat.grads, None
        lo, hi = layout.slice_of(self.rank)
        return flat.grad_slice(lo, hi), lambda local: group_sum(group, layout, local)

    def before_update(self, step: int, changing: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """As ``step``'s update begins: with sharded state, keep what it changes besides the
        slice (``changing``: each tensor with its value before the step, which the caller no
        longer writes) until the step's all-gather completes (``StepUndo``). Nothing without
        sharded state: no collective follows the update there."""
        if self.layout is not None:
            self.undo = StepUndo(step, [live for live, _ in changing], [before for _, before in changing])

    def gather_stepped(self, replica: Replica, step: int, stepped: bool) -> None:
        """After ``step``'s optimizer update (``stepped``: False on an fp16 skip), with sharded
        state: this rank's slice, loss scale and buffers are at ``step + 1`` (its state is ready
        for it), and the other slices' parameters are gathered. Should the gather fail, a group
        may start after ``step`` from what the slices' holders have (``_take_root_state``).
        Nothing without sharded state."""
        if self.group is None:
            return
        replica.state.stepped(self.group, self.layout, replica.flat, step, stepped)
        self.undo = None

    def _take_root_state(self, group: CommGroup, replica: Replica, previous: Communicator | None, named: int = -1) -> None:
        """Take rank 0's step, parameters, optimizer state, loss scale and model buffers into
        ``replica`` (rank 0 keeps its own). ``previous`` is the last generation's communicator.
        ``named``: the step the group starts from (-1: rank 0's next step). Sharded state and
        the parameters come from the holders of each slice at that step instead
        (``ShardedOptimizer.reshard``), then an all-gather in the sharding group."""
        step = torch.tensor([replica.next_step], dtype=torch.int64, device=replica.device)
        group.broadcast(step, root=0)
        root_step, staged_for = (int(step.item()) if named < 0 else named), self.reducing_step
        if isinstance(previous, TopKAllReduce) and root_step == staged_for + 1 and replica.next_step == staged_for:
            # This rank was aborted in a step that completed elsewhere (a rank died in the
            # all-gather after everyone's piece was out): its piece was counted, so its unsent
            # remainder is the residual now.
            previous.commit()
        if root_step != replica.next_step:
            # Until the whole state has arrived this replica holds none: if the transfer breaks
            # off, the driver must not take it for a survivor with a good state.
            replica.next_step = -1
        replica.state.take_state(
            group, self.layout, replica.flat, root_step, self.rank == 0, lambda: self.chaos_point("reshard", root_step)
        )
        if self.undo is not None:  # this rank updated them in a step whose all-gather failed
            self.undo.for_step(root_step)
        group.broadcast(replica.scaler.state, root=0)
        for buffer in replica.model.buffers():  # running statistics: a checkpoint restores them on one worker
            group.broadcast(buffer, root=0)
        replica.scaler.state_restored()
        replica.state.confirm(group, replica.device)  # sharded: what each rank kept may go now
        self.undo = None
        replica.next_step = root_step

    def leave(self) -> None:
        """Close the reducer and the comm group (one an abort left stuck is abandoned)."""
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None
        if self.group is not None:
            if self.abort_flag.is_set() and self.group.broken is None:
                self.group.broken = "aborted by the driver"  # its thread may be stuck: abandon it
            self.group.close()
            self.group = None
