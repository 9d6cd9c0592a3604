"""What steps one rank's slice of the flat parameters under sharded optimizer state, in the two
kinds the job may name (docs/architecture.md, "Sharded optimizer state"): the fused sgd/adam/adamw
(``FusedSlice``) and any element-wise ``torch.optim`` optimizer (``GenericSlice``).

Both hand their state to ``ShardedOptimizer`` the same way, so it can move between ranks when
the slices change: ``export`` gives the *flat* state (one tensor per key, an entry per entry of
the slice) and the *template* (what every entry shares: a step count), ``ShardedOptimizer``
moves the flat state and hands the new slice's to a new stepper. A generic optimizer sees the
slice as 1-D pieces of the model's parameters (cut where the parameters meet): an element-wise
rule (Adam-likes, RAdam, NAdam, Adagrad, Adamax, Lion, SGD) steps them exactly as it steps the
whole parameters; a rule that reads a parameter's shape (Adafactor's factored moments, Muon)
would not, and its state (a per-parameter entry that is not one value per entry, or that
differs between parameters) is refused when it is exported.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from policies.sharding import clip_span
from workers.checkpoint.parts import FlatPieces
from workers.checkpoint.reading import SavedFlat, read_span
from workers.model.flat_parameters import FlatParameters
from workers.optim.fused import FlatOptimizer
from workers.optim.generic import (
    FLAT_PREFIX,
    SKELETON,
    TENSOR_PREFIX,
    GenericOptimizer,
    decay_groups,
    resolve_optimizer_class,
)
from workers.optim.named_tensors import check_fit
from workers.optim.state_codec import FLAT, TENSOR, encode

#: Flat state by key (each the slice's length) and the template every entry shares.
Exported = tuple[dict[str, torch.Tensor], dict[str, Any]]


class FusedSlice:
    """``FlatOptimizer`` (sgd/adam/adamw: ``name``, ``kwargs``) over ``flat``'s values and
    gradients ``[lo, hi)``; ``no_decay`` in whole-vector coordinates; ``state`` (``export``'s
    flat state and template of this slice) taken as its own, or zero."""

    def __init__(
        self,
        name: str,
        kwargs: dict[str, Any],
        flat: FlatParameters,
        no_decay: list[tuple[int, int]] | None,
        lo: int,
        hi: int,
        state: Exported | None = None,
    ) -> None:
        mine = None if no_decay is None else [c for c in (clip_span(r, lo, hi) for r in no_decay) if c[0] < c[1]]
        tensors, template = state if state is not None else ({}, {})
        self.optimizer = FlatOptimizer(name, kwargs, flat.values[lo:hi], flat.grad_slice(lo, hi), mine, tensors)
        if template:
            self.optimizer.state["step"].fill_(float(template["step"]))
            self.optimizer.state_restored()

    @property
    def base_lr(self) -> float:
        return self.optimizer.base_lr

    def step(self, lr: float | None) -> None:
        self.optimizer.step(lr=lr)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.optimizer.state_tensors()

    def export(self) -> Exported:
        state = self.optimizer.state_tensors()
        return {k: v for k, v in state.items() if k != "step"}, {"step": float(state["step"])}

    def checkpoint_tensors(self, whole: bool, lo: int, numel: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        flat, wholes = self.optimizer.checkpoint_tensors(whole)
        return {k: FlatPieces((v,), offset=lo, total=numel) for k, v in flat.items()}, wholes

    @staticmethod
    def saved_span(
        name: str, kwargs: dict[str, Any], flat: FlatParameters, saved_flat: Mapping[str, torch.Tensor | SavedFlat],
        saved_whole: Mapping[str, torch.Tensor], lo: int, hi: int,
    ) -> Exported:
        """Entries ``[lo, hi)`` of a checkpoint's ``FlatOptimizer`` state (its
        ``checkpoint_tensors``, written sharded or not; a flat entry whole or a checkpoint's
        ``SavedFlat``), as ``export`` gives a slice's, on ``flat``'s device in its dtype. Checked
        first as ``FlatOptimizer.restore`` checks it (ValueError: other names, or flat entries
        not the parameters' length), then only the span is read."""
        probe = FlatOptimizer(name, kwargs, torch.zeros(1), torch.zeros(1))  # its keys, over one entry
        mine_flat, mine_whole = probe.checkpoint_tensors()
        mine = {**{k: torch.empty(flat.numel, device="meta") for k in mine_flat}, **mine_whole}
        loaded = {**{k: torch.empty(tuple(v.shape), device="meta") for k, v in saved_flat.items()}, **saved_whole}
        check_fit(mine, loaded, lambda held, needed: f"optimizer state {held} does not fit {name}'s {needed}")
        state = {}
        for key in mine_flat:
            state[key] = torch.empty(hi - lo, dtype=flat.values.dtype, device=flat.values.device)
            read_span(saved_flat[key], lo, hi, state[key])
        return state, {"step": float(saved_whole["step"])}


class GenericSlice:
    """A ``torch.optim`` optimizer (``name``: as ``OptimizerConfig.name``, ``kwargs``) over
    ``flat``'s values ``[lo, hi)``, as 1-D pieces of the model's parameters (each piece's
    ``.grad`` a view of the reduced gradient), in the parameter groups the whole parameters
    would be in (``decay_biases_and_norms``); ``state`` as ``FusedSlice``'s."""

    def __init__(
        self,
        name: str | type,
        kwargs: dict[str, Any],
        flat: FlatParameters,
        decay_biases_and_norms: bool,
        lo: int,
        hi: int,
        state: Exported | None = None,
    ) -> None:
        self.flat = flat
        self.cls = resolve_optimizer_class(name)
        self.kwargs = kwargs
        self.decay_biases_and_norms = decay_biases_and_norms
        skip = flat.extra.numel()
        self.pieces: list[torch.nn.Parameter] = []
        decayed: list[torch.nn.Parameter] = []
        exempt: list[torch.nn.Parameter] = []
        for param, (a, b) in zip(flat.params, flat.ranges):
            a, b = max(a - skip, lo), min(b - skip, hi)
            if a >= b:
                continue
            piece = torch.nn.Parameter(flat.values[a:b], requires_grad=True)
            piece.grad = flat.grad_slice(a, b)
            self.pieces.append(piece)
            (decayed if decay_biases_and_norms or param.dim() >= 2 else exempt).append(piece)
        groups = [{"params": decayed}] + ([{"params": exempt, "weight_decay": 0.0}] if exempt else [])
        self.optimizer = self.cls([g for g in groups if g["params"]] or [{"params": []}], **kwargs)
        self._base_lr = float(self.optimizer.defaults.get("lr", kwargs.get("lr", 0.0)))
        self._checked = False
        if state is not None and state[0]:
            tensors, template = state
            start = 0
            for piece in self.pieces:
                end = start + piece.numel()
                entry = {k: v[start:end] for k, v in tensors.items()}
                self.optimizer.state[piece] = {**copy.deepcopy(template), **entry}
                start = end

    @property
    def base_lr(self) -> float:
        return self._base_lr

    @torch.no_grad()
    def step(self, lr: float | None) -> None:
        """One step; after the first, its state is checked to be element-wise (``_per_piece``
        raises ValueError, naming ``sharding.group_size``), so a shape-reading optimizer fails at
        its first step rather than at its first move or checkpoint."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        if not self._checked:
            self._per_piece()
            self._checked = True

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.export()[0]

    def _per_piece(self) -> tuple[list[str], dict[str, Any]]:
        """The flat keys (a tensor of one value per entry of every piece, one dtype) and the
        template (every other entry, the same in every piece). Raises ValueError otherwise."""
        states = [self.optimizer.state.get(piece, {}) for piece in self.pieces]
        if not states or not states[0]:
            return [], {}
        first = states[0]
        keys = [
            k for k, v in first.items()
            if isinstance(v, torch.Tensor) and v.dim() == 1 and all(
                isinstance(s.get(k), torch.Tensor) and s[k].shape == p.shape and s[k].dtype == v.dtype
                for s, p in zip(states, self.pieces)
            )
        ]
        return keys, _shared_template(states, keys, f"{self.cls.__name__} keeps")

    def export(self) -> Exported:
        keys, template = self._per_piece()
        flat = {k: torch.cat([self.optimizer.state[p][k].reshape(-1) for p in self.pieces]) for k in keys}
        return flat, template

    def checkpoint_tensors(self, whole: bool, lo: int, numel: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """In the unsharded ``GenericOptimizer``'s format (so it resumes on any layout): the flat
        keys as ``FlatPieces`` of this slice; with ``whole``, the skeleton of the whole
        parameters' state, each parameter's entries the template's."""
        keys, template = self._per_piece()
        flat = {
            FLAT_PREFIX + k: FlatPieces(tuple(self.optimizer.state[p][k] for p in self.pieces), offset=lo, total=numel)
            for k in keys
        }
        if not whole:
            return flat, {}
        groups = self.cls(decay_groups(self.flat.params, self.decay_biases_and_norms), **self.kwargs).state_dict()["param_groups"]
        tensors: list[torch.Tensor] = []
        state: dict[int, dict[str, Any]] = {}
        for index in (i for g in groups for i in g["params"]):
            entry: dict[str, Any] = {k: (FLAT, k) for k in keys}
            for k, v in template.items():
                if isinstance(v, torch.Tensor):
                    entry[k] = (TENSOR, len(tensors))
                    tensors.append(v)
                else:
                    entry[k] = copy.deepcopy(v)
            state[index] = entry
        skeleton = {"state": state if keys or template else {}, "param_groups": groups}
        return flat, {SKELETON: encode(skeleton), **{f"{TENSOR_PREFIX}{n}": t for n, t in enumerate(tensors)}}

    @staticmethod
    def saved_span(
        name: str | type, kwargs: dict[str, Any], flat: FlatParameters, decay_biases_and_norms: bool,
        saved_flat: Mapping[str, torch.Tensor | SavedFlat], saved_whole: Mapping[str, torch.Tensor], lo: int, hi: int,
    ) -> Exported:
        """Entries ``[lo, hi)`` of a checkpoint's ``GenericOptimizer`` state (written sharded or
        not; a flat entry whole or a checkpoint's ``SavedFlat``), as ``export`` gives a slice's.
        Checked first as the unsharded optimizer checks it, without the flat entries' data: an
        unsharded ``GenericOptimizer`` over stand-ins (one entry each, expanded to each
        parameter's shape) loads the whole state with stand-ins for the flat entries, in the
        dtype torch would cast them to (ValueError if it does not fit). Its per-parameter state
        then gives the template (which must be the same for every parameter, ValueError naming
        ``sharding.group_size`` else), and only the span of each flat key is read."""
        values = flat.values
        stand_ins = [torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape)) for p in flat.params]
        loader = GenericOptimizer(name, kwargs, stand_ins, decay_biases_and_norms)
        cast = {k: values.dtype if values.is_floating_point() and k != FLAT_PREFIX + "step" else v.dtype for k, v in saved_flat.items()}
        loader.restore({k: torch.zeros((), dtype=cast[k]).expand(v.shape[0]) for k, v in saved_flat.items()}, saved_whole)
        states = [loader.optimizer.state.get(p, {}) for p in stand_ins]
        # One value per entry: a tensor of its parameter's shape in every parameter's state.
        keys = [k for k in states[0] if all(isinstance(s.get(k), torch.Tensor) and s[k].shape == p.shape for s, p in zip(states, stand_ins))]
        template = _shared_template(states, keys, f"the checkpoint's {loader.optimizer.__class__.__name__} state holds")
        tensors = {}
        for key in keys:
            # A state saved whole (before the state was taken apart) holds the entries itself.
            source = saved_flat.get(FLAT_PREFIX + key)
            if source is None:
                source = torch.cat([state[key].detach().reshape(-1) for state in states])
            tensors[key] = torch.empty(hi - lo, dtype=states[0][key].dtype, device=values.device)
            read_span(source, lo, hi, tensors[key])
        return tensors, template


