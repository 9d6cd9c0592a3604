"""One generation of the workers' process group, and the thread that runs its collectives.

Every collective is queued to a single communication thread, in call order, so every rank
issues the same sequence of operations, and runs there with blocking torch.distributed calls.
Callers hold a ``PendingOp`` and wait on it: that wait polls the abort flag (raised by the
driver when it sees a death) and a deadline, so no caller blocks past its timeout even where
gloo would (a survivor two hops from a dead rank waits in gloo until the process-group timeout,
and ``abort()`` does not free it). After an abort or a timeout the group is broken: ``close``
abandons it and a new generation (a new store prefix) is formed.

The process group is a ``ProcessGroupGloo``/``ProcessGroupNCCL`` object of our own rather than
torch's global default group, so a broken generation can be dropped while its thread is still
stuck in it, and the next one formed beside it.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from jobspec.failures import CollectiveAborted, CollectiveTimeout

# How often a waiting caller looks at the abort flag: the bound on how late an abort is seen.
ABORT_POLL_S = 0.02
# How often the communication thread looks whether an NCCL op has completed (short: it is
# latency added to every op of a ring).
COMPLETION_POLL_S = 0.0002
# TORCH_NCCL_ASYNC_ERROR_HANDLING's CleanUpOnly: abort communicators, do not kill the process.
NCCL_CLEAN_UP_ONLY = "2"

T = TypeVar("T")


class PendingOp:
    """A queued collective; ``wait`` returns when it is done or raises why it never will."""

    def __init__(self, future: Future[None], group: CommGroup, what: str) -> None:
        self._future = future
        self._group = group
        self._what = what

    def done(self) -> bool:
        """Whether the operation has ended (``wait`` then returns or raises at once)."""
        return self._future.done()

    def wait(self) -> None:
        """Block until done. Raises CollectiveAborted, CollectiveTimeout (both break the group)
        or the error the operation itself raised; a RuntimeError from the operation (gloo/NCCL:
        a peer closed its connection, ...) breaks the group too and becomes CollectiveTimeout."""
        group = self._group
        try:
            wait_abortable(
                self._future, group.abort_flag, group.timeout_s, self._what,
                detail=f"rank {group.rank} of {group.size}; a peer died, hung or is far behind",
            )
        except RuntimeError as err:
            if not _raised_by(self._future, err):  # the wait's own CollectiveAborted or CollectiveTimeout
                aborted = isinstance(err, CollectiveAborted)
                group.broken = f"{'aborted' if aborted else 'timed out'} during {self._what}"
                raise
            # gloo/NCCL errors: a peer closed its connection, ...
            group.broken = f"failed during {self._what}: {err}"
            raise CollectiveTimeout(f"{self._what} failed on rank {group.rank}: {err}") from err


def wait_abortable(
    future: Future[T], abort_flag: threading.Event, timeout_s: float, what: str, *, detail: str = ""
) -> T:
    """Wait for ``future`` for at most ``timeout_s`` seconds, looking at ``abort_flag`` every
    ``ABORT_POLL_S`` (gloo may block far longer than our timeout, and only the driver knows a
    peer has died). Returns its result, or re-raises the error it ended with, as is.

    Raises CollectiveAborted (``"<what> aborted by the driver"``) if the flag is up first, even
    if the future is done too, and CollectiveTimeout (``"<what> did not finish within <t>s"``,
    then ``(detail)`` if given) once the deadline passes. The future is left running either way.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if abort_flag.is_set():
            raise CollectiveAborted(f"{what} aborted by the driver")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            suffix = f" ({detail})" if detail else ""
            raise CollectiveTimeout(f"{what} did not finish within {timeout_s:.0f}s{suffix}")
        # wait(), not result(timeout): an operation that itself raised TimeoutError must not
        # look like one more poll that timed out.
        done, _ = wait_futures([future], timeout=min(ABORT_POLL_S, remaining))
        if done:
            return future.result()


def _raised_by(future: Future[object], err: BaseException) -> bool:
    """Whether ``err`` is the error ``future``'s operation ended with (not one raised while
    waiting for it)."""
    return future.done() and not future.cancelled() and future.exception() is err


