"""Straggler detection and mitigation settings (``stragglers``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from jobspec.fields import StrictModel

# Ranks whose claims one store process serves by default: a 64-rank job's store used ~8 ms of
# CPU a step in bench control-plane with every step rescuing, so 256 keep one near a core's
# 3% at a step a second (docs/architecture.md, "The control plane at scale").
RANKS_PER_CLAIM_STORE = 256
MAX_CLAIM_STORES = 64


class StragglerConfig(StrictModel):
    """Straggler detection and mitigation (docs/architecture.md, "The step protocol").

    ``mitigation``: master switch; when off, every worker runs exactly its planned shards.
    ``steal``: idle workers take unstarted shards of late workers; ``speculate``: they back up
    late running shards (first commit wins); ``rebalance``: shard counts follow measured speed;
    ``evict``: remove a worker at a step boundary when it holds a step up for ``silent_s``
    (stalled or hung while the others wait) or, persistently slow, is ``evict_ratio`` times slower
    than the median of the others and still late in ``persistent_steps`` of its last ``window``
    steps, as long as ``scaling.min_workers`` remain.
    Detection: a worker is slow when its seconds per shard exceed both ``min_ratio`` x the
    median and ``threshold`` robust deviations (MAD) of the recent ``window`` steps; slow in
    ``persistent_steps`` of the window makes it persistently slow. ``late_factor``: a shard that
    has sat longer than this many times its expected time gets stolen or backed up.
    ``rebalance_alpha`` (EWMA weight) and ``rebalance_hysteresis`` (fraction of step time a new
    split must save). ``claim_stores``: how many store processes the driver spreads shard
    claims over (rank r's on store r mod n); unset: one per ``RANKS_PER_CLAIM_STORE`` (256) of
    ``scaling.max_workers``, up to 64 (one without mitigation: nothing claims).
    """

    mitigation: bool = True
    steal: bool = True
    speculate: bool = True
    rebalance: bool = True
    evict: bool = True
    threshold: float = Field(4.0, gt=0)
    min_ratio: float = Field(1.5, gt=1)
    window: int = Field(8, ge=1)
    persistent_steps: int = Field(5, ge=1)
    late_factor: float = Field(3.0, gt=1)
    rebalance_alpha: float = Field(0.3, gt=0, le=1)
    rebalance_hysteresis: float = Field(0.15, ge=0, lt=1)
    evict_ratio: float = Field(8.0, gt=1)
    silent_s: float = Field(30.0, gt=0)
    claim_stores: int | None = Field(None, ge=1, le=MAX_CLAIM_STORES)

    def claim_store_count(self, max_workers: int) -> int:
        """The store processes claims are spread over for up to ``max_workers`` ranks."""
        if not self.mitigation:
            return 1
        return self.claim_stores or min(MAX_CLAIM_STORES, max(1, -(-max_workers // RANKS_PER_CLAIM_STORE)))

    def policy_kwargs(self) -> dict[str, float | int]:
        """The settings ``policies.straggler_policies.StragglerPolicies`` takes."""
        return self.model_dump(include={
            "threshold", "min_ratio", "window", "persistent_steps", "rebalance_alpha", "rebalance_hysteresis", "evict_ratio",
        })

    @model_validator(mode="after")
    def _window(self) -> "StragglerConfig":
        if self.persistent_steps > self.window:
            raise ValueError(f"persistent_steps ({self.persistent_steps}) must be <= window ({self.window})")
        return self
