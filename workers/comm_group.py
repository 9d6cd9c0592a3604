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

Point-to-point traffic goes only through ``CommGroup.exchange``: one call posts a set of sends
and receives as one group (NCCL: one coalesced launch, so no send waits on a receive posted
after it, and every exchange runs on the group's one communicator, made at formation), and
returns one handle. Tags are not used: NCCL ignores them, so between a pair of ranks a
receive takes the message of the send posted in the same place of their order; gloo is
given the same single tag, so both backends match messages in posting order alone.

Formation (``form_process_group``) runs in ``call_abortable``: with NCCL the communicator is
created eagerly on the worker's device and proven by a first one-element all-reduce, so the
whole rendezvous is inside the abortable, deadline-bounded wait, and a formation that fails
or is given up aborts what it made. Every NCCL group is released when it ends (``release``:
a failed formation's and a broken group's aborted, a healthy closed one's shut down) on a
thread of its own that nobody waits for past ``RELEASE_WAIT_S``: torch's abort can itself
wait (see ``release``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from datetime import timedelta
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from workers.devices import inherit_device

# How often a waiting caller looks at the abort flag: the bound on how late an abort is seen.
ABORT_POLL_S = 0.02
# How often the communication thread looks whether an NCCL op has completed (short: it is
# latency added to every op of a ring).
COMPLETION_POLL_S = 0.0002
# The NCCL environment for in-place recovery, each set only where the user has not chosen:
# - TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): a collective that times out or fails
#   aborts its communicators and keeps the process; torch's default (3) tears the process
#   down, turning one dead peer into the death of every survivor.
# - TORCH_NCCL_ENABLE_MONITORING=0: torch's heartbeat monitor kills the process (std::abort)
#   when its watchdog has been stuck TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 min) - e.g. in the
#   ncclCommAbort of a dead peer's communicator - and, in the process's first NCCL group,
#   a while after any rank flagged a timeout on the shared store (a key never cleared there,
#   so a replacement worker would read an old generation's flag and die minutes later).
#   Survivors must live for in-place recovery: every wait of ours is bounded by our own
#   deadline and the driver's abort, and a worker truly wedged in CUDA stops answering
#   progress probes and is replaced as lost (docs/architecture.md, Recovery).
NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
# TORCH_NCCL_NONBLOCKING_TIMEOUT (set to the collective timeout, where the user has not chosen,
# by ``new_process_group``): how long torch waits, holding the communicator's mutex, for a
# non-blocking communicator to become ready (NCCLComm::getNcclComm -> waitReady) before it
# raises; torch's default is 30 min. An abort takes that mutex, so it waits that long behind a
# formation stuck on a dead peer (``release``). Torch reads it once per process, at its first
# NCCL communicator: a job's groups all have the same collective timeout.
NONBLOCKING_TIMEOUT_VARIABLE = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
# How long a caller waits for an NCCL group's release (``release``) before going on without it.
RELEASE_WAIT_S = 5.0

T = TypeVar("T")


class PendingOp:
    """A queued collective; ``wait`` returns when it is done or raises why it never will."""

    def __init__(self, future: Future[None], group: CommGroup, what: str) -> None:
        self._future = future
        self._group = group
        self._what = what

    def ended_within(self, timeout_s: float) -> bool:
        """Block until the operation has ended or ``timeout_s`` passed; whether it has ended."""
        return bool(wait_futures([self._future], timeout=max(0.0, timeout_s)).done)

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
    pool = ThreadPoolExecutor(1, thread_name_prefix="ringleader-abortable", initializer=inherit_device())
    future = pool.submit(operation)
    pool.shutdown(wait=False)
    return wait_abortable(future, abort_flag, timeout_s, what)


def poll_work(work: dist.Work, stopped: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for NCCL-like ``work`` (whose ``wait()`` does not block the CPU) by polling
    ``is_completed()`` every ``COMPLETION_POLL_S``; raises CollectiveAborted (``"<what> was
    aborted"``) once ``stopped()`` and CollectiveTimeout (``"<what> did not finish within
    <t>s"``) after ``timeout_s``. Work that ended in an error (a watchdog timeout, a remote
    error, an abort) also counts as completed: ``wait()`` then raises that error instead of
    letting half-reduced values on."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if stopped():
            raise CollectiveAborted(f"{what} was aborted")
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"{what} did not finish within {timeout_s:.0f}s")
        time.sleep(COMPLETION_POLL_S)
    work.wait()


def new_process_group(
    backend: str, store: dist.Store, rank: int, size: int, timeout_s: float
) -> dist.ProcessGroup:
    """A standalone gloo or NCCL process group over ``store`` (not torch's default group).

    Gloo's constructor is the whole rendezvous (it connects every pair). NCCL's only makes the
    object: ``form_process_group`` connects it. Its communicators are created non-blocking
    (as torchft does), so ``abort()`` can end one still being set up with a dead peer (once
    torch's wait for it, bounded by the non-blocking timeout, lets go: ``release``); the NCCL
    environment (``NCCL_ENVIRONMENT``, and the non-blocking timeout: ``timeout_s``) is set
    first, where the user has not chosen."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        # Read when the process group (or, the timeout, its first communicator) is made.
        for name, value in {**NCCL_ENVIRONMENT, NONBLOCKING_TIMEOUT_VARIABLE: str(max(1, math.ceil(timeout_s)))}.items():
            os.environ.setdefault(name, value)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.config.blocking = False
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"unsupported backend {backend!r}; expected 'gloo' or 'nccl'")


class _Formation:
    """One attempt to form a process group, which its caller may give up on at any moment
    (abort, deadline): whatever it made by then, or makes after, is aborted, and its thread
    ends instead of waiting in a rendezvous nobody will finish."""

    def __init__(self, abort_flag: threading.Event) -> None:
        self._abort_flag = abort_flag
        self._given_up = threading.Event()
        self._lock = threading.Lock()
        self._pg: dist.ProcessGroup | None = None

    def _stopped(self) -> bool:
        return self._abort_flag.is_set() or self._given_up.is_set()

    def run(
        self, backend: str, store: dist.Store, rank: int, size: int, timeout_s: float, device: torch.device
    ) -> dist.ProcessGroup:
        """Construct the group, then (NCCL) create its communicator on ``device`` and run a
        first one-element all-reduce on it: with non-blocking communicators the connection is
        only proven once a collective completes. Runs on ``call_abortable``'s thread."""
        pg = new_process_group(backend, store, rank, size, timeout_s)
        with self._lock:  # either give_up sees this group and aborts it, or this sees give_up
            given_up = self._given_up.is_set()
            if not given_up:
                self._pg = pg
        if given_up:  # given up while it was being constructed
            release(pg, graceful=False, name="ringleader-abortable-release")
            raise CollectiveAborted("the process group was formed after its formation was given up")
        if backend == "nccl":
            pg.eager_connect_single_device(device)
            first = pg.allreduce([torch.zeros(1, device=device)], dist.AllreduceOptions())
            poll_work(first, self._stopped, timeout_s, f"the first collective of rank {rank}")
        return pg

    def give_up(self) -> None:
        """Abort what was made, without waiting past ``RELEASE_WAIT_S`` (``release``): a
        formation thread waiting for NCCL's communicator then ends, at the latest once torch's
        wait for the communicator (TORCH_NCCL_NONBLOCKING_TIMEOUT) gives up."""
        with self._lock:
            self._given_up.set()
            pg, self._pg = self._pg, None
        if pg is not None:
            release(pg, graceful=False, name="ringleader-abortable-release")


def release(pg: dist.ProcessGroup, *, graceful: bool, name: str) -> bool:
    """Free ``pg``'s communicators on a daemon thread named ``name``, waiting for it at most
    ``RELEASE_WAIT_S``; returns whether it finished by then. ``graceful``: ``shutdown()``,
    which lets the group's last sends reach their peers before destroying it (a healthy
    group: its queued work done), falling back to ``abort()`` if that fails; otherwise
    ``abort()``, which ends kernels still waiting on a dead peer. An error of either is
    dropped: the group is dropped all the same.

    Never waited for past the bound, because torch's abort may wait itself: ``NCCLComm::abort``
    takes the communicator's mutex, which ``NCCLComm::getNcclComm`` holds while it waits for a
    non-blocking communicator to become ready (``waitReady``, until TORCH_NCCL_NONBLOCKING_TIMEOUT),
    so aborting a group whose first collective still waits on a dead peer returns only then.
    The thread ends on its own by that time."""

    def free() -> None:
        if graceful:
            try:
                pg.shutdown()
                return
            except RuntimeError:
                pass  # a peer gone mid-flush, a timeout: abort instead
        try:
            pg.abort()
        except RuntimeError:
            pass  # nothing more can be done for it: the group is dropped either way

    thread = threading.Thread(target=free, name=name, daemon=True)
    thread.start()
    thread.join(RELEASE_WAIT_S)
    return not thread.is_alive()


def form_process_group(
    backend: str,
    store: dist.Store,
    rank: int,
    size: int,
    *,
    timeout_s: float,
    deadline_s: float,
    abort_flag: threading.Event,
    device: torch.device,
) -> dist.ProcessGroup:
    """Form and connect a process group (``new_process_group``; NCCL: its communicator made
    eagerly on ``device`` and proven by a first collective) inside ``call_abortable``, so an
    abort or ``deadline_s`` ends the wait wherever the formation is. ``timeout_s``: the
    group's collective timeout. A CUDA ``device`` without an index means the current device.

    Raises CollectiveAborted, CollectiveTimeout or the formation's own error; on any of them
    the group made so far is aborted (``release``: never waited for past ``RELEASE_WAIT_S``)
    and the formation thread, abandoned, ends by itself: with NCCL once the abort has ended its
    wait for the communicator, at the latest at TORCH_NCCL_NONBLOCKING_TIMEOUT. One wait no
    abort can end: NCCL's unique id goes from rank 0 to the others through ``store``, so if
    rank 0 died before publishing it, the others' formation threads wait in ``store.get``
    until the store's own timeout (``JoinRequest.timeout_s``) and then end."""
    if device.type == "cuda" and device.index is None:
        # torch keys the eager communicator by the device's index: without one it would make
        # none now, and the real one later, lazily, on cuda:0 whatever the current device.
        device = torch.device("cuda", torch.cuda.current_device())
    formation = _Formation(abort_flag)
    try:
        return call_abortable(
            lambda: formation.run(backend, store, rank, size, timeout_s, device), abort_flag, deadline_s, "rendezvous"
        )
    except BaseException:
        formation.give_up()
        raise


class Exchange:
    """Sends and receives posted as one group by ``CommGroup.exchange``; ``complete`` waits
    (on the communication thread) until all of them are done. Until then no sent tensor may
    be written and no received one read."""

    def __init__(self, group: CommGroup, works: list[dist.Work]) -> None:
        self._group = group
        self._works = works

    def complete(self) -> None:
        for work in self._works:
            self._group.complete(work)


class CommGroup:
    """``size`` ranks, this one being ``rank``, over the process group ``pg``.

    ``timeout_s`` bounds every wait; ``abort_flag`` is shared with whoever may abort (the actor's
    control thread). Operations queued with ``submit`` run on the communication thread; they
    exchange tensors with ``exchange`` and wait for each torch ``Work`` with ``complete``.
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
        # NCCL coalesces (torch's batch_isend_irecv asks the same property); gloo cannot, and
        # needs not: its sends never wait for the peer's receive.
        self._coalesce = bool(getattr(pg, "supports_coalescing", False))
        # Made on join_group's thread, where the worker's device is current: so is it on this one.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"ringleader-comm-r{rank}", initializer=inherit_device())

    def submit(self, operation: Callable[[], None], what: str) -> PendingOp:
        """Queue ``operation`` (blocking torch.distributed calls on ``pg``) after those before it."""
        if self.broken is not None:
            raise CollectiveAborted(f"the process group is broken ({self.broken}); re-form it")
        return PendingOp(self._thread.submit(operation), self, what)

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
        match, and keep each group's shapes alike on both sides."""
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
        CollectiveAborted or CollectiveTimeout, so nothing reads a value before it arrived."""
        if not self.poll_completion:
            work.wait()
            return
        poll_work(work, self.abort_flag.is_set, self.timeout_s, f"a collective on rank {self.rank}")

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
        of SIGABRT on its way out (pytorch/pytorch#190489). The group is unusable after close."""
        healthy = self.broken is None
        self._thread.shutdown(wait=healthy, cancel_futures=not healthy)
        if self.poll_completion:
            release(self.pg, graceful=healthy, name=f"ringleader-comm-r{self.rank}-release")
        elif healthy:
            del self.pg
