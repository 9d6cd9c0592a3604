"""Shard claims of one step in the driver-hosted store: every move is a compare-and-set.

The states are those of ``policies.work_stealing`` (free, run, sealed, race, done). The driver
writes every shard of a step as ``free`` before it submits the step; after that only these
compare-and-sets change a key, so for each shard exactly one worker ever reads back
``done:<itself>`` or ``sealed:<itself>`` (nothing moves a sealed shard but its owner): that
worker, and no other, adds the shard's gradient (exactly once).

Each rank also has a *block* key for its planned shards: the owner can seal them all with one
compare-and-set (free -> sealed), the common case when nobody is late, tried before reading
anything (``StepRunner._sealed_at_once``), so such a step costs each worker one round trip,
whatever the number of shards and workers, instead of one per shard (or a read of them all).
Anyone else must first open the block (free -> open) before touching one of its shards;
whichever of the two moves wins decides, so a shard is never both sealed by block and claimed
alone.

A peer also opens a block to rescue its owner, found late before it sealed (see
``workers/step/rescue_watch.py``); the owner, seeing its block opened (``block_taken``), gives its
shards up to the step's rescue pass.

A step's claims may be spread over several stores (``ClaimStores``, one process each): rank
r's block and planned shards live on store ``r % len(stores)``, so what reads or moves one
rank's claims (a seal, a victim's read, a steal) is one round trip to one store, and no store
serves more than its share of the ranks (docs/architecture.md, "The control plane at scale").

Keys live in ``SLOTS`` rotating slots (step mod SLOTS), reset to free when a step opens, so
the store does not grow with the run; SLOTS exceeds the steps the driver keeps in flight.

A *clean* step (``StepPlan.clean``: mitigation on, nobody suspected) has no claims opened and
none made: every rank runs its own shards without sealing them, so a step where nobody is late
costs the store nothing. Its keys live apart, under the step's own number (``clean/<step>/``),
and a missing key there means free: a watcher opens a late peer's block by creating it
(compare-and-set from absent), the owner finds it opened by its existence (``block_taken``,
``check``), and a rescue pass creates the keys of the shards it runs (``open_rescue``) before it
claims them as ever. Nothing seals a clean step's block, so an opening only asks its owner to
give its shards up; an owner that does not see it in time brings them itself, and the census
(which the rescue pass follows) counts each shard once either way. Those keys are made only
when someone is late, and deleted once the step is summed (``forget``): the store holds a
clean step's keys only while it runs.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from policies.run_ahead import BATCHES_IN_FLIGHT, MAX_STEPS_PER_CALL
from policies.work_stealing import FREE, ClaimKind, ClaimState, StepPlan

# Every step in flight has its own slot, and two more: the driver opens the next batch's
# steps while the last steps of the batch before are still read by late watchers.
SLOTS = BATCHES_IN_FLIGHT * MAX_STEPS_PER_CALL + 2


OPEN = "open"


class CountingStore:
    """The store calls claims make, each counted: ``round_trips`` and ``bytes`` (keys and values
    sent plus values received), for the control plane's telemetry (bench control-plane)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.round_trips = 0
        self.bytes = 0

    def _count(self, sent: int, received: int) -> None:
        self.round_trips += 1
        self.bytes += sent + received

    def get(self, key: str) -> bytes:
        value = self.store.get(key)
        self._count(len(key), len(value))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.store.multi_get(keys)
        self._count(sum(map(len, keys)), sum(map(len, values)))
        return values

    def delete_key(self, key: str) -> None:
        self.store.delete_key(key)
        self._count(len(key), 1)

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self.store.multi_set(keys, values)
        self._count(sum(map(len, keys)) + sum(map(len, values)), 0)

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` exists (never blocks, unlike a read of a missing key)."""
        exists = self.store.check(keys)
        self._count(sum(map(len, keys)), 1)
        return exists

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        value = self.store.compare_set(key, expected, desired)
        self._count(len(key) + len(expected) + len(desired), len(value))
        return value


class ClaimStores:
    """The stores a job's shard claims are spread over (at least one): rank r's block and
    planned shards live on ``of_rank(r)``. ``round_trips`` and ``bytes`` are summed over them."""

    def __init__(self, stores: Sequence[CountingStore]) -> None:
        if not stores:
            raise ValueError("claims need at least one store")
        self.stores = tuple(stores)

    @classmethod
    def of(cls, store: ClaimStores | CountingStore) -> ClaimStores:
        """``store`` itself, or one store as the only one."""
        return store if isinstance(store, ClaimStores) else cls((store,))

    def of_rank(self, rank: int) -> CountingStore:
        return self.stores[rank % len(self.stores)]

    def by_store(self, owners: Sequence[int]) -> dict[CountingStore, list[int]]:
        """The positions in ``owners`` (the rank whose claims each key is, in order) grouped
        by the store that holds them: one round trip per group."""
        groups: dict[CountingStore, list[int]] = {}
        for index, owner in enumerate(owners):
            groups.setdefault(self.of_rank(owner), []).append(index)
        return groups

    @property
    def round_trips(self) -> int:
        return sum(store.round_trips for store in self.stores)

    @property
    def bytes(self) -> int:
        return sum(store.bytes for store in self.stores)


def claim_keys(step: int, plan: StepPlan) -> list[str]:
    """The step's shard keys (by shard id), then its block keys (by rank)."""
    slot = step % SLOTS
    return [f"claim/{slot}/{shard}" for shard in range(plan.num_shards)] + [
        f"claim/{slot}/block{rank}" for rank in range(len(plan.shards_by_rank))
    ]


def open_step(stores: ClaimStores | CountingStore, step: int, plan: StepPlan) -> None:
    """Mark every shard and block of ``step`` free (the driver does this before submitting
    it): one round trip per store."""
    stores = ClaimStores.of(stores)
    keys = claim_keys(step, plan)
    # Whose store each key is on: a shard's planned rank's, a block's rank's.
    owners = [plan.owners[shard] for shard in range(plan.num_shards)] + list(range(len(plan.shards_by_rank)))
    for store, indices in stores.by_store(owners).items():
        store.multi_set([keys[i] for i in indices], [FREE.encode()] * len(indices))


class ShardClaims:
    """One worker's handle on the claims of ``step``. Every method is one round trip to each
    store it touches (one, for what touches one rank's claims), but ``open_rescue``."""

    def __init__(self, stores: ClaimStores | CountingStore, step: int, plan: StepPlan, me: int) -> None:
        self.stores = ClaimStores.of(stores)
        self.num_shards = plan.num_shards
        self.owner_of = plan.owners
        self.shards_of = plan.shards_by_rank
        self.me = me
        self.clean = plan.clean
        # A clean step's keys: its own, made only when needed, a missing block meaning free.
        self._prefix = f"clean/{step}/" if self.clean else f"claim/{step % SLOTS}/"
        self._free_block = "" if self.clean else FREE.encode()
        self._opened: set[int] = set()
        self._rescued: list[tuple[int, str]] = []  # the keys of a clean step's rescue pass (with their owners)

    def _shard_key(self, shard: int) -> str:
        return f"{self._prefix}{shard}"

    def _block_key(self, rank: int) -> str:
        return f"{self._prefix}block{rank}"

    def read(self, ranks: Sequence[int] | None = None) -> tuple[dict[int, ClaimState], dict[int, str]]:
        """The states of the planned shards of ``ranks`` (default: every rank, shards in id
        order) and their block values (``free``, ``open`` or ``sealed:<rank>``), in one round
        trip: a rank watching a few peers reads O(their shards), not the whole step."""
        if ranks is None:
            ranks, shards = range(len(self.shards_of)), list(range(self.num_shards))
        else:
            shards = [s for rank in ranks for s in self.shards_of[rank]]
        keys = [self._shard_key(s) for s in shards] + [self._block_key(r) for r in ranks]
        owners = [self.owner_of[s] for s in shards] + list(ranks)
        values = self._get(keys, owners)
        blocks = dict(zip(ranks, values[len(shards):]))
        sealed = {rank for rank, v in blocks.items() if v == f"sealed:{rank}"}
        states = {
            shard: ClaimState(ClaimKind.SEALED, self.owner_of[shard]) if self.owner_of[shard] in sealed else ClaimState.decode(value)
            for shard, value in zip(shards, values)
        }
        return states, blocks

    def _get(self, keys: Sequence[str], owners: Sequence[int]) -> list[str]:
        """The values of ``keys`` (``owners[i]``: the rank whose store holds ``keys[i]``), in
        order: one round trip per store they are on."""
        values: list[str] = [""] * len(keys)
        for store, indices in self.stores.by_store(owners).items():
            read = store.multi_get([keys[i] for i in indices])
            for index, value in zip(indices, read):
                values[index] = value.decode()
        return values

    def states(self, ranks: Sequence[int] | None = None) -> dict[int, ClaimState]:
        """The states of the planned shards of ``ranks`` (default: every rank's), read from the
        store. What it leaves out the caller takes as done (``pick_work`` does): a rescue pass
        reads only the blocks its census found shards missing from, every other shard being
        counted; a rank on a step with suspects its focus (``claim_focus``). O(their shards) a
        call, not O(the step's)."""
        return self.read(ranks)[0]

    def of(self, shards: Sequence[int]) -> dict[int, ClaimState]:
        """The states of ``shards``, claimed one by one (none sealed whole), from their keys alone."""
        values = self._get([self._shard_key(s) for s in shards], [self.owner_of[s] for s in shards])
        return {shard: ClaimState.decode(value) for shard, value in zip(shards, values)}

    def block_taken(self) -> bool:
        """Whether someone has opened my block (only I open it otherwise, by claiming one of
        my shards alone): my shards are no longer all mine to seal."""
        mine = self.stores.of_rank(self.me)
        if self.clean:
            return mine.check([self._block_key(self.me)])
        return mine.get(self._block_key(self.me)).decode() == OPEN

    def claim_block(self) -> bool:
        """Seal all my planned shards at once: fails if someone has opened my block."""
        mine = ClaimState(ClaimKind.SEALED, self.me).encode()
        return self.stores.of_rank(self.me).compare_set(self._block_key(self.me), self._free_block, mine).decode() == mine

    def open_block(self, rank: int) -> bool:
        """Open ``rank``'s block for single-shard moves; False if its owner sealed it whole."""
        if rank not in self._opened:
            if self.stores.of_rank(rank).compare_set(self._block_key(rank), self._free_block, OPEN).decode() != OPEN:
                return False
            self._opened.add(rank)
        return True

    def open_rescue(self, missing: Sequence[int]) -> None:
        """Make a clean step's claims for its rescue pass, before anything reads them (a read of
        a missing key would block): the ``missing`` shards free, their owners' other shards
        done (the census counted them) and their blocks open. Every rank does this, and only
        the first to make a key decides its value (compare-and-set from absent), so a shard
        claimed meanwhile stays claimed. Nothing to do on a step whose claims the driver opened."""
        if not self.clean:
            return
        owners = sorted({self.owner_of[s] for s in missing})
        lost = set(missing)
        made = {(r, self._shard_key(s)): FREE.encode() if s in lost else ClaimState(ClaimKind.DONE, r).encode()
                for r in owners for s in self.shards_of[r]}
        made.update({(r, self._block_key(r)): OPEN for r in owners})
        self._rescued = list(made)
        groups = self.stores.by_store([owner for owner, _ in self._rescued])
        if all(store.check([self._rescued[i][1] for i in indices]) for store, indices in groups.items()):
            return  # a faster rank made them all (and may have claimed some already)
        for (owner, key), value in made.items():
            self.stores.of_rank(owner).compare_set(key, "", value)

    def forget(self) -> None:
        """After a clean step is summed (its rescue pass too, if it had one: every rank is past
        its last look at it): delete the keys this rank made for it, so that the store does
        not grow with the run. Rank 0 deletes the rescue pass's; every rank the blocks it
        opened. Nothing to do on a step nobody was late in, or whose claims the driver opened."""
        if not self.clean:
            return
        doomed = (self._rescued if self.me == 0 else []) + [(r, self._block_key(r)) for r in self._opened]
        for owner, key in dict.fromkeys(doomed):
            self.stores.of_rank(owner).delete_key(key)

    def _move(self, shard: int, old: ClaimState, new: ClaimState) -> ClaimState:
        """Compare-and-set; returns the state after the attempt (``new`` if it won)."""
        after = self.stores.of_rank(self.owner_of[shard]).compare_set(self._shard_key(shard), old.encode(), new.encode())
        return ClaimState.decode(after.decode())

    def claim(self, shard: int, *, seal: bool = False) -> bool:
        """free -> run by me (sealed by me with ``seal``: certain to count, never backed up)."""
        mine = ClaimState(ClaimKind.SEALED if seal else ClaimKind.RUN, self.me)
        return self.open_block(self.owner_of[shard]) and self._move(shard, FREE, mine) == mine

    def start_backup(self, shard: int, owner: int) -> bool:
        """run by ``owner`` -> race between ``owner`` and me."""
        race = ClaimState(ClaimKind.RACE, owner, self.me)
        return self._move(shard, ClaimState(ClaimKind.RUN, owner), race) == race

    def commit(self, shard: int, owner: int) -> bool:
        """Try to make my gradient of ``shard`` the one that counts; True if it does.

        ``owner`` is who claimed the shard (me, or the owner I am backing up). Sealed shards
        need no commit.
        """
        done = ClaimState(ClaimKind.DONE, self.me)
        if owner != self.me:
            return self._move(shard, ClaimState(ClaimKind.RACE, owner, self.me), done) == done
        state = self._move(shard, ClaimState(ClaimKind.RUN, self.me), done)
        if state.kind is ClaimKind.RACE and state.owner == self.me:
            state = self._move(shard, state, done)
        return state == done
