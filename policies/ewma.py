"""Exponentially weighted moving average. Pure: no Ray, no torch.

The one smoothing rule for noisy measurements: the rebalancer's seconds per shard
(``policies/rebalance.py``), the checkpoint policy's step time and checkpoint cost
(``policies/checkpoint_interval.py``) and a slowed worker's own compute per shard
(``workers/runtime/chaos.py``).
"""

from __future__ import annotations


def ewma(current: float | None, sample: float, alpha: float) -> float:
    """The average after ``sample``: ``alpha * sample + (1 - alpha) * current``, or ``sample``
    itself when there is no average yet (``current`` None). ``alpha`` in (0, 1] is the weight
    of the newest sample: 1 keeps only the latest.

    Raises ValueError if ``alpha`` is outside (0, 1].
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    # The first sample stands alone: averaging it with an arbitrary start would bias early decisions.
    return sample if current is None else alpha * sample + (1.0 - alpha) * current
