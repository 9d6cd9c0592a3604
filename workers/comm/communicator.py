"""The interface the gradient reducer sums through, and the algorithms behind it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from workers.comm.comm_group import CommGroup, PendingOp
from workers.comm.ring import HierarchicalAllReduce, RingAllReduce


class PendingReduce(Protocol):
    def ended_within(self, timeout_s: float) -> bool:
        """Block until the sum has ended or ``timeout_s`` passed; whether it has ended."""
        ...

    def wait(self) -> None:
        """Block until the sum is in place; raises CollectiveTimeout/CollectiveAborted."""
        ...


class Communicator(Protocol):
    def start_sum(self, tensor: torch.Tensor) -> PendingReduce:
        """Begin summing ``tensor`` in place across all ranks; returns at once.

        Every rank must start the same sequence of sums, in the same order.
        """
        ...


class NativeAllReduce:
    """torch.distributed's own all-reduce (gloo's or NCCL's algorithm): the baseline. ``op``:
    the reduction (``SUM`` for gradients; the link probe agrees on ``MAX``)."""

    def __init__(self, group: CommGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        self.group = group
        self.op = op

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        options = dist.AllreduceOptions()
        options.reduceOp = self.op
        size = self.group.size

        def reduce() -> None:
            # Counted here, on the communication thread, like our algorithms' sends: one
            # thread updates the counter.
            self.group.bytes_sent += tensor.numel() * tensor.element_size() * 2 * (size - 1) // size
            self.group.launched(self.group.pg.allreduce([tensor], options))

        return self.group.submit(reduce, "native all-reduce")


ALGORITHMS = ("ring", "hierarchical", "native")


def make_communicator(algorithm: str, group: CommGroup, nodes: Sequence[str]) -> Communicator:
    """The communicator for ``algorithm`` (one of ALGORITHMS); ``nodes[rank]`` is each rank's
    node id, used by the hierarchical algorithm."""
    if algorithm == "native":
        return NativeAllReduce(group)
    if algorithm == "ring":
        return RingAllReduce(group)
    if algorithm == "hierarchical":
        return HierarchicalAllReduce(group, nodes)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose one of {ALGORITHMS}")


def pick_backend(device: torch.device, configured: str = "auto") -> str:
    """The process group's backend for tensors on ``device`` under ``collective.backend``
    (``configured``): ``auto`` is NCCL for CUDA tensors, gloo otherwise; ``gloo`` and ``nccl``
    as named. Raises ValueError (naming ``collective.backend``) for NCCL on a non-CUDA device:
    validation refuses it for a job without GPUs, this catches a worker whose GPU torch
    cannot use."""
    if configured == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if configured == "nccl" and device.type != "cuda":
        raise ValueError(f"field 'collective.backend': nccl needs CUDA tensors, and this worker trains on {device}")
    if configured not in ("gloo", "nccl"):
        raise ValueError(f"field 'collective.backend': expected auto, gloo or nccl, got {configured!r}")
    return configured
