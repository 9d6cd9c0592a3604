"""Ray's errors classified for the controller (``orchestrator/group/ray_calls.py``): a dead actor
is a death, a collective aborted or timed out inside the call is a lost peer, anything else the
call's own error, each named by its cause rather than Ray's wrapper; and a Ray error out of a
group method becomes a ``WorkerGroupError`` naming the method. Ray's exceptions are built here
as ``ray.get`` raises them; no cluster is started."""

from __future__ import annotations

import pytest
from ray import exceptions as ray_errors

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from orchestrator.group.interface import CallFailed, FailureKind, WorkerGroupError
from orchestrator.group.ray_calls import failure_of, ray_errors_as_group_errors


def raised_in_task(cause: BaseException) -> ray_errors.RayTaskError:
    """What ``ray.get`` raises for a call that raised ``cause``: a RayTaskError that is also an
    instance of the cause's class, the cause kept as ``cause``."""
    return ray_errors.RayTaskError("train_steps", "Traceback (most recent call last): ...", cause).as_instanceof_cause()


@pytest.mark.parametrize(
    "error",
    [ray_errors.ActorDiedError(), ray_errors.ActorUnavailableError("the actor is unreachable", b"\x00" * 16)],
    ids=["died", "unavailable"],
)
def test_a_call_into_an_actor_that_died_or_went_unreachable_is_a_death(error: BaseException) -> None:
    failed = failure_of(3, error)
    assert isinstance(failed, CallFailed)
    assert failed.worker == 3 and failed.kind is FailureKind.DIED
    assert failed.reason.startswith(type(error).__name__)


@pytest.mark.parametrize(
    "cause",
    [CollectiveAborted("aborted by the driver"), CollectiveTimeout("all-reduce timed out after 60s")],
    ids=["aborted", "timed-out"],
)
def test_a_collective_that_failed_inside_the_call_is_a_lost_peer_named_by_its_cause(cause: BaseException) -> None:
    failed = failure_of(1, raised_in_task(cause))
    assert failed.worker == 1 and failed.kind is FailureKind.PEER_LOST
    assert failed.reason == f"{type(cause).__name__}: {cause}"


def test_any_other_error_of_the_call_is_its_own_named_by_its_cause() -> None:
    failed = failure_of(2, raised_in_task(ValueError("the batch holds no sample")))
    assert failed.worker == 2 and failed.kind is FailureKind.ERROR
    assert failed.reason == "ValueError: the batch holds no sample"
    plain = failure_of(0, RuntimeError("unpicklable result"))  # an error with no cause: itself
    assert plain.kind is FailureKind.ERROR and plain.reason == "RuntimeError: unpicklable result"


class Group:
    """A group whose methods raise what they are given."""

    @ray_errors_as_group_errors
    def start(self, error: BaseException | None, answer: int = 0) -> int:
        if error is not None:
            raise error
        return answer


def test_a_ray_error_from_a_group_method_becomes_a_worker_group_error_naming_the_method() -> None:
    cause = ray_errors.RaySystemError("GCS unavailable: placement group creation failed")
    with pytest.raises(WorkerGroupError) as raised:
        Group().start(cause)
    assert str(raised.value) == "start: RaySystemError: System error: GCS unavailable: placement group creation failed"
    assert raised.value.__cause__ is cause


def test_a_group_method_that_raises_no_ray_error_is_left_as_it_is() -> None:
    group = Group()
    assert group.start(None, answer=7) == 7
    with pytest.raises(KeyError):
        group.start(KeyError("not a Ray error"))
