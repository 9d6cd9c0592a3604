"""Published plans: rank 0 hands every batch's plans to its followers over the process group and
gathers their reports back, so the driver calls one worker per batch, not every worker
(docs/architecture.md, "Published plans").

Three operations, each posted on the group's communication thread like any collective (so an
abort or the collective timeout ends every wait):

- ``publish``/``receive``: a broadcast from rank 0 of a header (kind, first step, payload
  bytes) and then the payload, the batch's plans in compact form (``compact_plans``: a plan
  whose shards are contiguous blocks in rank order travels as its block counts, not as
  tuples of shard numbers) and its checkpoint, if one is taken inside it (``SnapshotOrder``). ``end`` broadcasts a header that ends the followers' run.
- ``gather``: each follower's pickled reports to rank 0, as two grouped exchanges (the lengths,
  then the payloads of exactly those lengths), since NCCL matches every receive to a send of
  its own size.

Only what every rank does in the same order crosses the group: rank 0 publishes before it runs
a batch and collects after it (``TrainWorker.lead_steps``); a follower receives, runs the same
steps, then sends (``TrainWorker.follow``). The channel only carries: it never runs a step.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any, Sequence

import torch

from jobspec.step_record import StepRecord, batch_records, pack_batch
from jobspec.wire import SnapshotOrder, StepTelemetry
from policies.work_stealing import StepPlan
from workers.comm.comm_group import CommGroup

#: A header's kinds: a batch follows, or the followers' run ends.
BATCH, END = 1, 0


def compact_plans(plans: Sequence[StepPlan]) -> list[tuple[Any, ...]]:
    """``plans`` as picklable tuples: a plan whose shards are ``0..S-1`` cut into consecutive
    blocks in rank order (the common case: ``ShardAssignment``'s contiguous blocks) carries
    only its block counts; any other (shuffled shards, a rescue's assignment) its tuples."""
    out: list[tuple[Any, ...]] = []
    for plan in plans:
        counts = tuple(len(shards) for shards in plan.shards_by_rank)
        blocks = all(shards == tuple(range(shards[0], shards[0] + len(shards))) for shards in plan.shards_by_rank if shards)
        flat = [s for shards in plan.shards_by_rank for s in shards]
        if blocks and flat == list(range(len(flat))):
            out.append(("counts", counts, replace(plan, shards_by_rank=())))
        else:
            out.append(("shards", plan.shards_by_rank, replace(plan, shards_by_rank=())))
    return out


def expand_plans(compact: Sequence[tuple[Any, ...]]) -> list[StepPlan]:
    """The inverse of ``compact_plans``."""
    plans = []
    for kind, layout, rest in compact:
        if kind == "counts":
            starts = [0]
            for count in layout:
                starts.append(starts[-1] + count)
            layout = tuple(tuple(range(start, start + count)) for start, count in zip(starts, layout))
        plans.append(replace(rest, shards_by_rank=layout))
    return plans


class PlanChannel:
    """Rank 0's plans to the other ranks of ``group`` and their reports back. ``device``: where
    the group's tensors must live (the worker's GPU with NCCL, else the CPU)."""

    def __init__(self, group: CommGroup, device: torch.device) -> None:
        self.group = group
        self.device = device if group.poll_completion else torch.device("cpu")

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        on_device = tensor.to(self.device)
        self.group.broadcast(on_device, 0)
        return on_device.cpu()

    def _header(self, kind: int, first: int, length: int) -> torch.Tensor:
        return self._broadcast(torch.tensor([kind, first, length], dtype=torch.int64))

    def publish(self, first: int, plans: Sequence[StepPlan], snapshot: SnapshotOrder | None = None) -> None:
        """Rank 0: the batch from step ``first`` runs ``plans`` (and takes ``snapshot`` inside
        it); blocks until broadcast."""
        payload = pickle.dumps((compact_plans(plans), snapshot), protocol=pickle.HIGHEST_PROTOCOL)
        self._header(BATCH, first, len(payload))
        self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def end(self) -> None:
        """Rank 0: the followers' run ends (they return from ``TrainWorker.follow``)."""
        self._header(END, 0, 0)

    def receive(self) -> tuple[int, list[StepPlan], SnapshotOrder | None] | None:
        """A follower: the next batch (its first step, its plans, its checkpoint), or None once
        rank 0 ended the run. Raises CollectiveAborted or CollectiveTimeout as any collective."""
        kind, first, length = (int(v) for v in self._header(0, 0, 0).tolist())
        if kind == END:
            return None
        payload = self._broadcast(torch.empty(length, dtype=torch.uint8))
        compact, snapshot = pickle.loads(payload.numpy().tobytes())
        return first, expand_plans(compact), snapshot

    def collect(self, first: int, reports: list[StepTelemetry]) -> list[StepRecord] | None:
        """This rank's ``reports`` of the batch from step ``first`` to rank 0: there one
        ``StepRecord`` per step, every rank's row in it; None on a follower."""
        packed = self.gather(pack_batch(reports))
        return None if packed is None else batch_records(first, packed)

    def gather(self, payload: bytes) -> list[bytes] | None:
        """Every rank's ``payload`` to rank 0: there, all of them in rank order; elsewhere None."""
        group = self.group
        if group.size == 1:
            return [payload]
        if group.rank != 0:
            mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
            self._exchange(sends=[(length, 0)])
            self._exchange(sends=[(mine, 0)])
            return None
        lengths = [torch.empty(1, dtype=torch.int64, device=self.device) for _ in range(group.size - 1)]
        self._exchange(receives=[(length, peer) for peer, length in enumerate(lengths, start=1)])
        # An empty tensor is not posted (``exchange`` drops it), on either side: a zero length is fine.
        received = [torch.empty(int(length.item()), dtype=torch.uint8, device=self.device) for length in lengths]
        self._exchange(receives=[(tensor, peer) for peer, tensor in enumerate(received, start=1)])
        return [payload] + [tensor.cpu().numpy().tobytes() for tensor in received]

    def _exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]] = (), receives: Sequence[tuple[torch.Tensor, int]] = ()
    ) -> None:
        group = self.group
        group.submit(lambda: group.exchange(sends, receives).complete(), "report gather").wait()
