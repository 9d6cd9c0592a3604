"""One worker's share of a training step: which shards it computes, and in which passes.

Two ways, chosen by the step's plan:

* **fixed**: the worker runs exactly its planned shards (in one pass with ``fuse_shards``),
  the final backward overlapped with the all-reduce. No store traffic.
* **claimed** (straggler mitigation on): the worker claims, steals and backs up shards through
  the driver's store; ``StepRunner`` (``workers/step/runner.py``) adds it on top of these passes.

A model whose training forward couples a batch's samples or updates buffers (BatchNorm) runs
one pass per shard whatever ``fuse_shards`` says (a forward never spans two shards; each piece
of ``max_samples_per_pass`` is a normalization batch), each from the step's pre-step buffers,
and brings its committed shards' buffer changes to the all-reduce (``workers/model/buffers.py``).

Every pass is one forward/backward over a group of shards (split into passes of at most
``max_samples_per_pass`` samples): the backward of the loss sum (``workers/model/objective.py``)
divided by the step's global batch size and times the fp16 loss scale, both known before the
step. What the loss sums are finally normalised by, the step's total weight, is known only
after the all-reduce, which carries it with the gradient (in the census slots,
``workers/step/census.py``); the worker divides then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from jobspec.wire import Phase
from workers.comm.gradient_reducer import GradientReducer
from workers.data.batches import fetch_batch, move_to
from workers.data.prefetch import BatchPrefetch
from workers.data.sampler import ShardSampler
from workers.model.buffers import StepBuffers
from workers.model.flat_parameters import FlatParameters
from workers.model.objective import Objective
from workers.model.precision import autocast
from workers.model.seeding import piece_seed, seed_forward, shard_seed
from workers.runtime.chaos import ChaosSchedule
from workers.runtime.devices import host_batch
from workers.step.census import census_slots, write_census
from workers.step.records import PassResult, StepWork


class PassRunner:
    """Runs this worker's passes of a step into ``flat``'s gradient buffer: the passes
    themselves, and the fixed way (``run_fixed``); ``StepRunner`` (``workers/step/runner.py``)
    adds the claimed way."""

    def __init__(
        self,
        model: torch.nn.Module,
        flat: FlatParameters,
        sampler: ShardSampler,
        dataset: object,
        objective: Objective,
        seed: int,
        fuse_shards: bool,
        chaos: ChaosSchedule,
        device: torch.device,
        *,
        collate: Callable[[list[Any]], Any] | None = None,
        precision: str = "fp32",
        max_samples_per_pass: int | None = None,
        on_phase: Callable[[Phase], None] = lambda phase: None,
        buffers: StepBuffers | None = None,
    ) -> None:
        self.model = model
        self.flat = flat
        self.sampler = sampler
        self.dataset = dataset
        self.objective = objective
        self.seed = seed
        self.fuse_shards = fuse_shards
        self.chaos = chaos
        self.device = device
        self.collate = collate
        self.precision = precision
        self.max_samples_per_pass = max_samples_per_pass
        #: The fp16 loss scale of the step being run (1 otherwise), set by the worker.
        self.loss_scale = 1.0
        self.on_phase = on_phase  # told IDLE while waiting for others' shards, then COMPUTE
        #: The model's batch-dependent buffers (none: the fast path, passes as ``fuse_shards`` says).
        self.buffers = buffers if buffers is not None else StepBuffers(model, [], [])
        self.prefetch = BatchPrefetch(self._read)

    def _read(self, indices: np.ndarray) -> Any:
        """The samples at ``indices`` as a batch waiting on the host for this worker's device
        (pinned for a GPU, so the copy there overlaps: ``workers/runtime/devices.py``)."""
        return host_batch(fetch_batch(self.dataset, indices, self.collate), self.device)

    def start_reading(self, step: int, shards: list[int], before: Callable[[], object] | None = None) -> None:
        """Start reading the first batch of a pass over ``shards`` at ``step`` (after ``before()``)."""
        if shards:
            self.prefetch.start(self._first_batch(step, shards), before)

    def read_next(self, step: int, shards: list[int]) -> None:
        """Read the same shards' first batch at the step after ``step``, ahead (``BatchPrefetch``).
        Called once this step's batch is in hand: a read begun while the worker waits for its
        own takes the interpreter from it (a small model's step lost 1.4% of its time there)."""
        last = self.sampler.num_steps
        if shards and (last is None or step + 1 < last):
            self.prefetch.read_ahead(self._first_batch(step + 1, shards))

    def _first_batch(self, step: int, shards: list[int]) -> np.ndarray:
        first = self._indices(step, self._groups(shards)[0])
        return first[: self.max_samples_per_pass or len(first)]

    def _groups(self, shards: list[int]) -> list[list[int]]:
        """Shards run together in one pass (``fuse_shards``), or one at a time (always for a
        model with batch-dependent layers: a forward never spans two shards)."""
        fuse = self.fuse_shards and not self.buffers.per_shard
        return [list(shards)] if fuse and shards else [[s] for s in shards]

    def _indices(self, step: int, shards: list[int]) -> np.ndarray:
        return self.sampler.indices(step, shards)

    def _pass(
        self,
        step: int,
        shards: list[int],
        work: StepWork,
        *,
        sign: float = 1.0,
        before_backward: Callable[[PassResult], None] | None = None,
    ) -> PassResult:
        """Forward/backward of ``shards`` together (in pieces of at most
        ``max_samples_per_pass`` samples, each seeded by the shard and its place), gradient
        times ``sign`` added to the buffer. ``before_backward(result)`` runs before the last
        backward (to arm the overlap). A pass over empty shards does nothing. With
        batch-dependent layers (one shard a pass) it starts from the step's buffers and keeps
        the change its forward made to them (``StepBuffers``)."""
        started = time.perf_counter()
        indices = self._indices(step, shards)
        result = PassResult()
        if not len(indices):
            return result
        piece = self.max_samples_per_pass or len(indices)
        pieces = [indices[lo : lo + piece] for lo in range(0, len(indices), piece)]
        factor = sign * self.loss_scale / self.sampler.step_batch_size(step)
        self.buffers.reset()  # every shard's pass starts from the step's buffers
        for number, chunk in enumerate(pieces):
            read = self.prefetch.take(chunk) if number == 0 else None
            batch = move_to(read if read is not None else self._read(chunk), self.device)
            seed_forward(piece_seed(shard_seed(self.seed, step, shards[0]), number), self.device)
            with autocast(self.device, self.precision):
                loss = self.objective(self.model, batch, len(chunk))
            # The loss sum stays a device tensor (float64, as the Python float it replaces):
            # reading it here would hold the host until the forward is done, before backward is
            # queued. It reaches the census slots as a tensor and is read once, after the step.
            result = result + PassResult(loss.total.detach().to(torch.float64), loss.weight, len(chunk))
            if number == len(pieces) - 1:
                if self.buffers.per_shard:  # one shard: what its forward left in the buffers
                    self.buffers.record(shards[0])
                if before_backward is not None:
                    before_backward(result)
            (loss.total * factor).backward()
        work.compute_s += time.perf_counter() - started
        return result

    def _write_bookkeeping(self, work: StepWork, num_shards: int) -> None:
        """The census, loss sum, sample count and weight ride in the buffer's extra slots, then
        the committed shards' buffer changes (``StepBuffers.write``)."""
        write_census(self.flat.extra, num_shards, work.committed, work.total)
        self.buffers.write(self.flat.extra[census_slots(num_shards) :], work.committed)

    def run_fixed(self, step: int, shards: list[int], num_shards: int, reducer: GradientReducer) -> StepWork:
        """Exactly ``shards``, after sitting out any stall and waiting for the first batch (read
        ahead during the last step where the plan kept these shards); the final pass overlaps
        with the all-reduce."""
        work = StepWork(stalled_s=self.chaos.stall(step))
        if shards:
            started = time.monotonic()
            self.start_reading(step, shards)
            self.prefetch.wait(lambda: False)  # a stuck read holds the step, as a read in the pass would
            work.stalled_s += time.monotonic() - started
            self.read_next(step, shards)
        self.on_phase(Phase.COMPUTE)
        work.slowed_s += self.chaos.slow_down(step, len(shards), lambda: False)
        self._final_passes(step, shards, num_shards, reducer, work)
        return work

    def _final_passes(
        self, step: int, shards: list[int], num_shards: int, reducer: GradientReducer, work: StepWork
    ) -> None:
        """Run ``shards``, whose commit is certain, as this worker's last passes of the step: the
        last backward overlaps with the all-reduce, the bookkeeping riding in its last bucket."""
        work.committed += shards
        work.shards_run += len(shards)
        groups = [g for g in self._groups(shards) if len(self._indices(step, g))]
        if not groups:
            self._write_bookkeeping(work, num_shards)
        for number, group in enumerate(groups):
            final = number == len(groups) - 1

            def arm(result: PassResult, final: bool = final) -> None:
                if final:  # the bookkeeping rides in the last bucket, which may go out now
                    work.total = work.total + result
                    self._write_bookkeeping(work, num_shards)
                    reducer.arm()

            result = self._pass(step, group, work, before_backward=arm)
            if not final:
                work.total = work.total + result
