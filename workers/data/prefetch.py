"""A step's first batch, read ahead of the worker sealing its shards, on threads of its own; and
the next step's, read beside it, so a step's data is usually in memory before the step starts.

Why: a slow read (a cold object store, a stuck disk, a busy data pipeline) is the most common
stall that strikes a worker without warning. Read inside the pass, after the worker sealed its
shards, it would hold the whole step (nobody may compute sealed shards); read before, while the
worker watches its claims, it is a wait its peers can end by taking the shards over
(docs/architecture.md, "Rescue"). The read then goes on in the background and its batch is
dropped; it keeps its thread, so later steps read on the others (``FETCH_THREADS``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np

from workers.runtime.devices import inherit_device

# Reads in flight at once: a stuck one keeps its thread, the next steps read beside it.
FETCH_THREADS = 4
# How often a worker waiting for its data looks whether its peers took its shards (a store
# read); the first look comes only after this long, so a batch in memory costs none.
WATCH_S = 0.002


class BatchPrefetch:
    """Reads ``indices`` with ``read(indices)`` on a pool, holds the batch until a pass with
    exactly those indices takes it. Made on a thread with the worker's device current (its
    threads inherit it, ``devices.inherit_device``)."""

    def __init__(self, read: Callable[[np.ndarray], Any]) -> None:
        self.read = read
        # The worker's device current there too: a batch for a GPU is pinned on these threads.
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="ringleader-fetch", initializer=inherit_device())
        self._indices: np.ndarray | None = None
        self._future: Future[Any] | None = None
        self._ahead_indices: np.ndarray | None = None
        self._ahead: Future[Any] | None = None

    def start(self, indices: np.ndarray, before: Callable[[], object] | None = None) -> None:
        """Begin reading ``indices`` (after ``before()``, e.g. an injected stall, on the same
        thread), or take the read ahead of exactly these (``read_ahead``); a batch read earlier
        and not taken is dropped. Without a ``before``, the read ahead is taken as it is: no
        thread stands between it and the pass (a hop through the pool cost a small model's
        step 1-2% of its time, waiting for data already read)."""
        self._indices = indices
        ahead = self._ahead if self._ahead_indices is not None and np.array_equal(self._ahead_indices, indices) else None
        if ahead is None and self._ahead is not None:
            self._ahead.cancel()  # the plan changed: a read not yet begun is not begun
        self._ahead = self._ahead_indices = None
        if ahead is None:
            self._future = self._pool.submit(self.read, indices) if before is None else self._pool.submit(
                lambda: (before(), self.read(indices))[1]
            )
            return
        if before is None:
            self._future = ahead
            return
        # The batch read ahead, after ``before()`` (on a pool thread, as for a read): no thread
        # waits on the read itself, so a stuck one holds one thread, not two.
        taken: Future[Any] = Future()
        self._future = taken

        def hand_over(done: Future[Any]) -> None:
            if done.cancelled() or done.exception() is not None:
                taken.set_exception(done.exception() if not done.cancelled() else RuntimeError("read cancelled"))
            else:
                taken.set_result(done.result())

        def after_before() -> None:
            try:
                before()
            except BaseException as err:  # noqa: BLE001 - the read's error, as a read's would be
                taken.set_exception(err)
                return
            ahead.add_done_callback(hand_over)

        self._pool.submit(after_before)

    def read_ahead(self, indices: np.ndarray) -> None:
        """Read ``indices`` (the next step's first batch, as far as this step's plan tells) now,
        beside the batch started last, for a ``start`` of exactly these to take: at most one
        batch is held ahead. Not queued behind the current read: a stalled read must not hold
        the next step's. A plan that changed starts other indices, and this read is dropped."""
        self._ahead_indices, self._ahead = indices, self._pool.submit(self.read, indices)

    def ready(self) -> bool:
        """Whether the batch started last is read (or its read failed); True if none is."""
        return self._future is None or self._future.done()

    def wait(self, given_up: Callable[[], bool]) -> bool:
        """Wait for the batch started last, asking ``given_up()`` every WATCH_S; True once it
        is read, False as soon as ``given_up()`` is (the read goes on, its batch unwanted)."""
        while self._future is not None:
            done, _ = wait_futures([self._future], timeout=WATCH_S)
            if done:
                return True
            if given_up():
                return False
        return True

    def take(self, indices: np.ndarray) -> Any | None:
        """The batch read for exactly ``indices`` (once), or None: read it yourself. Raises
        what the read raised."""
        future, wanted = self._future, self._indices
        if future is None or wanted is None or not future.done() or not np.array_equal(wanted, indices):
            return None
        self._future = self._indices = None
        return future.result()
