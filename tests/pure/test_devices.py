"""A worker's device without a GPU: which CUDA device the GPU Ray assigned is, the backend and
the jobs refused for it, pinned batches for a GPU, no host sync per forward piece, and the
bucket hand-off to the communication thread ordered by stream marks (a fake of CUDA events),
and the worker's device current on every thread that touches CUDA (a fake of CUDA's)."""

from __future__ import annotations

import threading
from unittest.mock import patch

import numpy as np
import pytest
import torch

from jobspec.job import JobConfig
from orchestrator.job.reading import load_job
from tests.helpers.runners import ArmedReducer, linear_runner
from workers.comm.comm_group import CommGroup, PendingOp
from workers.comm.communicator import pick_backend
from workers.comm.compression import CastCompressed
from workers.comm.gradient_reducer import GradientReducer
from workers.data.prefetch import BatchPrefetch
from workers.model.flat_parameters import FlatParameters
from workers.model.objective import Objective, causal_lm, cross_entropy
from workers.runtime.abortable import call_abortable
from workers.runtime.devices import choose_device, cuda_index, host_batch, inherit_device, worker_device
from workers.step.census import LOSS_SLOT
from workers.step.runner import StepRunner

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


# Which device: the GPU Ray assigned, as this process's CUDA numbers it.


@pytest.mark.parametrize(
    "gpu_id, visible, index",
    [
        ("3", "3", 0),  # Ray narrowed CUDA_VISIBLE_DEVICES to the assigned GPU: it is cuda:0 whatever its id
        (3, "3", 0),  # ids come as ints where the node set no CUDA_VISIBLE_DEVICES of its own
        ("3", "1,3", 1),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the node's list is inherited
        (2, None, 2),  # ... and where the node has none, every GPU is visible, numbered as the node does
        ("GPU-b2", "GPU-a1, GPU-b2", 1),  # UUIDs, as a node's CUDA_VISIBLE_DEVICES may hold
    ],
)
def test_the_assigned_gpu_is_its_place_in_cuda_visible_devices(gpu_id, visible, index):
    assert cuda_index(gpu_id, visible) == index


@pytest.mark.parametrize(
    "gpu_id, visible, expected",
    [("4", "1,3", "which CUDA_VISIBLE_DEVICES='1,3' does not list"), ("GPU-a1", None, "which is no CUDA index")],
)
def test_an_assigned_gpu_cuda_cannot_see_is_refused(gpu_id, visible, expected):
    with pytest.raises(ValueError, match=expected):
        cuda_index(gpu_id, visible)


def test_the_device_is_the_cpu_without_a_gpu_and_the_assigned_gpu_with_one():
    assert choose_device([], None, cuda_available=True, device_count=8) == CPU
    assert choose_device(["5"], "5", cuda_available=True, device_count=1) == CUDA
    assert choose_device([5], None, cuda_available=True, device_count=8) == torch.device("cuda", 5)


@pytest.mark.parametrize(
    "gpu_ids, visible, available, count, expected",
    [
        (["1"], "1", False, 0, r"GPU 1 \(scaling.resources_per_worker\), but torch .* cannot use CUDA"),
        (["1", "2"], "1,2", True, 2, r"GPUs \['1', '2'\]: a worker trains on one GPU"),
        ([6], None, True, 4, r"GPU 6, cuda:6 here, but CUDA shows 4 device"),
        (["7"], "1,3", True, 2, r"does not list \(scaling.resources_per_worker\)"),
    ],
)
def test_a_gpu_the_worker_cannot_use_fails_its_start_with_the_reason(gpu_ids, visible, available, count, expected):
    with pytest.raises(RuntimeError, match=expected):
        choose_device(gpu_ids, visible, cuda_available=available, device_count=count)


def test_the_worker_device_reads_the_environment_and_is_made_current(monkeypatch):
    chosen = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")  # as RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES leaves it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert worker_device(["2"]) == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 1)]  # before any NCCL work: the actor's constructor
    assert worker_device([]) == CPU and len(chosen) == 1


# The backend, and the jobs refused for their devices.


