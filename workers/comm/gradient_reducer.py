"""Gradient buckets, reduced during backward (overlap) or after it.

The flat gradient buffer (``[extra | params]``, see ``FlatParameters``) is cut into buckets: contiguous
ranges taken in reverse parameter order, because backward produces the last layers' gradients
first. The first bucket is kept small so communication starts early. The final bucket also
covers the ``extra`` slots in front of the first parameter.

Buckets are launched strictly in index order, whatever order their gradients become ready in,
so every rank issues the same sequence of collectives: a rank with no shards this step, or
whose backward skipped some parameters, launches the rest in ``finish`` in that same order.

A bucket is launched from the compute thread (in a gradient hook, or in ``finish``) and read on
the communication thread. On a GPU its gradients may still be being written when it is
launched, on the streams backward ran its parameters' ops on (a model may use streams of its
own, one per branch): every parameter's hook notes its current stream, the stream that
accumulated that parameter's gradient; a bucket's launch records a mark (a CUDA event) on each
stream its parameters noted (usually one) and queues, right before its collective, a step on
the communication thread that makes that thread's stream wait for those marks
(``workers/runtime/devices.py``, ``StreamMarks``). What
``finish`` launches waits for one mark it records on its own thread's stream: backward has
returned, and autograd ordered that stream after every stream that wrote a gradient. All that
reads or rewrites a bucket (a compression's cast too) runs on the communication thread after
that wait. On the CPU there are no marks, and nothing is recorded. With a gradient slice kept
(sharded state) the launch itself reads the bucket's gradients, copying them out of the
parameters on the compute thread, on its stream once that waits for the marks; the copy is
handed over the same way. The copies live until their sum ends: when communication is slower
than backward they queue, up to the whole gradient.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from workers.comm.comm_group import CommGroup
from workers.comm.communicator import Communicator, PendingReduce
from workers.model.flat_parameters import FlatParameters
from workers.runtime.devices import StreamMarks, stream_marks

FIRST_BUCKET_BYTES = 1 << 20
# Buckets of an explicitly chosen algorithm when the job sets no bucket_mb (and of a group of
# one under auto): 4 MB on the CPU, 100 MB on a GPU. There each bucket costs the host the same
# whatever its size (a hand-off to the communication thread, a collective launch, a completion
# poll): a 710M-parameter GPT on one H100 ran at 0.76x a plain loop's tokens/s with 4 MB
# buckets, 0.83x with DDP's 25 MB and 0.91x with 100 MB (docs/benchmarks.md, "On a GPU").
# Megatron-LM's default is of the same size, 40M parameters a bucket.
DEFAULT_BUCKET_BYTES = 4 << 20
DEFAULT_GPU_BUCKET_BYTES = 100 << 20


def default_bucket_bytes(device: torch.device) -> int:
    """Bucket bytes for gradients on ``device`` when neither the job nor a probe chose them."""
    return DEFAULT_GPU_BUCKET_BYTES if device.type == "cuda" else DEFAULT_BUCKET_BYTES


@runtime_checkable
class BucketCommunicator(Protocol):
    """Sums a bucket taken out of the parameters' gradients into a slice kept
    (``FlatParameters.keep_gradient_slice``)."""

    def start_bucket(self, bucket: torch.Tensor, first: int) -> PendingReduce:
        """Start summing ``bucket``, the gradient entries from ``first`` (of the whole vector)
        on; what falls in the slice kept ends there, summed over every rank."""
        ...


@dataclass(frozen=True)
class _At:
    """``comm`` as a ``Communicator`` for one bucket starting at gradient entry ``first``."""

    comm: BucketCommunicator
    first: int

    def start_sum(self, tensor: torch.Tensor) -> PendingReduce:
        return self.comm.start_bucket(tensor, self.first)


@dataclass(frozen=True)
class Bucket:
    start: int
    end: int
    params: tuple[int, ...]  # indices into FlatParameters.params


def plan_buckets(
    ranges: list[tuple[int, int]], capacity: int, first_capacity: int, floor: int = 0
) -> list[Bucket]:
    """Group parameters (given by their ``(start, end)`` buffer ranges, in parameter order and
    contiguous) into buckets of at most ``capacity`` elements, in reverse order, the first at
    most ``first_capacity``. A parameter larger than the capacity gets a bucket of its own.
    The last bucket extends down to element ``floor``. Returns buckets in launch order.
    """
    if capacity < 1 or first_capacity < 1:
        raise ValueError(f"bucket capacities must be >= 1, got {capacity} and {first_capacity}")
    buckets: list[Bucket] = []
    members: list[int] = []
    limit = min(first_capacity, capacity)
    for index in reversed(range(len(ranges))):
        size = ranges[index][1] - ranges[index][0]
        current = ranges[members[0]][1] - ranges[members[-1]][0] if members else 0
        if members and current + size > limit:
            buckets.append(Bucket(ranges[members[-1]][0], ranges[members[0]][1], tuple(members)))
            members, limit = [], capacity
        members.append(index)
    if members:
        buckets.append(Bucket(floor, ranges[members[0]][1], tuple(members)))
    return buckets


class GradientReducer:
    """Sums the flat gradient buffer across ranks, bucket by bucket (with a gradient slice
    kept, ``FlatParameters.keep_gradient_slice``: the parameters' own gradients, each bucket
    taken out of them as it goes, into the slice).

    Per step: ``arm()`` right before the final backward (only that one overlaps: earlier passes
    of the step accumulate locally), then ``finish()`` after it. With ``overlap`` off, ``finish``
    launches every bucket. ``finish`` returns the seconds spent waiting: the exposed part of
    communication.

    ``group`` is the process group ``comm`` runs on: each bucket's hand-off (the wait on its
    marks) is queued on its communication thread. ``marks``: how the hand-off is ordered,
    by default ``stream_marks`` of the buffer's device (CUDA events on a GPU, none on the CPU).
    """

    def __init__(
        self,
        grads: FlatParameters,
        comm: Communicator,
        bucket_bytes: int,
        overlap: bool,
        extra_comm: Communicator | None = None,
        group: CommGroup | None = None,
        marks: StreamMarks | None = None,
    ) -> None:
        element = grads.buffer.element_size()
        self.grads = grads
        self.comm = comm
        # Checked once here, not per bucket: the slice is kept from the group's join on.
        self._bucket_comm = comm if isinstance(comm, BucketCommunicator) else None
        self.overlap = overlap
        self.group = group
        self.marks = marks if marks is not None else stream_marks(grads.buffer.device)
        if self.marks is not None and group is None:
            raise ValueError("a reducer on a device with streams needs the group whose thread reads its buckets")
        # An inexact (compressed) ``comm`` must not touch the bookkeeping slots: with
        # ``extra_comm`` they are summed apart, exactly, after the buckets.
        self.extra_comm = extra_comm
        floor = grads.extra.numel() if extra_comm is not None else 0
        self.buckets = plan_buckets(
            grads.ranges, max(1, bucket_bytes // element), max(1, FIRST_BUCKET_BYTES // element), floor
        )
        self._bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self._missing: list[int] = []
        self._ready: set[int] = set()  # parameters whose gradient hook fired this backward
        self._late: set[int] = set()  # ... again after their bucket went out
        # Per bucket, the streams its parameters' hooks noted this backward (GPU only), in order.
        self._streams: list[dict[object, None]] = []
        self._pending: list[PendingReduce] = []
        self._taken: list[torch.Tensor] = []  # buckets taken out of the parameters, while summed
        self._armed = False
        self._hooks = (
            [param.register_post_accumulate_grad_hook(self._hook(i)) for i, param in enumerate(grads.params)]
            if overlap
            else []
        )

    def close(self) -> None:
        """Remove the gradient hooks (the reducer is bound to one process group)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._armed = False

    def _hook(self, index: int):  # noqa: ANN202 - autograd hook signature
        # A hook can fire more than once in one backward: reentrant activation checkpointing
        # runs a backward per checkpointed segment, and a parameter shared by two segments
        # accumulates in each. A bucket counts each parameter once, so a repeat never launches
        # it before its other parameters; a repeat after the launch (its sum already reading
        # the gradient) is noted, and ``finish`` fails the step naming it.
        def on_ready(_: torch.Tensor) -> None:
            if not self._armed:
                return
            bucket = self._bucket_of[index]
            if bucket < len(self._pending):
                self._late.add(index)
                return
            if self.marks is not None:  # this hook runs on the stream that accumulated the gradient
                self._streams[bucket][self.marks.current()] = None
            if index in self._ready:
                return
            self._ready.add(index)
            self._missing[bucket] -= 1
            self._launch_ready()

        return on_ready

    def _launch_ready(self) -> None:
        while len(self._pending) < len(self.buckets) and self._missing[len(self._pending)] == 0:
            index = len(self._pending)
            marks = self.marks
            # Recorded now, after every hook of the bucket: each covers its stream's writes so far.
            self._launch(index, [] if marks is None else [marks.record(s) for s in self._streams[index]])

    def _launch(self, index: int, marks: list[object]) -> None:
        bucket = self.buckets[index]
        if not self.grads.sliced:
            self._pending.append(self._start(self.comm, self.grads.buffer[bucket.start : bucket.end], marks))
            return
        # A slice kept: the bucket's gradients are taken out of the parameters (freed) into a
        # tensor of its own, on this thread's stream once it is ordered after their writers'.
        if self.marks is not None:
            for mark in marks:
                self.marks.wait(mark)
        comm = self._bucket_comm
        if comm is None:
            raise TypeError("a reducer over a gradient slice needs a communicator that sums whole buckets into it")
        taken = self.grads.take_gradients(bucket.params)
        first = self.grads.ranges[min(bucket.params)][0] - self.grads.extra.numel()
        # Held here until the step's waits are over, so that it is freed on this thread (the
        # sum lets go of it as it ends): the memory probe sees only its own thread's frees.
        self._taken.append(taken)
        self._pending.append(self._start(_At(comm, first), taken, self._mark_here()))

    def _mark_here(self) -> list[object]:
        """A mark on this thread's current stream, as a hand-off's list ([] on the CPU)."""
        return [] if self.marks is None else [self.marks.record()]

    def _start(self, comm: Communicator, tensor: torch.Tensor, marks: list[object]) -> PendingReduce:
        """Hand ``tensor`` to ``comm`` from the compute thread: the communication thread first
        waits for ``marks`` (those of the streams that wrote it), then sums it."""
        handoff, group = self.marks, self.group
        if handoff is not None and group is not None and marks:

            def wait_for_writers() -> None:
                for mark in marks:
                    handoff.wait(mark)

            # Queued before the sum (the thread runs in order), so nothing of it reads the
            # bucket before the wait. Its PendingOp is not waited for: the sum's is.
            group.submit(wait_for_writers, "bucket hand-off")
        return comm.start_sum(tensor)

    def arm(self) -> None:
        """Call right before the step's final backward: buckets go out as their grads are ready."""
        self._missing = [len(b.params) for b in self.buckets]
        self._ready, self._late = set(), set()
        self._streams = [{} for _ in self.buckets]
        self._pending = []
        self._armed = self.overlap

    def finish(self, watch: Callable[[], float | None] | None = None) -> float:
        """Launch what backward did not, wait for every bucket; returns seconds waited.

        ``watch`` (the step's rescue watch, ``workers/step/rescue_watch.py``) is called while a
        bucket is still being summed: at once, then again after the seconds it returns each
        time, until it returns None; it must return None once it has nothing more to do or the
        abort flag is up (the wait proper, with its abort and timeout, comes after it)."""
        started = time.perf_counter()
        if not self._armed:
            self._pending = []
        self._armed = False
        # After backward: this stream is ordered after every stream that wrote a gradient.
        after = self._mark_here()
        for index in range(len(self._pending), len(self.buckets)):
            self._launch(index, after)
        if self.extra_comm is not None and self.grads.extra.numel():
            self._pending.append(self._start(self.extra_comm, self.grads.extra, after))
        late, self._late = sorted(self._late), set()
        try:
            if watch is not None:
                self._watch_while_summing(watch)
            for pending in self._pending:
                pending.wait()
        finally:
            self._pending, self._taken = [], []
        if late:
            raise RuntimeError(
                f"parameters {late[:8]} got gradient after their bucket was reduced (their gradient hook fired again "
                "in one backward: reentrant activation checkpointing over a shared parameter?); use non-reentrant "
                "activation checkpointing (use_reentrant=False) or collective.overlap: false"
            )
        return time.perf_counter() - started

    def _watch_while_summing(self, watch: Callable[[], float | None]) -> None:
        """Call ``watch`` while a bucket is still being summed (see ``finish``); between its
        looks the wait ends as soon as the last bucket is summed, not at the next look."""
        next_look = time.monotonic()
        for pending in self._pending:
            while not pending.ended_within(next_look - time.monotonic()):
                delay = watch()
                if delay is None:
                    return
                next_look = time.monotonic() + delay

    def sum_whole(self) -> float:
        """Sum the whole buffer, bookkeeping included, exactly (never compressed) in one
        collective after backward; returns seconds waited. The rescue pass of a step uses it:
        it is rare, and its shards' gradient then counts the same whoever computed it. A slice
        kept, its buckets go as ``finish`` sends them (the sharded sum compresses nothing)."""
        if self.grads.sliced:
            self._armed = False
            return self.finish()
        started = time.perf_counter()
        self._start(self.extra_comm or self.comm, self.grads.buffer, self._mark_here()).wait()
        return time.perf_counter() - started
