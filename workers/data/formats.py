"""The formats of indexed files: how many samples a file holds and where (``describe``, run once
per file when the index is built), and one sample read back (``read``, on the workers).

Every format reads through a pyarrow filesystem (a local path, or ``s3://``, ``gs://``,
``hdfs://`` URIs) and opens the file per read, so reads from two threads at once are safe.

* ``tokens``: a flat little-endian array of ``dtype`` token ids (nanoGPT's ``.bin``); sample
  ``r`` is tokens ``[r * seq_len, (r + 1) * seq_len)``; a tail shorter than ``seq_len`` is left out.
* ``npy``: a 1-D array cut the same way, or a 2-D array, a sample per row.
* ``parquet``: a sample per row, its ``column``.
* ``jsonl``: a sample per line, its field ``column``.

Numbers and lists of numbers come back as tensors (int64 for integers, float32 else), other
values as they are (a collate must handle them). Errors name the file (its URI's credentials
masked) and the offset of a record that does not decode.
"""

from __future__ import annotations

import ast
import json
import os
import threading
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
import pyarrow.fs
import pyarrow.parquet as pq
import torch

from jobspec.data_index import IndexedFile
from jobspec.redaction import redact

TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}


class DataFileError(ValueError):
    """A data file that cannot be read as its format says; the message names the file."""


_LOCAL = pyarrow.fs.LocalFileSystem()
#: Schemes whose URI names its server (``hdfs://namenode:port/path``): part of the filesystem.
WITH_AUTHORITY = ("hdfs", "viewfs")


_FILESYSTEMS: dict[tuple[str, str], pyarrow.fs.FileSystem] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def split_uri(uri: str) -> tuple[str, str, str]:
    """(the part naming the filesystem: scheme, credentials and, for hdfs, the server; the path
    on it, as its listings give it; the query) of a URI: ``s3://k:s@b/x?q`` -> (``s3://k:s@``,
    ``b/x``, ``?q``), ``hdfs://nn:8020/x`` -> (``hdfs://nn:8020``, ``/x``, ""); a local path is
    ("", the path, "")."""
    if "://" not in uri:
        return "", uri, ""
    scheme, rest = uri.split("://", 1)
    rest, _, query = rest.partition("?")
    credentials = ""
    if "@" in rest.split("/", 1)[0]:
        credentials, rest = rest.split("@", 1)
        credentials += "@"
    authority = ""
    if scheme in WITH_AUTHORITY:  # hdfs://namenode:port/path: listings give /path
        authority, _, rest = rest.partition("/")
        rest = "/" + rest
    return f"{scheme}://{credentials}{authority}", rest, f"?{query}" if query else ""


def filesystem_of(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem holding ``uri`` (a local path or a URI pyarrow understands) and the path
    on it. One filesystem per scheme, credentials, server and query (they hold connections, and
    are safe to share between threads), whatever the bucket and key."""
    prefix, path, query = split_uri(uri)
    if not prefix:
        return _LOCAL, uri
    with _FILESYSTEMS_LOCK:
        if (prefix, query) not in _FILESYSTEMS:
            _FILESYSTEMS[prefix, query] = pyarrow.fs.FileSystem.from_uri(uri)[0]
        return _FILESYSTEMS[prefix, query], path


def read_range(uri: str, offset: int, length: int) -> bytes | memoryview:
    """``length`` bytes of ``uri`` from ``offset``: a local file's from its memory map (a copy
    of pages, no system call), a remote one's by a ranged read. Raises DataFileError naming the
    file if fewer are there (a file cut short since it was indexed)."""
    if "://" in uri:
        fs, path = filesystem_of(uri)
        with fs.open_input_file(path) as handle:
            data: bytes | memoryview = handle.read_at(length, offset)
    else:
        data = memoryview(_mapped(uri))[offset : offset + length]
    if len(data) != length:
        raise DataFileError(f"{redact(uri)}: {length} bytes at offset {offset} asked, {len(data)} there (truncated?)")
    return data


@lru_cache(maxsize=128)
def _mapped(path: str) -> np.ndarray:
    """The local file ``path`` mapped read-only (bytes), kept for the next reads: mapping costs
    system calls, reading a mapped page does not. Maps of a file changed since stay on the
    version they mapped (the index refused files changed before the run)."""
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


@lru_cache(maxsize=128)
def _rows(path: str, offset: int, dtype: str, samples: int, row_items: int) -> np.ndarray:
    """The local file ``path`` from byte ``offset`` as ``[samples, row_items]`` items of
    ``dtype`` (a view of its memory map). Raises DataFileError if the file is shorter than
    that (cut short since it was indexed)."""
    mapped, size = _mapped(path), samples * row_items * np.dtype(dtype).itemsize
    if len(mapped) < offset + size:
        raise DataFileError(f"{path}: {len(mapped)} bytes, {offset + size} indexed (truncated?)")
    return np.frombuffer(mapped, dtype=dtype, count=samples * row_items, offset=offset).reshape(samples, row_items)


class FileFormat(Protocol):
    def describe(self, uri: str, size: int, spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(samples in the file, its layout) for a file of ``size`` bytes, under the source's
        ``spec`` (``dtype``, ``seq_len``, ``column``). Raises DataFileError naming the file."""
        ...

    def read(self, entry: IndexedFile, row: int, spec: dict[str, Any]) -> Any:
        """Sample ``row`` of the file ``entry``."""
        ...

    def rows_view(self, entry: IndexedFile, spec: dict[str, Any]) -> np.ndarray | None:
        """The file ``entry`` as an array whose row ``r`` is sample ``r`` (a view of a local
        file's memory map: many samples are then gathered at numpy's speed), or None where its
        samples are read one by one (``read``)."""
        ...


