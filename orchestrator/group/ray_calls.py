"""Ray's side of a call into a worker: its errors classified for the controller. Used by
``orchestrator/group/ray_group.py``."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import ray

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from orchestrator.group.interface import CallFailed, FailureKind, WorkerGroupError


def failure_of(worker: int, err: BaseException) -> CallFailed:
    """Classify a Ray call's error: the actor died, a collective failed on a lost peer, or the
    call raised an error of its own."""
    cause = getattr(err, "cause", None) or err
    reason = f"{type(cause).__name__}: {cause}".strip()
    if isinstance(err, ray.exceptions.RayActorError):
        return CallFailed(worker, FailureKind.DIED, reason)
    if isinstance(cause, (CollectiveAborted, CollectiveTimeout)):
        return CallFailed(worker, FailureKind.PEER_LOST, reason)
    return CallFailed(worker, FailureKind.ERROR, reason)


F = TypeVar("F", bound=Callable[..., Any])


def ray_errors_as_group_errors(method: F) -> F:
    """Turn a Ray error raised by a group method (GCS trouble placing or killing actors) into a
    WorkerGroupError, so the controller fails the job with a summary instead of crashing."""

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except ray.exceptions.RayError as err:
            raise WorkerGroupError(f"{method.__name__}: {failure_of(-1, err).reason}") from err

    return wrapped  # type: ignore[return-value]