def test_the_backend_follows_collective_backend():
    assert (pick_backend(CUDA), pick_backend(CPU)) == ("nccl", "gloo")  # auto
    assert pick_backend(CUDA, "gloo") == "gloo"  # workers sharing a GPU
    assert pick_backend(CUDA, "nccl") == "nccl"
    with pytest.raises(ValueError, match="field 'collective.backend': nccl needs CUDA tensors, and this worker trains on cpu"):
        pick_backend(CPU, "nccl")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["scaling.resources_per_worker={CPU: 1, GPU: 2}"], "field 'scaling.resources_per_worker': GPU 2 per worker: a worker trains on one GPU"),
        (["scaling.resources_per_worker={GPU: 1.5}"], "field 'scaling.resources_per_worker': GPU 1.5 per worker"),
        (["scaling.resources_per_worker={GPU: 0.5}"], "scaling.resources_per_worker GPU 0.5: workers sharing a GPU need collective.backend: gloo (got auto"),
        (["scaling.resources_per_worker={GPU: 0.25}", "collective.backend=nccl"], "GPU 0.25: workers sharing a GPU need collective.backend: gloo (got nccl"),
        (["collective.backend=nccl"], "collective.backend nccl needs a GPU per worker, and scaling.resources_per_worker asks for none"),
        (["collective.backend=mpi"], "field 'collective.backend'"),
        (["scaling.resources_per_worker={GPU: 0.5}", "collective.backend=gloo"], "collective.algorithm auto over collective.backend gloo on a GPU"),
        (
            ["scaling.resources_per_worker={GPU: 1}", "collective.backend=gloo", "collective.algorithm=native", "collective.compression=int8"],
            "collective.algorithm native with collective.compression int8 over collective.backend gloo on a GPU",
        ),
    ],
    ids=["two-gpus", "gpu-and-a-half", "shared-auto", "shared-nccl", "nccl-on-cpu", "unknown", "gloo-gpu-ring", "gloo-gpu-int8"],
)
def test_jobs_whose_devices_do_not_fit_are_refused_naming_the_field(overrides, expected):
    from jobspec.fields import ConfigError

    with pytest.raises(ConfigError) as refused:
        load_job(None, overrides, resolve=False)
    assert expected in str(refused.value)


def test_jobs_whose_devices_fit_are_taken():
    shared = load_job(
        None, ["scaling.resources_per_worker={CPU: 1, GPU: 0.5}", "collective.backend=gloo", "collective.algorithm=native"],
        resolve=False,
    )
    assert shared.scaling.resources_per_worker["GPU"] == 0.5
    for backend in ("auto", "nccl"):
        assert load_job(None, ["scaling.resources_per_worker={GPU: 1}", f"collective.backend={backend}"], resolve=False)
    assert load_job(None, ["scaling.resources_per_worker={GPU: 1}", "collective.backend=gloo", "collective.algorithm=native"], resolve=False)
    assert JobConfig().collective.backend == "auto"


# Batches for a GPU wait on the host pinned.


