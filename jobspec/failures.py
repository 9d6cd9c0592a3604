"""Failures a worker raises that cross the actor boundary and the driver classifies: a collective
that timed out or was aborted (the group must re-form), a step whose shards were miscounted."""

from __future__ import annotations


class CollectiveTimeout(RuntimeError):
    """A collective did not finish within its timeout (a peer died, hung or is far behind)."""


class CollectiveAborted(RuntimeError):
    """The driver raised the abort flag while a collective was pending."""


class ShardCensusError(RuntimeError):
    """After the all-reduce some shard was counted zero or several times: the step is invalid."""
