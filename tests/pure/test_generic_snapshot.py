"""A generic optimizer's state off the thread that trains: a checkpoint snapshot and a join's
state transfer only copy tensors (the serializer runs in the background writer, or not at
all), the per-parameter state is sliced across checkpoint parts like the fused state, the
state comes back exactly, and checkpoints written before still restore. No Ray."""

from __future__ import annotations

import io
import logging
import threading
import time
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from jobspec.job import JobConfig
from jobspec.wire import SnapshotRequest
from tests.helpers.optimizers import Lion, SharedStep
from tests.helpers.replicas import FakeReplica
from tests.helpers.slow_save import float_bytes, slowed
from workers.checkpoint import tensor_file
from workers.checkpoint.manifest import verify_checkpoint, write_manifest
from workers.checkpoint.parts import FlatPieces
from workers.checkpoint.reading import read_part
from workers.checkpoint.storage import CheckpointStorage
from workers.optim.generic import STATE_ENTRY, GenericOptimizer
from workers.optim.state_codec import as_loaded
from workers.replica_checkpoint import CheckpointWriter, restore_state
from workers.runtime.chaos import ChaosSchedule

OPTIMIZERS = [("RAdam", {"lr": 0.01, "weight_decay": 0.1}), (Lion, {"lr": 0.001, "weight_decay": 0.1})]
SAVE_RATE = 200.0  # bytes of floating-point data per second the slowed serializer writes
SLOW_S = 1.0  # what it takes for the test model's optimizer state, at least


def _same_state(got: GenericOptimizer, want: GenericOptimizer) -> None:
    """Bit for bit: every tensor and value of the two optimizers' state_dicts."""
    a, b = got.optimizer.state_dict(), want.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for index, state in b["state"].items():
        assert a["state"][index].keys() == state.keys()
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(a["state"][index][key], value) and a["state"][index][key].device == value.device, key
            else:
                assert a["state"][index][key] == value, key


def _saves_on(monkeypatch) -> list[tuple[str, int]]:
    """Slow the serializers down (``torch.save``, a part file's ``encode``: ``SLOW_S`` for the
    test state) and record (thread, float bytes) of each call."""
    calls: list[tuple[str, int]] = []

    def record(size: int) -> None:
        calls.append((threading.current_thread().name, size))

    monkeypatch.setattr(torch, "save", slowed(torch.save, SAVE_RATE, record))
    monkeypatch.setattr(tensor_file, "encode", slowed(tensor_file.encode, SAVE_RATE, record))
    return calls


@pytest.mark.parametrize("name, kwargs", OPTIMIZERS)
def test_a_snapshot_copies_on_the_compute_thread_and_serializes_in_the_background(tmp_path, monkeypatch, name, kwargs):
    source = FakeReplica(name, kwargs)
    source.train(3)
    state_bytes = sum(float_bytes(s) for s in source.optimizer.optimizer.state.values())
    assert state_bytes >= SLOW_S * SAVE_RATE  # the slowed save of it takes SLOW_S at least
    calls = _saves_on(monkeypatch)
    # The two ranks' writers (one replica stands for both).
    writers = [CheckpointWriter(ChaosSchedule.for_worker(JobConfig().chaos, i, threading.Event()), lambda: None) for i in range(2)]
    started = time.perf_counter()
    for index, writer in enumerate(writers):
        writer.snapshot(SnapshotRequest(3, str(tmp_path), "step-00000003", "a1", index, 2), source, {}, index)
    copying_s = time.perf_counter() - started
    source.train(2)  # training goes on while the parts are written, and changes nothing in them
    files = [f for writer in writers for f in writer.written("step-00000003", "a1", timeout_s=60).files]
    assert copying_s < SLOW_S / 2, f"the snapshots held training up {copying_s:.2f}s"
    on_compute = [size for thread, size in calls if thread == threading.current_thread().name]
    assert not any(on_compute), f"tensor data serialized on the compute thread: {on_compute} bytes"

    storage = CheckpointStorage(str(tmp_path))
    write_manifest(storage, 3, files, {})
    manifest = verify_checkpoint(storage, "step-00000003")
    parts = [read_part((tmp_path / "step-00000003" / f.path).read_bytes()) for f in files]
    # The moments are sliced across the parts like the parameters; part 1 holds nothing whole.
    assert {k for p in parts for k in p["slices"]} == {"params", "optim/state/exp_avg", *(["optim/state/exp_avg_sq"] if name == "RAdam" else [])}
    assert all(0 < p["slices"]["optim/state/exp_avg"].numel() < source.flat.numel for p in parts)
    assert parts[1]["whole"] == {}

    expected = FakeReplica(name, kwargs)
    expected.train(3)
    restored = FakeReplica(name, kwargs)
    restore_state(restored, storage, "step-00000003", manifest)
    _same_state(restored.optimizer, expected.optimizer)
    restored.train(2)
    expected.train(2)
    _same_state(restored.optimizer, expected.optimizer)
    assert torch.equal(restored.flat.values, expected.flat.values)


