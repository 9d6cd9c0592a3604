"""A worker's device: which GPU is its own, how batches get there, and how the thread that sends
gradients is ordered after the stream that wrote them.

**Which GPU.** A worker asks Ray for at most one GPU (``scaling.resources_per_worker``; more is
refused at validation), and Ray tells it which in ``ray.get_gpu_ids()``: ids in the node's
numbering (or, where the node's own ``CUDA_VISIBLE_DEVICES`` narrowed it, the entries of that
list). Unless ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` is set, Ray then sets the actor's
``CUDA_VISIBLE_DEVICES`` to exactly its ids, so CUDA in this process sees one GPU, index 0,
whatever its id: GPU 3 of the node is ``cuda:0`` here, and ``cuda:3`` would not exist. With that
variable set, Ray leaves ``CUDA_VISIBLE_DEVICES`` as the process inherited it: the GPU is then
the id's place in that list, or, where the variable is unset (every GPU visible, numbered as the
node numbers them), the id itself. One rule covers both (``cuda_index``): the id's place in
this process's ``CUDA_VISIBLE_DEVICES``, else the id. Workers sharing a GPU (a fraction of one,
over gloo) get the same id, so the same device.

**On every thread.** The current CUDA device is a thread's own, and every thread starts at
device 0: making the worker's current once, in the actor's constructor, would leave ``cuda:0``
current on the threads Ray runs the actor's methods on (one per concurrency group) and on our
own (communication, formation, prefetch), where allocations without an explicit device,
pinned memory and NCCL's setup would land on device 0, another worker's GPU, whenever the
worker's index is not 0 (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``). So the actor's
methods that touch CUDA make it current as they start (``on_worker_device``), and our
executors make it current on each of their threads (``inherit_device``: the device current
where the executor is made, which is one of those methods or the constructor).

**Batches.** For a CUDA device a batch is pinned where it is read (on the prefetch thread for a
step's first piece), so its ``non_blocking`` copy to the device is truly asynchronous and
overlaps with compute; a copy from pageable memory is staged through the driver and may hold
the host until the stream catches up.

**Gradients to the communication thread.** A bucket's gradients are written on whichever stream
backward ran that parameter's ops on (a model may use streams of its own), while collectives run
on the communication thread's stream: relying on both being CUDA's legacy default stream is
luck. ``StreamMarks`` orders them: each parameter's gradient hook notes its current stream (the
stream that accumulated that gradient); when the bucket is launched, the compute thread records
a mark (a CUDA event) on each stream its parameters noted, usually one, and before it reads the
bucket the communication thread makes its own stream wait on those marks
(``workers/comm/gradient_reducer.py``). A mark recorded at the launch covers everything its stream queued
before, those gradients included: one event per stream, not one per parameter (a 700M-parameter
GPT has ~440 parameters, each event a host call on both threads). On the CPU there is nothing to
order (no marks).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch


def cuda_index(gpu_id: int | str, visible: str | None) -> int:
    """The CUDA index in this process of the GPU Ray assigned as ``gpu_id``, given this
    process's ``CUDA_VISIBLE_DEVICES`` (``visible``, None if unset): the id's place in that
    list, else the id itself. Raises ValueError if the id is not in the list, or is not a
    number where there is no list."""
    wanted = str(gpu_id).strip()
    if visible is None:
        if not wanted.isdigit():
            raise ValueError(f"Ray assigned GPU {wanted!r}, which is no CUDA index, and CUDA_VISIBLE_DEVICES is unset")
        return int(wanted)
    listed = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if wanted not in listed:
        raise ValueError(f"Ray assigned GPU {wanted!r}, which CUDA_VISIBLE_DEVICES={visible!r} does not list")
    return listed.index(wanted)


def choose_device(gpu_ids: Sequence[int | str], visible: str | None, cuda_available: bool, device_count: int) -> torch.device:
    """The device a worker trains on: the CPU without assigned GPUs, else the one GPU Ray
    assigned (``gpu_ids``), as ``cuda_index`` finds it among the ``device_count`` CUDA shows
    this process. Raises RuntimeError (naming ``scaling.resources_per_worker``) if a GPU was
    assigned but torch cannot use CUDA here, if more than one was, or if the index is not a
    device CUDA shows."""
    if not gpu_ids:
        return torch.device("cpu")
    ids = sorted(str(i) for i in gpu_ids)
    if len(ids) > 1:
        raise RuntimeError(
            f"Ray assigned this worker GPUs {ids}: a worker trains on one GPU (scaling.resources_per_worker GPU: 1)"
        )
    if not cuda_available:
        raise RuntimeError(
            f"Ray assigned this worker GPU {ids[0]} (scaling.resources_per_worker), but torch {torch.__version__} "
            "here cannot use CUDA (torch.cuda.is_available() is False): install a CUDA build of torch on the "
            "workers' nodes, or ask for no GPU"
        )
    try:
        index = cuda_index(ids[0], visible)
    except ValueError as err:
        raise RuntimeError(f"{err} (scaling.resources_per_worker)") from None
    if index >= device_count:
        raise RuntimeError(
            f"Ray assigned this worker GPU {ids[0]}, cuda:{index} here, but CUDA shows {device_count} device(s) "
            f"(CUDA_VISIBLE_DEVICES={visible!r})"
        )
    return torch.device("cuda", index)


def worker_device(gpu_ids: Sequence[int | str]) -> torch.device:
    """``choose_device`` for this process (its ``CUDA_VISIBLE_DEVICES`` and CUDA), made the
    current CUDA device of the calling thread (the actor's constructor: the model, the
    optimizer and the loss scaler are made there). ``gpu_ids``: ``ray.get_gpu_ids()`` in an
    actor, [] elsewhere."""
    available = torch.cuda.is_available()
    device = choose_device(
        gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"), available, torch.cuda.device_count() if available else 0
    )
    make_current(device)
    return device


def make_current(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for another device)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def inherit_device() -> Callable[[], None]:
    """An executor's ``initializer``: makes the CUDA device current on the calling thread (the
    one making the executor) current on each of the executor's threads; does nothing where
    this process has not initialized CUDA (a CPU worker never does)."""
    if not torch.cuda.is_initialized():
        return _on_the_cpu
    return functools.partial(torch.cuda.set_device, torch.cuda.current_device())


def _on_the_cpu() -> None:
    """``inherit_device``'s initializer without CUDA: nothing to make current."""


