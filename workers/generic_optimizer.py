"""Any ``torch.optim.Optimizer`` as a worker's optimizer: the generic path beside the fused flat one.

The model's parameters are views into the flat buffer and their ``.grad`` views into the
reduced gradient, so a stock optimizer steps them in place like any model. Its state is
created lazily and its layout is the optimizer's own (a user's Lion or Muon may keep
anything), so it travels as one serialized ``state_dict`` (``torch.save`` bytes in a uint8
tensor): broadcast to joining workers, written whole in checkpoints and read back with
``weights_only=True``, so a state holding anything but tensors and plain values is refused
rather than unpickled.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import Any

import torch

from jobspec import targets as factories
from jobspec.recipe import OptimizerConfig
from workers.flat_optimizer import FlatOptimizer
from workers.training import FlatParameters

#: The name of the state entry in ``checkpoint_tensors``'s whole part.
STATE_ENTRY = "state_dict"


def resolve_optimizer_class(name: str | type) -> type[torch.optim.Optimizer]:
    """A ``torch.optim`` class by name (``RAdam``), by import path (``my.module:Lion``) or as
    given. Raises ValueError if it is none of these or not an Optimizer subclass."""
    if isinstance(name, str) and ":" not in name:
        found = getattr(torch.optim, name, None)
        if found is None:
            raise ValueError(f"torch.optim has no optimizer {name!r} (and it is not 'package.module:Class')")
    else:
        found = factories.resolve_import_path(name) if isinstance(name, str) else name
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise ValueError(f"{name!r} is not a torch.optim.Optimizer subclass")
    return found


def decay_groups(params: Iterable[torch.nn.Parameter], decay_biases_and_norms: bool) -> list[dict[str, Any]]:
    """Parameter groups: all in one, or (``decay_biases_and_norms`` False) those with fewer than
    2 dimensions (biases, norm weights) in a second group without weight decay."""
    params = list(params)
    if decay_biases_and_norms:
        return [{"params": params}]
    return [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class GenericOptimizer:
    """A stock or user optimizer class stepping ``params`` (whose ``.grad`` are set)."""

    def __init__(
        self,
        name: str | type,
        kwargs: dict[str, Any],
        params: list[torch.nn.Parameter],
        decay_biases_and_norms: bool = True,
    ) -> None:
        cls = resolve_optimizer_class(name)
        groups = decay_groups(params, decay_biases_and_norms)
        self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        self.device = params[0].device
        self._base_lr = float(self.optimizer.defaults.get("lr", kwargs.get("lr", 0.0)))

    @property
    def base_lr(self) -> float:
        return self._base_lr

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()

    def _serialized(self) -> torch.Tensor:
        buffer = io.BytesIO()
        torch.save(self.optimizer.state_dict(), buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def _load(self, blob: torch.Tensor) -> None:
        # On the CPU first: load_state_dict then places each tensor as the optimizer wants it
        # (a step count stays on the host where torch keeps it there).
        state = torch.load(io.BytesIO(blob.cpu().numpy().tobytes()), weights_only=True, map_location="cpu")
        self.optimizer.load_state_dict(state)

    def sync(self, broadcast: Callable[[torch.Tensor], None], is_root: bool) -> None:
        """Take the root's state through ``broadcast`` (in place, from the group's root): its
        length first, then its bytes; the root keeps its own."""
        blob = self._serialized().to(self.device) if is_root else None
        length = torch.tensor([0 if blob is None else blob.numel()], dtype=torch.int64, device=self.device)
        broadcast(length)
        if blob is None:
            blob = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        broadcast(blob)
        if not is_root:
            self._load(blob)

    def checkpoint_tensors(self, whole: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """No flat tensors; the serialized state as one whole entry (serialized only if ``whole``)."""
        return {}, {STATE_ENTRY: self._serialized()} if whole else {}

    def restore(self, flat: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> None:
        """Load what ``checkpoint_tensors`` returned (from a checkpoint). Raises ValueError if
        the entry is missing or does not fit this optimizer."""
        if flat or set(whole) != {STATE_ENTRY}:
            raise ValueError(f"optimizer state {sorted([*flat, *whole])} is not a {type(self.optimizer).__name__}'s")
        try:
            self._load(whole[STATE_ENTRY])
        except (RuntimeError, ValueError, KeyError) as err:
            raise ValueError(f"optimizer state does not fit {type(self.optimizer).__name__}: {err}") from None


def make_optimizer(config: OptimizerConfig, flat: FlatParameters) -> FlatOptimizer | GenericOptimizer:
    """The job's optimizer over ``flat``: the fused flat one for sgd/adam/adamw, else generic."""
    if config.is_fused:
        no_decay = None if config.decay_biases_and_norms else flat.no_decay_ranges()
        return FlatOptimizer(config.name, config.kwargs, flat.values, flat.grads, no_decay)
    return GenericOptimizer(config.name, config.kwargs, flat.params, config.decay_biases_and_norms)
