"""SGD, Adam and AdamW stepping a model's parameters as one flat buffer with torch's fused kernels.

Why not ``torch.optim`` in the worker: building any ``torch.optim`` optimizer imports
``torch._dynamo`` (over 2 s of CPU per process here, most of a worker's start-up after torch
itself), and a per-parameter optimizer launches its kernels once per tensor. Stepping the flat
buffer calls the very kernels ``torch.optim.<X>(fused=True)`` calls (``torch._fused_adam_``,
``_fused_adamw_``, ``_fused_sgd_``), once per step, so updates match stock torch fused
optimizers exactly. On a device without those kernels the buffer is stepped by ``torch.optim``
as a single parameter instead (same rules; pays the import).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from workers.optim.named_tensors import check_fit, copy_by_name

FUSED_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class SGDSettings:
    lr: float = 0.001
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    def check(self) -> None:
        _at_least_zero(self, "lr", "momentum", "weight_decay")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov momentum requires momentum > 0 and dampening = 0")


@dataclass(frozen=True)
class AdamSettings:
    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False

    def check(self) -> None:
        _at_least_zero(self, "lr", "eps", "weight_decay")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")


OptimizerSettings = SGDSettings | AdamSettings

# name -> (settings type, defaults that differ from the type's, as in torch.optim)
_KINDS: dict[str, tuple[type[SGDSettings] | type[AdamSettings], dict[str, Any]]] = {
    "sgd": (SGDSettings, {}),
    "adam": (AdamSettings, {}),
    "adamw": (AdamSettings, {"weight_decay": 0.01}),
}


def _at_least_zero(settings: object, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")


def parse_optimizer(name: str, kwargs: dict[str, Any]) -> OptimizerSettings:
    """Validate optimizer ``name`` (sgd, adam, adamw) and its torch.optim-style ``kwargs``.

    Raises ValueError for an unknown name or a bad value, TypeError for an unknown keyword.
    """
    if name not in _KINDS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(_KINDS)}")
    kind, defaults = _KINDS[name]
    accepted = [f.name for f in fields(kind)]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"{name} got unexpected keyword argument(s) {unknown}; accepted: {accepted}")
    values = {**defaults, **kwargs}
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    settings = kind(**values)
    settings.check()
    return settings


def check_decay_groups(name: str, settings: OptimizerSettings) -> None:
    """Raise ValueError if ``name`` with ``settings`` cannot exempt parameters from weight
    decay: the L2 decay (SGD, Adam) is added to the gradient before the kernel, which a
    ``maximize`` kernel would then negate."""
    if settings.weight_decay and settings.maximize and name != "adamw":
        raise ValueError(f"{name} with maximize cannot exempt biases and norms from weight decay (adamw can)")


class FlatOptimizer:
    """Steps ``params`` (one flat tensor) from ``grads`` (same shape), in place.

    ``name`` and ``kwargs`` as for ``parse_optimizer``: the kwargs (and defaults) of
    torch.optim's SGD, Adam and AdamW, less the implementation switches (fused, foreach, ...).
    ``no_decay``: ``[start, end)`` slices of ``params`` exempt from weight decay (a second
    parameter group with ``weight_decay=0``, in torch.optim terms); the decay of the others is
    then applied around the fused kernel, by the same rule (decoupled for AdamW, L2 otherwise).
    """

    def __init__(
        self,
        name: str,
        kwargs: dict[str, Any],
        params: torch.Tensor,
        grads: torch.Tensor,
        no_decay: list[tuple[int, int]] | None = None,
        state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``state``: flat tensors (by key, like ``params``) to hold as the state instead of
        zeros (a sharded slice's, moved from other ranks); the step count is then set by
        the caller."""
        if params.shape != grads.shape or params.dim() != 1:
            raise ValueError(f"params and grads must be flat and alike, got {params.shape} and {grads.shape}")
        self.name = name
        self.settings = parse_optimizer(name, kwargs)
        self._decayed: list[tuple[int, int]] = []
        if no_decay and self.settings.weight_decay:
            check_decay_groups(name, self.settings)
            self._decayed = _complement(no_decay, params.numel())
        self.params = params
        self.grads = grads
        # The decayed slices as views, made once: one foreach call a step decays them all
        # (biases and norms interleave with weights: ~150 slices for a 36-layer GPT).
        self._decayed_params = [params[lo:hi] for lo, hi in self._decayed]
        self._decayed_grads = [grads[lo:hi] for lo, hi in self._decayed]
        self._fallback: torch.optim.Optimizer | None = None
        if params.device.type not in FUSED_DEVICES:
            self._fallback = self._stock_optimizer()
        #: Optimizer state, flat like ``params`` (``step`` is a scalar tensor), allocated up front
        #: (zeros are what the first step starts from) so that it can be sent to a joining worker
        #: or checkpointed before any step: every replica then holds the same keys.
        self.state: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.float32, device=params.device)}
        self._steps_taken = 0  # mirrors state["step"] without a device sync per step
        s = self.settings
        if self._fallback is not None:
            self.state = {}  # the stock optimizer keeps its own
            return
        keys = ["momentum_buffer"] if isinstance(s, SGDSettings) and s.momentum != 0 else []
        if isinstance(s, AdamSettings):
            keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if s.amsgrad else [])
        given = state or {}
        if given and (sorted(given) != sorted(keys) or any(t.shape != params.shape for t in given.values())):
            raise ValueError(f"state {sorted(given)} does not fit {name}'s {keys} over {params.numel()} entries")
        for key in keys:
            self.state[key] = given[key] if given else torch.zeros_like(params)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's state, by name, in a fixed order (the same on every replica of one
        job); restoring is copying into these tensors in place, then ``state_restored()``.
        Raises NotImplementedError on a device stepped by the ``torch.optim`` fallback."""
        if self._fallback is not None:
            raise NotImplementedError(f"optimizer state transfer needs a fused device {FUSED_DEVICES}")
        return self.state

    def state_restored(self) -> None:
        """Call after writing into ``state_tensors()``: picks up the restored step count."""
        self._steps_taken = int(self.state["step"].item())

    def sync(self, broadcast: Callable[[torch.Tensor], None], is_root: bool) -> None:
        """Take the group root's state through ``broadcast`` (in place, from the root; every
        replica holds the same tensors, so ``is_root`` changes nothing here)."""
        for tensor in self.state_tensors().values():
            broadcast(tensor)
        self.state_restored()

    def checkpoint_tensors(self, whole: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The state as flat tensors (like ``params``, checkpointed in slices) and whole ones
        (none unless ``whole``)."""
        state = self.state_tensors()
        return {k: v for k, v in state.items() if k != "step"}, {"step": state["step"]} if whole else {}

    def restore(self, flat: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> None:
        """Copy a checkpoint's ``checkpoint_tensors`` into the state. Raises ValueError if the
        names or shapes differ."""
        mine_flat, mine_whole = self.checkpoint_tensors()
        mine, loaded = {**mine_flat, **mine_whole}, {**flat, **whole}
        check_fit(mine, loaded, lambda held, needed: f"optimizer state {held} does not fit {self.name}'s {needed}")
        copy_by_name(mine, loaded)
        self.state_restored()

    def _stock_optimizer(self) -> torch.optim.Optimizer:
        flat = torch.nn.Parameter(self.params, requires_grad=True)
        flat.grad = self.grads
        stock = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[self.name]
        return stock([flat], **vars(self.settings))

    @property
    def base_lr(self) -> float:
        """The ``lr`` the optimizer was configured with (a schedule scales it)."""
        return self.settings.lr

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """One optimizer step with learning rate ``lr`` (default: the configured one)."""
        s = self.settings if lr is None else dataclasses.replace(self.settings, lr=lr)
        if self._decayed:
            self._decay_outside_kernel(s)
            s = dataclasses.replace(s, weight_decay=0.0)
        if self._fallback is not None:
            for group in self._fallback.param_groups:
                group["lr"], group["weight_decay"] = s.lr, s.weight_decay
            self._fallback.step()
        elif isinstance(s, SGDSettings):
            self._sgd(s)
        else:
            self._adam(s)

    def _decay_outside_kernel(self, s: OptimizerSettings) -> None:
        """Weight decay of the decayed slices only, as torch.optim applies it: AdamW shrinks
        the parameters (``p *= 1 - lr * wd``, before the update, which does not read them);
        SGD and Adam add ``wd * p`` to the gradient the kernel then reads."""
        if self.name == "adamw":
            torch._foreach_mul_(self._decayed_params, 1.0 - s.lr * s.weight_decay)
        else:
            torch._foreach_add_(self._decayed_grads, self._decayed_params, alpha=s.weight_decay)

    def _sgd(self, s: SGDSettings) -> None:
        first = self._steps_taken == 0
        self._steps_taken += 1
        self.state["step"] += 1
        momentum = [self.state["momentum_buffer"]] if s.momentum != 0 else []
        torch._fused_sgd_(
            [self.params], [self.grads], momentum,
            weight_decay=s.weight_decay, momentum=s.momentum, lr=s.lr, dampening=s.dampening,
            nesterov=s.nesterov, maximize=s.maximize, is_first_step=first and s.momentum != 0,
        )

    def _adam(self, s: AdamSettings) -> None:
        self._steps_taken += 1
        self.state["step"] += 1
        kernel = torch._fused_adamw_ if self.name == "adamw" else torch._fused_adam_
        kernel(
            [self.params], [self.grads], [self.state["exp_avg"]], [self.state["exp_avg_sq"]],
            [self.state["max_exp_avg_sq"]] if s.amsgrad else [], [self.state["step"]],
            lr=s.lr, beta1=s.betas[0], beta2=s.betas[1], weight_decay=s.weight_decay, eps=s.eps,
            amsgrad=s.amsgrad, maximize=s.maximize,
        )


def _complement(ranges: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The slices of ``[0, numel)`` outside ``ranges``, merged."""
    found, cursor = [], 0
    for lo, hi in sorted(ranges):
        if lo > cursor:
            found.append((cursor, lo))
        cursor = max(cursor, hi)
    if cursor < numel:
        found.append((cursor, numel))
    return found