def _joined(root: FakeReplica) -> FakeReplica:
    """A new replica that joined ``root``: its optimizer state through ``sync`` (the
    broadcasts recorded, then replayed), its parameters and step copied (``GroupLink``)."""
    joiner = FakeReplica(root.optimizer_name, root.kwargs, dtype=root.dtype)
    sent: list[torch.Tensor] = []
    root.optimizer.sync(lambda tensor: sent.append(tensor.clone()), is_root=True)
    replies = iter(sent)
    joiner.optimizer.sync(lambda tensor: tensor.copy_(next(replies)), is_root=False)
    assert next(replies, None) is None  # as many broadcasts on both sides
    joiner.flat.values.copy_(root.flat.values)
    joiner.next_step = root.next_step
    return joiner


@pytest.mark.parametrize("name, kwargs", OPTIMIZERS)
def test_a_join_sends_the_state_without_serializing_its_tensors(monkeypatch, name, kwargs):
    root = FakeReplica(name, kwargs)
    root.train(3)
    calls = _saves_on(monkeypatch)
    started = time.perf_counter()
    joiner = _joined(root)
    assert time.perf_counter() - started < SLOW_S / 2 and not any(size for _, size in calls), calls
    _same_state(joiner.optimizer, root.optimizer)
    root.train(2)
    joiner.train(2)
    _same_state(joiner.optimizer, root.optimizer)
    assert torch.equal(joiner.flat.values, root.flat.values)


def test_a_join_before_the_first_step_sends_an_empty_state():
    root, joiner = FakeReplica("RAdam", {}), FakeReplica("RAdam", {})
    sent: list[torch.Tensor] = []
    root.optimizer.sync(lambda tensor: sent.append(tensor.clone()), is_root=True)
    assert len(sent) == 2  # the skeleton's length and the skeleton: no tensors yet
    replies = iter(sent)
    joiner.optimizer.sync(lambda tensor: tensor.copy_(next(replies)), is_root=False)
    assert joiner.optimizer.optimizer.state_dict()["state"] == {}


def test_a_checkpoint_written_before_the_state_was_taken_apart_still_restores():
    source = FakeReplica("RAdam", {"lr": 0.01})
    source.train(3)
    buffer = io.BytesIO()
    torch.save(source.optimizer.optimizer.state_dict(), buffer)  # what part 0 held until now
    blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    restored = FakeReplica("RAdam", {"lr": 0.01})
    restored.optimizer.restore({}, {STATE_ENTRY: blob})
    _same_state(restored.optimizer, source.optimizer)


def test_a_state_that_does_not_fit_is_refused_in_one_line():
    source = FakeReplica("RAdam", {"lr": 0.01})
    source.train(1)
    flat, whole = source.optimizer.checkpoint_tensors()
    other = GenericOptimizer("RAdam", {"lr": 0.01}, list(torch.nn.Linear(3, 2).parameters()))
    with pytest.raises(ValueError, match=r"^optimizer state does not fit RAdam: flat optimizer state of \[63\] entries, the parameters have 8$"):
        other.restore(flat, whole)
    with pytest.raises(ValueError, match=r"is not a RAdam's"):
        other.restore(flat, {k: v for k, v in whole.items() if k != "tensor/0"})


