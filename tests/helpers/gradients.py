"""A reduced gradient finished as a step finishes it (``StepTrainer.run``,
``workers/train_step.py``): measured on its device, judged on the host, then made the clipped
mean where it is finite."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from workers.step.verdict import GradientUpdate, StepVerdict, measure_gradient


def finish_gradient(
    grads: torch.Tensor,
    weight: float,
    scaled_by: float,
    clip: float | None,
    sum_squares: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> GradientUpdate:
    """``grads`` (a reduced sum, times ``scaled_by``) made the mean over ``weight``, clipped to
    ``clip``, in place; returns its norm and whether it was clipped. Raises ValueError (naming
    ``loss``) for a weight <= 0, as a step does."""
    measure = measure_gradient(grads, torch.tensor(weight, device=grads.device), scaled_by, clip, sum_squares)
    update = StepVerdict((), 0.0, 0.0, weight, float(measure.norm), clip, 0.0).update()
    if math.isfinite(update.grad_norm):
        measure.apply()
    return update
