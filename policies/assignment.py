"""Which worker runs which shards of a step. Pure: no Ray, no torch.

An assignment must cover every shard exactly once; that, not who gets what, is what the
training result depends on (docs/architecture.md, "Commit and census").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from policies.split import even_counts


@dataclass(frozen=True)
class ShardAssignment:
    """``shards_by_rank[r]`` lists the shard ids rank ``r`` runs this step, in run order."""

    shards_by_rank: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.shards_by_rank:
            raise ValueError("an assignment needs at least one rank")
        flat = sorted(s for shards in self.shards_by_rank for s in shards)
        if flat != list(range(len(flat))):
            raise ValueError(f"shards must be 0..n-1 each exactly once, got {flat}")

    @property
    def world_size(self) -> int:
        return len(self.shards_by_rank)

    @property
    def num_shards(self) -> int:
        return sum(len(shards) for shards in self.shards_by_rank)

    @classmethod
    def balanced(cls, num_shards: int, world_size: int) -> "ShardAssignment":
        """Contiguous blocks whose sizes differ by at most one (lower ranks take the extra).
        Raises ValueError if ``world_size < 1``."""
        return cls.from_counts(even_counts(num_shards, world_size))

    @classmethod
    def from_counts(cls, counts: list[int]) -> "ShardAssignment":
        """Contiguous blocks of the given sizes, rank 0 first."""
        if any(c < 0 for c in counts):
            raise ValueError(f"shard counts must be >= 0, got {counts}")
        blocks, start = [], 0
        for count in counts:
            blocks.append(tuple(range(start, start + count)))
            start += count
        return cls(tuple(blocks))

    @classmethod
    def shuffled(cls, num_shards: int, world_size: int, seed: int) -> "ShardAssignment":
        """A seeded random assignment with uneven counts; some ranks may get no shard.

        For testing that the result does not depend on who runs what.
        """
        rng = random.Random(seed)
        order = list(range(num_shards))
        rng.shuffle(order)
        owners = [rng.randrange(world_size) for _ in order]
        blocks: list[list[int]] = [[] for _ in range(world_size)]
        for shard, owner in zip(order, owners):
            blocks[owner].append(shard)
        return cls(tuple(tuple(b) for b in blocks))

