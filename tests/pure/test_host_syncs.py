"""A training step of the real worker waits for its device at most once (issue 42): the
step's verdict (census, loss, weight, gradient norm) is read in one copy, and nothing else
of the step reads a device value, moves one to the host or synchronizes.

Counted by ``HostSyncs`` (``benchmarks/host_syncs.py``) over one step of a ``TrainWorker`` in
a process group of one, without Ray, with the plan the driver makes by default (mitigations
on: the rescue check reads the census too) and with a fixed plan; on the CPU (CI) and on a
GPU, where copies across the device count as well."""

from __future__ import annotations

import pytest
import torch

from benchmarks.host_syncs import HostSyncs
from benchmarks.overhead import overhead_job, solo_worker
from policies.work_stealing import StepPlan
from tests.helpers.devices import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mitigating", [True, False], ids=["mitigating", "fixed"])
def test_a_training_step_syncs_the_host_with_its_device_at_most_once(device, mitigating):
    job = overhead_job(device, steps=4)
    with solo_worker(job, torch.device(device)) as (worker, plan):
        if not mitigating:
            plan = StepPlan(plan.shards_by_rank, steal=False, speculate=False)
        for index in range(3):
            worker.train_step(index, plan)
        with HostSyncs() as syncs:
            worker.train_step(3, plan)
    assert syncs.count <= 1, f"{syncs.count} host syncs in one step: {dict(syncs.sites)}"


def test_the_sync_counter_sees_each_kind_of_read():
    """The control: each way code reads a device value counts once, plain arithmetic never."""
    values = torch.arange(4.0)
    with HostSyncs() as syncs:
        (values * 2 + 1).sum()
        float(values.sum())
        values.tolist()
        values.cpu()
        bool(values.any())
        torch.nonzero(values)
    assert syncs.count == 5, dict(syncs.sites)