def _fake_pin(monkeypatch) -> list[torch.Tensor]:
    """Pinning recorded instead of done (no CUDA here): returns the tensors it produced."""
    pinned: list[torch.Tensor] = []

    def pin_memory(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        pinned.append(tensor.clone())
        return pinned[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor, *args, **kwargs: any(tensor is p for p in pinned))
    return pinned


def test_a_batch_for_a_gpu_is_pinned_and_one_for_the_cpu_is_not(monkeypatch):
    pinned = _fake_pin(monkeypatch)
    batch = {"input_ids": torch.zeros(2, 3), "extra": [torch.ones(2), "text"]}
    assert host_batch(batch, CPU) is batch and not pinned
    moved = host_batch(batch, CUDA)
    assert moved["input_ids"] is pinned[0] and moved["extra"][0] is pinned[1] and moved["extra"][1] == "text"
    assert host_batch(moved, CUDA)["input_ids"] is pinned[0] and len(pinned) == 2  # pinned once


def test_the_step_reads_batches_pinned_for_a_gpu(monkeypatch):
    pinned = _fake_pin(monkeypatch)
    runner, _, _ = linear_runner(CUDA, Objective("mse"), runner=StepRunner)  # the claimed way reads ahead
    indices = np.arange(4)
    runner.prefetch.start(indices)  # a step's first batch, read on the prefetch thread
    assert runner.prefetch.wait(lambda: False)
    inputs, targets = runner.prefetch.take(indices)
    assert inputs is pinned[0] and targets is pinned[1]
    inputs, _ = runner._read(indices)  # a later piece's, read in the pass
    assert inputs is pinned[2]


# No host sync in a forward/backward piece.


class _SyncCounter(torch.Tensor):
    """A tensor (and every one computed from it) counting the reads that would wait for a GPU."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206 - torch's protocol
        if func in (torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.tolist):
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def counted_mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-sample squared error whose tensors count host reads."""
    inputs, targets = batch
    return (model(inputs) - targets).pow(2).sum(dim=1).as_subclass(_SyncCounter)


def test_a_step_reads_no_loss_per_piece_and_its_census_holds_the_loss_sum(monkeypatch):
    monkeypatch.setattr(_SyncCounter, "reads", [])
    runner, flat, model = linear_runner(CPU, Objective(counted_mse), max_samples_per_pass=1)  # 4 pieces per shard
    work = runner.run_fixed(0, [0, 1], 2, ArmedReducer())
    assert _SyncCounter.reads == []  # the loss was never read from the device: once, after the step, from the census
    # What the pieces' losses summed to reaches the census slot (what used to be a float per piece).
    inputs, targets = runner.dataset.tensors
    indices = np.concatenate([runner.sampler.shard_indices(0, s) for s in (0, 1)])
    with torch.no_grad():
        expected = (model(inputs[indices]) - targets[indices]).pow(2).sum()
    assert float(flat.extra[2 + LOSS_SLOT]) == pytest.approx(float(expected), rel=1e-6)
    assert work.total.samples == 8 and work.total.weight == 8.0


def test_the_built_in_token_losses_keep_their_weight_on_the_device(monkeypatch):
    """Counting the kept tokens on the host would sync every pass (the GPT recipe's loss)."""
    monkeypatch.setattr(_SyncCounter, "reads", [])
    torch.manual_seed(0)
    classifier = torch.nn.Linear(4, 3)
    inputs = torch.randn(5, 4).as_subclass(_SyncCounter)
    labels = torch.tensor([0, 1, 2, -100, 1]).as_subclass(_SyncCounter)
    tokens = torch.tensor([[1, 2, 3, 0], [2, 2, 1, 3]]).as_subclass(_SyncCounter)
    lm = torch.nn.Embedding(4, 4)
    classified, modelled = cross_entropy(classifier, (inputs, labels)), causal_lm(lm, tokens)
    assert _SyncCounter.reads == []
    assert float(classified.weight) == 4 and float(modelled.weight) == 2 * 3  # read here, once: counted after
    assert classified.weight.dtype == modelled.weight.dtype == torch.float64


# The bucket hand-off: the communication thread waits for the marks of the streams that wrote it.


class _FakeStreams:
    """``StreamMarks`` over fake streams whose writes land only when someone waits for them.

    A parameter's gradient is "written on stream s" by ``write_later`` (run in a hook before the
    reducer's): its values are taken out of the buffer and queued on s, as a kernel queued
    there but not run yet. ``record`` marks what is queued on a stream, by default the
    one being written (as a CUDA event does); ``wait`` lands what a mark covers. Whatever reads a bucket before waiting for
    the marks of every stream that wrote it reads zeros where those writes belong."""

    def __init__(self) -> None:
        self.stream = "main"
        self._queued: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._covered: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.recorded: list[tuple[int, str]] = []  # (mark, stream)
        self.log: list[tuple[str, int, str]] = []  # (what, mark or bucket offset, thread)

    def write_later(self, stream: str, grad: torch.Tensor) -> None:
        self.stream = stream
        self._queued.setdefault(stream, []).append((grad, grad.clone()))
        grad.zero_()

    def end_backward(self) -> None:
        """What autograd does as backward returns: the calling stream waits for every other."""
        self.stream = "main"
        for stream in list(self._queued):
            self._queued.setdefault("main", []).extend(self._queued.pop(stream))

    def current(self) -> str:
        return self.stream

    def record(self, stream: object = None) -> int:
        stream = self.stream if stream is None else stream
        assert isinstance(stream, str)
        mark = len(self.recorded) + 1
        self.recorded.append((mark, stream))
        self._covered[mark] = self._queued.pop(stream, [])
        self.log.append(("record", mark, threading.current_thread().name))
        return mark

    def wait(self, mark: object) -> None:
        assert isinstance(mark, int)
        for grad, values in self._covered.pop(mark):
            grad.copy_(values)
        self.log.append(("wait", mark, threading.current_thread().name))


class _ReadingComm:
    """A communicator that, on the group's communication thread, logs that it read its tensor
    and keeps what it read."""

    def __init__(self, group: CommGroup, log: list[tuple[str, int, str]]) -> None:
        self.group = group
        self.log = log
        self.read: list[torch.Tensor] = []

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        def read() -> None:
            self.read.append(tensor.clone())
            self.log.append(("read", len(self.read), threading.current_thread().name))

        return self.group.submit(read, "read")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 40)
        self.b = torch.nn.Linear(40, 40)
        self.c = torch.nn.Linear(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _gradient(net: torch.nn.Module, flat: FlatParameters) -> torch.Tensor:
    flat.zero()
    torch.manual_seed(1)
    net(torch.randn(3, 6)).pow(2).sum().backward()
    return flat.buffer.clone()


def test_a_cast_sum_writes_back_on_the_callers_thread_and_not_at_all_when_the_sum_failed():
    group = CommGroup(None, 0, 1, 10.0, threading.Event())  # type: ignore[arg-type]  # only its thread is used

    class Doubling:
        def start_sum(self, tensor: torch.Tensor) -> PendingOp:
            return group.submit(lambda: tensor.mul_(2), "doubling")

    class Failing:
        def start_sum(self, tensor: torch.Tensor) -> PendingOp:
            return group.submit(lambda: (tensor.fill_(7), 1 / 0), "failing")

    bucket = torch.tensor([1.5, -2.0, 3.0])
    pending = CastCompressed(Doubling(), torch.bfloat16, group).start_sum(bucket)
    written = []
    original = torch.Tensor.copy_
    with patch.object(torch.Tensor, "copy_", lambda t, *a, **k: (written.append(threading.current_thread().name), original(t, *a, **k))[1]):
        pending.wait()
    assert torch.equal(bucket, torch.tensor([3.0, -4.0, 6.0]))
    assert written[-1] == threading.current_thread().name  # the write-back: the caller's, who reads the bucket next
    pending = CastCompressed(Failing(), torch.bfloat16, group).start_sum(bucket)
    with pytest.raises(ZeroDivisionError):
        pending.wait()
    assert torch.equal(bucket, torch.tensor([3.0, -4.0, 6.0]))  # a failed sum's partial values never reach it
    group.close()


@pytest.mark.parametrize("compression", ["none", "bf16"])
@pytest.mark.parametrize("overlap", [True, False])
def test_each_bucket_is_read_only_after_the_marks_of_every_stream_that_wrote_it(overlap, compression):
    """Parameters' gradients written on two streams (alternately): a bucket holding both waits
    for both streams' marks before anything reads it, the bf16 cast included."""
    torch.manual_seed(0)
    net = _Net()
    flat = FlatParameters(net.parameters(), extra=2)
    want = _gradient(net, flat)
    streams = _FakeStreams()
    for index, param in enumerate(flat.params):  # registered before the reducer's hooks: they run first
        param.register_post_accumulate_grad_hook(lambda p, s=f"s{index % 2}": streams.write_later(s, p.grad))
    group = CommGroup(None, 0, 1, 10.0, threading.Event())  # type: ignore[arg-type]  # only its thread is used
    exact = _ReadingComm(group, streams.log)
    comm = exact if compression == "none" else CastCompressed(exact, torch.bfloat16, group)
    # Buckets of 300 elements: c's and b.bias together, b.weight alone, a's together.
    reducer = GradientReducer(flat, comm, 1200, overlap, extra_comm=exact, group=group, marks=streams)
    assert [b.params for b in reducer.buckets] == [(5, 4, 3), (2,), (1, 0)]
    flat.zero()
    reducer.arm()
    torch.manual_seed(1)
    net(torch.randn(3, 6)).pow(2).sum().backward()
    streams.end_backward()
    reducer.finish()
    group.close()
    rounded = want if compression == "none" else want.bfloat16()
    read = [rounded[b.start : b.end] for b in reducer.buckets] + [want[:2]]  # the extra slots last, exactly
    assert len(exact.read) == len(read)
    for got, expected in zip(exact.read, read):
        assert torch.equal(got, expected)
    me = threading.current_thread().name
    assert all(thread == me for kind, _, thread in streams.log if kind == "record")
    assert all(thread.startswith("ringleader-comm") for kind, _, thread in streams.log if kind != "record")
    first_read = streams.log.index(next(e for e in streams.log if e[0] == "read"))
    waited = {mark for kind, mark, _ in streams.log[:first_read] if kind == "wait"}
    if overlap:  # the first bucket's parameters wrote on both streams, and it waited for both
        assert {stream for mark, stream in streams.recorded if mark in waited} == {"s0", "s1"}
        # A mark per stream a bucket's parameters wrote on, one in finish: not one per parameter.
        assert [stream for _, stream in streams.recorded] == ["s1", "s0", "s0", "s1", "s0", "main"]
    else:  # launched after backward: marked on the stream backward returned to
        assert waited and all(stream == "main" for _, stream in streams.recorded)
    torch.testing.assert_close(flat.buffer, want if compression == "none" else want.bfloat16().float(), rtol=0, atol=0)


def test_on_the_cpu_nothing_is_handed_over_but_the_sums():
    log: list[tuple[str, int, str]] = []
    group = CommGroup(None, 0, 1, 10.0, threading.Event())  # type: ignore[arg-type]
    flat = FlatParameters(_Net().parameters(), extra=2)
    reducer = GradientReducer(flat, _ReadingComm(group, log), 400, False, group=group)
    assert reducer.marks is None
    reducer.finish()
    group.close()
    assert [kind for kind, _, _ in log] == ["read"] * len(reducer.buckets)


# The worker's device on every thread that touches CUDA.


def _fake_cuda(monkeypatch, current: int) -> list[tuple[str, object]]:
    """CUDA initialized with device ``current`` current, ``set_device`` recorded (thread, device)."""
    chosen: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append((threading.current_thread().name, device)))
    return chosen


