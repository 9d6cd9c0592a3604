"""Dynamic loss scaling for fp16, decided from the reduced gradient so replicas agree.

``torch.amp.GradScaler`` decides from each process's local gradients (it un-scales and checks
them before an optimizer step); here every replica holds the same all-reduced gradient, so
the same finiteness test gives the same decision everywhere: every replica skips the same
steps and keeps the same scale with no extra collective. The scale is training state: it is
sent to joining workers and checkpointed with the rest.
"""

from __future__ import annotations

import math

import torch


class LossScaler:
    """The loss scale and the count of finite steps since it last changed, in one small
    tensor (``state``: float64 ``[scale, good_steps]``) that travels with the training state.

    ``enabled`` False (fp32, bf16): the scale stays 1 and no step is skipped.
    """

    def __init__(
        self,
        enabled: bool,
        init: float = 65536.0,
        growth: float = 2.0,
        backoff: float = 0.5,
        growth_interval: int = 2000,
        device: torch.device | None = None,
    ) -> None:
        self.enabled = enabled
        self.growth, self.backoff, self.growth_interval = growth, backoff, growth_interval
        self.state = torch.tensor([init if enabled else 1.0, 0.0], dtype=torch.float64, device=device)
        self._scale, self._good = float(self.state[0]), 0  # mirrors, read without a device sync

    @property
    def scale(self) -> float:
        """What the step's loss sums are multiplied by before backward."""
        return self._scale

    def state_restored(self) -> None:
        """Call after writing into ``state`` (a join's broadcast, a checkpoint restored)."""
        self._scale, self._good = float(self.state[0]), int(self.state[1])

    def update(self, grad_norm: float) -> bool:
        """After a step's reduction, with the reduced gradient's norm (any scale): returns
        True if the step must be skipped (the gradient overflowed), and moves the scale."""
        if not self.enabled:
            return False
        skip = not math.isfinite(grad_norm)
        if skip:
            self._scale, self._good = self._scale * self.backoff, 0
        else:
            self._good += 1
            if self._good >= self.growth_interval:
                self._scale, self._good = self._scale * self.growth, 0
        # Filled with numbers (kernel arguments), not copied from a host tensor: on a GPU a copy
        # from pageable memory would wait for the device every step.
        self.state[0].fill_(self._scale)
        self.state[1].fill_(float(self._good))
        return skip
