"""Waits that an abort flag and a deadline can end, wherever the thing waited for is stuck.

gloo may block far past our timeout (a survivor two hops from a dead rank waits until the
process-group timeout, and ``abort()`` does not free it), NCCL's ``wait()`` does not block the
CPU at all, and only the driver knows a peer has died: every wait of the workers' collectives
and rendezvous goes through these, polling the abort flag the driver raises and a deadline.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Callable, TypeVar

import torch.distributed as dist

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from workers.runtime.devices import inherit_device

# How often a waiting caller looks at the abort flag: the bound on how late an abort is seen.
ABORT_POLL_S = 0.02
# How often the communication thread looks whether an NCCL op has completed (short: it is
# latency added to every op of a ring).
COMPLETION_POLL_S = 0.0002
T = TypeVar("T")


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


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Poll ``done`` every ``COMPLETION_POLL_S`` until it is true or ``time.monotonic()``
    passes ``deadline``; whether it became true."""
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(COMPLETION_POLL_S)
    return True


def poll_done(done: Callable[[], bool], stopped: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``done()`` every ``COMPLETION_POLL_S`` until it is true; raises CollectiveAborted
    (``"<what> was aborted"``) once ``stopped()`` and CollectiveTimeout (``"<what> did not
    finish within <t>s"``) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if stopped():
            raise CollectiveAborted(f"{what} was aborted")
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"{what} did not finish within {timeout_s:.0f}s")
        time.sleep(COMPLETION_POLL_S)


def poll_work(work: dist.Work, stopped: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for NCCL-like ``work`` (whose ``wait()`` does not block the CPU) by polling
    ``is_completed()`` (``poll_done``). Work that ended in an error (a watchdog timeout, a
    remote error, an abort) also counts as completed: ``wait()`` then raises that error
    instead of letting half-reduced values on."""
    poll_done(work.is_completed, stopped, timeout_s, what)
    work.wait()
