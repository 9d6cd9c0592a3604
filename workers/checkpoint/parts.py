"""A worker's share of a coordinated checkpoint, as files: a snapshot in memory,
written as parts.

The training state is replicated on every worker, so each of the ``count`` workers of a
checkpoint writes a contiguous ``index``-th slice of every flat tensor (parameters and optimizer
state), in parallel; part 0 also carries what is small and whole (optimizer step, model
buffers, RNG). A worker also writes its own top-k residuals (per-worker state), if any. Files
are ``workers/checkpoint/tensor_file.py``'s (a JSON header and raw tensor bytes, laid out for direct I/O);
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

Reading back (``workers/checkpoint/reading.py``) goes by the parts' headers (``open_checkpoint``): a rank of sharded state reads
only the parts, and the byte ranges of parts, that hold the entries it will own, straight into
their memory (``SavedFlat.read``), whatever the count that wrote them. A file read so is checked
against its manifest entry's size and by its header; its sha256 was checked when the checkpoint
was verified (``verify_checkpoint``, by the driver, before the restore), and cannot be without
reading all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from jobspec.wire import FileEntry
from policies.split import even_bounds
from workers.checkpoint import tensor_file
from workers.checkpoint.storage import CheckpointStorage

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
    (``workers/optim/state_codec.py``), sliced without building it whole. ``offset`` and
    ``total``: the pieces are entries ``[offset, offset + their size)`` of a flat tensor of
    ``total`` entries of which this worker holds no more (a sharded optimizer's slice,
    ``workers/sharding/optimizer.py``); by default they are all of it."""

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
    """Write ``snapshot`` under checkpoint ``name`` as attempt ``tag`` (``workers/checkpoint/tensor_file.py``
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