Method = TypeVar("Method", bound=Callable[..., Any])


def on_worker_device(method: Method) -> Method:
    """Decorates an actor method that touches CUDA: its ``self.device`` is made current on the
    thread Ray runs it on (one per concurrency group, each started at device 0) first."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        make_current(self.device)
        return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to each tensor in it (a tensor, or tuples, lists and dicts of
    them, nested); anything else as is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    return batch


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in page-locked memory (itself if it is there already, or not on the CPU)."""
    if tensor.device.type != "cpu" or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def host_batch(batch: Any, device: torch.device, pin: Callable[[torch.Tensor], torch.Tensor] = pin) -> Any:
    """``batch`` as it should wait on the host for ``device``: its CPU tensors pinned (``pin``)
    for a CUDA device, so the copy there overlaps with compute; as it is otherwise."""
    if device.type != "cuda":
        return batch
    return map_tensors(batch, pin)


class StreamMarks(Protocol):
    """Marks that order one thread's stream after work another thread queued on its own."""

    def current(self) -> object:
        """On the producing thread: its current stream (a handle for ``record``; hashable)."""
        ...

    def record(self, stream: object = None) -> object:
        """On the producing thread: a mark after everything queued so far on ``stream`` (by
        default its current stream)."""
        ...

    def wait(self, mark: object) -> None:
        """On the consuming thread: make its current stream's later work wait for ``mark``."""
        ...

    def done(self, mark: object) -> bool:
        """Whether everything ``mark`` covers has run (never blocks)."""
        ...

    def own_stream(self) -> object:
        """A new stream of the device, for a thread of its own (the communication thread's)."""
        ...

    def use(self, stream: object) -> None:
        """Make ``stream`` (``own_stream``'s) the calling thread's current stream."""
        ...


class CudaStreamMarks:
    """``StreamMarks`` as CUDA events on ``device``'s current streams (neither call blocks the host)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def record(self, stream: object = None) -> torch.cuda.Event:
        assert stream is None or isinstance(stream, torch.cuda.Stream)
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, mark: object) -> None:
        assert isinstance(mark, torch.cuda.Event)
        torch.cuda.current_stream(self.device).wait_event(mark)

    def done(self, mark: object) -> bool:
        assert isinstance(mark, torch.cuda.Event)
        return mark.query()

    def own_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def use(self, stream: object) -> None:
        assert isinstance(stream, torch.cuda.Stream)
        torch.cuda.set_stream(stream)


def stream_marks(device: torch.device) -> StreamMarks | None:
    """The marks ordering work on ``device`` across threads: CUDA events for a CUDA device,
    None (nothing to order: CPU ops are done when they return) otherwise."""
    return CudaStreamMarks(device) if device.type == "cuda" else None