def test_our_threads_start_with_the_device_current_where_they_were_made(monkeypatch):
    chosen = _fake_cuda(monkeypatch, current=1)
    prefetch = BatchPrefetch(lambda indices: indices * 2)
    prefetch.start(np.arange(3))
    assert prefetch.wait(lambda: False)
    assert list(prefetch.take(np.arange(3))) == [0, 2, 4]
    assert chosen and all(thread.startswith("ringleader-fetch") and device == 1 for thread, device in chosen)
    chosen.clear()
    group = CommGroup(object(), rank=0, size=1, timeout_s=5.0, abort_flag=threading.Event())  # type: ignore[arg-type]
    group.submit(lambda: None, "nothing").wait()
    group.close()
    assert chosen == [("ringleader-comm-r0_0", 1)]  # the communication thread too
    chosen.clear()
    assert call_abortable(lambda: 5, threading.Event(), 5.0, "forming") == 5
    assert [device for thread, device in chosen if thread.startswith("ringleader-abortable")] == [1]  # and formation's
    chosen.clear()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU worker
    inherit_device()()
    assert chosen == []


def test_every_compute_method_of_the_worker_runs_with_its_device_current(monkeypatch):
    from workers.actor import TrainWorker

    chosen = _fake_cuda(monkeypatch, current=0)

    class Worker:
        device = torch.device("cuda", 1)
        leave_group = vars(TrainWorker)["leave_group"]
        link = type("NoGroup", (), {"leave": lambda self: None})()

    thread = threading.Thread(target=Worker().leave_group, name="ray-compute")  # as one of Ray's group threads
    thread.start()
    thread.join(timeout=10)
    assert chosen == [("ray-compute", torch.device("cuda", 1))]
    compute = [name for name, f in vars(TrainWorker).items() if getattr(f, "__ray_concurrency_group__", None) == "compute"]
    assert {"join_group", "train_step", "train_steps", "snapshot", "restore", "model_state"} <= set(compute)
    assert all(hasattr(vars(TrainWorker)[name], "__wrapped__") for name in compute)  # each through on_worker_device