class OneByOne:
    """Formats whose samples are read one by one."""

    def rows_view(self, entry: IndexedFile, spec: dict[str, Any]) -> np.ndarray | None:
        return None


def as_sample(value: Any) -> Any:
    """A tensor for a number or a list of numbers (int64 or float32); anything else as it is."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, bytes, dict)):
        return value
    array = np.asarray(value)
    if array.dtype.kind in "iu":
        return torch.from_numpy(array.astype(np.int64))
    if array.dtype.kind == "f":
        return torch.from_numpy(array.astype(np.float32))
    return value


def as_samples(rows: np.ndarray) -> list[torch.Tensor]:
    """Rows gathered from ``rows_view``s as samples, typed as ``as_sample`` types one."""
    kind = rows.dtype.kind
    batch = torch.from_numpy(rows.astype(np.int64 if kind in "iu" else np.float32))
    return list(batch.unbind(0))


class Tokens:
    def rows_view(self, entry: IndexedFile, spec: dict[str, Any]) -> np.ndarray | None:
        if "://" in entry.uri:
            return None
        return _rows(entry.uri, 0, TOKEN_DTYPES[spec["dtype"]], entry.samples, spec["seq_len"])

    def describe(self, uri: str, size: int, spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        itemsize = np.dtype(TOKEN_DTYPES[spec["dtype"]]).itemsize
        if size % itemsize:
            raise DataFileError(f"{redact(uri)}: {size} bytes is not a whole number of {spec['dtype']} tokens")
        return size // itemsize // spec["seq_len"], {}

    def read(self, entry: IndexedFile, row: int, spec: dict[str, Any]) -> Any:
        dtype = np.dtype(TOKEN_DTYPES[spec["dtype"]])
        length = spec["seq_len"] * dtype.itemsize
        data = read_range(entry.uri, row * length, length)
        return torch.from_numpy(np.frombuffer(data, dtype=dtype).astype(np.int64))


class Npy:
    def describe(self, uri: str, size: int, spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        fs, path = filesystem_of(uri)
        with fs.open_input_file(path) as handle:
            head = handle.read(min(size, 65536))
        try:
            if not head.startswith(b"\x93NUMPY"):
                raise ValueError("no .npy magic")
            major = head[6]
            length_bytes = 2 if major == 1 else 4
            header_len = int.from_bytes(head[8 : 8 + length_bytes], "little")
            offset = 8 + length_bytes + header_len
            header = ast.literal_eval(head[8 + length_bytes : offset].decode("latin1"))
            dtype, shape, fortran = np.dtype(header["descr"]), tuple(header["shape"]), header["fortran_order"]
        except (ValueError, SyntaxError, KeyError, IndexError, TypeError) as err:
            raise DataFileError(f"{redact(uri)}: not a .npy file ({err})") from None
        if fortran or len(shape) not in (1, 2) or dtype.hasobject:
            raise DataFileError(f"{redact(uri)}: need a C-ordered 1-D or 2-D array of numbers, got shape {shape} {dtype}")
        if offset + int(np.prod(shape)) * dtype.itemsize > size:
            raise DataFileError(f"{redact(uri)}: {size} bytes hold less than its header's {shape} {dtype} (truncated?)")
        row_items = spec["seq_len"] if len(shape) == 1 else shape[1]
        if len(shape) == 1 and row_items is None:
            raise DataFileError(f"{redact(uri)}: a 1-D array needs 'seq_len' to cut it into samples")
        if len(shape) == 2 and spec["seq_len"] not in (None, shape[1]):
            raise DataFileError(f"{redact(uri)}: rows of {shape[1]} items, but seq_len is {spec['seq_len']}")
        samples = shape[0] // row_items if len(shape) == 1 else shape[0]
        return samples, {"offset": offset, "dtype": dtype.str, "row_items": row_items}

    def rows_view(self, entry: IndexedFile, spec: dict[str, Any]) -> np.ndarray | None:
        if "://" in entry.uri:
            return None
        layout = entry.layout
        return _rows(entry.uri, layout["offset"], layout["dtype"], entry.samples, layout["row_items"])

    def read(self, entry: IndexedFile, row: int, spec: dict[str, Any]) -> Any:
        layout = entry.layout
        dtype = np.dtype(layout["dtype"])
        length = layout["row_items"] * dtype.itemsize
        data = read_range(entry.uri, layout["offset"] + row * length, length)
        return as_sample(np.frombuffer(data, dtype=dtype))


class Parquet(OneByOne):
    def describe(self, uri: str, size: int, spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            meta = _parquet_file(uri).metadata
        except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
            raise DataFileError(f"{redact(uri)}: not a parquet file ({err})") from None
        names = meta.schema.to_arrow_schema().names
        if spec["column"] not in names:
            raise DataFileError(f"{redact(uri)}: no column {spec['column']!r} (columns: {', '.join(names)})")
        groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        return sum(groups), {"row_groups": groups}

    def read(self, entry: IndexedFile, row: int, spec: dict[str, Any]) -> Any:
        group, at = 0, row
        for rows in entry.layout["row_groups"]:
            if at < rows:
                break
            group, at = group + 1, at - rows
        column = _row_group(entry.uri, group, spec["column"])
        return as_sample(column[at].as_py())


def _parquet_file(uri: str) -> pq.ParquetFile:
    fs, path = filesystem_of(uri)
    return pq.ParquetFile(fs.open_input_file(path))


@lru_cache(maxsize=8)
def _row_group(uri: str, group: int, column: str) -> Any:
    """One row group's column (the unit parquet reads), kept for the next samples from it: a
    shard's samples are scattered, but a step reads many rows of few groups."""
    return _parquet_file(uri).read_row_group(group, columns=[column]).column(0)


