"""A torch optimizer's ``state_dict`` taken apart into what moves cheaply, and put back together.

A generic optimizer's state (``workers/optim/generic.py``) is the optimizer's own: created
lazily, of any layout. Serializing it whole (``torch.save``) costs time in proportion to its
size on the thread that trains, while the peers wait (a checkpoint's part 0, a join's root).
So nothing here serializes tensor data. The state is split into its *skeleton* (the nested
structure with every tensor replaced by a marker: small, serialized on its own) and its
tensors, which move as tensors:

* at a join, packed into one byte buffer on the device and broadcast (``pack``, ``unpack``);
* in a checkpoint, the per-parameter state shaped like its parameter (Adam-like moments: the
  bulk) is laid out flat like the parameters (``FlatPieces``), so every part copies and
  writes its own slice as for the fused optimizers; the other tensors are whole ones that
  part 0 copies. The background writer serializes both.

State tensors that share memory come back sharing it: entries holding one tensor (or the
same view of one: a step counter shared by every parameter) hold one marker, and come back
as one tensor. Tensors whose memory overlaps otherwise (a view of part of another) cannot be
taken apart so: ``TakenApart.exact`` is False, and the caller moves the state whole. Either
way the state is cast before ``load_state_dict`` (``as_loaded``): torch casts each
parameter's state on its own (to the parameter's device and dtype), which would copy shared
or overlapping memory apart.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.checkpoint.parts import FlatPieces

# Markers standing in for tensors in a skeleton: (TENSOR, index into the tensors) and
# (FLAT, state key) for per-parameter state laid out flat. Plain tuples, so that a skeleton
# loads with ``weights_only=True``.
TENSOR = "ringleader.optimizer_state.tensor"
FLAT = "ringleader.optimizer_state.flat"
# What a ``_rebuild`` leaf function returns for a part it leaves as it is.
KEEP = object()
# Packed tensors start at multiples of this many bytes: a byte slice can be viewed as any
# dtype (up to complex128) only from an offset its element size divides.
ALIGN = 16


@dataclass(frozen=True)
class ParamSlot:
    """Where one of the optimizer's parameters (by its ``state_dict`` index) lies in the flat
    layout: from entry ``start``, ``shape.numel()`` entries."""

    start: int
    shape: torch.Size


@dataclass
class TakenApart:
    """A ``state_dict`` as ``skeleton`` (markers for tensors), ``tensors`` (by marker index)
    and ``flat`` (per-parameter state by key, laid out like the parameters). ``exact``: put
    back together, it shares memory where the original did (False: some of its tensors
    overlap in memory without being the same view; it must move whole)."""

    skeleton: Any
    tensors: list[torch.Tensor]
    flat: dict[str, FlatPieces]
    exact: bool = True


def _marker(value: Any, kind: str) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and value[0] == kind


def _view_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors exactly when they are the same view of the same memory (an
    empty tensor has no memory: it is only itself)."""
    if tensor.numel() == 0:
        return ("empty", id(tensor))
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value`` (through its dicts, lists and tuples), as often as it occurs."""
    found: list[torch.Tensor] = []

    def leaf(part: Any) -> Any:
        if isinstance(part, torch.Tensor):
            found.append(part)
            return part
        return KEEP

    _rebuild(value, leaf)
    return found


def _overlapping(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the memory spans of any two of ``tensors`` (distinct views) overlap (two
    strided views interleaving in one span count: better whole than wrong)."""
    spans = sorted(
        (t.device.type, t.device.index or 0, t.data_ptr(), t.data_ptr() + _extent(t)) for t in tensors if t.numel()
    )
    return any(a[:2] == b[:2] and b[2] < a[3] for a, b in zip(spans, spans[1:]))


