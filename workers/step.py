"""One worker's share of a training step: which shards it computes, and in which passes.

Two ways, chosen by the step's plan:

* **fixed**: the worker runs exactly its planned shards (in one pass with ``fuse_shards``),
  the final backward overlapped with the all-reduce. No store traffic.
* **claimed** (straggler mitigation on): the worker asks ``pick_work`` what to do, moves
  shards through the claim states of ``workers/claims.py`` by compare-and-set, and only adds
  a shard's gradient if its commit won. It runs its own shards in two passes, steals
  unstarted shards of laggards, and backs up their late running shards. A backup computes
  from a snapshot of the gradient buffer, restored if it loses; an owner that loses a race
  after computing removes the shard's gradient with a negated pass. The final own pass is
  overlapped only when sealed (no backup can start any more, so its commit is certain).

Every pass is one forward/backward over a group of shards, each shard's loss summed over its
samples and divided by the step's global batch size.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from policies.work_stealing import Backup, ClaimKind, Finished, RunShards, StepPlan, Wait, pick_work
from workers.chaos import ChaosSchedule
from workers.claims import ShardClaims
from workers.comm_group import CollectiveAborted, CollectiveTimeout
from workers.overlap import GradientReducer
from workers.sampler import ShardSampler
from workers.protocol import Phase
from workers.training import FlatParameters, fetch_batch, move_to, per_sample_loss

# How often an idle worker looks at the claims again (store round trips are ~50-150 us).
POLL_S = 0.002


def shard_seed(seed: int, step: int, shard: int) -> int:
    # Randomness inside the forward pass (dropout) depends on the shard, not on the worker.
    return ((seed * 1_000_003 + step) * 1_000_003 + shard) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class StepWork:
    """What this worker did in a step: the shards whose gradient it contributes, and counts."""

    committed: list[int] = field(default_factory=list)
    samples: int = 0
    loss: float = 0.0
    shards_run: int = 0  # passes' shards, including lost races and discarded backups
    compute_s: float = 0.0  # forward + backward, all passes
    slowed_s: float = 0.0  # injected slowness (chaos), part of the compute it stands for
    idle_s: float = 0.0  # waiting for other workers' shards before the all-reduce
    stolen: int = 0
    backups: int = 0
    backups_won: int = 0
    races_lost: int = 0


class StepRunner:
    """Runs this worker's passes of a step into ``flat``'s gradient buffer."""

    def __init__(
        self,
        model: torch.nn.Module,
        flat: FlatParameters,
        sampler: ShardSampler,
        dataset: object,
        loss: str,
        seed: int,
        fuse_shards: bool,
        chaos: ChaosSchedule,
        device: torch.device,
        on_phase: Callable[[Phase], None] = lambda phase: None,
    ) -> None:
        self.model = model
        self.flat = flat
        self.sampler = sampler
        self.dataset = dataset
        self.loss = loss
        self.seed = seed
        self.fuse_shards = fuse_shards
        self.chaos = chaos
        self.device = device
        self.on_phase = on_phase  # told IDLE while waiting for others' shards, then COMPUTE

    def _groups(self, shards: list[int]) -> list[list[int]]:
        """Shards run together in one pass (``fuse_shards``), or one at a time."""
        return [list(shards)] if self.fuse_shards and shards else [[s] for s in shards]

    def _indices(self, step: int, shards: list[int]) -> np.ndarray:
        return np.concatenate([self.sampler.shard_indices(step, s) for s in shards])

    def _pass(
        self,
        step: int,
        shards: list[int],
        work: StepWork,
        *,
        sign: float = 1.0,
        before_backward: Callable[[float], None] | None = None,
    ) -> tuple[float, int]:
        """Forward/backward of ``shards`` together, gradient times ``sign`` added to the buffer.
        ``before_backward(loss)`` runs between them (to arm the overlap). Returns (loss, samples);
        a pass over empty shards does nothing."""
        started = time.perf_counter()
        indices = self._indices(step, shards)
        if not len(indices):
            return 0.0, 0
        inputs, targets = move_to(fetch_batch(self.dataset, indices), self.device)
        torch.manual_seed(shard_seed(self.seed, step, shards[0]))
        loss = per_sample_loss(self.loss, self.model(inputs), targets).sum() / self.sampler.step_batch_size(step)
        value = float(loss.detach())
        if before_backward is not None:
            before_backward(value)
        (loss * sign).backward()
        work.compute_s += time.perf_counter() - started
        return value, len(indices)

    def _write_bookkeeping(self, work: StepWork, num_shards: int) -> None:
        """The census, loss and sample count ride in the buffer's extra slots."""
        extra = self.flat.extra
        extra[:num_shards] = 0.0
        if work.committed:
            extra[work.committed] = 1.0
        extra[num_shards] = work.loss
        extra[num_shards + 1] = work.samples

    def run_fixed(self, step: int, shards: list[int], num_shards: int, reducer: GradientReducer) -> StepWork:
        """Exactly ``shards``; the final pass overlaps with the all-reduce."""
        work = StepWork()
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

            def arm(loss: float, final: bool = final, group: list[int] = group) -> None:
                if final:  # the bookkeeping rides in the last bucket, which may go out now
                    work.loss += loss
                    work.samples += len(self._indices(step, group))
                    self._write_bookkeeping(work, num_shards)
                    reducer.arm()

            loss, samples = self._pass(step, group, work, before_backward=arm)
            if not final:
                work.loss += loss
                work.samples += samples

    def run_claimed(
        self,
        step: int,
        plan: StepPlan,
        claims: ShardClaims,
        reducer: GradientReducer,
        deadline_s: float,
        abort: threading.Event,
    ) -> StepWork:
        """Claim, steal and back up shards until every shard is done or sealed."""
        work = StepWork()
        seen: dict[int, tuple[str, float]] = {}
        waited_since: float | None = None
        while True:
            if abort.is_set():
                raise CollectiveAborted(f"step {step} aborted by the driver")
            states = claims.states()
            now = time.monotonic()
            ages = {}
            for shard, state in states.items():
                code = state.encode()
                if seen.get(shard, ("", 0.0))[0] != code:
                    seen[shard] = (code, now)
                ages[shard] = now - seen[shard][1]
            decision = pick_work(claims.me, plan, states, ages)
            if isinstance(decision, Finished):
                if waited_since is not None:
                    work.idle_s += now - waited_since
                break
            if isinstance(decision, Wait):
                if waited_since is None:
                    waited_since = now
                    self.on_phase(Phase.IDLE)
                if now - waited_since > deadline_s:
                    raise CollectiveTimeout(
                        f"step {step}: shards {[s for s, st in states.items() if st.kind is not ClaimKind.DONE]} "
                        f"not committed within {deadline_s:.0f}s"
                    )
                time.sleep(POLL_S)
                continue
            if waited_since is not None:
                work.idle_s += now - waited_since
                waited_since = None
                self.on_phase(Phase.COMPUTE)
            if isinstance(decision, Backup):
                if claims.start_backup(decision.shard, decision.owner):
                    self._backup(step, decision.shard, decision.owner, claims, work)
                continue
            assert isinstance(decision, RunShards)
            whole = decision.seal and decision.shards == plan.shards_by_rank[claims.me]
            if whole and claims.claim_block():
                claimed = list(decision.shards)
            else:
                claimed = [s for s in decision.shards if claims.claim(s, seal=decision.seal)]
            if not claimed:
                continue
            if decision.stolen_from >= 0:
                work.stolen += len(claimed)
            if decision.seal:
                work.slowed_s += self.chaos.slow_down(step, len(claimed), lambda: False)
                self._final_passes(step, claimed, plan.num_shards, reducer, work)
                return work  # the all-reduce of this pass is under way: no more gradient may be added
            self._own_pass(step, claimed, claims, work)
        self._write_bookkeeping(work, plan.num_shards)
        return work

    def _own_pass(self, step: int, claimed: list[int], claims: ShardClaims, work: StepWork) -> None:
        """Run shards claimed (not sealed) by me; only those whose commit wins keep their gradient."""

        def raced() -> bool:
            return any(claims.states()[s].kind is ClaimKind.RACE for s in claimed)

        work.slowed_s += self.chaos.slow_down(step, len(claimed), raced)
        states = claims.states()  # a backup that started while we were slow takes the shard over
        claimed = [s for s in claimed if states[s].kind is not ClaimKind.RACE]
        work.shards_run += len(claimed)
        value, samples = 0.0, 0
        for group in self._groups(claimed):
            loss, count = self._pass(step, group, work)
            value, samples = value + loss, samples + count
        won = [s for s in claimed if claims.commit(s, claims.me)]
        lost = [s for s in claimed if s not in won]
        if lost:  # a backup committed first: take these shards' gradient back out
            work.races_lost += len(lost)
            for group in self._groups(lost):
                loss, count = self._pass(step, group, work, sign=-1.0)
                value, samples = value - loss, samples - count
        work.committed += won
        work.loss += value
        work.samples += samples

    def _backup(self, step: int, shard: int, owner: int, claims: ShardClaims, work: StepWork) -> None:
        work.backups += 1
        work.shards_run += 1
        snapshot = self.flat.grads.clone()
        value, samples = self._pass(step, [shard], work)
        if claims.commit(shard, owner):
            work.backups_won += 1
            work.committed.append(shard)
            work.loss += value
            work.samples += samples
        else:
            self.flat.grads.copy_(snapshot)
