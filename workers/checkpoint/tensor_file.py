"""The file format of a checkpoint's parts (tensor files): named tensors laid out for a write
that bypasses the page cache (docs/architecture.md, "Checkpoints").

A part is written while training goes on, on a host whose cores training keeps busy. Written
through the page cache, each byte is copied once more by the CPU (13 ms of CPU for 8 MB here,
twice a sha256 of it); written with ``O_DIRECT`` the disk reads it from memory (0.3 ms). Direct
I/O wants the buffer's address and the length aligned (the file is written whole, from offset
0), so a part is laid out as: ``MAGIC``, the header's length (8 bytes, little-endian), the
header (JSON: the caller's ``meta`` and each tensor's name, dtype, shape and byte range), then
the tensors' bytes packed at ``PACK``-byte offsets, the whole padded to ``ALIGN``; ``encode``
builds it in page-aligned memory. Reading it runs no pickle (as ``torch.load(weights_only=True)``
for the parts written before, which ``workers/checkpoint/parts.py`` still reads).
"""

from __future__ import annotations

import json
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"RLPART\x00\x01"
#: Direct I/O's alignment (the page size; a multiple of every common logical block size): of
#: the buffer's address and the file's length. Tensors inside need none, only ``PACK``.
ALIGN = 4096
PACK = 64
_LENGTH_BYTES = 8
#: Parts larger than this get a buffer of their own, dropped after: a thread keeps no more than
#: this much for the next checkpoint (faulting fresh pages in costs ~0.3 ms a MB).
SCRATCH_KEEP_BYTES = 256 << 20


def _rounded(offset: int, to: int) -> int:
    return -(-offset // to) * to


def encode(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> memoryview:
    """``meta`` (JSON-able) and ``tensors`` (CPU, any dtype and layout) as one part file, in
    page-aligned memory whose length is a multiple of ``ALIGN``: this thread's scratch buffer,
    valid until its next ``encode`` (kept, up to ``SCRATCH_KEEP_BYTES``, so a checkpoint's
    write does not fault fresh pages in; a worker's writer thread encodes and writes one file
    at a time). Raises ValueError for a tensor not on the CPU."""
    entries = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {name!r}: a part holds CPU tensors, got one on {tensor.device}")
        nbytes = tensor.numel() * tensor.element_size()
        entries.append({"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape), "offset": offset, "bytes": nbytes})
        offset = _rounded(offset + nbytes, PACK)
    header = json.dumps({"meta": meta, "tensors": entries}, allow_nan=False).encode()
    start = _rounded(len(MAGIC) + _LENGTH_BYTES + len(header), PACK)
    size = _rounded(max(1, start + offset), ALIGN)
    out = _scratch(size)
    out[: len(MAGIC)] = MAGIC
    out[len(MAGIC) : len(MAGIC) + _LENGTH_BYTES] = len(header).to_bytes(_LENGTH_BYTES, "little")
    out[len(MAGIC) + _LENGTH_BYTES : len(MAGIC) + _LENGTH_BYTES + len(header)] = header
    for entry, tensor in zip(entries, tensors.values()):
        if entry["bytes"]:
            into = torch.frombuffer(out, dtype=torch.uint8, count=entry["bytes"], offset=start + entry["offset"])
            flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
            into.copy_(flat.view(torch.uint8))
    return memoryview(out)[:size]


_thread_scratch = threading.local()


def _scratch(size: int) -> mmap.mmap:
    """A page-aligned buffer of at least ``size`` bytes, zeroed (its padding is part of the
    file, and must not carry an earlier file's bytes): this thread's own, kept for the next
    call, unless ``size`` is over ``SCRATCH_KEEP_BYTES``."""
    if size > SCRATCH_KEEP_BYTES:
        return mmap.mmap(-1, size)  # anonymous: page-aligned, zero-filled
    held: mmap.mmap | None = getattr(_thread_scratch, "buffer", None)
    if held is None or len(held) < size:  # (a smaller one goes once no view of it is left)
        held = _thread_scratch.buffer = mmap.mmap(-1, size)
        return held
    torch.frombuffer(held, dtype=torch.uint8, count=size).zero_()
    return held


def is_tensor_file(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[: len(MAGIC)]) == MAGIC


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) and name.startswith("torch.") else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class Entry:
    """One tensor of a part file as its header describes it: ``offset`` and ``nbytes``, its bytes
    from the file's start (checked to lie in the file)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(read: Callable[[int, int], bytes | memoryview], size: int) -> tuple[dict[str, Any], dict[str, Entry]]:
    """The ``meta`` and tensor entries (by name) of a part file of ``size`` bytes, reading only
    its header through ``read(offset, nbytes)``. Raises ValueError if it is not one, or its
    header does not describe its bytes."""
    begin = len(MAGIC) + _LENGTH_BYTES
    if size < begin or not is_tensor_file(read(0, len(MAGIC))):
        raise ValueError("not a tensor file (no magic)")
    length = int.from_bytes(read(len(MAGIC), _LENGTH_BYTES), "little")
    if begin + length > size:
        raise ValueError(f"its header claims {length} bytes, the file has {size - begin} after the magic")
    try:
        header = json.loads(bytes(read(begin, length)))
        start = _rounded(begin + length, PACK)
        entries: dict[str, Entry] = {}
        for entry in header["tensors"]:
            name, dtype = str(entry["name"]), _dtype(entry["dtype"])
            if name in entries or not isinstance(entry["shape"], list):
                raise ValueError(f"tensor {name!r} is listed twice or has no shape")
            shape = tuple(_count(n, f"tensor {name!r}'s shape") for n in entry["shape"])
            offset, nbytes = _count(entry["offset"], "an offset"), _count(entry["bytes"], "a size")
            numel = 1
            for n in shape:
                numel *= n
            if numel * dtype.itemsize != nbytes or start + offset + nbytes > size:
                raise ValueError(f"tensor {name!r}: {nbytes} bytes at {offset} do not hold {list(shape)} of {dtype}")
            entries[name] = Entry(name, dtype, shape, start + offset, nbytes)
        return dict(header["meta"]), entries
    except (KeyError, TypeError, AttributeError, RuntimeError, OverflowError, RecursionError, json.JSONDecodeError) as err:
        raise ValueError(f"its header is not a part's: {type(err).__name__}: {err}") from None


def decode(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``meta`` and tensors (by name, each in memory of its own) of a part file. Raises
    ValueError if it is not one, or its header does not describe its bytes."""
    view = memoryview(data).cast("B")
    meta, entries = read_header(lambda offset, nbytes: view[offset : offset + nbytes], len(view))
    tensors: dict[str, torch.Tensor] = {}
    for entry in entries.values():
        own = bytearray(view[entry.offset : entry.offset + entry.nbytes])  # frombuffer wants it writable
        raw = torch.frombuffer(own, dtype=torch.uint8) if entry.nbytes else torch.empty(0, dtype=torch.uint8)
        tensors[entry.name] = raw.view(entry.dtype).reshape(entry.shape)
    return meta, tensors