def _restored(tmp_path, source: FakeReplica) -> FakeReplica:
    """A new replica restored from a 2-part checkpoint of ``source`` (two ranks' writers)."""
    writers = [CheckpointWriter(ChaosSchedule.for_worker(JobConfig().chaos, i, threading.Event()), lambda: None) for i in range(2)]
    name = f"step-{source.next_step:08d}"
    for index, writer in enumerate(writers):
        writer.snapshot(SnapshotRequest(source.next_step, str(tmp_path), name, "a1", index, 2), source, {}, index)
    storage = CheckpointStorage(str(tmp_path))
    write_manifest(storage, source.next_step, [f for w in writers for f in w.written(name, "a1", timeout_s=60).files], {})
    restored = FakeReplica(source.optimizer_name, source.kwargs, dtype=source.dtype)
    restore_state(restored, storage, name, verify_checkpoint(storage, name))
    return restored


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["as-the-state", "cast-on-load"])
@pytest.mark.parametrize("overlap", [False, True], ids=["one-shared-tensor", "overlapping-views"])
def test_state_tensors_sharing_memory_come_back_sharing_it(tmp_path, caplog, overlap, dtype):
    # One step counter for every parameter (and, overlapping, a view of each momentum's head):
    # restored as separate copies, the counter would advance once per parameter. With float64
    # parameters, the float32 counter is cast by torch's load_state_dict to their dtype,
    # parameter by parameter (as it moves host state to a GPU's parameters): one copy each,
    # unless it arrives cast already.
    caplog.set_level(logging.WARNING, logger="workers.optim.generic")
    source = FakeReplica(SharedStep, {"lr": 0.01, "overlap": overlap}, dtype=dtype)
    source.train(3)
    expected = FakeReplica(SharedStep, {"lr": 0.01, "overlap": overlap}, dtype=dtype)
    expected.train(6)
    for how, copy in (("checkpoint", _restored(tmp_path, source)), ("join", _joined(source))):
        states = list(copy.optimizer.optimizer.state.values())
        assert {s["t"].dtype for s in states} == {dtype}, how  # cast as torch casts it
        assert len({id(s["t"]) for s in states}) == 1, how
        if overlap:
            assert all(s["head"].data_ptr() == s["m"].data_ptr() for s in states), how
        copy.train(3)
        assert torch.equal(copy.flat.values, expected.flat.values), how
    # Overlapping views cannot be taken apart: the state moved whole, and the log says so.
    whole = [m for m in caplog.messages if "overlap in memory" in m]
    assert whole == (["SharedStep's state holds tensors that overlap in memory: checkpoints and joins serialize it "
                      "whole, on the thread that trains (slower), to keep the overlap"] if overlap else [])


def test_overlapping_state_of_another_dtype_than_its_parameters_keeps_its_overlap_when_cast(tmp_path):
    # The momenta float32, the parameters float64: torch would cast each momentum and its head
    # apart (the head no longer a view of it); cast as one memory, the head stays its view.
    kwargs = {"lr": 0.01, "overlap": True, "low_precision": True}
    source = FakeReplica(SharedStep, kwargs, dtype=torch.float64)
    source.train(3)
    for how, copy in (("checkpoint", _restored(tmp_path, source)), ("join", _joined(source))):
        states = list(copy.optimizer.optimizer.state.values())
        assert {s["m"].dtype for s in states} == {torch.float64}, how
        assert all(s["head"].data_ptr() == s["m"].data_ptr() for s in states), how
        assert len({id(s["t"]) for s in states}) == 1, how
        copy.train(1)
        assert all(torch.equal(s["head"], s["m"].view(-1)[:1]) for s in states), how


