"""Making a standalone gloo or NCCL process group, proving it connected, and releasing it.

The process group is a ``ProcessGroupGloo``/``ProcessGroupNCCL`` object of our own rather than
torch's global default group, so a broken generation can be dropped while its thread is still
stuck in it, and the next one formed beside it.

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
from datetime import timedelta

import torch
import torch.distributed as dist

from jobspec.failures import CollectiveAborted
from workers.runtime.abortable import call_abortable, poll_work

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
