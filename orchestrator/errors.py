"""Errors that end a job."""

from __future__ import annotations


class JobFailed(RuntimeError):
    """The job cannot go on; the controller moves to ``Failed`` with this message (and the run
    directory's summary says why)."""


class StoreFailed(JobFailed):
    """The job's store (the rendezvous and shard-claim store the driver serves) died or an
    operation on it failed; the message names the store's address and the underlying error.
    The store is not restarted: the shard claims of the steps in flight and the rendezvous
    keys live only in it, and it is the driver's own child (or thread), so its death means
    the driver's host is in trouble."""