def test_state_is_cast_where_and_as_load_state_dict_casts_it():
    # RAdam over float64 parameters, its state made float32 (the step count too, which torch
    # leaves as it is): cast beforehand, the loaded state is what torch's own cast makes of it.
    source = FakeReplica("RAdam", {"lr": 0.01}, dtype=torch.float64)
    source.train(2)
    state = source.optimizer.optimizer.state_dict()
    state = {**state, "state": {i: {k: v.float() for k, v in s.items()} for i, s in state["state"].items()}}
    params = [p for group in source.optimizer.optimizer.param_groups for p in group["params"]]
    ours = FakeReplica("RAdam", {"lr": 0.01}, dtype=torch.float64)
    torchs = FakeReplica("RAdam", {"lr": 0.01}, dtype=torch.float64)
    ours.optimizer.optimizer.load_state_dict(as_loaded(state, params))
    torchs.optimizer.optimizer.load_state_dict(state)
    _same_state(ours.optimizer, torchs.optimizer)
    assert {(k, v.dtype) for s in ours.optimizer.optimizer.state.values() for k, v in s.items()} == {
        ("step", torch.float32), ("exp_avg", torch.float64), ("exp_avg_sq", torch.float64)
    }


def test_views_of_one_memory_are_cast_together_only_where_they_overlap():
    # One float32 storage of 1000 entries for float64 parameters: a momentum (0..9) with its
    # head (0) shared by both parameters, and a counter at its far end (999).
    memory = torch.arange(1000.0)
    m, head, t = memory[:10], memory[:1], memory[999:]
    params = [torch.zeros(10, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    state = {"state": {0: {"m": m, "head": head, "t": t}, 1: {"head": head, "t": t}}, "param_groups": [{"params": [0, 1]}]}
    got = as_loaded(state, params)["state"]
    assert got[0]["head"].data_ptr() == got[0]["m"].data_ptr() and got[1]["head"] is got[0]["head"] and got[1]["t"] is got[0]["t"]
    assert torch.equal(got[0]["m"], torch.arange(10.0, dtype=torch.float64)) and got[0]["t"].item() == 999.0
    # The entries between them are not copied: the momentum's span, and the counter's apart.
    assert got[0]["m"].untyped_storage().nbytes() == 80 and got[0]["t"].untyped_storage().nbytes() == 8


def test_a_restored_state_is_held_once_in_what_was_received_or_read(tmp_path):
    # A join's receiver keeps views into the buffer it received; a restore, views of the flat
    # state read from the checkpoint: no copy of each tensor beside them.
    source = FakeReplica("RAdam", {})
    source.train(2)
    joined = _joined(source)
    held = {t.untyped_storage().data_ptr() for s in joined.optimizer.optimizer.state.values() for t in s.values()}
    assert len(held) == 1
    restored = _restored(tmp_path, source)
    moments = {s["exp_avg"].untyped_storage().data_ptr() for s in restored.optimizer.optimizer.state.values()}
    assert len(moments) == 1


def test_how_a_checkpoint_holds_the_state_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="workers.optim.generic")
    source = FakeReplica("RAdam", {})
    source.optimizer.checkpoint_tensors()  # no state before the first step: nothing to say
    source.train(1)
    for _ in range(3):
        source.optimizer.checkpoint_tensors()
    source.optimizer.checkpoint_tensors(whole=False)
    assert caplog.messages == [
        "RAdam's per-parameter state ['exp_avg', 'exp_avg_sq'] is checkpointed in slices across the parts, like the "
        "parameters; its 6 other tensor(s) whole in part 0"
    ]


class _Reads(TorchDispatchMode):
    """Records each operator that reads memory of ``watched`` tensors, with its arguments."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in watched}
        self.reads: list[tuple[Any, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not func.is_view and any(t.untyped_storage().data_ptr() in self.storages for t in tensors):
            self.reads.append((func.overloadpacket, args))
        return func(*args, **(kwargs or {}))


def test_a_flat_range_is_copied_piece_by_piece_straight_into_its_cpu_output():
    pieces = (torch.arange(6.0).view(2, 3), torch.arange(6.0, 10.0), torch.arange(10.0, 15.0))
    with _Reads(list(pieces)) as reads:
        out = FlatPieces(pieces).cpu_range(4, 12)
    assert torch.equal(out, torch.arange(4.0, 12.0))
    # The pieces are read only by copies into the output: nothing builds the range on their
    # device first (on a GPU, that would take the range's size in device memory).
    assert [func for func, _ in reads.reads] == [torch.ops.aten.copy_] * 3
    assert all(args[0].untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for _, args in reads.reads)
    assert FlatPieces(pieces).cpu_range(15, 15).numel() == 0
