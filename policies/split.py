"""Near-equal splitting of a count into parts. Pure: no Ray, no torch.

One rule serves all three places that cut something into near-equal pieces: the ring
all-reduce's chunks (``workers/comm/ring.py``), the slices of a checkpoint that each worker writes
(``workers/checkpoint/parts.py``) and the balanced shard assignment (``policies/assignment.py``).
Sizes differ by at most one and the first ``total % parts`` parts take the extra one. The rule
must be the same everywhere: a checkpoint written by N workers is read back by slicing with it,
and shard blocks must match what the benchmarks' DDP peers are given.
"""

from __future__ import annotations


def even_counts(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` pieces that add up to ``total`` and differ by at most one; the first
    ``total % parts`` pieces are the larger ones. With ``parts > total`` the last pieces are 0.

    Raises ValueError if ``parts < 1`` or ``total < 0``.
    """
    if parts < 1:
        raise ValueError(f"need at least one part, got {parts}")
    if total < 0:
        raise ValueError(f"cannot split a negative total, got {total}")
    size, extra = divmod(total, parts)
    return [size + 1 if index < extra else size for index in range(parts)]


def even_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``range(total)`` cut into ``parts`` contiguous ``[start, end)`` pieces of the sizes
    :func:`even_counts` gives, in order: they tile ``0..total`` with no gap or overlap.

    Raises ValueError if ``parts < 1`` or ``total < 0``.
    """
    bounds: list[tuple[int, int]] = []
    start = 0
    for count in even_counts(total, parts):
        bounds.append((start, start + count))
        start += count
    return bounds
