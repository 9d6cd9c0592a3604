"""A worker's share of a coordinated checkpoint, as files: a snapshot in memory, written, read back.

The training state is replicated on every worker, so each of the ``count`` workers of a
checkpoint writes a contiguous ``index``-th slice of every flat tensor (parameters and optimizer
state), in parallel; part 0 also carries what is small and whole (optimizer step, model
buffers, RNG). A worker also writes its own top-k residuals (per-worker state), if any. Files
are ``workers/tensor_file.py``'s (a JSON header and raw tensor bytes, laid out for direct I/O);
those written before were ``torch.save`` dicts of tensors, ints and strings only, still read
with ``weights_only=True``: no arbitrary pickle is ever run when a checkpoint is read. Which of the
replica's tensors go in, the background writer and restoring are ``workers/replica_checkpoint.py``.

Why not torch.distributed.checkpoint: its ``.metadata`` file is read back with plain
``pickle`` (contrary to loading with ``weights_only``); its save and load plan through
collectives on a process group, which would tie a background write to the health of the
training group (a worker dying mid-write would fail the collective) and share our gloo group
with a second thread; and state replicated as plain tensors is written by one rank only, not
split across workers. The flat layout here makes every part a plain slice, loadable on any
worker count.

Reading back goes by the parts' headers (``open_checkpoint``): a rank of sharded state reads
only the parts, and the byte ranges of parts, that hold the entries it will own, straight into
their memory (``SavedFlat.read``), whatever the count that wrote them. A file read so is checked
against its manifest entry's size and by its header; its sha256 was checked when the checkpoint
was verified (``verify_checkpoint``, by the driver, before the restore), and cannot be without
reading all of it.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from jobspec.wire import FileEntry
from policies.split import even_bounds
from workers import tensor_file
from workers.checkpoint_manifest import CheckpointCorrupt
from workers.checkpoint_storage import CheckpointStorage, RangedReader

FORMAT = 1


# File names carry the attempt (``tag``) that wrote them: a checkpoint of the same step taken
# again (after an abandoned one whose writers may still be running) never writes over its files.
def part_file(index: int, count: int, tag: str) -> str:
    return f"part-{index:05d}-of-{count:05d}-{tag}.pt"


def residual_file(rank: int, tag: str) -> str:
    return f"residuals-rank-{rank:05d}-{tag}.pt"


def part_range(numel: int, index: int, count: int) -> tuple[int, int]:
    """Slice ``[lo, hi)`` of a flat tensor of ``numel`` entries that part ``index`` (0-based)
    of ``count`` holds; parts differ in size by at most one entry, the first ones larger
    (``policies.split.even_bounds``). Raises ValueError if ``count < 1``, IndexError if
    ``index`` is not in ``0..count-1``."""
    if not 0 <= index < count:
        # A negative index would silently pick a part from the end.
        raise IndexError(f"part {index} of {count} does not exist")
    return even_bounds(numel, count)[index]


@dataclass
class PartSnapshot:
    """CPU copies of what one worker writes: its slice of each flat tensor, the whole small
    tensors (part 0 only) and its residuals. ``copy_s``: how long training was held up."""

    step: int
    index: int
    count: int
    numel: int
    slices: dict[str, torch.Tensor]
    whole: dict[str, torch.Tensor]
    residuals: dict[str, torch.Tensor]
    copy_s: float = 0.0


@dataclass(frozen=True)
class FlatPieces:
    """A flat tensor held as its ``pieces`` back to back (any shapes, one dtype): a generic
    optimizer's per-parameter state laid out like the flat parameters
    (``workers/optimizer_state.py``), sliced without building it whole. ``offset`` and
    ``total``: the pieces are entries ``[offset, offset + their size)`` of a flat tensor of
    ``total`` entries of which this worker holds no more (a sharded optimizer's slice,
    ``workers/sharded_optimizer.py``); by default they are all of it."""

    pieces: tuple[torch.Tensor, ...]
    offset: int = 0
    total: int | None = None

    def held(self) -> int:
        return sum(piece.numel() for piece in self.pieces)

    def numel(self) -> int:
        return self.held() if self.total is None else self.total

    def cpu_range(self, lo: int, hi: int) -> torch.Tensor:
        """A CPU copy of entries ``[lo, hi)``: each piece's share copied straight into its place
        in the output (no gathering on the pieces' device first: no device memory taken).
        Raises ValueError if some of those entries are not held here."""
        hi = min(hi, self.numel())
        if lo < hi and (lo < self.offset or hi > self.offset + self.held()):
            raise ValueError(
                f"entries [{lo}, {hi}) are wanted, this worker holds [{self.offset}, {self.offset + self.held()})"
            )
        out = torch.empty(max(0, hi - lo), dtype=self.pieces[0].dtype)
        start = self.offset
        for piece in self.pieces:
            end = start + piece.numel()
            if start < hi and lo < end:
                a, b = max(lo, start), min(hi, end)
                out[a - lo: b - lo].copy_(piece.detach().reshape(-1)[a - start: b - start])
            start = end
        return out


# Top-k residuals are keyed by their bucket's (offset, length); files hold string keys only.
def _residual_key(bucket: tuple[int, int]) -> str:
    return f"{bucket[0]}:{bucket[1]}"


def _residual_bucket(key: str) -> tuple[int, int]:
    offset, length = key.split(":")
    return int(offset), int(length)


def take_snapshot(
    step: int,
    index: int,
    count: int,
    flat: dict[str, torch.Tensor | FlatPieces],
    whole: dict[str, torch.Tensor],
    residuals: dict[tuple[int, int], torch.Tensor],
) -> PartSnapshot:
    """Copy part ``index`` of ``count`` of the flat tensors (all of length ``numel``; a
    ``FlatPieces`` copies only the pieces in that part), and ``whole`` if this is part 0, and
    this worker's ``residuals`` (by bucket) to the CPU. Training may change the originals
    right after."""
    numels = {t.numel() for t in flat.values()}
    if len(numels) != 1:
        raise ValueError(f"flat tensors differ in length: {sorted(numels)}")
    numel = numels.pop()
    lo, hi = part_range(numel, index, count)
    return PartSnapshot(
        step=step,
        index=index,
        count=count,
        numel=numel,
        slices={
            k: t.cpu_range(lo, hi) if isinstance(t, FlatPieces) else t[lo:hi].detach().to("cpu", copy=True)
            for k, t in flat.items()
        },
        whole={k: t.detach().to("cpu", copy=True) for k, t in whole.items()} if index == 0 else {},
        residuals={_residual_key(k): t.detach().to("cpu", copy=True) for k, t in residuals.items()},
    )


def write_snapshot(
    storage: CheckpointStorage, name: str, tag: str, rank: int, snapshot: PartSnapshot
) -> list[FileEntry]:
    """Write ``snapshot`` under checkpoint ``name`` as attempt ``tag`` (``workers/tensor_file.py``
    files, written past the page cache where the file system allows); returns the FileEntry
    of each file written, for the manifest."""
    meta = {"format": FORMAT, "step": snapshot.step, "index": snapshot.index, "count": snapshot.count, "numel": snapshot.numel}
    tensors = {**{f"slices/{k}": t for k, t in snapshot.slices.items()}, **{f"whole/{k}": t for k, t in snapshot.whole.items()}}
    files = [_save(storage, name, part_file(snapshot.index, snapshot.count, tag), meta, tensors)]
    if snapshot.residuals:
        residuals = {f"residuals/{k}": t for k, t in snapshot.residuals.items()}
        files.append(_save(storage, name, residual_file(rank, tag), {"format": FORMAT}, residuals))
    return files


def _save(storage: CheckpointStorage, name: str, filename: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> FileEntry:
    sha256, size = storage.write_aligned(f"{name}/{filename}", tensor_file.encode(meta, tensors))
    return FileEntry(path=filename, sha256=sha256, bytes=size)


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
