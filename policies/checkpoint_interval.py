"""How often to checkpoint. Pure: no Ray, no torch.

A checkpoint holds training up for its cost C (the in-memory snapshot; the write to storage
runs in the background and is not counted). A failure loses, on average, half an interval of
work. Young/Daly balance the two: with a mean time between failures M, the interval that
minimises the expected waste is about ``sqrt(2 * C * M)`` seconds. All times are in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.ewma import ewma

# Used in auto mode until both a step time and a checkpoint cost have been measured. The first
# checkpoint is what measures the cost, so this only sets when that first one happens.
DEFAULT_STEPS = 100

STEP_ALPHA = 0.2  # step times are noisy (data loading, stragglers): smooth over ~5 steps
COST_ALPHA = 0.5  # checkpoints are rare, so each measurement should count for more


@dataclass(frozen=True)
class CheckpointDecision:
    """Checkpoint every ``every_steps`` (>= 1) training steps; ``reason`` says how that was chosen."""

    every_steps: int
    reason: str


class CheckpointInterval:
    """A fixed checkpoint interval, or (``every_steps=None``) one chosen by Young/Daly.

    Auto mode: ``interval_s = sqrt(2 * C * M)`` where C is the EWMA of the measured checkpoint
    cost in seconds and M the estimated mean time between failures,
    ``(elapsed_s + mtbf_prior_s) / (failures + 1)``: a prior of one failure per
    ``mtbf_prior_s``, so a job that has not failed yet still gets a finite interval, and
    observed failures pull M towards ``elapsed_s / failures``. The interval in steps is
    ``clamp(round(interval_s / step_s), min_steps, max_steps)``, step_s being the EWMA of
    seconds per step. Until both a step time and a cost have been observed, auto mode uses
    ``clamp(DEFAULT_STEPS, min_steps, max_steps)``.

    A fixed ``every_steps`` is used as given: min_steps/max_steps only bound auto mode.
    """

    def __init__(
        self,
        every_steps: int | None,
        *,
        mtbf_prior_s: float = 3600.0,
        min_steps: int = 1,
        max_steps: int = 10_000,
    ) -> None:
        if every_steps is not None:
            _check_int("every_steps", every_steps, minimum=1, extra="or None for auto")
        _check_seconds("mtbf_prior_s", mtbf_prior_s, positive=True)
        _check_int("min_steps", min_steps, minimum=1)
        _check_int("max_steps", max_steps, minimum=min_steps, extra=f"(min_steps is {min_steps})")
        self.every_steps = every_steps
        self.mtbf_prior_s = float(mtbf_prior_s)
        self.min_steps = min_steps
        self.max_steps = max_steps
        self._step_s: float | None = None
        self._cost_s: float | None = None
        self._failures = 0
        self._elapsed_s = 0.0

    def observe_step(self, step_s: float) -> None:
        """Record one training step's duration in seconds (> 0)."""
        _check_seconds("step_s", step_s, positive=True)
        self._step_s = ewma(self._step_s, float(step_s), STEP_ALPHA)

    def observe_checkpoint(self, cost_s: float) -> None:
        """Record how long one checkpoint held training up, in seconds (>= 0)."""
        _check_seconds("cost_s", cost_s)
        self._cost_s = ewma(self._cost_s, float(cost_s), COST_ALPHA)

    def observe_failure(self) -> None:
        """Record one failure that cost the job its progress since the last checkpoint."""
        self._failures += 1

    def observe_elapsed(self, elapsed_s: float) -> None:
        """Set the total training time so far in seconds (>= 0); it replaces, not adds to, the last value."""
        _check_seconds("elapsed_s", elapsed_s)
        self._elapsed_s = float(elapsed_s)

    def mtbf_s(self) -> float:
        """The current estimate of the mean time between failures, in seconds."""
        return (self._elapsed_s + self.mtbf_prior_s) / (self._failures + 1)

    def decide(self) -> CheckpointDecision:
        """The interval to use now."""
        if self.every_steps is not None:
            return CheckpointDecision(self.every_steps, "fixed")
        if self._step_s is None or self._cost_s is None:
            missing = " and ".join(
                what for what, value in (("step time", self._step_s), ("checkpoint cost", self._cost_s)) if value is None
            )
            steps = _clamp(DEFAULT_STEPS, self.min_steps, self.max_steps)
            return CheckpointDecision(steps, f"auto default: no {missing} measured yet")
        mtbf = self.mtbf_s()
        interval_s = math.sqrt(2.0 * self._cost_s * mtbf)
        raw = interval_s / self._step_s
        # Clamp before rounding so an absurd ratio never becomes a huge int.
        steps = round(_clamp(raw, self.min_steps, self.max_steps))
        clamped = "" if self.min_steps <= raw <= self.max_steps else f" (clamped to [{self.min_steps}, {self.max_steps}])"
        reason = (
            f"young-daly: cost {self._cost_s:.3g}s, mtbf {mtbf:.4g}s, step {self._step_s:.3g}s"
            f" -> {interval_s:.3g}s = {steps} steps{clamped}"
        )
        return CheckpointDecision(steps, reason)

    def due(self, steps_since_last: int) -> bool:
        """Whether to checkpoint now, ``steps_since_last`` (>= 0) steps after the last one."""
        _check_int("steps_since_last", steps_since_last, minimum=0)
        return steps_since_last >= self.decide().every_steps

    def state(self) -> dict[str, float | int | None]:
        """The observations (not the configuration), JSON-able, to save with a checkpoint.

        The configuration is left out on purpose: a restarted job takes its settings from its
        new configuration but keeps what was learned about step time, cost and failures.
        """
        return {
            "step_s": self._step_s,
            "cost_s": self._cost_s,
            "failures": self._failures,
            "elapsed_s": self._elapsed_s,
        }

    def restore(self, state: dict) -> None:
        """Replace the observations with those from :meth:`state`. Raises ValueError on a bad state.

        A restart after a failure should call :meth:`observe_failure` after this.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict from state(), got {type(state).__name__}")
        expected = {"step_s", "cost_s", "failures", "elapsed_s"}
        if set(state) != expected:
            raise ValueError(f"state must have keys {sorted(expected)}, got {sorted(state)}")
        step_s, cost_s = state["step_s"], state["cost_s"]
        if step_s is not None:
            _check_seconds("state['step_s']", step_s, positive=True)
        if cost_s is not None:
            _check_seconds("state['cost_s']", cost_s)
        _check_int("state['failures']", state["failures"], minimum=0)
        _check_seconds("state['elapsed_s']", state["elapsed_s"])
        self._step_s = None if step_s is None else float(step_s)
        self._cost_s = None if cost_s is None else float(cost_s)
        self._failures = state["failures"]
        self._elapsed_s = float(state["elapsed_s"])


def _clamp(value: float, low: int, high: int) -> float:
    return max(low, min(high, value))


def _check_int(name: str, value: object, *, minimum: int, extra: str = "") -> None:
    # bool is an int subclass, but True as a step count is a bug at the call site.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        suffix = f" {extra}" if extra else ""
        raise ValueError(f"{name} must be an int >= {minimum}{suffix}, got {value!r}")


def _check_seconds(name: str, value: object, *, positive: bool = False) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > 0 if positive else value >= 0)
    )
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
