"""A checkpoint read back: its parts opened by their headers and checked to fit together, its
flat tensors read by span without reading the rest (``workers/checkpoint/parts.py`` writes them)."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from workers.checkpoint import tensor_file
from workers.checkpoint.file_io import RangedReader
from workers.checkpoint.manifest import CheckpointCorrupt
from workers.checkpoint.parts import FORMAT, part_range, residual_file
from workers.checkpoint.storage import CheckpointStorage


def _residual_bucket(key: str) -> tuple[int, int]:
    offset, length = key.split(":")
    return int(offset), int(length)


def _load(storage: CheckpointStorage, name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Read one file of a checkpoint, checking it against its manifest entry as it is read: a
    part file as the payload it holds (``meta``, its tensors grouped by the name's first
    component), or one written before part files (``torch.save``, read with weights only)."""
    relpath = f"{name}/{entry['path']}"
    data = storage.read_bytes(relpath)
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointCorrupt(name, storage.location(relpath), "changed since it was verified (size or sha256)")
    try:
        return read_part(data)
    except ValueError as err:
        raise CheckpointCorrupt(name, storage.location(relpath), f"not a readable part: {err}") from None


def read_part(data: bytes) -> dict[str, Any]:
    """A part's or residuals' file as the payload it holds: its ``meta`` with its tensors under
    ``slices``, ``whole`` and ``residuals`` (by the name's first component); a file written
    before part files, by ``torch.load`` with weights only. Raises ValueError for a part file
    that does not read."""
    if not tensor_file.is_tensor_file(data):
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    meta, tensors = tensor_file.decode(data)
    payload: dict[str, Any] = {**meta, "slices": {}, "whole": {}, "residuals": {}}
    for key, tensor in tensors.items():
        group, _, inner = key.partition("/")
        if group not in ("slices", "whole", "residuals") or not inner:
            raise ValueError(f"it holds an unknown tensor {key!r}")
        payload[group][inner] = tensor
    return payload


@dataclass(frozen=True)
class _Part:
    """One part file of checkpoint ``name`` (``relpath``), holding entries ``[lo, hi)`` of every
    flat tensor: its tensors as its header lists them (``entries``), or, for a file written
    before part files, as read whole (``payload``)."""

    name: str
    relpath: str
    entries: dict[str, tensor_file.Entry]
    payload: dict[str, Any] | None = None
    lo: int = 0
    hi: int = 0

    def slice_into(self, storage: CheckpointStorage, key: str, a: int, b: int, into: torch.Tensor) -> None:
        """Entries ``[a, b)`` of this part's slice of flat tensor ``key`` into ``into`` (CPU,
        contiguous, the saved dtype): only their bytes are read, straight into its memory."""
        if self.payload is not None:
            into.copy_(self.payload["slices"][key][a:b])
            return
        entry = self.entries[f"slices/{key}"]
        with _reading(storage, self.name, self.relpath) as reader:
            reader.read_into(entry.offset + a * entry.dtype.itemsize, _bytes_of(into))

    def whole(self, storage: CheckpointStorage) -> dict[str, torch.Tensor]:
        """The whole tensors it holds (part 0's), each in memory of its own: read in one go
        (the writer packs them together), not one request each (a generic optimizer's may be
        one per parameter)."""
        if self.payload is not None:
            return dict(self.payload["whole"])
        wanted = {k[len("whole/"):]: e for k, e in self.entries.items() if k.startswith("whole/")}
        if not wanted:
            return {}
        lo, hi = min(e.offset for e in wanted.values()), max(e.offset + e.nbytes for e in wanted.values())
        block = torch.empty(hi - lo, dtype=torch.uint8)
        with _reading(storage, self.name, self.relpath) as reader:
            reader.read_into(lo, _bytes_of(block))
        # Each at a PACK-aligned offset from lo: a view of any dtype.
        return {k: block[e.offset - lo : e.offset - lo + e.nbytes].view(e.dtype).reshape(e.shape).clone() for k, e in wanted.items()}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, writable, as bytes."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


