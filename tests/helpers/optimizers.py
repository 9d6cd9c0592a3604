"""Users' own optimizer classes, as a job names one (``tests.helpers.optimizers:Lion``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): the update is the sign of an interpolated momentum, with
    decoupled weight decay. Its state per parameter: the momentum ``exp_avg`` (shaped like
    the parameter), the number of ``updates`` (a plain int) and the ``last_norm`` of the
    update (a 0-dim tensor): state of three kinds, as a user's optimizer may keep."""

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["updates"] = 0
                exp_avg = state["exp_avg"]
                update = (exp_avg * beta1 + p.grad * (1 - beta1)).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
                state["updates"] += 1
                state["last_norm"] = torch.linalg.vector_norm(update)


class SharedStep(torch.optim.Optimizer):
    """Momentum SGD with a step size decaying as 1/t, ``t`` one step-counter tensor held by
    every parameter's state (``state[p]["t"]`` all one tensor): state entries that share
    memory. With ``overlap``, each parameter's state also holds ``head``, a view of its
    momentum's first entry that the step reads (memory overlapping without being one
    tensor). Restored as separate copies, either would train differently. ``t`` is float32
    whatever the parameters' dtype (torch's ``load_state_dict`` casts it to theirs, parameter
    by parameter); so are the momenta with ``low_precision`` (a state of another dtype than
    its parameters, like a bf16 optimizer state)."""

    def __init__(self, params: Iterable[Any], lr: float = 0.1, overlap: bool = False, low_precision: bool = False) -> None:
        super().__init__(params, {"lr": lr})
        self.overlap = overlap
        self.low_precision = low_precision

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        counter = next((self.state[p]["t"] for p in params if "t" in self.state[p]), None)
        if counter is None:
            counter = torch.zeros(())
        for p in params:
            state = self.state[p]
            if not state:
                state["t"] = counter
                state["m"] = torch.zeros_like(p, dtype=torch.float32 if self.low_precision else p.dtype)
                if self.overlap:
                    state["head"] = state["m"].view(-1)[:1]
        counter.add_(1)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["m"].mul_(0.9).add_(p.grad)
                p.add_(state["m"], alpha=-group["lr"] / float(counter))
                if self.overlap:
                    p.view(-1)[:1].sub_(state["head"], alpha=group["lr"])
