"""Gradient compression for the all-reduce: fewer bytes on the wire, some precision lost.

- ``bf16``/``fp16``: the bucket travels and is summed in half precision (any algorithm).
- ``int8``: our ring with each hop's chunk quantized to int8 with one fp32 scale per block of
  ``INT8_BLOCK`` elements; partial sums are dequantized, added in fp32 and requantized at each
  hop, and the finished chunks travel quantized once, so every rank ends with the same values.
- ``topk``: each rank sends only its ``topk_ratio`` largest-magnitude entries of gradient plus
  residual (error feedback: what was not sent is kept and added next step, so nothing is lost,
  only delayed); the (index, value) lists are ring-all-gathered and summed in the same order
  on every rank, so replicas stay identical.

Compressed sums are not exact, so the step's bookkeeping (shard census, loss, sample count)
never goes through them: the reducer sums it separately, exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from workers.comm.comm_group import CommGroup, PendingOp
from workers.comm.communicator import Communicator, PendingReduce
from workers.comm.ring import chunk_bounds, ring_all_gather

COMPRESSIONS = ("none", "bf16", "fp16", "int8", "topk")
#: Compressions that run on their own ring, not on the job's algorithm.
OWN_TRANSPORT = ("int8", "topk")
INT8_BLOCK = 256


class _InOrder:
    """Operations queued one after another on a group's thread, as one pending sum, then
    ``then`` on the caller's thread: done once all are; ``wait`` raises the first one's error
    (then ``then`` never runs), else runs ``then``."""

    def __init__(self, *ops: PendingReduce, then: Callable[[], None]) -> None:
        self._ops = ops
        self._then = then

    def ended_within(self, timeout_s: float) -> bool:
        until = time.monotonic() + timeout_s
        return all(op.ended_within(until - time.monotonic()) for op in self._ops)

    def wait(self) -> None:
        for op in self._ops:
            op.wait()
        self._then()


class CastCompressed:
    """Sums through ``inner`` in ``dtype`` (bf16 or fp16), then writes back in full precision.

    The cast runs on ``group``'s communication thread (``inner`` must run there too), queued
    before the sum: a bucket handed over by the gradient reducer is read only after the
    thread's stream waited for the streams that wrote it (``workers/comm/gradient_reducer.py``), and the cast
    must come after that wait, not before it on the caller's thread. The write-back runs in
    ``wait``, on the caller's thread and stream, once the sum has completed (an NCCL sum is
    polled until its kernel is done): the caller, who reads the bucket next, writes it; a failed
    sum writes nothing back."""

    def __init__(self, inner: Communicator, dtype: torch.dtype, group: CommGroup) -> None:
        self.inner = inner
        self.dtype = dtype
        self.group = group

    def start_sum(self, tensor: torch.Tensor) -> PendingReduce:
        # Allocated here, written only on the communication thread: the sum takes the tensor now.
        low = torch.empty(tensor.shape, dtype=self.dtype, device=tensor.device)

        def cast() -> None:
            if low.is_cuda:
                # Allocated on the caller's stream, used on this thread's: its memory must not
                # go back to the caller's stream before this thread's work with it is done.
                low.record_stream(torch.cuda.current_stream(low.device))
            low.copy_(tensor)

        casting = self.group.submit(cast, f"{self.dtype} cast")
        summing = self.inner.start_sum(low)
        return _InOrder(casting, summing, then=lambda: tensor.copy_(low))


def quantize_int8(values: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D float ``values`` -> (int8 codes, one fp32 scale per ``block`` elements)."""
    padded = torch.nn.functional.pad(values.float(), (0, -values.numel() % block))
    blocks = padded.view(-1, block)
    scales = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    codes = (blocks / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes.view(-1)[: values.numel()], scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    padded = torch.nn.functional.pad(codes.float(), (0, -codes.numel() % block))
    return (padded.view(-1, block) * scales[:, None]).view(-1)[: codes.numel()]


def int8_ring_sum(group: CommGroup, flat: torch.Tensor) -> None:
    """Ring all-reduce of ``flat`` with int8 traffic (see module doc). Blocking."""
    n = group.size
    if n == 1 or flat.numel() == 0:
        return
    me, right, left = group.rank, (group.rank + 1) % n, (group.rank - 1) % n
    bounds = chunk_bounds(flat.numel(), n)
    longest = max(hi - lo for lo, hi in bounds)
    in_codes = torch.empty(longest, dtype=torch.int8, device=flat.device)
    in_scales = torch.empty(math.ceil(longest / INT8_BLOCK), dtype=torch.float32, device=flat.device)
    for step in range(n - 1):  # reduce-scatter, requantizing the partial sum at every hop
        (slo, shi), (rlo, rhi) = bounds[(me - step) % n], bounds[(me - step - 1) % n]
        codes, scales = quantize_int8(flat[slo:shi])
        r_codes, r_scales = in_codes[: rhi - rlo], in_scales[: math.ceil((rhi - rlo) / INT8_BLOCK)]
        # One exchange per step; codes before scales on both sides (messages match in order).
        group.exchange([(codes, right), (scales, right)], [(r_codes, left), (r_scales, left)]).complete()
        if rhi > rlo:
            with group.writing():  # refused once the group is broken: a late step adds nothing
                flat[rlo:rhi].add_(dequantize_int8(r_codes, r_scales).to(flat.dtype))
    # Finished chunks travel quantized once; every rank (the owner too) keeps the decoded values.
    pieces = []
    for index, (lo, hi) in enumerate(bounds):
        if index == (me + 1) % n:
            pieces.append(quantize_int8(flat[lo:hi]))
        else:
            pieces.append((
                torch.empty(hi - lo, dtype=torch.int8, device=flat.device),
                torch.empty(math.ceil((hi - lo) / INT8_BLOCK), dtype=torch.float32, device=flat.device),
            ))
    ring_all_gather(group, pieces, list(range(n)), own=(me + 1) % n)
    with group.writing():
        for (lo, hi), (codes, scales) in zip(bounds, pieces):
            if hi > lo:
                flat[lo:hi] = dequantize_int8(codes, scales).to(flat.dtype)


class Int8RingAllReduce:
    def __init__(self, group: CommGroup) -> None:
        self.group = group

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        flat = tensor.view(-1)
        return self.group.submit(lambda: int8_ring_sum(self.group, flat), "int8 ring all-reduce")


class TopKAllReduce:
    """Top-k sparsified sum with error feedback; ``residuals`` (per bucket) are this worker's
    unsent gradient mass, state to keep across steps and in checkpoints.

    A step's new residuals are staged and become ``residuals`` only on ``commit()`` (the caller
    commits once the step's reduction is complete and verified): a step aborted half-way (a
    peer died) and run again must not leave its gradient in the residuals twice."""

    def __init__(self, group: CommGroup, ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"topk_ratio must be in (0, 1], got {ratio}")
        self.group = group
        self.ratio = ratio
        #: Residual per bucket, keyed by the bucket's (offset in its storage, length).
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}
        self._staged: dict[tuple[int, int], torch.Tensor] = {}

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        flat = tensor.view(-1)
        return self.group.submit(lambda: self._sum(flat), "top-k all-reduce")

    def _sum(self, flat: torch.Tensor) -> None:
        if flat.numel() == 0:
            return
        key = (flat.storage_offset(), flat.numel())
        residual = self.residuals.get(key)
        values = flat.to(torch.float32, copy=True)
        if residual is not None:
            values += residual
        k = max(1, math.ceil(self.ratio * flat.numel()))
        chosen = values.abs().topk(k, sorted=False).indices
        sent = values[chosen]
        values[chosen] = 0.0
        self._staged[key] = values
        n, me = self.group.size, self.group.rank
        pieces = [(chosen, sent) if r == me else (torch.empty_like(chosen), torch.empty_like(sent)) for r in range(n)]
        if n > 1:
            ring_all_gather(self.group, pieces, list(range(n)), own=me)
        total = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        for indices, entries in pieces:  # same order on every rank: identical results
            total.index_add_(0, indices, entries)
        with self.group.writing():  # refused once the group is broken: a late sum writes nothing
            flat.copy_(total)


    def commit(self) -> None:
        """The step's reduction completed: its unsent mass becomes the residuals."""
        self.residuals.update(self._staged)
        self._staged.clear()


def compress(
    compression: str, inner: Communicator, group: CommGroup, topk_ratio: float
) -> Communicator:
    """Wrap or replace ``inner`` (the job's algorithm) for ``compression`` (one of
    COMPRESSIONS). int8 and top-k need our own transport, so they run on the flat ring."""
    if compression == "none":
        return inner
    if compression in ("bf16", "fp16"):
        return CastCompressed(inner, torch.bfloat16 if compression == "bf16" else torch.float16, group)
    if compression == "int8":
        return Int8RingAllReduce(group)
    if compression == "topk":
        return TopKAllReduce(group, topk_ratio)
    raise ValueError(f"unknown compression {compression!r}; choose one of {COMPRESSIONS}")