@contextmanager
def _reading(storage: CheckpointStorage, name: str, relpath: str) -> Iterator[RangedReader]:
    """File ``relpath`` of checkpoint ``name`` open for ranged reads; one that no longer reads
    (missing, shorter than its header says) is CheckpointCorrupt."""
    try:
        with storage.open_ranged(relpath) as reader:
            yield reader
    except (OSError, EOFError) as err:
        raise CheckpointCorrupt(name, storage.location(relpath), f"changed since it was verified: {err}") from None


@dataclass(frozen=True)
class SavedFlat:
    """A flat tensor of a checkpoint (its parameters, an optimizer state key), not read yet:
    ``dtype`` and ``shape`` (its length) as its parts' headers say; ``read`` takes any span."""

    storage: CheckpointStorage
    parts: tuple[_Part, ...]
    key: str
    dtype: torch.dtype
    shape: tuple[int]

    def numel(self) -> int:
        return self.shape[0]

    def read(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Entries ``[lo, hi)`` into ``out`` (``hi - lo`` entries, any dtype and device: cast as
        ``copy_`` casts), reading only the parts, and the byte ranges of parts, they lie in;
        straight into ``out`` where it is a contiguous CPU tensor of the saved dtype, else
        through host memory one part's share at a time. Raises CheckpointCorrupt if a file no
        longer reads."""
        if not 0 <= lo <= hi <= self.numel() or out.shape != (hi - lo,):
            raise ValueError(f"entries [{lo}, {hi}) of {self.key} ({self.numel()}) do not fit {tuple(out.shape)}")
        direct = out.device.type == "cpu" and out.dtype == self.dtype and out.is_contiguous()
        for part in self.parts:
            a, b = max(lo, part.lo), min(hi, part.hi)
            if a >= b:
                continue
            into = out[a - lo : b - lo] if direct else torch.empty(b - a, dtype=self.dtype)
            part.slice_into(self.storage, self.key, a - part.lo, b - part.lo, into)
            if not direct:
                out[a - lo : b - lo].copy_(into)


def read_span(source: torch.Tensor | SavedFlat, lo: int, hi: int, out: torch.Tensor) -> None:
    """Entries ``[lo, hi)`` of a flat tensor, in memory or a checkpoint's, into ``out``."""
    if isinstance(source, SavedFlat):
        source.read(lo, hi, out)
    else:
        out.copy_(source[lo:hi])


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint as its parts' headers describe it, checked to fit together, nothing else
    read: its flat tensors (parameters and optimizer state, ``numel`` entries each), read by
    span, and its whole ones (``read_whole``)."""

    storage: CheckpointStorage
    numel: int
    flat: dict[str, SavedFlat]
    parts: tuple[_Part, ...]

    def read_whole(self) -> dict[str, torch.Tensor]:
        """The whole tensors (buffers, RNG, loss scale, the optimizer's step and skeleton)."""
        return {k: v for part in self.parts for k, v in part.whole(self.storage).items()}


def open_checkpoint(storage: CheckpointStorage, name: str, manifest: dict[str, Any]) -> SavedCheckpoint:
    """Checkpoint ``name`` (verified against ``manifest``), reading only its parts' headers (a
    file written before part files: whole, checked against its sha256). Raises CheckpointCorrupt
    if a file's size no longer matches the manifest, a header does not read, or the parts do
    not fit together: each part once, every flat tensor in each, of one dtype and its length."""
    listed = [e for e in manifest["files"] if e["path"].startswith("part-")]
    parts: dict[int, _Part] = {}
    layout: dict[str, torch.dtype] | None = None
    numel = -1
    for entry in listed:
        where = storage.location(f"{name}/{entry['path']}")
        meta, part = _open_part(storage, name, entry)
        try:
            if meta.get("format") != FORMAT or meta["count"] != len(listed) or numel not in (-1, meta["numel"]):
                raise ValueError("its format, count or length differs")
            lo, hi = part_range(meta["numel"], meta["index"], meta["count"])
        except (KeyError, TypeError, ValueError, IndexError):
            raise CheckpointCorrupt(name, where, "not a part of this checkpoint") from None
        if meta["index"] in parts:
            # Two copies of one slice would leave another slice unread (uninitialised memory).
            raise CheckpointCorrupt(name, where, f"part {meta['index']} is listed twice")
        numel, parts[meta["index"]] = meta["numel"], replace(part, lo=lo, hi=hi)
        slices = _slices(part)
        if any(shape != (hi - lo,) for _, shape in slices.values()) or layout not in (None, _dtypes(slices)):
            raise CheckpointCorrupt(
                name, where, f"its slices {sorted(slices.items())} do not fit: each part holds every flat tensor, {hi - lo} entries here"
            )
        layout = _dtypes(slices)
    if not parts:
        raise CheckpointCorrupt(name, storage.location(name), "its 0 part(s) do not cover the state")
    ordered = tuple(parts[i] for i in sorted(parts))
    flat = {k: SavedFlat(storage, ordered, k, dtype, (numel,)) for k, dtype in (layout or {}).items()}
    return SavedCheckpoint(storage, numel, flat, ordered)


def _open_part(storage: CheckpointStorage, name: str, entry: dict[str, Any]) -> tuple[dict[str, Any], _Part]:
    """A part's ``meta`` and its tensors as its header lists them (its size checked against the
    manifest entry), or, written before part files, as read whole (and checked)."""
    relpath = f"{name}/{entry['path']}"
    with _reading(storage, name, relpath) as reader:
        if reader.size != entry["bytes"]:
            raise CheckpointCorrupt(name, reader.where, f"changed since it was verified: {reader.size} bytes, not {entry['bytes']}")
        # Its first page holds most headers: one request for it (a GET on an object store).
        head = reader.read(0, min(reader.size, tensor_file.ALIGN))
        if not tensor_file.is_tensor_file(head):
            payload = _load(storage, name, entry)
            return {k: v for k, v in payload.items() if k not in ("slices", "whole")}, _Part(name, relpath, {}, payload)
        try:
            meta, entries = tensor_file.read_header(
                lambda offset, nbytes: head[offset : offset + nbytes] if offset + nbytes <= len(head) else reader.read(offset, nbytes),
                reader.size,
            )
        except ValueError as err:
            raise CheckpointCorrupt(name, reader.where, f"not a readable part: {err}") from None
    unknown = [k for k in entries if not k.startswith(("slices/", "whole/"))]
    if unknown:
        raise CheckpointCorrupt(name, storage.location(relpath), f"not a readable part: it holds an unknown tensor {unknown[0]!r}")
    return meta, _Part(name, relpath, entries)


def _slices(part: _Part) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of each flat tensor's slice in ``part``."""
    if part.payload is not None:
        return {k: (v.dtype, tuple(v.shape)) for k, v in part.payload["slices"].items()}
    return {k[len("slices/"):]: (e.dtype, e.shape) for k, e in part.entries.items() if k.startswith("slices/")}


def _dtypes(slices: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, torch.dtype]:
    return {k: dtype for k, (dtype, _) in slices.items()}


def load_state(
    storage: CheckpointStorage, name: str, manifest: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The flat tensors (every part read straight into its slice of them) and the whole ones
    of checkpoint ``name``. Raises CheckpointCorrupt as ``open_checkpoint`` and
    ``SavedFlat.read`` do."""
    saved = open_checkpoint(storage, name, manifest)
    flat = {key: torch.empty(saved.numel, dtype=source.dtype) for key, source in saved.flat.items()}
    for key, source in saved.flat.items():
        source.read(0, saved.numel, flat[key])
    return flat, saved.read_whole()


def load_residuals(
    storage: CheckpointStorage, name: str, manifest: dict[str, Any], rank: int
) -> dict[tuple[int, int], torch.Tensor]:
    """Rank ``rank``'s saved top-k residuals by bucket, or {} if it had none (or did not exist)."""
    mine = residual_file(rank, "").removesuffix(".pt")
    for entry in manifest["files"]:
        if entry["path"].startswith(mine):
            return {_residual_bucket(k): v for k, v in _load(storage, name, entry)["residuals"].items()}
    return {}
