"""An NCCL group of one rank exchanges tensors with itself through ``CommGroup.exchange``: its
sends and receives posted as one coalesced group (``_start_coalescing``/``_end_coalescing`` on
``ProcessGroupNCCL``), the only way our algorithms talk between ranks, then closed (a healthy
group's communicators shut down).

The ``cuda`` variant (``pytest -m gpu``; skipped, saying so, without a CUDA device) runs torch's
real NCCL on one GPU, formed on ``cuda`` without an index (the current device). The ``cpu``
variant (CI) runs the same test over the fake NCCL process group
(``tests/helpers/nccl_fake_group.py``): gloo cannot send to its own rank. Without Ray."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tests.helpers.nccl_fake_group import FakeNcclWorld, FakeProcessGroupNCCL
from workers.comm.comm_group import CommGroup
from workers.comm.process_group import NCCL_ENVIRONMENT, NONBLOCKING_TIMEOUT_VARIABLE, form_process_group

TIMEOUT_S = 60.0
# cpu: the fake NCCL group; cuda: torch's ProcessGroupNCCL on the GPU.
DEVICES = [pytest.param("cpu", id="fake-nccl-cpu"), pytest.param("cuda", id="nccl-cuda", marks=pytest.mark.gpu)]


def _group_of_one(device: str, monkeypatch: pytest.MonkeyPatch) -> CommGroup:
    """A formed NCCL ``CommGroup`` of one rank on ``device`` (the NCCL environment it sets is
    undone after the test)."""
    for name in (*NCCL_ENVIRONMENT, NONBLOCKING_TIMEOUT_VARIABLE):
        monkeypatch.setenv(name, "unset")  # recorded, so what the code under test sets is undone
        monkeypatch.delenv(name)
    if device == "cpu":
        monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeProcessGroupNCCL, raising=False)
        store: object = FakeNcclWorld(1)
    else:
        store = dist.HashStore()
    flag = threading.Event()
    pg = form_process_group(
        "nccl", store, 0, 1, timeout_s=TIMEOUT_S, deadline_s=TIMEOUT_S, abort_flag=flag,  # type: ignore[arg-type]
        device=torch.device(device),
    )
    assert pg.supports_coalescing  # exchange takes the coalesced path, as between real ranks
    return CommGroup(pg, 0, 1, TIMEOUT_S, flag, poll_completion=True)


@pytest.mark.parametrize("device", DEVICES)
def test_an_nccl_rank_sends_to_itself_and_receives_in_one_exchange(device, monkeypatch):
    group = _group_of_one(device, monkeypatch)
    sent = [torch.arange(1000, dtype=torch.float32, device=device), torch.arange(7, dtype=torch.float32, device=device) - 3]
    received = [torch.zeros_like(tensor) for tensor in sent]

    def exchange() -> None:
        group.exchange([(tensor, 0) for tensor in sent], [(tensor, 0) for tensor in received]).complete()

    try:
        group.submit(exchange, "an exchange with itself").wait()
    finally:
        group.close()
    for got, want in zip(received, sent):  # matched in posting order: the k-th sent is the k-th received
        assert torch.equal(got, want)
    assert group.bytes_sent == 1007 * 4
    if isinstance(group.pg, FakeProcessGroupNCCL):
        assert group.pg.shut_down  # closed healthy: its communicators shut down, not aborted
