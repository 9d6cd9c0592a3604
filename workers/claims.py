"""Shard claims of one step in the driver-hosted store: every move is a compare-and-set.

The states are those of ``policies.work_stealing`` (free, run, sealed, race, done). The driver
writes every shard of a step as ``free`` before it submits the step; after that only these
compare-and-sets change a key, so for each shard exactly one worker ever reads back
``done:<itself>`` or ``sealed:<itself>`` (nothing moves a sealed shard but its owner): that
worker, and no other, adds the shard's gradient (exactly once).

Keys live in ``SLOTS`` rotating slots (step mod SLOTS), reset to free when a step opens, so
the store does not grow with the run; SLOTS exceeds the steps the driver keeps in flight.
"""

from __future__ import annotations

import torch.distributed as dist

from policies.work_stealing import FREE, ClaimKind, ClaimState


SLOTS = 8


def claim_keys(step: int, num_shards: int) -> list[str]:
    return [f"claim/{step % SLOTS}/{shard}" for shard in range(num_shards)]


def open_step(store: dist.Store, step: int, num_shards: int) -> None:
    """Mark every shard of ``step`` free (the driver does this before submitting the step)."""
    store.multi_set(claim_keys(step, num_shards), [FREE.encode()] * num_shards)


class ShardClaims:
    """One worker's handle on the claims of ``step``. Every method is one store round trip."""

    def __init__(self, store: dist.Store, step: int, num_shards: int, me: int) -> None:
        self.store = store
        self.keys = claim_keys(step, num_shards)
        self.me = me

    def states(self) -> dict[int, ClaimState]:
        values = self.store.multi_get(self.keys)
        return {shard: ClaimState.decode(value.decode()) for shard, value in enumerate(values)}

    def _move(self, shard: int, old: ClaimState, new: ClaimState) -> ClaimState:
        """Compare-and-set; returns the state after the attempt (``new`` if it won)."""
        after = self.store.compare_set(self.keys[shard], old.encode(), new.encode())
        return ClaimState.decode(after.decode())

    def claim(self, shard: int, *, seal: bool = False) -> bool:
        """free -> run by me (sealed by me with ``seal``: certain to count, never backed up)."""
        mine = ClaimState(ClaimKind.SEALED if seal else ClaimKind.RUN, self.me)
        return self._move(shard, FREE, mine) == mine

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
