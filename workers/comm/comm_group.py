"""One generation of the workers' process group, and the thread that runs its collectives.

Every collective is queued to a single communication thread, in call order, so every rank
issues the same sequence of operations, and runs there with blocking torch.distributed calls.
Callers hold a ``PendingOp`` and wait on it: that wait polls the abort flag (raised by the
driver when it sees a death) and a deadline (``workers/runtime/abortable.py``), so no caller blocks
past its timeout even where gloo would. After an abort or a timeout the group is broken:
``close`` abandons it and a new generation (a new store prefix) is formed
(``workers/comm/process_group.py``).

An abandoned operation may go on after its caller's wait raised: gloo's waits on the
communication thread never look at the abort flag, and a broken gloo group is left alive (its
thread may be blocked in it), so after a stall in which nobody died, a peer's late sends
complete its steps. Nothing of it may then reach the caller's tensors, which the next
generation uses (the gradient buffer outlives generations). So the group checks its state
before every post and after every wait (``check_live``), and an operation writes a caller's
tensor only inside ``writing``: under the lock that marking the group broken takes, so once
``broken`` is set no such write is under way or starts. Received data lands in the
operation's own scratch, never in a caller's tensor, since the backend writes a receive
whenever its send arrives (``workers/comm/ring.py``).

On a GPU the communication thread runs on a CUDA stream of its own (``marks``: the device's
``StreamMarks``), so that what it launches (NCCL's collectives wait on the launching thread's
current stream, our ring's additions and casts run there) waits only for what it was told to
wait for (a bucket's writers: ``GradientReducer``'s hand-off), never for everything backward
has queued on the compute stream. Events go both ways: every operation ends with a mark on
that stream, and whoever waits for the operation polls the mark (with the abort flag and the
deadline) and then orders its own stream after it, so nothing of the caller reads a result
before it is there. A native collective is therefore only launched on the communication
thread, never polled there: the next one launches at once, NCCL runs them in order, and the
waits poll each in turn, which costs what polling the last does.

Point-to-point traffic goes only through ``CommGroup.exchange``: one call posts a set of sends
and receives as one group (NCCL: one coalesced launch, so no send waits on a receive posted
after it, and every exchange runs on the group's one communicator, made at formation), and
returns one handle. Tags are not used: NCCL ignores them, so between a pair of ranks a
receive takes the message of the send posted in the same place of their order; gloo is
given the same single tag, so both backends match messages in posting order alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from workers.comm.process_group import release
from workers.runtime.abortable import poll_done, poll_until, poll_work, wait_abortable
from workers.runtime.devices import StreamMarks, inherit_device

# ``CommGroup.broken`` once the group is closed.
CLOSED = "closed"


class PendingOp:
    """A queued collective; ``wait`` returns when it is done or raises why it never will."""

    def __init__(self, future: Future[None], group: CommGroup, what: str) -> None:
        self._future = future
        self._group = group
        self._what = what

    def ended_within(self, timeout_s: float) -> bool:
        """Block until the operation has ended (on a GPU: its work on the device too) or
        ``timeout_s`` passed; whether it has ended."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not wait_futures([self._future], timeout=max(0.0, timeout_s)).done:
            return False
        marks, ended = self._group.marks, self._future.result() if self._future.exception() is None else None
        if marks is None or ended is None:
            return True
        return poll_until(lambda: marks.done(ended.mark), deadline)

    def wait(self) -> None:
        """Block until done. Raises CollectiveAborted, CollectiveTimeout (both break the group)
        or the error the operation itself raised; a RuntimeError from the operation (gloo/NCCL:
        a peer closed its connection, ...) breaks the group too and becomes CollectiveTimeout.
        Once it has raised, the operation writes none of its caller's tensors (``writing``)."""
        group = self._group
        detail = f"rank {group.rank} of {group.size}; a peer died, hung or is far behind"
        try:
            ended = wait_abortable(self._future, group.abort_flag, group.timeout_s, self._what, detail=detail)
            if ended is not None:
                group.await_end(ended, self._what, detail)
        except RuntimeError as err:
            if not _raised_by(self._future, err):  # the wait's own CollectiveAborted or CollectiveTimeout
                aborted = isinstance(err, CollectiveAborted)
                group.broken = f"{'aborted' if aborted else 'timed out'} during {self._what}"
                raise
            if isinstance(err, CollectiveAborted):  # the operation stopped itself (``check_live``)
                group.broken = group.broken or f"aborted during {self._what}"
                raise
            # gloo/NCCL errors: a peer closed its connection, ...
            group.broken = f"failed during {self._what}: {err}"
            raise CollectiveTimeout(f"{self._what} failed on rank {group.rank}: {err}") from err


