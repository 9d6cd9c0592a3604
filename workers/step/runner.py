"""The claimed way of running a step's shards (straggler mitigation on): the worker asks
``pick_work`` what to do, moves shards through the claim states of ``workers/step/claims.py`` by
compare-and-set, and only adds a shard's gradient if its commit won. It runs its own shards in
two passes, steals unstarted shards of laggards, and backs up their late running shards. A
backup computes from a snapshot of the gradient buffer, restored if it loses; an owner that
loses a race after computing removes the shard's gradient with a negated pass. The final own
pass is overlapped only when sealed (no backup can start any more, so its commit is certain).
It reads its first batch before sealing, watching its block meanwhile, and watches its peers'
blocks while it waits in the all-reduce (``workers/step/rescue_watch.py``): a peer stalled
before sealing is rescued (``run_claimed``, ``rescue``; docs/architecture.md, "Rescue").
The passes themselves, and the fixed way, are ``workers/step/passes.py``'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from jobspec.failures import CollectiveAborted, CollectiveTimeout
from jobspec.wire import Phase
from policies.work_stealing import (
    FREE,
    RESCUE_AFTER_MIN_S,
    Backup,
    ClaimKind,
    ClaimState,
    Finished,
    RunShards,
    StepPlan,
    Wait,
    claim_focus,
    pick_work,
)
from workers.step.claims import ShardClaims
from workers.step.passes import PassRunner
from workers.step.records import ClaimedStep, PassResult, RescuePass, StepWork

# How often an idle worker looks at the claims again (store round trips are ~50-150 us).
POLL_S = 0.002


def _first_look_s(plan: StepPlan) -> float:
    """How long a rank waits for its data before it first looks whether its block was opened.
    On a step with claims at once (a thief may open it any time). On a clean step only a
    watcher opens a block, no sooner than RESCUE_AFTER_MIN_S after it began to wait: a read of
    a few ms (not late) costs the store nothing, and one that started late gives up a little
    later; where no watcher could open it (no stealing, nothing expected yet, no peer), never."""
    if not plan.clean:
        return 0.0
    if plan.rescues and len(plan.shards_by_rank) > 1:
        return RESCUE_AFTER_MIN_S / 2
    return math.inf


class StepRunner(PassRunner):
    """Runs this worker's passes of a step, the fixed way (``PassRunner.run_fixed``) or
    claimed (``run_claimed``, then ``rescue`` if the census finds shards nobody brought)."""

    def run_claimed(self, ctx: ClaimedStep) -> StepWork:
        """Read my first batch, then claim, steal and back up shards until every shard is done
        or sealed. The batch is read before I seal my shards (``workers/data/prefetch.py``), and
        waited for watching my block: a peer that opened it (docs/architecture.md, "Rescue")
        made my shards no longer mine to seal, so I stop waiting and bring nothing to the
        all-reduce; the rescue pass (``rescue``) runs them. So I do, too, if I find my block
        opened when I come to seal it. Where the opening decision is to seal my whole block,
        I try that before reading anything (``_sealed_at_once``)."""
        work = StepWork()
        claims, step = ctx.claims, ctx.step
        mine = list(ctx.plan.shards_by_rank[claims.me])
        opening: object = None
        if mine:  # a rank with no shards this step has no data to wait for
            # What its first pass will run: pick_work's decision with every shard still free.
            opening = pick_work(claims.me, ctx.plan, dict.fromkeys(range(ctx.plan.num_shards), FREE), {})
            first_pass = list(opening.shards) if isinstance(opening, RunShards) else mine
            started = time.monotonic()
            stall = (lambda: self.chaos.stall(step, "fetch")) if self.chaos.stall_s(step, "fetch") else None
            self.start_reading(step, first_pass, stall)
            look_from = started + _first_look_s(ctx.plan)
            work.gave_up = not self.prefetch.wait(
                lambda: ctx.abort.is_set() or (time.monotonic() >= look_from and claims.block_taken())
            )
            if ctx.abort.is_set():
                raise CollectiveAborted(f"step {step} aborted by the driver while reading its data")
            work.stalled_s = time.monotonic() - started
            work.data_ready = self.prefetch.ready
            if not work.gave_up:  # a worker that gave up waiting reads the next step anew
                self.read_next(step, first_pass)
        self.on_phase(Phase.COMPUTE)
        if ctx.plan.clean:  # nothing to claim: my shards are mine unless I gave them up
            if mine and not work.gave_up:
                self._run_block(ctx, work)
            else:
                self._write_bookkeeping(work, ctx.plan.num_shards)
            return work
        if not work.gave_up and not (mine and self._sealed_at_once(ctx, work, opening)):
            self._claim_loop(ctx, ctx.plan, work, overlap=True)
        if work.gave_up:
            self._write_bookkeeping(work, ctx.plan.num_shards)
        return work

    def rescue(self, ctx: ClaimedStep, work: StepWork, missing: list[int]) -> RescuePass:
        """After the step's all-reduce, whose census (the same on every rank) shows ``missing``
        shards nobody brought (their owner stopped waiting for its data, see ``run_claimed``):
        run the rescue pass for them, on every rank alike. The reduced gradient is set aside and the
        buffer zeroed; every rank claims, steals and backs up the shards still free until all
        are done, reading only the blocks of the missing shards' owners; nobody seals (every
        rank counts as a suspect), so each shard counts through a compare-and-set commit; a
        rank whose data is still being read (``work.data_ready``) only waits. The pass is
        summed exactly in one more all-reduce and added back. Its passes and commits are added
        to ``work``."""
        # Only the blocks of the missing shards' owners are read: every other shard was
        # counted (the census says so), and reading the whole step on every rank at every poll
        # made rescue passes the store's heaviest load at 32-64 workers.
        owners = sorted({ctx.plan.owner_of(shard) for shard in missing})
        started = time.perf_counter()
        ctx.claims.open_rescue(missing)
        reduced = self.flat.buffer.clone()
        self.flat.zero()
        self.on_phase(Phase.COMPUTE)
        rescue = StepWork(seen=work.seen)
        everyone = frozenset(range(len(ctx.plan.shards_by_rank)))
        self._claim_loop(
            ctx, replace(ctx.plan, suspects=everyone), rescue, overlap=False,
            can_compute=work.data_ready, focus=owners,
        )
        self.on_phase(Phase.REDUCE)
        comm_s = ctx.reducer.sum_whole()
        self.flat.buffer.add_(reduced)
        work.add(rescue)
        work.committed += rescue.committed
        work.total = work.total + rescue.total
        return RescuePass(len(missing), time.perf_counter() - started, comm_s)

    def _sealed_at_once(self, ctx: ClaimedStep, work: StepWork, opening: object) -> bool:
        """Where the step's opening decision (``pick_work`` with every shard free) is to seal my
        whole block, try that first, without reading the step's claims: one compare-and-set,
        the only claim traffic of a rank on a step where nobody is late (the rescue watch's
        looks aside). True if it won and my final pass is on its way in the all-reduce; False
        (someone opened my block: I am late) sends me to the claim loop, which reads the
        claims and decides as ever."""
        mine = ctx.plan.shards_by_rank[ctx.claims.me]
        whole = isinstance(opening, RunShards) and opening.seal and opening.shards == mine
        if not whole or not ctx.claims.claim_block():
            return False
        self._run_block(ctx, work)
        return True

    def _run_block(self, ctx: ClaimedStep, work: StepWork) -> None:
        """Run all my planned shards as my final pass, its all-reduce overlapped with backward
        (they are mine: sealed, or a clean step's)."""
        mine = list(ctx.plan.shards_by_rank[ctx.claims.me])
        if self.chaos.stall_s(ctx.step, "compute") > 0:  # held up in my own shards' compute
            self._compute_stall(ctx.step, work)
        work.slowed_s += self.chaos.slow_down(ctx.step, len(mine), lambda: False)
        self._final_passes(ctx.step, mine, ctx.plan.num_shards, ctx.reducer, work)

    def _compute_stall(self, step: int, work: StepWork) -> None:
        """Sit out an injected stall in this rank's own shards' compute (``chaos.stall``)."""
        self.on_phase(Phase.STALL)
        work.stalled_s += self.chaos.stall(step, "compute")
        self.on_phase(Phase.COMPUTE)

    def _claim_loop(
        self,
        ctx: ClaimedStep,
        plan: StepPlan,
        work: StepWork,
        *,
        overlap: bool,
        can_compute: Callable[[], bool] = lambda: True,
        focus: list[int] | None = None,
    ) -> None:
        """Claim, steal and back up shards of ``plan`` until every shard is done or sealed, or
        (``overlap``) until my sealed final pass is on its way in the all-reduce. While
        ``can_compute()`` is False, work found is left to others (as if there were none).
        ``focus``: read only these ranks' blocks, every other shard being done (a rescue pass);
        by default, with suspects about, my own, the suspects' and my watched peers'
        (``claim_focus``), not the whole step's."""
        step, claims = ctx.step, ctx.claims
        if focus is None and plan.suspects:
            focus = claim_focus(plan, claims.me)
        idle = _IdleClock(work, self.on_phase)
        compute_stall = self.chaos.stall_s(step, "compute") if overlap else 0.0
        while True:
            if ctx.abort.is_set():
                raise CollectiveAborted(f"step {step} aborted by the driver")
            states = claims.states(focus)
            now = time.monotonic()
            decision = pick_work(claims.me, plan, states, work.ages(states, now))
            if isinstance(decision, Finished):
                idle.stop(now)
                break
            if isinstance(decision, Wait) or not can_compute():
                idle.wait(now, ctx, states)
                time.sleep(POLL_S)
                continue
            idle.resume(now)
            if isinstance(decision, Backup):
                if claims.start_backup(decision.shard, decision.owner):
                    self._backup(step, decision.shard, decision.owner, claims, work)
                continue
            assert isinstance(decision, RunShards)
            claimed = self._claim(ctx, plan, decision, work, overlap)
            if claimed is None:
                return  # I gave my block up to the rescue pass
            if not claimed:
                continue
            if decision.stolen_from >= 0:
                work.stolen += len(claimed)
            elif compute_stall > 0:  # held up in my own shards' compute, now they are mine
                self._compute_stall(step, work)
                compute_stall = 0.0
            if decision.seal:
                if not overlap:
                    raise AssertionError("sealed shards in a pass with no all-reduce to overlap")
                work.slowed_s += self.chaos.slow_down(step, len(claimed), lambda: False)
                self._final_passes(step, claimed, plan.num_shards, ctx.reducer, work)
                return  # the all-reduce of this pass is under way: no more gradient may be added
            self._own_pass(step, claimed, claims, work)
        self._write_bookkeeping(work, plan.num_shards)

    def _claim(
        self, ctx: ClaimedStep, plan: StepPlan, decision: RunShards, work: StepWork, overlap: bool
    ) -> list[int] | None:
        """The shards of ``decision`` I won a claim on (my whole block at once where it says to
        seal it), or None: a peer opened my block before I sealed it (it found me late), so I
        bring nothing and my shards go to the rescue pass, where everyone, me included, runs them."""
        claims = ctx.claims
        whole = decision.seal and decision.shards == plan.shards_by_rank[claims.me]
        if whole and claims.claim_block():
            return list(decision.shards)
        if whole and overlap and not work.shards_run:
            work.gave_up = True
            return None
        return [s for s in decision.shards if claims.claim(s, seal=decision.seal)]

    def _own_pass(self, step: int, claimed: list[int], claims: ShardClaims, work: StepWork) -> None:
        """Run shards claimed (not sealed) by me; only those whose commit wins keep their gradient."""

        def raced() -> bool:
            return any(state.kind is ClaimKind.RACE for state in claims.of(claimed).values())

        work.slowed_s += self.chaos.slow_down(step, len(claimed), raced)
        states = claims.of(claimed)  # a backup that started while we were slow takes the shard over
        taken_over = [s for s in claimed if states[s].kind is ClaimKind.RACE]
        work.races_lost += len(taken_over)  # lost before running them
        claimed = [s for s in claimed if s not in taken_over]
        work.shards_run += len(claimed)
        total = PassResult()
        for group in self._groups(claimed):
            total = total + self._pass(step, group, work)
        won = [s for s in claimed if claims.commit(s, claims.me)]
        lost = [s for s in claimed if s not in won]
        if lost:  # a backup committed first: take these shards' gradient back out
            work.races_lost += len(lost)
            for group in self._groups(lost):
                total = total + -self._pass(step, group, work, sign=-1.0)
        work.committed += won
        work.total = work.total + total

    def _backup(self, step: int, shard: int, owner: int, claims: ShardClaims, work: StepWork) -> None:
        work.backups += 1
        work.shards_run += 1
        snapshot = self.flat.accumulated()
        result = self._pass(step, [shard], work)
        if claims.commit(shard, owner):
            work.backups_won += 1
            work.committed.append(shard)
            work.total = work.total + result
        else:
            self.flat.restore_accumulated(snapshot)


class _IdleClock:
    """How long a rank of the claim loop has waited for others' shards, added to its
    ``work.idle_s`` when it finds work again or the step finishes; ``on_phase`` is told IDLE
    when a wait starts and COMPUTE when work resumes."""

    def __init__(self, work: StepWork, on_phase: Callable[[Phase], None]) -> None:
        self.work, self.on_phase = work, on_phase
        self.since: float | None = None

    def wait(self, now: float, ctx: ClaimedStep, states: dict[int, ClaimState]) -> None:
        """Still waiting at ``now``, the shards' ``states`` as read. Raises CollectiveTimeout,
        naming the shards not done, once the wait is longer than ``ctx.deadline_s``."""
        if self.since is None:
            self.since = now
            self.on_phase(Phase.IDLE)
        if now - self.since > ctx.deadline_s:
            raise CollectiveTimeout(
                f"step {ctx.step}: shards {[s for s, st in states.items() if st.kind is not ClaimKind.DONE]} "
                f"not committed within {ctx.deadline_s:.0f}s"
            )

    def stop(self, now: float) -> None:
        if self.since is not None:
            self.work.idle_s += now - self.since
            self.since = None

    def resume(self, now: float) -> None:
        if self.since is not None:
            self.stop(now)
            self.on_phase(Phase.COMPUTE)
