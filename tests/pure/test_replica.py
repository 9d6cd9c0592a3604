"""``workers.replica.Replica``: what a model replica holds, as joins and checkpoints see it. The
real replica, a ``TrainWorker`` built without Ray (fused, generic and sharded optimizer: every
member of the optimizer union, both state layouts), and the tests' ``FakeReplica`` hold every
field the Protocol names (read with ``typing.get_type_hints``, so a field added to it that an
implementation lacks fails here) with a value of its declared type, the fake declaring each
no wider than the Protocol; and in both the model's trainable parameters are views into
``flat``, as the Protocol says."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest
import torch

from orchestrator.job.reading import load_job
from tests.helpers.replicas import FakeReplica
from workers.actor import TrainWorker
from workers.replica import Replica

FIELDS = get_type_hints(Replica)
JOBS = {
    "fused": ["optimizer={name: adam, kwargs: {lr: 0.01}}"],
    "generic": ["optimizer={name: RAdam, kwargs: {lr: 0.01}}"],
    "sharded": ["optimizer={name: adam, kwargs: {lr: 0.01}}", "sharding={group_size: 2}"],
}


def _arms(hint: Any) -> tuple[Any, ...]:
    """A union's members, or the one type."""
    return get_args(hint) if isinstance(hint, types.UnionType) or get_origin(hint) is Union else (hint,)


def _is_protocol(hint: Any) -> bool:
    return isinstance(hint, type) and bool(getattr(hint, "_is_protocol", False))


def _protocol_methods(protocol: type) -> set[str]:
    """The public methods a Protocol (``StateLayout``, not runtime-checkable) declares."""
    return {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


def _conforms(value: object, protocol: type) -> bool:
    """Whether ``value`` (an object, or a class) has each of ``protocol``'s methods."""
    return all(callable(getattr(value, name, None)) for name in _protocol_methods(protocol))


def _holds(value: object, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint``: a class, a union of them, or a Protocol."""
    return any(_conforms(value, arm) if _is_protocol(arm) else isinstance(value, arm) for arm in _arms(hint))


def _narrows(declared: Any, hint: Any) -> bool:
    """Whether every type ``declared`` admits is one ``hint`` admits."""
    return all(
        any(_conforms(arm, wide) if _is_protocol(wide) else isinstance(arm, type) and issubclass(arm, wide) for wide in _arms(hint))
        for arm in _arms(declared)
    )


def _missing_or_mistyped(replica: object) -> dict[str, str]:
    """Each Protocol field ``replica`` lacks or holds a value of another type, and what it holds."""
    return {
        name: repr(type(getattr(replica, name, None)))
        for name, hint in FIELDS.items()
        if not hasattr(replica, name) or not _holds(getattr(replica, name), hint)
    }


def _parameters_are_views_into_flat(replica: Any) -> bool:
    storage = replica.flat.values.untyped_storage().data_ptr()
    trainable = [p for p in replica.model.parameters() if p.requires_grad]
    return bool(trainable) and all(p.untyped_storage().data_ptr() == storage for p in trainable)


def _worker(kind: str) -> TrainWorker:
    return TrainWorker(load_job(None, ["eval=null", *JOBS[kind]]), device=torch.device("cpu"))


def test_the_protocol_names_a_replicas_whole_training_state() -> None:
    assert {"model", "flat", "optimizer", "state", "scaler", "device", "next_step"} <= FIELDS.keys()


@pytest.mark.parametrize("kind", list(JOBS))
def test_a_worker_built_without_ray_holds_every_replica_field_with_its_declared_type(kind: str) -> None:
    worker = _worker(kind)
    assert _missing_or_mistyped(worker) == {}
    assert _parameters_are_views_into_flat(worker)


def test_the_fake_replica_declares_every_replica_field_no_wider_than_the_protocol() -> None:
    declared = get_type_hints(FakeReplica)
    assert {name: declared.get(name) for name in FIELDS if name not in declared or not _narrows(declared[name], FIELDS[name])} == {}


def test_the_fake_replica_holds_every_replica_field_with_its_declared_type_and_views_into_flat() -> None:
    replica = FakeReplica("RAdam", {"lr": 0.01})
    replica.train(1)
    assert _missing_or_mistyped(replica) == {}
    assert _parameters_are_views_into_flat(replica)