def _extent(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (strides included)."""
    return (sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1) * tensor.element_size()


def flat_keys(state: Any, slots: Sequence[ParamSlot], shared: Collection[tuple[Any, ...]] = ()) -> list[str]:
    """The per-parameter state keys to lay out flat: held by every parameter as a tensor of
    its parameter's shape, one dtype and device across parameters, none of them held
    elsewhere too (``shared``: the ``_view_key`` of those; laid out flat, each would come
    back as a copy of its own) ([] if the state is not keyed by parameter index, as
    ``torch.optim``'s is)."""
    if not slots or not isinstance(state, Mapping) or set(state) != set(range(len(slots))):
        return []
    if not all(isinstance(s, Mapping) for s in state.values()):
        return []
    first = state[0]
    found = []
    for key, sample in first.items():
        if not (isinstance(key, str) and isinstance(sample, torch.Tensor)):
            continue
        if all(
            isinstance(t := state[i].get(key), torch.Tensor)
            and t.shape == slot.shape and t.dtype == sample.dtype and t.device == sample.device
            and _view_key(t) not in shared
            for i, slot in enumerate(slots)
        ):
            found.append(key)
    return found


def take_apart(state_dict: Mapping[str, Any], slots: Sequence[ParamSlot] = ()) -> TakenApart:
    """Split ``state_dict`` (an optimizer's) into skeleton, tensors and flat state. With
    ``slots`` (one per parameter, covering the flat layout), per-parameter state of the
    parameters' shapes goes flat; without, every tensor is a whole one. Copies no tensor."""
    state = state_dict.get("state")
    found = _tensors_in(state_dict)
    uses = Counter(_view_key(t) for t in found)
    distinct = {_view_key(t): t for t in found}
    keys = flat_keys(state, slots, {key for key, count in uses.items() if count > 1})
    flat: dict[str, FlatPieces] = {}
    if keys:
        by_start = sorted(range(len(slots)), key=lambda i: slots[i].start)
        flat = {key: FlatPieces(tuple(state[i][key] for i in by_start)) for key in keys}
        marked = {i: {k: (FLAT, k) if k in flat else v for k, v in s.items()} for i, s in state.items()}
        state_dict = {**state_dict, "state": marked}
    tensors: list[torch.Tensor] = []
    return TakenApart(_skeleton(state_dict, tensors), tensors, flat, not _overlapping(list(distinct.values())))


def _rebuild(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` rebuilt through its dicts, lists and tuples, each part that ``leaf`` replaces
    (returns other than ``KEEP`` for) replaced."""
    replaced = leaf(value)
    if replaced is not KEEP:
        return replaced
    if isinstance(value, Mapping):
        return {k: _rebuild(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebuild(v, leaf) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, leaf) for v in value)
    return value


def _skeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its marker: one per view (``_view_key``), so
    that entries sharing one come back sharing it; each appended to ``tensors`` once."""
    markers: dict[tuple[Any, ...], tuple[str, int]] = {}

    def leaf(part: Any) -> Any:
        if not isinstance(part, torch.Tensor):
            return KEEP
        key = _view_key(part)
        if key not in markers:
            markers[key] = (TENSOR, len(tensors))
            tensors.append(part)
        return markers[key]

    return _rebuild(value, leaf)


def put_together(
    skeleton: Any,
    tensors: Sequence[torch.Tensor],
    flat: Mapping[str, torch.Tensor] | None = None,
    slots: Sequence[ParamSlot] = (),
) -> Any:
    """The ``state_dict`` that ``take_apart`` took apart: markers replaced by ``tensors`` and,
    for flat state, by views of each parameter's range of ``flat[key]`` (whole flat tensors,
    laid out by ``slots``; the caller's, no copies). Raises ValueError if a marker has
    nothing to refer to."""
    if flat:
        if not isinstance(skeleton, Mapping) or not isinstance(skeleton.get("state"), Mapping):
            raise ValueError("flat optimizer state without per-parameter state to put it in")
        numel = sum(slot.shape.numel() for slot in slots)
        if {t.numel() for t in flat.values()} != {numel}:
            raise ValueError(f"flat optimizer state of {sorted({t.numel() for t in flat.values()})} entries, the parameters have {numel}")
        state = {i: _unflatten(i, s, flat, slots) for i, s in skeleton["state"].items()}
        skeleton = {**skeleton, "state": state}
    return _fill(skeleton, tensors)


def _unflatten(index: Any, state: Any, flat: Mapping[str, torch.Tensor], slots: Sequence[ParamSlot]) -> Any:
    """Parameter ``index``'s state with its flat markers replaced by views of its ranges of ``flat``."""
    if not isinstance(state, Mapping):
        return state
    out = {}
    for key, value in state.items():
        if _marker(value, FLAT):
            if value[1] not in flat or not (isinstance(index, int) and 0 <= index < len(slots)):
                raise ValueError(f"optimizer state of parameter {index!r} refers to flat state {value[1]!r} it does not hold")
            slot = slots[index]
            value = flat[value[1]][slot.start: slot.start + slot.shape.numel()].view(slot.shape)
        out[key] = value
    return out


def _fill(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """``value`` with each tensor marker replaced by its tensor of ``tensors``."""

    def leaf(part: Any) -> Any:
        if _marker(part, FLAT):
            raise ValueError(f"optimizer state refers to flat state {part[1]!r} outside the per-parameter state")
        if not _marker(part, TENSOR):
            return KEEP
        if not (isinstance(part[1], int) and 0 <= part[1] < len(tensors)):
            raise ValueError(f"optimizer state refers to tensor {part[1]!r} of {len(tensors)}")
        return tensors[part[1]]

    return _rebuild(value, leaf)


#: A dtype and device a state tensor is cast to; None where torch leaves it as it is.
Target = tuple[torch.dtype, torch.device] | None


def _target(value: torch.Tensor, param: torch.Tensor, key: Any, fused_or_capturable: bool) -> Target:
    """Where ``torch.optim.Optimizer.load_state_dict`` puts state ``value`` of ``param`` under
    ``key`` (its ``_process_value_according_to_param_policy``): a ``step`` stays as it is (but
    float32 on the parameter's device for a fused or capturable group); anything else goes to
    the parameter's device, and to its dtype if that is floating-point."""
    if key == "step":
        return (torch.float32, param.device) if fused_or_capturable else None
    return (param.dtype if param.is_floating_point() else value.dtype, param.device)


def _per_parameter(
    state_dict: Mapping[str, Any], params: Sequence[torch.Tensor], leaf: Callable[[torch.Tensor, Target], Any]
) -> Any:
    """``state_dict``'s state rebuilt (through dicts, lists and tuples) with each tensor of a
    parameter replaced by ``leaf(tensor, its target)``; None if the state's parameters do not
    match ``params`` (``load_state_dict`` says why)."""
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups) or not isinstance(state, Mapping):
        return None
    saved = [i for g in groups for i in g.get("params", ())]
    if len(saved) != len(params):
        return None
    by_id = dict(zip(saved, params))
    special = {i for g in groups if g.get("fused") or g.get("capturable") for i in g.get("params", ())}

    def walk(value: Any, param: torch.Tensor, fused: bool, key: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return leaf(value, _target(value, param, key, fused))
        if isinstance(value, Mapping):
            return {k: walk(v, param, fused, k) for k, v in value.items()}
        if isinstance(value, (list, tuple)):  # torch's cast passes no key down into these
            return type(value)(walk(v, param, fused, None) for v in value)
        return value

    return {i: walk(v, by_id[i], i in special, None) if i in by_id else v for i, v in state.items()}


def _cast_together(views: list[torch.Tensor], target: tuple[torch.dtype, torch.device]) -> dict[tuple[Any, ...], torch.Tensor]:
    """``views`` (of one storage, of one dtype) cast to ``target``, by ``_view_key``: views
    whose memory overlaps (through one another) cast as the one span they cover, so that they
    come back as views of one memory; the others apart (no bytes between them copied)."""
    def stop(view: torch.Tensor) -> int:  # the storage entry after its last
        return view.storage_offset() + _extent(view) // view.element_size()

    out: dict[tuple[Any, ...], torch.Tensor] = {}
    views = sorted(views, key=lambda v: v.storage_offset())
    start = 0
    while start < len(views):
        lo, hi, end = views[start].storage_offset(), stop(views[start]), start + 1
        while end < len(views) and views[end].storage_offset() < hi:
            hi, end = max(hi, stop(views[end])), end + 1
        span = torch.as_strided(views[start].detach(), (hi - lo,), (1,), lo).to(dtype=target[0], device=target[1])
        for view in views[start:end]:
            out.setdefault(_view_key(view), span.as_strided(view.shape, view.stride(), view.storage_offset() - lo))
        start = end
    return out


def as_loaded(state_dict: Mapping[str, Any], params: Sequence[torch.Tensor]) -> Mapping[str, Any]:
    """``state_dict`` with every state tensor already of the dtype and on the device that
    ``load_state_dict`` casts it to, for an optimizer whose parameters in group order are
    ``params``: torch casts each parameter's state on its own, so a tensor held by several
    parameters (a shared step counter) or views of one memory (overlapping state), arriving on
    the host for a GPU's parameters or of another dtype, would come back as one copy per
    entry. Here each memory is cast once (``_cast_together``), each distinct view comes back
    as one tensor, and torch's own cast then copies nothing. (Overlapping views in different
    dtypes, or going to different targets, are cast apart.)"""
    needs: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def collect(tensor: torch.Tensor, target: Target) -> torch.Tensor:
        if target is not None and (tensor.dtype, tensor.device) != target and tensor.numel():
            memory = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.dtype, target)
            needs.setdefault(memory, []).append(tensor)
        return tensor

    if _per_parameter(state_dict, params, collect) is None or not needs:
        return state_dict
    cast = {(key, memory[3]): t for memory, views in needs.items() for key, t in _cast_together(views, memory[3]).items()}

    def place(tensor: torch.Tensor, target: Target) -> torch.Tensor:
        if target is None or (tensor.dtype, tensor.device) == target:
            return tensor
        if not tensor.numel():
            return tensor.to(dtype=target[0], device=target[1])
        return cast[_view_key(tensor), target]

    return {**state_dict, "state": _per_parameter(state_dict, params, place)}


def encode(value: Any) -> torch.Tensor:
    """``value`` (a skeleton: plain values only) as bytes in a uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode(blob: torch.Tensor) -> Any:
    """What ``encode`` encoded (on the CPU), loaded with ``weights_only=True``: anything but
    tensors and plain values is refused rather than unpickled."""
    return torch.load(io.BytesIO(blob.cpu().numpy().tobytes()), weights_only=True, map_location="cpu")


#: A packed tensor's shape, dtype name and whether it lives on the host (the CPU) rather than the device.
TensorSpec = tuple[tuple[int, ...], str, bool]


def _padded(nbytes: int) -> int:
    return nbytes + (-nbytes) % ALIGN


def _nbytes(spec: TensorSpec) -> int:
    shape, dtype, _ = spec
    return torch.Size(shape).numel() * _dtype(dtype).itemsize


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"optimizer state names an unknown dtype {name!r}")
    return found


def packed_bytes(specs: Sequence[TensorSpec]) -> int:
    """The size of the buffer that ``pack`` makes of tensors of ``specs``."""
    return sum(_padded(_nbytes(spec)) for spec in specs)


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[TensorSpec]]:
    """``tensors`` back to back (each from an ``ALIGN``-byte boundary) in one uint8 buffer on
    ``device``, and their specs: one broadcast moves them all. A copy into the buffer, made
    once (no serialization, no copy on the way)."""
    specs: list[TensorSpec] = [
        (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type == "cpu") for t in tensors
    ]
    buffer = torch.zeros(packed_bytes(specs), dtype=torch.uint8, device=device)
    offset = 0
    for tensor, spec in zip(tensors, specs):
        nbytes = _nbytes(spec)
        buffer[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        offset += _padded(nbytes)
    return buffer, specs


def unpack(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """The tensors ``pack`` packed into ``buffer``: views into it (the caller's, so the state
    is held once), but a copy on the host for one that was there if the buffer is not."""
    if buffer.numel() != packed_bytes(specs):
        raise ValueError(f"packed optimizer state of {buffer.numel()} bytes, its specs need {packed_bytes(specs)}")
    out, offset = [], 0
    for spec in specs:
        shape, dtype, on_host = spec
        nbytes = _nbytes(spec)
        piece = buffer[offset: offset + nbytes].view(_dtype(dtype)).view(shape)
        out.append(piece.to("cpu") if on_host else piece)
        offset += _padded(nbytes)
    return out
