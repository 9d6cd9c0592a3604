"""The claim protocol on a real TCPStore: under racing threads, each shard counts exactly once."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist

from policies import work_stealing as stealing
from policies.work_stealing import ClaimKind, ClaimState, StepPlan, claim_focus, watched_peers
from workers.step.claims import SLOTS, ClaimStores, CountingStore, ShardClaims, claim_keys, open_step


def _store(port: int = 0) -> dist.Store:
    """The driver's store (``port`` 0), or a worker's client of the one on ``port``."""
    tcp = dist.TCPStore("127.0.0.1", port, is_master=not port, wait_for_workers=False)
    return dist.PrefixStore("gen1/", tcp)


def _spread(masters: list[dist.TCPStore]) -> ClaimStores:
    """A worker's clients of the claim stores served by ``masters`` (rank r's on r mod n)."""
    return ClaimStores([CountingStore(_store(master.port)) for master in masters])


def _masters(count: int) -> list[dist.TCPStore]:
    return [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(count)]


# A suspect about: the driver opens the step's claims (a clean step makes none, see below).
def _race(worker: Callable[[int], None], workers: int) -> None:
    """Run ``worker(me)`` for every rank on a thread of its own, all at once; each is joined for
    at most 30 s (a claim that hung would fail the test's counts, not hang it)."""
    threads = [threading.Thread(target=worker, args=(me,)) for me in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


PLAN3 = StepPlan(((0, 2), (1,)), suspects=frozenset({1}))


def test_one_claim_wins_and_a_sealed_shard_cannot_be_backed_up():
    store = _store()
    open_step(store, 0, PLAN3)
    a, b = ShardClaims(store, 0, PLAN3, me=0), ShardClaims(store, 0, PLAN3, me=1)
    assert a.claim(0) and not b.claim(0)
    assert b.claim(1, seal=True) and not a.start_backup(1, owner=1)
    assert a.states()[1].kind is ClaimKind.SEALED
    # A backup races the owner: the first commit wins, the other loses.
    assert b.start_backup(0, owner=0) and not a.start_backup(0, owner=0)
    assert b.commit(0, owner=0) and not a.commit(0, owner=0)
    assert a.states()[0].owner == 1
    # The owner committing first beats the backup.
    assert a.claim(2) and b.start_backup(2, owner=0)
    assert a.commit(2, owner=0) and not b.commit(2, owner=0)


def test_a_block_claim_and_a_single_shard_claim_exclude_each_other():
    store = _store()
    open_step(store, 0, PLAN3)
    owner, thief = ShardClaims(store, 0, PLAN3, me=0), ShardClaims(store, 0, PLAN3, me=1)
    assert owner.claim_block() and not thief.claim(2)
    assert {s: st.kind for s, st in thief.states().items()} == {0: ClaimKind.SEALED, 1: ClaimKind.FREE, 2: ClaimKind.SEALED}
    open_step(store, 1, PLAN3)
    owner, thief = ShardClaims(store, 1, PLAN3, me=0), ShardClaims(store, 1, PLAN3, me=1)
    assert thief.claim(2) and not owner.claim_block()  # opened: the owner claims shard by shard
    assert owner.claim(0, seal=True) and not owner.claim(2)


def test_a_reopened_slot_starts_free():
    store = _store()
    open_step(store, 3, PLAN3)
    claims = ShardClaims(store, 3, PLAN3, me=0)
    assert claims.claim_block()
    open_step(store, 3 + 8, PLAN3)  # the same slot, a later step
    assert all(s.kind is ClaimKind.FREE for s in ShardClaims(store, 11, PLAN3, me=1).states().values())


@pytest.mark.parametrize("stores", [1, 2])
def test_exactly_once_under_racing_threads(stores):
    masters = _masters(stores)
    store = _spread(masters)
    shards, workers, steps = 12, 4, 30
    plan = StepPlan(tuple(tuple(range(r, shards, workers)) for r in range(workers)), suspects=frozenset({0}))
    clients = [_spread(masters) for _ in range(workers)]
    for step in range(steps):
        open_step(store, step, plan)
        winners: dict[int, list[int]] = {s: [] for s in range(shards)}
        lock = threading.Lock()

        def worker(me: int, step: int = step) -> None:
            rng = random.Random(step * 31 + me)
            claims = ShardClaims(clients[me], step, plan, me)
            if rng.random() < 0.3 and claims.claim_block():
                with lock:
                    for shard in plan.shards_by_rank[me]:
                        winners[shard].append(me)
            order = list(range(shards))
            rng.shuffle(order)
            for shard in order:
                state = claims.states()[shard]
                if state.kind is ClaimKind.FREE and claims.claim(shard, seal=rng.random() < 0.2):
                    if claims.states()[shard].kind is ClaimKind.SEALED or claims.commit(shard, me):
                        with lock:
                            winners[shard].append(me)
                elif state.kind is ClaimKind.RUN and state.owner != me and claims.start_backup(shard, state.owner):
                    if claims.commit(shard, state.owner):
                        with lock:
                            winners[shard].append(me)
            for shard in range(shards):  # owners commit whatever they still hold
                state = claims.states()[shard]
                if state.owner == me and state.kind in (ClaimKind.RUN, ClaimKind.RACE) and claims.commit(shard, me):
                    with lock:
                        winners[shard].append(me)

        _race(worker, workers)
        assert all(len(w) == 1 for w in winners.values()), (step, winners)
        final = ShardClaims(store, step, plan, me=-1).states()
        for shard, (winner,) in winners.items():
            assert final[shard].owner == winner and final[shard].kind in (ClaimKind.DONE, ClaimKind.SEALED)


def test_an_opened_block_is_seen_by_its_owner_and_read_with_the_states():
    store = _store()
    open_step(store, 0, PLAN3)
    owner, peer = ShardClaims(store, 0, PLAN3, me=0), ShardClaims(store, 0, PLAN3, me=1)
    assert not owner.block_taken()
    assert peer.open_block(0) and owner.block_taken() and not owner.claim_block()
    states, blocks = peer.read()
    assert blocks == {0: "open", 1: "free"} and all(s.kind is ClaimKind.FREE for s in states.values())
    assert peer.claim_block() and not owner.open_block(1)  # a sealed block stays closed
    assert peer.read()[1] == {0: "open", 1: "sealed:1"}


def test_a_watcher_reads_only_its_peers_keys_and_every_read_is_counted():
    plan = StepPlan(((0, 1), (2,), (), (3, 4, 5)), suspects=frozenset({1}))
    store = CountingStore(_store())
    open_step(store, 0, plan)
    assert store.round_trips == 1 and store.bytes > 0
    owner, watcher = ShardClaims(store, 0, plan, me=3), ShardClaims(store, 0, plan, me=1)
    assert owner.claim_block()
    states, blocks = watcher.read()
    before = store.round_trips, store.bytes
    peer_states, peer_blocks = watcher.read([3, 0])
    assert store.round_trips == before[0] + 1
    # Keys of ranks 3 and 0 only: fewer bytes than the whole step's read.
    assert store.bytes - before[1] < sum(len(k) for k in claim_keys(0, plan))
    assert peer_blocks == {3: blocks[3], 0: blocks[0]} and peer_blocks[3] == "sealed:3"
    assert peer_states == {s: states[s] for s in (3, 4, 5, 0, 1)}
    # Each rank watches the next rank and the first ones half the ring on, all with shards.
    assert [watched_peers(plan, r) for r in range(4)] == [[1, 3], [3, 0], [3, 0], [0, 1]]
    assert watched_peers(StepPlan(((0,), ())), 0) == [] and watched_peers(StepPlan(((0,), (1,))), 0) == [1]
    eight = StepPlan(tuple((r,) for r in range(8)))
    assert watched_peers(eight, 0) == [1, 4] and watched_peers(eight, 6) == [7, 2]
    # Every rank is watched by two others, one of them from the other half of the ring.
    watchers = {r: [w for w in range(8) if r in watched_peers(eight, w)] for r in range(8)}
    assert all(len(w) == 2 for w in watchers.values()) and watchers[0] == [4, 7]


def test_with_suspects_a_rank_reads_the_suspects_and_its_watched_peers_not_the_whole_step():
    ranks = 64
    plan = StepPlan(tuple((r,) for r in range(ranks)), suspects=frozenset({5, 40}))
    focus = {me: claim_focus(plan, me) for me in range(ranks)}
    # Itself, the two suspects and its two watched peers: bounded, whatever the ranks (the
    # old claim loop read all 64 shard keys and 64 block keys every poll, on every rank).
    assert focus[0] == [0, 1, 5, 32, 40] and max(len(f) for f in focus.values()) <= 5
    # Every rank's claims are still read by at least two others: one late unannounced is seen.
    readers = {r: [me for me in range(ranks) if me != r and r in focus[me]] for r in range(ranks)}
    assert min(len(r) for r in readers.values()) >= 2
    assert all(len(readers[s]) == ranks - 1 for s in plan.suspects)  # the victims, by everyone


def test_a_clean_step_with_mitigation_on_sends_the_claim_store_nothing():
    """Mitigation on, nobody suspected, nobody late: no claims opened by the driver, none made
    by the worker (no key, no round trip), however many shards (bench control-plane)."""
    from jobspec.wire import JoinRequest
    from orchestrator.job.reading import load_job
    from workers.actor import TrainWorker

    shards = 64
    job = load_job(None, ["eval=null", f"shards={shards}", f"batch_size={shards}", "scaling.workers=1", "steps=2"])
    tcp = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    worker = TrainWorker(job)
    worker.join_group(JoinRequest("127.0.0.1", tcp.port, "gen1/", 1, 0, ("node",), 30.0))
    plan = StepPlan((tuple(range(shards)),), steal=True, speculate=True, expected_shard_s=1.0)
    assert plan.mitigating and plan.clean
    try:
        for step in range(2):
            keys = tcp.num_keys()
            report = worker.train_step(step, plan)
            assert report.shards == tuple(range(shards))
            assert report.store_round_trips == report.store_bytes == 0 and tcp.num_keys() == keys
    finally:
        worker.leave_group()


def test_a_clean_steps_claims_are_made_by_whoever_finds_a_rank_late():
    """A clean step's keys exist only once someone is late: the watcher opens the late block by
    making it, the owner sees it by its existence (never blocking on a missing key), the rescue
    pass makes its shards' keys (the first maker deciding) and claims them as ever, and once
    the step is summed the keys are deleted."""
    plan = StepPlan(((0, 1), (2, 3)), expected_shard_s=0.01)
    store = CountingStore(_store())
    keys = store.store.num_keys()
    owner, watcher = ShardClaims(store, 5, plan, me=0), ShardClaims(store, 5, plan, me=1)
    assert not owner.block_taken()
    assert watcher.open_block(0) and owner.block_taken()
    assert not owner.claim_block()  # nothing seals an opened block
    watcher.open_rescue([0])  # shard 0 missing (as if its owner had brought shard 1 alone)
    assert watcher.claim(0)
    owner.open_rescue([0])  # late: rank 1's claim stands
    assert owner.of([0, 1]) == {0: ClaimState(ClaimKind.RUN, 1), 1: ClaimState(ClaimKind.DONE, 0)}
    assert owner.states([0]) == {0: ClaimState(ClaimKind.RUN, 1), 1: ClaimState(ClaimKind.DONE, 0)}  # rank 0's
    assert watcher.commit(0, owner=1) and not owner.claim(0)
    # The same slot of a later step (a claimed step's keys rotate) is untouched: its own keys.
    assert not ShardClaims(store, 5 + SLOTS, plan, me=0).block_taken()
    assert store.store.num_keys() == keys + 3
    watcher.forget()  # rank 1: the block it opened
    owner.forget()  # rank 0: the rescue pass's keys
    assert store.store.num_keys() == keys and not owner.block_taken()


@pytest.mark.parametrize("stores", [1, 3])
def test_a_clean_rescue_counts_each_shard_once_under_racing_threads(stores):
    masters = _masters(stores)
    shards, workers = 12, 4
    plan = StepPlan(tuple(tuple(range(r, shards, workers)) for r in range(workers)), expected_shard_s=0.01)
    clients = [_spread(masters) for _ in range(workers)]
    for step in range(20):
        missing = sorted(plan.shards_by_rank[step % workers] + plan.shards_by_rank[(step + 1) % workers])
        winners: dict[int, list[int]] = {s: [] for s in missing}
        lock = threading.Lock()

        def worker(me: int, step: int = step) -> None:
            rng = random.Random(step * 31 + me)
            claims = ShardClaims(clients[me], step, plan, me)
            time.sleep(rng.random() * 0.002)
            claims.open_rescue(missing)
            for shard in rng.sample(missing, len(missing)):
                if claims.of([shard])[shard].kind is ClaimKind.FREE and claims.claim(shard) and claims.commit(shard, me):
                    with lock:
                        winners[shard].append(me)

        _race(worker, workers)
        assert all(len(w) == 1 for w in winners.values()), (step, winners)
        assert all(v.kind is ClaimKind.DONE for v in ShardClaims(clients[0], step, plan, 0).states(
            sorted({plan.owner_of(s) for s in missing})).values())


def test_a_focused_read_costs_the_focused_blocks_and_takes_every_other_shard_as_done():
    """What a rescue pass reads: the blocks its census found shards missing from, not the step;
    what it leaves out, pick_work takes as done."""
    plan = StepPlan(tuple(tuple(range(4 * r, 4 * r + 4)) for r in range(16)), suspects=frozenset({1}))  # 16 ranks, 4 shards each
    store = CountingStore(_store())
    open_step(store, 0, plan)
    claims = ShardClaims(store, 0, plan, me=0)
    assert ShardClaims(store, 0, plan, me=5).claim(21)  # rank 5 took one of its own alone
    before = store.bytes
    whole = claims.states()
    whole_bytes, before = store.bytes - before, store.bytes
    focused = claims.states([5])
    assert store.bytes - before < whole_bytes / 8  # one block of 16, not the step
    assert focused[21] == whole[21] and focused[21].kind is ClaimKind.RUN and focused[20].kind is ClaimKind.FREE
    assert set(focused) == set(range(20, 24))  # O(the focus) to read and to decide on
    # Rank 0 (its own shards counted, say) finds nothing but rank 5's to do: it backs up none
    # yet, waits, and is done once rank 5's are; the 60 other shards count as done.
    assert isinstance(stealing.pick_work(0, plan, focused, {}), (stealing.Wait, stealing.RunShards))
    done = {s: ClaimState(ClaimKind.DONE, 5) for s in range(20, 24)}
    assert isinstance(stealing.pick_work(0, plan, done, {}), stealing.Finished)
    # Rank 4's one free shard: sealed, unless the suspect (rank 1) has one free to steal.
    assert stealing.pick_work(4, plan, {**done, 16: ClaimState(ClaimKind.FREE)}, {}) == stealing.RunShards((16,), seal=True)
    both = {**done, 16: ClaimState(ClaimKind.FREE), 4: ClaimState(ClaimKind.FREE)}
    assert stealing.pick_work(4, plan, both, {}) == stealing.RunShards((16,), seal=False)


def test_the_watch_of_a_clean_step_reads_nothing_and_opens_a_late_peer_when_it_is_due():
    from workers.runtime.abortable import ABORT_POLL_S
    from workers.step.records import ClaimedStep, StepWork
    from workers.step.rescue_watch import rescue_watch

    plan = StepPlan(((0,), (1,), (2,)), expected_shard_s=0.01, late_factor=3.0)  # late after 50 ms (the floor)
    store = CountingStore(_store())
    abort = threading.Event()
    step = ClaimedStep(7, plan, ShardClaims(store, 7, plan, me=0), None, 30.0, abort)  # type: ignore[arg-type]
    look = rescue_watch(step, StepWork())
    delay = look()
    assert delay == ABORT_POLL_S and store.round_trips == 0  # nothing read, nothing late yet
    time.sleep(0.06)
    assert look() is None and store.round_trips == 2  # both watched peers opened: nothing left to watch
    assert all(ShardClaims(store, 7, plan, me=r).block_taken() for r in (1, 2))
    # The abort flag, or no stealing, ends the watch at its next look.
    abort.set()
    assert rescue_watch(step, StepWork())() is None
    abort.clear()
    no_steal = StepPlan(plan.shards_by_rank, expected_shard_s=0.01, steal=False)
    assert rescue_watch(ClaimedStep(8, no_steal, ShardClaims(store, 8, no_steal, 0), None, 30.0, abort), StepWork())() is None  # type: ignore[arg-type]


def test_spread_claims_keep_each_ranks_keys_on_its_own_store_and_read_one_store_a_victim():
    """Rank r's block and planned shards live on store r mod n: a seal, a victim's read and a
    steal are one round trip to one store, and no store holds another's ranks' keys."""
    masters = _masters(2)
    plan = StepPlan(((0, 1), (2,), (3, 4), (5,)), suspects=frozenset({1}))
    driver = _spread(masters)
    open_step(driver, 0, plan)
    assert [s.round_trips for s in driver.stores] == [1, 1]
    on = [{k for k in claim_keys(0, plan) if dist.PrefixStore("gen1/", masters[n]).check([k])} for n in range(2)]
    assert on[0] == {f"claim/0/{s}" for s in (0, 1, 3, 4)} | {"claim/0/block0", "claim/0/block2"}
    assert on[1] == {f"claim/0/{s}" for s in (2, 5)} | {"claim/0/block1", "claim/0/block3"}
    thief = ShardClaims(_spread(masters), 0, plan, me=3)
    before = [s.round_trips for s in thief.stores.stores]
    thief.read([1])  # the suspect's keys: its store only
    assert [s.round_trips - b for s, b in zip(thief.stores.stores, before)] == [0, 1]
    assert thief.claim(2) and thief.commit(2, 3)  # rank 1's shard, stolen: on rank 1's store
    owner = ShardClaims(_spread(masters), 0, plan, me=1)
    assert owner.block_taken() and not owner.claim_block()
    assert owner.states()[2] == ClaimState(ClaimKind.DONE, 3)
    states = owner.states()  # the whole step: one round trip per store
    assert set(states) == set(range(6)) and thief.stores.round_trips == sum(s.round_trips for s in thief.stores.stores)


def test_claims_get_one_store_per_256_workers_up_to_64_and_one_without_mitigation():
    from jobspec.stragglers import StragglerConfig

    assert [StragglerConfig().claim_store_count(n) for n in (1, 256, 257, 4096, 100_000)] == [1, 1, 2, 16, 64]
    assert StragglerConfig(claim_stores=3).claim_store_count(8) == 3
    assert StragglerConfig(mitigation=False).claim_store_count(4096) == 1
