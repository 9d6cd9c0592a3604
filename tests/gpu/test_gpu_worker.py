"""The GPU suite's worker parts, without Ray (the lent GPU machine has none): a process group of
one rank on the device (NCCL on CUDA: it forms, runs every algorithm and compression, is
aborted and forms again, leaving no thread behind), a gradient reduced bucket by bucket during
a real backward whose branches run on streams of their own, checkpoints written on one device and restored on another, the fused
optimizer, the fp16 loss scaler and forward seeding on the device.

Every test runs on ``cpu`` (CI: the logic) and ``cuda`` (``pytest -m gpu``: skipped, saying
so, where there is no CUDA device). One GPU is enough: NCCL refuses two ranks on one device,
so collectives between ranks on CUDA are verified only by the fake NCCL process group
(tests/multiprocess/test_nccl_semantics.py) and, over gloo, by tests/gpu/test_gpu_jobs.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from jobspec.failures import CollectiveAborted
from jobspec.job import JobConfig
from jobspec.recipe import OptimizerConfig
from jobspec.runtime import CollectiveConfig
from jobspec.wire import JoinRequest, SnapshotRequest
from tests.helpers.devices import DEVICES
from tests.helpers.gradients import finish_gradient
from workers.checkpoint.manifest import verify_checkpoint, write_manifest
from workers.checkpoint.storage import CheckpointStorage
from workers.comm.comm_group import CommGroup, PendingOp
from workers.comm.compression import CastCompressed, TopKAllReduce
from workers.comm.gradient_reducer import GradientReducer
from workers.group_link import GroupLink
from workers.model.flat_parameters import FlatParameters
from workers.model.seeding import seed_forward
from workers.optim.generic import decay_groups, make_optimizer
from workers.optim.loss_scaler import LossScaler
from workers.replica_checkpoint import CheckpointWriter, restore_state
from workers.runtime.chaos import ChaosSchedule
from workers.state_layout import ReplicatedState

ADAMW = OptimizerConfig(name="adamw", kwargs={"lr": 0.01, "weight_decay": 0.1}, decay_biases_and_norms=False)
# Every algorithm and compression a group can be built with (auto: the link probe runs too).
COLLECTIVES = [
    CollectiveConfig(algorithm="auto"),
    CollectiveConfig(algorithm="ring"),
    CollectiveConfig(algorithm="hierarchical"),
    CollectiveConfig(algorithm="native"),
    CollectiveConfig(algorithm="native", compression="bf16"),
    CollectiveConfig(algorithm="ring", compression="int8"),
    CollectiveConfig(algorithm="ring", compression="topk", topk_ratio=0.25),
]
THREAD_PREFIXES = ("ringleader-comm", "ringleader-abortable")
THREADS_GONE_S = 10.0
# About 10 ms of a GPU's clock: far longer than the branches' backward itself.
SLOW_CYCLES = 20_000_000


@dataclass
class DeviceReplica:
    """A small model replica on ``device`` as a worker holds one (``workers.replica.Replica``):
    the flat parameters, the fused AdamW, the fp16 loss scaler."""

    device: torch.device
    seed: int = 0
    model: torch.nn.Module = field(init=False)
    flat: FlatParameters = field(init=False)
    optimizer: object = field(init=False)
    state: ReplicatedState = field(init=False)
    scaler: LossScaler = field(init=False)
    next_step: int = 0

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        layers = [torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 4)]
        self.model = torch.nn.Sequential(*layers).to(self.device)
        self.flat = FlatParameters(self.model.parameters(), extra=2)
        self.optimizer = make_optimizer(ADAMW, self.flat)
        self.state = ReplicatedState(self.optimizer)
        self.scaler = LossScaler(True, init=1024.0, growth_interval=2, device=self.device)

    def backward(self, step: int) -> None:
        """The gradient of a fixed batch of step ``step`` into the flat buffer."""
        generator = torch.Generator().manual_seed(100 + step)
        batch = torch.randn(32, 16, generator=generator).to(self.device)
        self.model(batch).square().mean().backward()

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.flat.zero()
            self.backward(self.next_step)
            self.optimizer.step()
            self.next_step += 1


def _ringleader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIXES)]


def _join(link: GroupLink, port: int, generation: int, replica: DeviceReplica) -> None:
    link.join(JoinRequest("127.0.0.1", port, f"gen{generation}/", generation, 0, ("node",), 30.0), replica)


def _check_sum(link: GroupLink, collective: CollectiveConfig, device: torch.device) -> None:
    """A sum over the group of one is the tensor itself: exactly, in bf16's rounding, to int8's
    quantization error, or (top-k) the largest entries of it plus the residual it held (which
    outlives a generation), the rest kept as the new residual."""
    values = torch.linspace(-3.0, 5.0, 1000, device=device)
    held = link.residuals.get((0, values.numel()), torch.zeros_like(values))
    summed = values.clone()
    assert link.reducer_comm is not None
    link.reducer_comm.start_sum(summed).wait()
    assert summed.device == values.device
    if collective.compression == "topk":
        assert isinstance(link.reducer_comm, TopKAllReduce)
        assert int((summed != 0).sum()) == 250  # topk_ratio of 1000
        link.commit_residuals()
        residual = link.residuals[0, values.numel()]
        assert residual.device == values.device
        torch.testing.assert_close(summed + residual, values + held)
    elif collective.compression == "int8":
        torch.testing.assert_close(summed, values, rtol=0, atol=float(values.abs().max()) / 127)
    elif collective.compression == "bf16":
        torch.testing.assert_close(summed, values, rtol=2**-8, atol=0)
    else:
        assert torch.equal(summed, values)


@pytest.mark.parametrize("device", DEVICES)
def test_a_group_of_one_forms_runs_every_algorithm_is_aborted_and_forms_again(device):
    """On CUDA the group is NCCL's: formation (the join's broadcasts of the state), each
    algorithm and compression, the link probe, an abort that breaks the group (its
    communicator aborted as it closes) and a new generation formed beside it."""
    device = torch.device(device)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    replica, flag = DeviceReplica(device), threading.Event()
    before = _ringleader_threads()
    generation = 0
    for collective in COLLECTIVES:
        link = GroupLink(collective, 30.0, flag)
        generation += 1
        _join(link, store.port, generation, replica)
        _check_sum(link, collective, device)
        flag.set()  # the driver's abort: what is queued and what comes fails at once
        with pytest.raises(CollectiveAborted, match="aborted by the driver"):
            link.reducer_comm.start_sum(torch.ones(8, device=device)).wait()
        link.leave()
        assert link.group is None
        flag.clear()
        generation += 1
        _join(link, store.port, generation, replica)  # formed again, beside the broken one
        _check_sum(link, collective, device)
        link.leave()
    deadline = time.monotonic() + THREADS_GONE_S
    while _ringleader_threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ringleader_threads() == before  # no formation or abort left a thread behind


class _Slowed(torch.autograd.Function):
    """The identity, whose backward (on CUDA) holds its stream for ``SLOW_CYCLES`` first: the
    gradients computed after it on that stream land late."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        if grad.is_cuda:
            torch.cuda._sleep(SLOW_CYCLES)
        return grad


