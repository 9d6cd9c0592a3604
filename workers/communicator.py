"""Collective communication behind a small interface, so algorithms can be swapped per job."""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A collective did not finish within its timeout (a peer died, hung or is far behind)."""


class PendingReduce(Protocol):
    def wait(self) -> None:
        """Block until the sum is in place; raises CollectiveTimeout past the timeout."""
        ...


class Communicator(Protocol):
    def start_sum(self, tensor: torch.Tensor) -> PendingReduce:
        """Begin summing ``tensor`` in place across all ranks; returns at once.

        Every rank must start the same sequence of sums, in the same order.
        """
        ...


class _NativeWork:
    def __init__(self, work: dist.Work, timeout: timedelta) -> None:
        self._work = work
        self._timeout = timeout

    def wait(self) -> None:
        try:
            self._work.wait(self._timeout)
        except RuntimeError as err:
            raise CollectiveTimeout(
                f"all-reduce did not finish within {self._timeout.total_seconds():.0f}s: {err}"
            ) from err


class NativeAllReduce:
    """``torch.distributed.all_reduce``, asynchronous, each wait bounded by ``timeout_s``."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)

    def start_sum(self, tensor: torch.Tensor) -> PendingReduce:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _NativeWork(work, self.timeout)


def pick_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"