def shape_blind(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> str | None:
    """Whether ``cls(**kwargs)`` steps a parameter's entries the same whatever the parameter's
    shape and however it is cut: three steps of a 3x4 matrix, of its 12 entries as one vector
    and as two pieces (5 and 7) must agree. None if they do, else how they differ (Adafactor
    factors a matrix's moments, Muon orthogonalises it, a per-tensor trust ratio sees the cut).
    What it cannot run on a vector also differs."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(3, 4, generator=gen)
    grads = [torch.randn(3, 4, generator=gen) for _ in range(3)]
    results = []
    for cut in ((3, 4), (12,), (5, 7)):
        whole = start.clone().reshape(-1)
        params = [torch.nn.Parameter(whole.view(3, 4))] if cut == (3, 4) else [
            torch.nn.Parameter(piece) for piece in whole.split(list(cut))
        ]
        try:
            optimizer = cls(params, **kwargs)
            for grad in grads:
                flat_grad = grad.reshape(-1)
                for param, piece in zip(params, flat_grad.split([p.numel() for p in params])):
                    param.grad = piece.view(param.shape).clone()
                optimizer.step()
        except Exception as err:  # noqa: BLE001 - any failure on a vector is a difference
            return f"it fails on a {cut} parameter ({type(err).__name__}: {err})"
        results.append(torch.cat([p.detach().reshape(-1) for p in params]))
    if not all(torch.allclose(results[0], other, rtol=1e-6, atol=1e-7) for other in results[1:]):
        return "it steps a matrix otherwise than its entries as a vector, or as two pieces"
    return None


def check_element_wise(name: str | type, kwargs: dict[str, Any]) -> None:
    """Raises ValueError (naming ``sharding.group_size``) unless optimizer ``name`` (as
    ``OptimizerConfig.name``) with ``kwargs`` steps slices of a parameter as it steps the whole
    parameter (``shape_blind``): what sharded state asks of a generic optimizer."""
    cls = resolve_optimizer_class(name)
    differs = shape_blind(cls, kwargs)
    if differs is not None:
        raise ValueError(
            f"field 'sharding.group_size': {cls.__name__} cannot step slices of parameters: {differs}; "
            "sharded optimizer state needs an element-wise optimizer (Adam-likes, RAdam, Adagrad, Lion, ...); "
            "set sharding.group_size: 1"
        )


def _shared_template(states: list[dict[str, Any]], keys: list[str], holder: str) -> dict[str, Any]:
    """What every per-parameter state in ``states`` holds besides the one-value-per-entry ``keys``
    (the step count), which must be the same in each. Raises ValueError (``holder``: who holds
    it, e.g. "RAdam keeps") naming ``sharding.group_size`` otherwise."""
    template = {k: v for k, v in states[0].items() if k not in keys}
    for state in states:
        rest = {k: v for k, v in state.items() if k not in keys}
        if rest.keys() != template.keys() or not all(_same(rest[k], template[k]) for k in template):
            raise ValueError(
                f"{holder} per-parameter state that is not one value per entry ({sorted(set(rest) | set(template))}): "
                "sharding.group_size above 1 needs an element-wise optimizer; set sharding.group_size: 1"
            )
    return template


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return bool(a == b)