class _Branches(torch.nn.Module):
    """Two branches summed into a head; on CUDA each branch runs on a stream of its own, as a
    model may, and ``slowed``'s backward lands late on its stream. On the CPU, one after the
    other."""

    def __init__(self, device: torch.device, slowed: str) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(16, 64), torch.nn.Linear(16, 64), torch.nn.Linear(64, 4)
        self.slowed = slowed
        self.streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)] if device.type == "cuda" else None
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = [(self.a, "a"), (self.b, "b")]
        if self.streams is None:
            outs = [_Slowed.apply(layer(x)) if name == self.slowed else layer(x) for layer, name in branches]
            return self.head(outs[0] + outs[1])
        main, outs = torch.cuda.current_stream(x.device), []
        for (layer, name), stream in zip(branches, self.streams):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                out = layer(x)
                outs.append(_Slowed.apply(out) if name == self.slowed else out)
        for stream in self.streams:
            main.wait_stream(stream)
        return self.head(outs[0] + outs[1])


class _Doubling:
    """A communicator whose result depends on what it read: it doubles its tensor on the
    group's communication thread (on that thread's stream). A bucket read before its
    gradient landed ends up not doubled (or half of it)."""

    def __init__(self, group: CommGroup) -> None:
        self.group = group

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        return self.group.submit(lambda: tensor.mul_(2), "doubling")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slowed", ["a", "b"])
@pytest.mark.parametrize("compression", ["none", "bf16"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after-backward"])
def test_buckets_reduced_during_a_real_backward_hold_its_gradient(device, slowed, compression, overlap):
    """The reducer's hand-off on the device: a bucket holding both branches' parameters goes
    out from the hook of whichever is ready last, while (CUDA) the slowed branch's stream may
    still be writing its gradient; the communication thread must read it only after every
    stream that wrote it (and bf16's cast must come after that too). Either branch is slowed
    in turn, so the one not covered by the last hook's stream is slowed in one of them."""
    device = torch.device(device)
    torch.manual_seed(0)
    model = _Branches(device, slowed)
    flat = FlatParameters(model.parameters(), extra=2)
    batch = torch.randn(32, 16, generator=torch.Generator().manual_seed(100)).to(device)

    def backward() -> None:
        flat.zero()
        flat.extra[0] = 1.0
        model(batch).square().mean().backward()

    backward()
    want = flat.buffer.clone()
    group = CommGroup(None, 0, 1, 30.0, threading.Event())  # type: ignore[arg-type]  # only its thread is used
    doubling = _Doubling(group)
    comm = doubling if compression == "none" else CastCompressed(doubling, torch.bfloat16, group)
    reducer = GradientReducer(flat, comm, 1 << 20, overlap, extra_comm=doubling, group=group)
    assert len(reducer.buckets) == 1 and (reducer.marks is None) == (device.type == "cpu")  # one bucket: both branches
    reducer.arm()
    backward()
    reducer.finish()
    group.close()
    grads = want[2:] if compression == "none" else want[2:].bfloat16().float()  # doubling is exact in bf16
    torch.testing.assert_close(flat.buffer, torch.cat([2 * want[:2], 2 * grads]), rtol=0, atol=0)


def _write_checkpoint(root: str, source: DeviceReplica) -> CheckpointStorage:
    """A 2-part checkpoint of ``source`` (two ranks' writers) and its manifest under ``root``."""
    writers = [CheckpointWriter(ChaosSchedule.for_worker(JobConfig().chaos, i, threading.Event()), lambda: None) for i in range(2)]
    name = f"step-{source.next_step:08d}"
    for index, writer in enumerate(writers):
        writer.snapshot(SnapshotRequest(source.next_step, root, name, "a1", index, 2), source, {}, index)
    storage = CheckpointStorage(root)
    write_manifest(storage, source.next_step, [f for w in writers for f in w.written(name, "a1", timeout_s=60).files], {})
    return storage


@pytest.mark.parametrize(
    "written_on, restored_on",
    [
        pytest.param("cpu", "cpu", id="cpu-cpu"),
        pytest.param("cuda", "cpu", id="cuda-cpu", marks=pytest.mark.gpu),
        pytest.param("cpu", "cuda", id="cpu-cuda", marks=pytest.mark.gpu),
    ],
)
def test_a_checkpoint_written_on_one_device_restores_exactly_on_another(tmp_path, written_on, restored_on):
    """A snapshot copies device tensors to the host; a restore puts them on the replica's own
    device, bit for bit: parameters, the fused optimizer's state, the loss scale, the step."""
    source = DeviceReplica(torch.device(written_on))
    source.train(3)
    source.scaler.update(float("inf"))  # a scale that moved: it must travel too
    storage = _write_checkpoint(str(tmp_path), source)
    name = f"step-{source.next_step:08d}"
    restored = DeviceReplica(torch.device(restored_on), seed=1)  # other parameters to start with
    restore_state(restored, storage, name, verify_checkpoint(storage, name))
    assert restored.next_step == 3 and restored.scaler.scale == source.scaler.scale == 512.0
    assert restored.flat.values.device.type == restored_on
    assert torch.equal(restored.flat.values.cpu(), source.flat.values.cpu())
    for key, tensor in source.optimizer.state_tensors().items():
        mine = restored.optimizer.state_tensors()[key]
        assert mine.device.type == restored_on and torch.equal(mine.cpu(), tensor.cpu()), key
    # Both go on alike from there (on the same device: the same kernels, the same numbers).
    again = DeviceReplica(torch.device(written_on), seed=1)
    restore_state(again, storage, name, verify_checkpoint(storage, name))
    again.train(2)
    source.train(2)
    assert torch.equal(again.flat.values, source.flat.values)


@pytest.mark.parametrize("device", DEVICES)
def test_the_fused_optimizer_on_the_device_steps_as_torch_optim_does(device):
    """The flat buffer stepped by torch's fused AdamW kernel on the device (not the stock
    fallback) follows torch.optim.AdamW's plain loop on the CPU, parameter by parameter."""
    replica = DeviceReplica(torch.device(device))
    assert replica.optimizer._fallback is None  # the fused kernel runs on this device
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    groups = decay_groups(plain.parameters(), ADAMW.decay_biases_and_norms)  # biases and norms undecayed, as ours
    stock = torch.optim.AdamW([g for g in groups if g["params"]], **ADAMW.kwargs, foreach=False)
    for step in range(5):
        replica.flat.zero()
        replica.backward(step)
        replica.optimizer.step()
        stock.zero_grad()
        generator = torch.Generator().manual_seed(100 + step)
        plain(torch.randn(32, 16, generator=generator)).square().mean().backward()
        stock.step()
    for got, want in zip(replica.model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_the_fp16_loss_scaler_skips_an_overflowing_step_on_the_device(device):
    """The skip is decided from the reduced gradient's norm on the device: an inf there skips
    the step and halves the scale (in the state tensor that travels, on the device too);
    finite steps go on and grow it after ``growth_interval`` of them."""
    replica = DeviceReplica(torch.device(device))
    replica.flat.zero()
    replica.backward(0)
    grads = replica.flat.grads
    grads[3] = float("inf")
    update = finish_gradient(grads, weight=1.0, scaled_by=replica.scaler.scale, clip=1.0)
    assert replica.scaler.update(update.grad_norm) is True
    assert replica.scaler.state.device.type == device and replica.scaler.state.tolist() == [512.0, 0.0]
    replica.flat.zero()
    replica.backward(1)
    for expected in ([512.0, 1.0], [1024.0, 0.0]):
        update = finish_gradient(replica.flat.grads.clone(), weight=1.0, scaled_by=replica.scaler.scale, clip=1.0)
        assert replica.scaler.update(update.grad_norm) is False
        assert replica.scaler.state.tolist() == expected


@pytest.mark.parametrize("device", DEVICES)
def test_forward_seeding_on_the_device_repeats_its_dropout(device):
    """``seed_forward`` seeds the generator the device's dropout draws from: the same seed gives
    the same mask on the device, another seed another mask."""
    device = torch.device(device)
    ones = torch.ones(4096, device=device)

    def mask(seed: int) -> torch.Tensor:
        torch.manual_seed(12345)  # a different state beforehand: only seed_forward may decide
        seed_forward(seed, device)
        return torch.nn.functional.dropout(ones, p=0.5, training=True)

    assert torch.equal(mask(7), mask(7))
    assert not torch.equal(mask(7), mask(8))
