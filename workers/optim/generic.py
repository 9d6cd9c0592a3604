"""Any ``torch.optim.Optimizer`` as a worker's optimizer: the generic path beside the fused flat one.

The model's parameters are views into the flat buffer and their ``.grad`` views into the
reduced gradient, so a stock optimizer steps them in place like any model. Its state is
created lazily and its layout is the optimizer's own (a user's Lion or Muon may keep
anything), so it moves as its ``state_dict`` taken apart (``workers/optim/state_codec.py``):
a small skeleton, read back with ``weights_only=True`` (a state holding anything but tensors
and plain values is refused rather than unpickled), and its tensors, copied, never
serialized on the thread that trains. Joining workers get them packed in one broadcast;
checkpoints slice the per-parameter state across parts like the fused state, the rest in
part 0, written by the background writer. A state whose tensors overlap in memory (other
than as one shared tensor) cannot be taken apart exactly: it moves whole, serialized on the
thread that trains, with a warning. Which way the state goes is logged (once, and again if
it changes).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from jobspec import targets as factories
from jobspec.recipe import OptimizerConfig
from workers.checkpoint.parts import FlatPieces
from workers.model.flat_parameters import FlatParameters
from workers.optim.fused import FlatOptimizer
from workers.optim.state_codec import (
    ParamSlot,
    TakenApart,
    as_loaded,
    decode,
    encode,
    pack,
    packed_bytes,
    put_together,
    take_apart,
    unpack,
)

log = logging.getLogger(__name__)

#: Names of ``checkpoint_tensors``'s entries: the skeleton and the other tensors (whole) and
#: the per-parameter state laid out flat, by key.
SKELETON, TENSOR_PREFIX, FLAT_PREFIX = "skeleton", "tensor/", "state/"
#: The single whole entry of checkpoints written before the state was taken apart: the
#: ``state_dict`` serialized whole (still read).
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
    """A stock or user optimizer class stepping ``params`` (whose ``.grad`` are set).

    ``params`` back to back are the flat layout its per-parameter state is checkpointed in
    (the worker passes ``FlatParameters.params``, whose values are laid out so)."""

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
        self._starts: dict[int, int] = {}  # id(parameter) -> its first entry in the flat layout
        start = 0
        for param in params:
            self._starts[id(param)] = start
            start += param.numel()
        self._told = ""  # the last line logged on how the state moves

    def _tell(self, parts: TakenApart, checkpoint: bool) -> None:
        """Log how the state moves, unless that was the last thing logged: whole (overlapping
        tensors), or, in a ``checkpoint``, which of it is sliced across the parts."""
        name = type(self.optimizer).__name__
        if not parts.exact:
            line = (
                f"{name}'s state holds tensors that overlap in memory: checkpoints and joins serialize it whole, "
                "on the thread that trains (slower), to keep the overlap"
            )
        elif not checkpoint or not (parts.tensors or parts.flat):
            return  # a join's exact transfer is always the same; no state yet: nothing to tell
        elif parts.flat:
            line = (
                f"{name}'s per-parameter state {sorted(parts.flat)} is checkpointed in slices across the parts, "
                f"like the parameters; its {len(parts.tensors)} other tensor(s) whole in part 0"
            )
        else:
            line = (
                f"{name}'s state holds no per-parameter tensors shaped like the model's parameters (or its "
                f"parameters are not the model's): its {len(parts.tensors)} tensor(s) are checkpointed whole in part 0"
            )
        if line != self._told:
            self._told = line
            log.warning(line)

    @property
    def base_lr(self) -> float:
        return self._base_lr

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()

    def _slots(self) -> list[ParamSlot]:
        """Where each of the optimizer's parameters (in ``state_dict`` order) lies in the flat
        layout; [] (nothing goes flat) unless they are the given ``params``, each once."""
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len(order) != len(self._starts) or {id(p) for p in order} != self._starts.keys():
            return []
        return [ParamSlot(self._starts[id(p)], p.shape) for p in order]

    def _load(self, state: Any) -> None:
        """Load a ``state_dict`` (its tensors on the CPU or the device, of any dtype), each
        memory cast once to where and as ``load_state_dict`` wants it (``as_loaded``: torch's
        own cast, parameter by parameter, would copy a shared counter or overlapping views
        apart; a step count stays on the host where torch keeps it there). Raises ValueError
        if it does not fit this optimizer."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        try:
            self.optimizer.load_state_dict(as_loaded(state, params))
        except (RuntimeError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"optimizer state does not fit {type(self.optimizer).__name__}: {err}") from None

    def sync(self, broadcast: Callable[[torch.Tensor], None], is_root: bool) -> None:
        """Take the root's state through ``broadcast`` (in place, from the group's root): the
        length of its skeleton (with the specs of its tensors), the skeleton, then its tensors
        packed in one buffer; the root keeps its own. The root only copies tensors (no
        serialization of their data), so its peers are not kept waiting in the first broadcast.
        A state that does not take apart exactly goes whole in the skeleton's place. A
        receiver's state is views into the buffer it received (held once)."""
        if is_root:
            state = self.optimizer.state_dict()
            parts = take_apart(state)
            self._tell(parts, checkpoint=False)
            if parts.exact:
                buffer, specs = pack(parts.tensors, self.device)
                header = encode({"skeleton": parts.skeleton, "specs": specs}).to(self.device)
            else:
                buffer, header = torch.empty(0), encode({"state": state}).to(self.device)
            broadcast(torch.tensor([header.numel()], dtype=torch.int64, device=self.device))
            broadcast(header)
            if buffer.numel():  # nothing to send before the first step
                broadcast(buffer)
            return
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        broadcast(length)
        header = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        broadcast(header)
        decoded = decode(header)
        if "state" in decoded:
            self._load(decoded["state"])
            return
        buffer = torch.empty(packed_bytes(decoded["specs"]), dtype=torch.uint8, device=self.device)
        if buffer.numel():
            broadcast(buffer)
        self._load(put_together(decoded["skeleton"], unpack(buffer, decoded["specs"])))

    def checkpoint_tensors(
        self, whole: bool = True
    ) -> tuple[dict[str, torch.Tensor | FlatPieces], dict[str, torch.Tensor]]:
        """The state as flat entries (per-parameter state shaped like the parameters, laid out
        like them: ``state/<key>``, checkpointed in slices) and whole ones (only if ``whole``:
        the skeleton, encoded, and every other tensor as ``tensor/<n>``). Nothing is copied or
        serialized here: the snapshot copies, the background writer serializes. A state that
        does not take apart exactly is the single ``STATE_ENTRY``, serialized here."""
        state = self.optimizer.state_dict()
        parts = take_apart(state, self._slots())
        self._tell(parts, checkpoint=True)
        if not parts.exact:
            return {}, {STATE_ENTRY: encode(state)} if whole else {}
        flat: dict[str, torch.Tensor | FlatPieces] = {FLAT_PREFIX + k: v for k, v in parts.flat.items()}
        if not whole:
            return flat, {}
        tensors = {f"{TENSOR_PREFIX}{n}": t for n, t in enumerate(parts.tensors)}
        return flat, {SKELETON: encode(parts.skeleton), **tensors}

    def restore(self, flat: Mapping[str, torch.Tensor | FlatPieces], whole: Mapping[str, torch.Tensor]) -> None:
        """Load what ``checkpoint_tensors`` returned (from a checkpoint: the flat entries
        whole), or a checkpoint's single serialized ``state_dict`` entry as written before the
        state was taken apart. Raises ValueError if the entries are not this optimizer's or
        do not fit it."""
        name = type(self.optimizer).__name__
        count = len(whole) - 1  # tensor/0 .. tensor/<count - 1> beside the skeleton
        if not flat and set(whole) == {STATE_ENTRY}:
            parts = None
        elif set(whole) == {SKELETON, *(f"{TENSOR_PREFIX}{n}" for n in range(count))} and all(
            k.startswith(FLAT_PREFIX) for k in flat
        ):
            parts = [whole[f"{TENSOR_PREFIX}{n}"] for n in range(count)]
        else:
            raise ValueError(f"optimizer state {sorted([*flat, *whole])} is not a {name}'s")
        try:
            if parts is None:
                state = decode(whole[STATE_ENTRY])
            else:
                laid_out = {k[len(FLAT_PREFIX):]: _whole(v) for k, v in flat.items()}
                state = put_together(decode(whole[SKELETON]), parts, laid_out, self._slots())
        except (RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as err:
            raise ValueError(f"optimizer state does not fit {name}: {err}") from None
        self._load(state)


def _whole(entry: torch.Tensor | FlatPieces) -> torch.Tensor:
    """A flat entry as one tensor (a ``FlatPieces`` straight from ``checkpoint_tensors`` gathered)."""
    return entry if isinstance(entry, torch.Tensor) else entry.cpu_range(0, entry.numel())


def make_optimizer(config: OptimizerConfig, flat: FlatParameters) -> FlatOptimizer | GenericOptimizer:
    """The job's optimizer over ``flat``: the fused flat one for sgd/adam/adamw, else generic."""
    if config.is_fused:
        no_decay = None if config.decay_biases_and_norms else flat.no_decay_ranges()
        return FlatOptimizer(config.name, config.kwargs, flat.values, flat.grads, no_decay)
    return GenericOptimizer(config.name, config.kwargs, flat.params, config.decay_biases_and_norms)