def _raised_by(future: Future[object], err: BaseException) -> bool:
    """Whether ``err`` is the error ``future``'s operation ended with (not one raised while
    waiting for it)."""
    return future.done() and not future.cancelled() and future.exception() is err


@dataclass(frozen=True)
class _Ended:
    """An operation's end on the communication thread's stream: ``mark`` after its work there,
    and the collectives it launched without waiting for them (``CommGroup.launched``)."""

    mark: object
    works: tuple[dist.Work, ...]


class Exchange:
    """Sends and receives posted as one group by ``CommGroup.exchange``; ``complete`` waits
    (on the communication thread) until all of them are done. Until then no sent tensor may
    be written and no received one read."""

    def __init__(self, group: CommGroup, works: list[dist.Work]) -> None:
        self._group = group
        self._works = works

    def complete(self) -> None:
        """Raises CollectiveAborted if the group was abandoned meanwhile (``CommGroup.complete``)."""
        for work in self._works:
            self._group.complete(work)


class CommGroup:
    """``size`` ranks, this one being ``rank``, over the process group ``pg``.

    ``timeout_s`` bounds every wait; ``abort_flag`` is shared with whoever may abort (the actor's
    control thread). Operations queued with ``submit`` run on the communication thread; they
    exchange tensors with ``exchange`` and wait for each torch ``Work`` with ``complete``.
    ``marks`` (a GPU: the device's ``StreamMarks``): the communication thread runs on a stream
    of its own, ordered with the callers' by marks both ways (the module doc).
    ``poll_completion`` (NCCL): ``Work.wait()`` does not block the CPU there (it only orders the
    current CUDA stream), so completion is polled with ``is_completed()`` against the abort
    flag and the deadline, and its communicators are released when it closes.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        rank: int,
        size: int,
        timeout_s: float,
        abort_flag: threading.Event,
        poll_completion: bool = False,
        marks: StreamMarks | None = None,
    ) -> None:
        self.pg = pg
        self.marks = marks
        self.poll_completion = poll_completion
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.abort_flag = abort_flag
        # Held while an operation writes a caller's tensor (``writing``) and while ``broken``
        # is set: once it is, no such write is under way or starts.
        self._writes = threading.Lock()
        self._broken: str | None = None
        self._launched: list[dist.Work] = []  # the running operation's (communication thread only)
        #: Bytes handed to point-to-point sends and native all-reduces (their 2(n-1)/n share).
        self.bytes_sent = 0
        # NCCL coalesces (torch's batch_isend_irecv asks the same property); gloo cannot, and
        # needs not: its sends never wait for the peer's receive.
        self._coalesce = bool(getattr(pg, "supports_coalescing", False))
        # Made on join_group's thread, where the worker's device is current: so is it on this
        # one, with a stream of its own there.
        on_device, stream = inherit_device(), marks.own_stream() if marks is not None else None

        def start_thread() -> None:
            on_device()
            if marks is not None:
                marks.use(stream)

        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"ringleader-comm-r{rank}", initializer=start_thread)

    @property
    def broken(self) -> str | None:
        """Why the group can no longer be used, or None while it is healthy. Setting it waits
        for a write under way (``writing``) and makes every later one, every post and every
        wait's end raise CollectiveAborted: an abandoned operation changes nothing more."""
        return self._broken

    @broken.setter
    def broken(self, reason: str | None) -> None:
        with self._writes:
            self._broken = reason

    def _stopped(self) -> bool:
        return self._broken is not None or self.abort_flag.is_set()

    def check_live(self) -> None:
        """Raise CollectiveAborted if the group is broken or the abort flag is up: whatever
        runs on the communication thread then stops, rather than post or write for a caller
        who has given up on it (the flag is cleared when the next generation forms, and
        ``broken`` stays)."""
        if self._broken is not None:
            raise CollectiveAborted(f"the process group is broken ({self._broken}); its operation stops")
        if self.abort_flag.is_set():
            raise CollectiveAborted(f"rank {self.rank}'s collectives were aborted by the driver; its operation stops")

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold while writing a caller's tensor on the communication thread (a received
        segment added or copied into it). Raises CollectiveAborted instead of entering if the
        group is broken or the abort flag is up (``check_live``); a caller's wait that gives
        up marks the group broken, which waits until the write is done. Keep it short: no
        wait for a peer inside (on a GPU the write is only queued on the current stream)."""
        with self._writes:
            self.check_live()
            yield

    def submit(self, operation: Callable[[], None], what: str) -> PendingOp:
        """Queue ``operation`` (blocking torch.distributed calls on ``pg``) after those before it.
        On a GPU its work on the communication thread's stream waits for what the caller had
        queued on its own stream (a mark recorded now), and ends with a mark the ``PendingOp``
        waits for."""
        if self.broken is not None:
            raise CollectiveAborted(f"the process group is broken ({self.broken}); re-form it")
        marks = self.marks
        # What the caller queued on its stream before this: the operation's inputs.
        before = None if marks is None else marks.record()

        def run() -> _Ended | None:
            self._launched = []
            if marks is None:
                operation()
                return None
            marks.wait(before)
            operation()
            return _Ended(marks.record(), tuple(self._launched))

        return PendingOp(self._thread.submit(run), self, what)

    def await_end(self, ended: _Ended, what: str, detail: str) -> None:
        """On a caller's thread: poll until the device has run what ``ended.mark`` covers
        (raising CollectiveAborted once the group is broken or the abort flag is up,
        CollectiveTimeout after ``timeout_s``), order the caller's stream after it, and raise
        CollectiveTimeout if a collective it launched ended in an error: NCCL's watchdog
        aborts a communicator whose collective failed or timed out, its kernels exit and the
        mark after them completes all the same, over a half-reduced buffer."""
        marks = self.marks
        assert marks is not None, "marks exist only on a group with streams"
        poll_done(lambda: marks.done(ended.mark), self._stopped, self.timeout_s, f"{what} on the device ({detail})")
        marks.wait(ended.mark)
        for work in ended.works:
            try:
                work.wait()  # done: raises the error it ended in
            except RuntimeError as err:
                raise CollectiveTimeout(f"{what} failed on rank {self.rank}: {err}") from err
        self.check_live()

    def launched(self, work: dist.Work) -> None:
        """On the communication thread, after launching a collective that writes only its own
        tensors (a native one): with a stream of its own (NCCL on a GPU), order that stream after
        ``work`` and go on (its waiter polls the operation's mark); else wait for it
        (``complete``)."""
        if self.marks is not None and self.poll_completion:
            work.wait()  # NCCL: orders the current stream after the collective; never blocks the host
            self._launched.append(work)  # its error, if it ends in one, is raised to the waiter
            self.check_live()
        else:
            self.complete(work)

    # Blocking primitives, for operations run on the comm thread.

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]] = (), receives: Sequence[tuple[torch.Tensor, int]] = ()
    ) -> Exchange:
        """Post ``sends`` ((tensor, destination rank)) and ``receives`` ((tensor, source rank))
        as one group and return its handle. With NCCL they are one coalesced launch: its ops
        start together, so no send in it waits on a receive of it posted after it, whatever
        the peers; with gloo they are posted one by one (receives first), which never blocks.

        Messages carry no tag (NCCL ignores tags): between two ranks, the k-th tensor one
        sends to the other is the k-th the other receives from it, counted over every
        exchange in posting order. Every caller must post its exchanges in an order its peers
        match, and keep each group's shapes alike on both sides. Raises CollectiveAborted,
        posting nothing, if the group is broken or the abort flag is up (``check_live``)."""
        self.check_live()
        receives = [(tensor, src) for tensor, src in receives if tensor.numel()]
        sends = [(tensor, dst) for tensor, dst in sends if tensor.numel()]
        self.bytes_sent += sum(tensor.numel() * tensor.element_size() for tensor, _ in sends)
        if not self._coalesce:
            works = [self.pg.recv([tensor], src, 0) for tensor, src in receives]
            return Exchange(self, works + [self.pg.send([tensor], dst, 0) for tensor, dst in sends])
        if not sends and not receives:
            return Exchange(self, [])
        # A failure between start and end leaves the backend mid-group: it propagates, the
        # PendingOp breaks the group, and the group is aborted on close, never used again.
        self.pg._start_coalescing()
        for tensor, src in receives:
            self.pg.recv([tensor], src, 0)
        for tensor, dst in sends:
            self.pg.send([tensor], dst, 0)
        return Exchange(self, [self.pg._end_coalescing()])

    def complete(self, work: dist.Work) -> None:
        """Block (on the communication thread) until ``work`` has finished. Gloo's ``wait()``
        blocks until then (a caller's PendingOp.wait polls the abort flag meanwhile). NCCL's
        returns at once, and a dead peer would surface later in a CUDA sync that never ends
        (reading the census): its work is polled until done (``poll_work``), raising
        CollectiveAborted or CollectiveTimeout, so nothing reads a value before it arrived.

        Gloo's wait sees no abort: a late completion (a stalled peer's send, after the group
        was abandoned) returns here, then raises CollectiveAborted (``check_live``), so the
        abandoned operation ends at its first wait that does."""
        if not self.poll_completion:
            work.wait()
        else:
            poll_work(work, self._stopped, self.timeout_s, f"a collective on rank {self.rank}")
        self.check_live()

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Blocking broadcast from ``root`` (queued behind pending operations)."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        self.submit(lambda: self.complete(self.pg.broadcast([tensor], options)), "broadcast").wait()

    def close(self) -> None:
        """Stop taking work. A healthy group's thread finishes what is queued; a broken group's
        thread may stay blocked in gloo until the process-group timeout or the peer's death,
        so it is abandoned rather than joined. A polled (NCCL) group's communicators are then
        released (``release``, waited for at most ``RELEASE_WAIT_S``): a healthy group's shut
        down, freeing them now rather than whenever the object is collected after a re-form;
        a broken group's aborted, which ends its kernels still waiting on a dead peer.

        A healthy gloo group's backend is dropped, and with it (torch's destructor waits for
        gloo's work queue, then joins its worker threads, the GIL released) every tensor those
        threads still hold. Otherwise a thread that lets go of a collective's tensor late, after
        Python dropped its own reference, takes the GIL to free it; if the interpreter is
        finalizing by then, CPython ends that thread inside a noexcept frame and the process dies
        of SIGABRT on its way out (pytorch/pytorch#190489). A broken gloo group's threads may be
        blocked in gloo: abandoned with it, they keep that risk until they end.

        Once closed, ``submit`` refuses work ("closed") and a second ``close`` does nothing,
        and no operation of the group writes a caller's tensor any more (``broken``)."""
        if self._broken == CLOSED:
            return
        healthy = self._broken is None
        # A healthy group's queued work runs before ``broken`` is set, which would stop it.
        self._thread.shutdown(wait=healthy, cancel_futures=not healthy)
        self.broken = CLOSED
        if self.poll_completion:
            release(self.pg, graceful=healthy, name=f"ringleader-comm-r{self.rank}-release")
        elif healthy:
            del self.pg