class Jsonl(OneByOne):
    """Each line's offset is indexed, and each line decoded once then (the index reads the whole
    file anyway), so a record that does not decode is refused before training."""

    def describe(self, uri: str, size: int, spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        fs, path = filesystem_of(uri)
        offsets, at, tail = [], 0, b""
        with fs.open_input_stream(path) as stream:
            while chunk := stream.read(1 << 22):
                lines = (tail + chunk).split(b"\n")
                start = at - len(tail)
                tail = lines.pop()
                for line in lines:
                    if line.strip():
                        _field(uri, start, line, spec["column"])
                        offsets.append(start)
                    start += len(line) + 1
                at += len(chunk)
        if tail.strip():
            _field(uri, at - len(tail), tail, spec["column"])
            offsets.append(at - len(tail))
        return len(offsets), {"offsets": offsets}

    def read(self, entry: IndexedFile, row: int, spec: dict[str, Any]) -> Any:
        offsets = entry.layout["offsets"]
        start = offsets[row]
        end = offsets[row + 1] if row + 1 < len(offsets) else entry.bytes
        return as_sample(_field(entry.uri, start, read_range(entry.uri, start, end - start), spec["column"]))


def _field(uri: str, offset: int, line: bytes | memoryview, column: str) -> Any:
    """Field ``column`` of the JSON record ``line`` (at byte ``offset`` of ``uri``). Raises
    DataFileError naming the file and the offset if it does not decode or lacks the field."""
    try:
        return json.loads(bytes(line))[column]
    except (ValueError, KeyError, TypeError) as err:
        raise DataFileError(f"{redact(uri)}: the record at byte offset {offset} does not decode ({err!r})") from None


#: ``dataset.format``'s names.
FORMATS: dict[str, FileFormat] = {"tokens": Tokens(), "npy": Npy(), "parquet": Parquet(), "jsonl": Jsonl()}
