"""Errors that end a job."""

from __future__ import annotations


class JobFailed(RuntimeError):
    """The job cannot go on; the controller moves to ``Failed`` with this message (and the run
    directory's summary says why)."""
