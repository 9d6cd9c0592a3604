"""An epoch's order: a seeded permutation of the dataset's ``n`` indices, read at given positions.

Two orders, chosen by the job's ``dataset.shuffle``:

* ``index`` (the default): each position's index is computed on its own, by a balanced Feistel
  network over the smallest ``2**(2k) >= n`` with cycle-walking back into ``[0, n)`` (the
  construction of format-preserving encryption, and of Grain's ``index_shuffle``). Memory is
  O(1) in ``n``: a worker computes only its own shards' indices, at 10^10 samples as at 10^3.
* ``permutation``: the whole epoch drawn by ``numpy``'s ``Generator.permutation`` (8 bytes per
  sample on every worker). The order of runs written before ``index`` existed; a checkpoint of
  such a run resumes on it (``orchestrator/checkpoints/resume_point.py``).

Either is a pure function of ``(seed, epoch, position)``. No torch here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import numpy as np

_MASK64 = (1 << 64) - 1
ROUNDS = 6  # a Feistel network over a pseudo-random round function is a permutation that looks random from 4 on


class EpochOrder(Protocol):
    """Epoch ``epoch``'s order over a dataset of ``n`` samples, for job seed ``seed``."""

    def __init__(self, n: int, seed: int, epoch: int) -> None: ...

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The dataset indices (int64) at ``positions`` (int64, each in ``[0, n)``) of the epoch."""
        ...


def _splitmix(x: int) -> int:
    """splitmix64's step on a Python int: well-spread 64-bit round keys from small seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class IndexShuffle:
    """``index``: a keyed bijection of ``[0, n)`` evaluated per position (see the module's
    docstring). Raises ValueError unless ``1 <= n < 2**62``."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if not 1 <= n < 1 << 62:
            raise ValueError(f"need 1 <= n < 2**62 samples, got {n}")
        self.n = n
        self.half_bits = ((n - 1).bit_length() + 1) // 2  # the domain 2**(2 * half_bits) >= n
        self.half_mask = np.uint64((1 << self.half_bits) - 1)
        # The round function: (right ^ key) times an odd 64-bit multiplier, its top half_bits bits
        # (multiply-shift hashing: every input bit reaches the top bits). Keys and multipliers
        # are drawn per round from (seed, epoch).
        self.top = np.uint64(64 - self.half_bits) if self.half_bits else np.uint64(63)
        state = _splitmix((seed & _MASK64) ^ _splitmix(epoch & _MASK64))
        rounds = []
        for _ in range(ROUNDS):
            state = _splitmix(state)
            key = state
            state = _splitmix(state)
            rounds.append((np.uint64(key), np.uint64(state | 1)))
        self.rounds = tuple(rounds)

    def _permute_domain(self, x: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network: a bijection of ``[0, 2**(2 * half_bits))``."""
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self.half_mask
        for key, multiplier in self.rounds:
            left, right = right, left ^ (((right ^ key) * multiplier) >> self.top & self.half_mask)
        return (left << shift) | right

    def at(self, positions: np.ndarray) -> np.ndarray:
        # Cycle-walking: a value past n is permuted again until it lands inside. The domain is
        # under 4n, so a position takes under 4 passes on average.
        out = self._permute_domain(np.asarray(positions, dtype=np.uint64))
        outside = np.flatnonzero(out >= self.n)
        while outside.size:
            out[outside] = self._permute_domain(out[outside])
            outside = outside[out[outside] >= self.n]
        return out.astype(np.int64)


class EpochPermutation:
    """``permutation``: the whole epoch's order drawn at once (8 bytes per sample; kept while
    ``epoch_order`` keeps this order)."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, epoch]))
        self.permutation = rng.permutation(n)
        self.permutation.setflags(write=False)

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self.permutation[positions]


class SourceOrder:
    """``none``: every epoch in the source's own order (a Ray Data stream's, which shuffles in
    its pipeline if at all)."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        pass

    def at(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64)


#: ``dataset.shuffle``'s names.
ORDERS: dict[str, type[EpochOrder]] = {"index": IndexShuffle, "permutation": EpochPermutation, "none": SourceOrder}


@lru_cache(maxsize=4)  # a step spans at most two epochs; a permutation's array is held by its order
def epoch_order(name: str, n: int, seed: int, epoch: int) -> EpochOrder:
    """``ORDERS[name]``'s order of ``epoch``, made once for the steps of that epoch."""
    return ORDERS[name](n, seed, epoch)