def call_abortable(operation: Callable[[], T], abort_flag: threading.Event, timeout_s: float, what: str) -> T:
    """Run ``operation`` (blocking, e.g. forming a process group, which waits in the store for
    every rank) on its own thread and wait for it, polling ``abort_flag``: a rank that died
    during a re-forming would otherwise hold the others until the rendezvous timeout. On abort
    or timeout the thread is abandoned (it ends at its own timeout) and CollectiveAborted or
    CollectiveTimeout is raised; the operation's own error is re-raised."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="ringleader-abortable")
    future = pool.submit(operation)
    pool.shutdown(wait=False)
    return wait_abortable(future, abort_flag, timeout_s, what)


def new_process_group(
    backend: str, store: dist.Store, rank: int, size: int, timeout_s: float
) -> dist.ProcessGroup:
    """A standalone gloo or NCCL process group over ``store`` (not torch's default group).

    For NCCL, asynchronous error handling is set to clean up only (abort the communicators, keep
    the process) unless the user chose otherwise: torch's default tears the whole process down
    when a collective times out, which would turn one dead peer into the death of every
    survivor instead of an in-place recovery."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_CLEAN_UP_ONLY)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"unsupported backend {backend!r}; expected 'gloo' or 'nccl'")


class CommGroup:
    """``size`` ranks, this one being ``rank``, over the process group ``pg``.

    ``timeout_s`` bounds every wait; ``abort_flag`` is shared with whoever may abort (the actor's
    control thread). Operations queued with ``submit`` run on the communication thread and wait
    for each torch ``Work`` with ``complete``. ``poll_completion`` (NCCL): ``Work.wait()`` does
    not block the CPU there (it only orders the current CUDA stream), so completion is polled
    with ``is_completed()`` against the abort flag and the deadline, and a broken group's
    communicators are aborted when it closes.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        rank: int,
        size: int,
        timeout_s: float,
        abort_flag: threading.Event,
        poll_completion: bool = False,
    ) -> None:
        self.pg = pg
        self.poll_completion = poll_completion
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.abort_flag = abort_flag
        #: Why the group can no longer be used, or None while it is healthy.
        self.broken: str | None = None
        #: Bytes handed to point-to-point sends and native all-reduces (their 2(n-1)/n share).
        self.bytes_sent = 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"ringleader-comm-r{rank}")

    def submit(self, operation: Callable[[], None], what: str) -> PendingOp:
        """Queue ``operation`` (blocking torch.distributed calls on ``pg``) after those before it."""
        if self.broken is not None:
            raise CollectiveAborted(f"the process group is broken ({self.broken}); re-form it")
        return PendingOp(self._thread.submit(operation), self, what)

    # Blocking point-to-point and collective primitives, for operations run on the comm thread.

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> dist.Work:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return self.pg.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> dist.Work:
        return self.pg.recv([tensor], src, tag)

    def complete(self, work: dist.Work) -> None:
        """Block (on the communication thread) until ``work`` has finished. Gloo's ``wait()``
        blocks until then (a caller's PendingOp.wait polls the abort flag meanwhile). NCCL's
        returns at once, and a dead peer would surface later in a CUDA sync that never ends
        (reading the census): its work is polled until done, raising CollectiveAborted or
        CollectiveTimeout, so nothing reads a reduced value before the op has completed."""
        if not self.poll_completion:
            work.wait()
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if self.abort_flag.is_set():
                raise CollectiveAborted("a collective was aborted by the driver")
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"a collective did not finish within {self.timeout_s:.0f}s (rank {self.rank})")
            time.sleep(COMPLETION_POLL_S)
        # NCCL work that ended in an error (a watchdog timeout, a remote error, an abort) also
        # counts as completed: wait() raises that error instead of letting half-reduced values on.
        work.wait()

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Blocking broadcast from ``root`` (queued behind pending operations)."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        self.submit(lambda: self.complete(self.pg.broadcast([tensor], options)), "broadcast").wait()

    def close(self) -> None:
        """Stop taking work. A healthy group's thread finishes what is queued; a broken group's
        thread may stay blocked in gloo until the process-group timeout or the peer's death,
        so it is abandoned rather than joined. A broken polled (NCCL) group's communicators are
        aborted, which ends its kernels still waiting on a dead peer."""
        self._thread.shutdown(wait=self.broken is None, cancel_futures=self.broken is not None)
        if self.broken is not None and self.poll_completion and hasattr(self.pg, "abort"):
            self.pg.abort()
