"""Collective communication behind a small interface, so algorithms can be swapped per job."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A collective did not finish within its timeout (a peer died, hung or is far behind)."""


class Communicator(Protocol):
    def all_reduce_sum(self, tensor: torch.Tensor) -> float:
        """Sum ``tensor`` in place across all ranks; returns the seconds spent.

        Raises CollectiveTimeout when the operation does not finish in time.
        """
        ...


class NativeAllReduce:
    """``torch.distributed.all_reduce`` on buckets of at most ``bucket_bytes`` each.

    All buckets are launched asynchronously and then awaited, each wait bounded by ``timeout_s``.
    """

    def __init__(self, group: dist.ProcessGroup | None, bucket_bytes: int, timeout_s: float) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.timeout = timedelta(seconds=timeout_s)

    def all_reduce_sum(self, tensor: torch.Tensor) -> float:
        start = time.perf_counter()
        per_bucket = max(1, self.bucket_bytes // tensor.element_size())
        works = [
            dist.all_reduce(chunk, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            for chunk in tensor.view(-1).split(per_bucket)
        ]
        for work in works:
            try:
                work.wait(self.timeout)
            except RuntimeError as err:
                raise CollectiveTimeout(
                    f"all-reduce did not finish within {self.timeout.total_seconds():.0f}s: {err}"
                ) from err
        return time.perf_counter() - start


def pick_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"
