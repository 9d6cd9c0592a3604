"""The file format of a checkpoint's parts (tensor files): named tensors laid out for a write
that bypasses the page cache (docs/architecture.md, "Checkpoints").

A part is written while training goes on, on a host whose cores training keeps busy. Written
through the page cache, each byte is copied once more by the CPU (13 ms of CPU for 8 MB here,
twice a sha256 of it); written with ``O_DIRECT`` the disk reads it from memory (0.3 ms). Direct
I/O wants the buffer's address, the file offset and the length aligned, so a part is laid out
as: ``MAGIC``, the header's length (8 bytes, little-endian), the header (JSON: the caller's
``meta`` and each tensor's name, dtype, shape and byte range), then each tensor's bytes from an
``ALIGN``-aligned offset, the whole padded to ``ALIGN``; ``encode`` builds it in page-aligned
memory. Reading it runs no pickle (as ``torch.load(weights_only=True)`` for the parts written
before, which ``workers/checkpointing.py`` still reads).
"""

from __future__ import annotations

import json
import mmap
import threading
from typing import Any

import torch

MAGIC = b"RLPART\x00\x01"
#: Direct I/O's alignment (the page size; a multiple of every common logical block size).
ALIGN = 4096
_LENGTH_BYTES = 8
#: The dtypes a part may hold (what checkpoints carry: parameters, optimizer state, buffers, RNG).
DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool,
    )
}


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def encode(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> memoryview:
    """``meta`` (JSON-able) and ``tensors`` (CPU, any layout) as one part file, in page-aligned
    memory whose length is a multiple of ``ALIGN``: this thread's scratch buffer, valid until
    its next ``encode`` (kept, so a checkpoint's write does not fault fresh pages in; a
    worker's writer thread encodes and writes one file at a time). Raises ValueError for a
    dtype not in ``DTYPES`` or a tensor not on the CPU."""
    entries = []
    offset = 0
    for name, tensor in tensors.items():
        if str(tensor.dtype) not in DTYPES or tensor.device.type != "cpu":
            raise ValueError(f"tensor {name!r}: a part holds CPU tensors of {sorted(DTYPES)}, got {tensor.dtype} on {tensor.device}")
        nbytes = tensor.numel() * tensor.element_size()
        entries.append({"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape), "offset": offset, "bytes": nbytes})
        offset = _aligned(offset + nbytes)
    header = json.dumps({"meta": meta, "tensors": entries}, allow_nan=False).encode()
    start = _aligned(len(MAGIC) + _LENGTH_BYTES + len(header))
    size = max(ALIGN, start + offset)
    out = _scratch(size)
    out[: len(MAGIC)] = MAGIC
    out[len(MAGIC) : len(MAGIC) + _LENGTH_BYTES] = len(header).to_bytes(_LENGTH_BYTES, "little")
    out[len(MAGIC) + _LENGTH_BYTES : len(MAGIC) + _LENGTH_BYTES + len(header)] = header
    for entry, tensor in zip(entries, tensors.values()):
        if entry["bytes"]:
            into = torch.frombuffer(out, dtype=torch.uint8, count=entry["bytes"], offset=start + entry["offset"])
            into.copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return memoryview(out)[:size]


_thread_scratch = threading.local()


def _scratch(size: int) -> mmap.mmap:
    """This thread's page-aligned buffer of at least ``size`` bytes, zeroed (its padding is
    part of the file, and must not carry an earlier file's bytes)."""
    held: mmap.mmap | None = getattr(_thread_scratch, "buffer", None)
    if held is None or len(held) < size:  # (the smaller one goes once no view of it is left)
        held = _thread_scratch.buffer = mmap.mmap(-1, size)  # anonymous: page-aligned, zero-filled
        return held
    torch.frombuffer(held, dtype=torch.uint8, count=size).zero_()
    return held


def is_tensor_file(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[: len(MAGIC)]) == MAGIC


def decode(data: bytes | bytearray) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``meta`` and tensors (copies, by name) of a part file. Raises ValueError if it is not
    one, or its header does not fit its bytes."""
    if not is_tensor_file(data):
        raise ValueError("not a tensor file (no magic)")
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + _LENGTH_BYTES], "little")
    begin = len(MAGIC) + _LENGTH_BYTES
    if begin + length > len(data):
        raise ValueError(f"its header claims {length} bytes, the file has {len(data) - begin} after the magic")
    try:
        header = json.loads(bytes(data[begin : begin + length]))
        start = _aligned(begin + length)
        tensors: dict[str, torch.Tensor] = {}
        buffer = bytearray(data) if isinstance(data, bytes) else data  # frombuffer wants a writable buffer
        for entry in header["tensors"]:
            dtype, shape, offset, nbytes = DTYPES[entry["dtype"]], entry["shape"], int(entry["offset"]), int(entry["bytes"])
            numel = 1
            for size in shape:
                numel *= int(size)
            if numel * torch.empty((), dtype=dtype).element_size() != nbytes or start + offset + nbytes > len(data):
                raise ValueError(f"tensor {entry['name']!r}: {nbytes} bytes at {offset} do not hold {shape} of {dtype}")
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start + offset) if nbytes else torch.empty(0, dtype=torch.uint8)
            tensors[str(entry["name"])] = raw.view(dtype).reshape(shape).clone()
        return dict(header["meta"]), tensors
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"its header is not a part's: {type(err).__name__}: {err}") from None
