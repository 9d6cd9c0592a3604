"""The abort and timeout guarantees with NCCL's semantics, without a GPU: a fake process group
whose work ``wait()`` returns at once (as NCCL's does: it only orders a CUDA stream) and
``is_completed()`` stays false while a peer is dead."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from workers.comm_group import CommGroup
from workers.communicator import NativeAllReduce
from workers.ring import RingAllReduce


class _NeverCompletes:
    """NCCL-like work whose peer died: wait() does not block, it never completes."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self) -> bool:
        self.log.append("wait")
        return True

    def is_completed(self) -> bool:
        return False


class _DeadPeerGroup:
    """A process group whose every operation hangs on a dead peer; records abort()."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.aborted = False

    def allreduce(self, tensors, options):  # noqa: ANN001 - torch's signature
        return _NeverCompletes(self.log)

    def send(self, tensors, dst, tag):  # noqa: ANN001
        return _NeverCompletes(self.log)

    recv = send

    def broadcast(self, tensors, options):  # noqa: ANN001
        return _NeverCompletes(self.log)

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("make", [NativeAllReduce, RingAllReduce])
def test_an_abort_frees_a_polled_collective_and_aborts_the_communicator(make):
    pg, flag = _DeadPeerGroup(), threading.Event()
    group = CommGroup(pg, rank=0, size=2, timeout_s=30.0, abort_flag=flag, poll_completion=True)  # type: ignore[arg-type]
    pending = make(group).start_sum(torch.ones(8))
    time.sleep(0.1)
    assert pg.log == []  # polled, never trusted wait(): the op is not "done" on a dead peer
    flag.set()
    started = time.perf_counter()
    with pytest.raises(CollectiveAborted):
        pending.wait()
    assert time.perf_counter() - started < 1.0
    group.close()
    assert pg.aborted


def test_a_polled_collective_times_out_without_an_abort():
    pg = _DeadPeerGroup()
    group = CommGroup(pg, rank=1, size=2, timeout_s=0.3, abort_flag=threading.Event(), poll_completion=True)  # type: ignore[arg-type]
    with pytest.raises(CollectiveTimeout):
        group.broadcast(torch.ones(4), root=0)
    group.close()
    assert pg.aborted


class _FailedWork:
    """NCCL work that ended in an error: completed, and wait() raises it."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        raise RuntimeError("NCCL communicator was aborted")


def test_a_completed_op_that_failed_raises_instead_of_passing_half_reduced_values():
    group = CommGroup(object(), rank=0, size=2, timeout_s=5.0, abort_flag=threading.Event(), poll_completion=True)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="aborted"):
        group.complete(_FailedWork())  # type: ignore[arg-type]
    group.close()


def test_without_polling_wait_would_have_reported_a_dead_op_as_done():
    """Why polling is needed: trusting NCCL's wait() ends the op at once, and the caller would
    go on to read values that never arrive."""
    pg = _DeadPeerGroup()
    group = CommGroup(pg, rank=0, size=2, timeout_s=5.0, abort_flag=threading.Event(), poll_completion=False)  # type: ignore[arg-type]
    NativeAllReduce(group).start_sum(torch.ones(4)).wait()  # "succeeds"
    assert pg.log == ["wait"]
    group.close()
    assert not pg.aborted


@pytest.mark.parametrize(("preset", "want"), [(None, "2"), ("1", "1")])
def test_nccl_errors_abort_communicators_without_killing_the_process(monkeypatch, preset, want):
    """torch's default (3) tears the process down on a collective timeout: every survivor
    would die with the peer. A user's own choice is kept."""
    from workers.comm_group import new_process_group

    if preset is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", preset)
    try:
        new_process_group("nccl", None, 0, 1, 1.0)  # type: ignore[arg-type]  # no GPU here: fails after the setting
    except (AttributeError, RuntimeError, TypeError, ValueError):
        pass
    import os

    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == want
